"""ASGI middleware of the service: a request-body size limit, and request timing for
Prometheus. Both are plain ASGI (no buffering of bodies that are within the limit)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _limit_message(max_bytes: int) -> str:
    return (
        f"request body over the limit of {max_bytes} bytes; a job spec "
        "is a few hundred bytes (the service's --max-body-bytes sets the limit)"
    )


class _TooLargeError(HTTPException):
    """An HTTPException, so FastAPI re-raises it from its body parsing (it turns any other
    exception raised while reading the body into a 400) and the app's handler answers 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _limit_message(max_bytes))


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413, by Content-Length or as they stream."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLargeError(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLargeError:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": _limit_message(self.max_bytes)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Timing:
    """Calls ``observe(method, route, status, seconds)`` once per HTTP request, when its
    response has been sent (streams: when the stream ends). ``route`` is the path template
    (``/v1/jobs/{job_id}``), so labels stay few."""

    def __init__(
        self,
        app: ASGIApp,
        observe: Callable[[str, str, int, float], None],
        prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app, self.observe, self.prefixes = app, observe, prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route: Any = scope.get("route")
            path = getattr(route, "path", None)
            template = path or "(unmatched)"
            # An included router's route knows its path without the router's prefix.
            for prefix in self.prefixes:
                if path and scope["path"].startswith(prefix + "/") and not path.startswith(prefix):
                    template = prefix + template
            self.observe(scope["method"], template, status, time.perf_counter() - began)


class BearerAuth:
    """Refuse requests under ``prefixes`` without ``Authorization: Bearer <token>`` with 401
    before anything reads their body (FastAPI parses a JSON body before it runs the
    dependencies, so a dependency alone answers a broken body without a token with 422)."""

    def __init__(self, app: ASGIApp, token: str | None, prefixes: tuple[str, ...]) -> None:
        self.app, self.token, self.prefixes = app, token, prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or self.token is None
            or not any(
                scope["path"] == p or scope["path"].startswith(p + "/") for p in self.prefixes
            )
        ):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(
            credentials.strip(), self.token.encode()
        ):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": UNAUTHORIZED_DETAIL}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


UNAUTHORIZED_DETAIL = (
    "missing or wrong token: send 'Authorization: Bearer <token>' with the token the "
    "service was started with (kaisa-ray serve --token, or $KAISA_RAY_TOKEN)"
)
