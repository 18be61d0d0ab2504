"""The API's documented answers besides success, shared by its routers: the error bodies
each status carries, and the shape of a server-sent event."""

from __future__ import annotations

from typing import Any

from service.routes.schemas import ErrorBody, ValidationErrorBody

__all__ = [
    "INVALID",
    "NOT_FOUND",
    "PLAIN_ROUTE_ERRORS",
    "SSE_EVENT",
    "TOO_MANY",
    "UNAUTHORIZED",
    "UNWRITABLE",
    "error",
    "json_error",
]


def error(code: int, what: str) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": what}}


def json_error(code: int, what: str, model: str = "ErrorBody") -> dict[int | str, dict[str, Any]]:
    """An error of a route whose success is not JSON: FastAPI would document a ``model`` under
    the route's media type (text/plain), but errors are always JSON."""
    schema = {"$ref": f"#/components/schemas/{model}"}
    return {code: {"description": what, "content": {"application/json": {"schema": schema}}}}


PLAIN_ROUTE_ERRORS = {
    **json_error(401, "no token, or a wrong one"),
    **json_error(500, "an internal error (see the log)"),
}

# One server-sent event, as OpenAPI tools read a stream: each event's fields. The data of a
# record's event is the record (``kaisa_train.records``: its schema is ``Record``).
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {
            "type": "string",
            "enum": [
                "state",
                "progress",
                "eval",
                "tuner",
                "intervals",
                "trial",
                "sweep",
                "ready",
                "deleted",
            ],
        },
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "JSON: a JobView for state; for progress, eval, tuner, intervals, "
            "trial and sweep, the record (a Record, with its kind and the time the sink took it)",
        },
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}
UNAUTHORIZED = error(401, "no token, or a wrong one")
NOT_FOUND = error(404, "no such job")
INVALID: dict[int | str, dict[str, Any]] = {
    422: {"model": ValidationErrorBody, "description": "bad parameters or body"}
}
TOO_MANY: dict[int | str, dict[str, Any]] = {
    429: {
        "model": ErrorBody,
        "description": "over the rate limit of POSTs per client: retry after Retry-After seconds",
        "headers": {
            "Retry-After": {
                "description": "seconds to wait before retrying",
                "schema": {"type": "integer"},
            }
        },
    }
}
UNWRITABLE: dict[int | str, dict[str, Any]] = {
    503: {
        "model": ErrorBody,
        "description": "the job database cannot be written now (another process's lock, a "
        "full disk); nothing was changed: retry after Retry-After seconds",
        "headers": {
            "Retry-After": {
                "description": "seconds to wait before retrying",
                "schema": {"type": "integer"},
            }
        },
    }
}
