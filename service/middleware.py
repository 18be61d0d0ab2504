"""ASGI middleware of the service: a request-body size limit, request timing for
Prometheus, the bearer token, a rate limit on POSTs, the JobSpec body's media type (JSON or
YAML) and depth, and the security headers of every response. All plain ASGI."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import yaml
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kaisa_ray.errors import KaisaRayError


def _limit_message(max_bytes: int) -> str:
    return (
        f"request body over the limit of {max_bytes} bytes; a job spec "
        "is a few hundred bytes (the service's --max-body-bytes sets the limit)"
    )


class _TooLargeError(HTTPException, KaisaRayError):
    """An HTTPException, so FastAPI re-raises it from its body parsing (it turns any other
    exception raised while reading the body into a 400) and the app's handler answers 413."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        super().__init__(413, _limit_message(max_bytes))

    def __reduce__(self) -> tuple[type[_TooLargeError], tuple[int]]:
        return (type(self), (self.max_bytes,))


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
    "service was started with ($KAISA_RAY_TOKEN, or the file of --token-file)"
)


class SecurityHeaders:
    """Every response of the service carries ``headers`` (its Content-Security-Policy and
    friends): pages, their files, the API docs, errors alike."""

    def __init__(self, app: ASGIApp, headers: dict[str, str]) -> None:
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in self.headers if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


async def send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer with ``body`` as JSON, here and now (a middleware's refusal)."""
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class RateLimit:
    """At most ``rate`` POST requests a second per client (its address), with bursts of
    ``burst``: a token bucket each. Over it: 429 with ``Retry-After`` (whole seconds). The
    bucket of a client idle for a minute is dropped, so memory stays bounded."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        rate: float,
        burst: int,
        prefixes: tuple[str, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app, self.rate, self.burst, self.prefixes = app, rate, burst, prefixes
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)
        self.refused = 0

    def _take(self, client: str) -> float:
        """0 if the client may go now, else the seconds until it may."""
        now = self.clock()
        tokens, at = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens >= 1:
            self._buckets[client] = (tokens - 1, now)
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1 - tokens) / self.rate

    def _prune(self) -> None:
        if len(self._buckets) > 10_000:
            now = self.clock()
            self._buckets = {c: (t, at) for c, (t, at) in self._buckets.items() if now - at < 60}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not any(scope["path"].startswith(p + "/") for p in self.prefixes)
        ):
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown", 0))[0]
        wait = self._take(client)
        if not wait:
            self._prune()
            await self.app(scope, receive, send)
            return
        self.refused += 1
        retry = max(1, math.ceil(wait))
        await send_json(
            send,
            429,
            {
                "detail": f"too many requests: at most {self.rate:g} POSTs a second from one "
                f"client (bursts of {self.burst}); retry in {retry} s (the service's "
                "--post-rate and --post-burst set the limit)"
            },
            [(b"retry-after", str(retry).encode())],
        )


YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})


class SpecBody:
    """The body of ``POST <path>`` (a JobSpec), before FastAPI reads it: JSON as it is, YAML
    (``Content-Type: application/yaml``) turned into JSON, any other type refused with 415
    saying what to send. Bodies nested deeper than ``max_depth`` (a JobSpec is at most about
    6 levels deep) are refused with 422 before anything walks them. Parsing runs in a worker
    thread, never on the event loop."""

    def __init__(self, app: ASGIApp, *, path: str, max_depth: int = 32) -> None:
        self.app, self.path, self.max_depth = app, path, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers", []))
        declared = next((v.decode("latin-1") for k, v in headers if k == b"content-type"), "")
        media = declared.split(";", 1)[0].strip().lower()
        yaml_body = media in YAML_TYPES
        if media and not yaml_body and media != "application/json" and not media.endswith("+json"):
            await send_json(
                send,
                415,
                {
                    "detail": f"a JobSpec is sent as JSON (Content-Type: application/json) or "
                    f"YAML (Content-Type: application/yaml), not {media}"
                },
            )
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if yaml_body or len(body) > 16 * 1024:  # YAML, or a large body: a worker thread
            converted, problem = await run_in_threadpool(
                _read_spec_body, body, yaml_body, self.max_depth
            )
        else:  # a typical spec, JSON of a few hundred bytes: microseconds, here
            converted, problem = _read_spec_body(body, yaml_body, self.max_depth)
        if problem is not None:
            await send_json(
                send,
                422,
                {
                    "detail": f"1 problem(s): body: {problem}",
                    "problems": [{"field": "body", "message": problem}],
                },
            )
            return
        if converted is not None:
            body = converted
            headers = [(k, v) for k, v in headers if k not in (b"content-type", b"content-length")]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            scope = {**scope, "headers": headers}
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _read_spec_body(
    body: bytes, yaml_body: bool, max_depth: int
) -> tuple[bytes | None, str | None]:
    """``(JSON to use instead, None)``, ``(None, None)`` to pass the body on as it is (FastAPI
    names what is wrong with bad JSON), or ``(None, problem)``."""
    if yaml_body:
        if _flow_depth(body) > max_depth:
            return None, f"nested too deep: a JobSpec is at most {max_depth} levels deep"
        loader = _NoAliasLoader(body)  # a SafeLoader without aliases, its depth bounded
        loader.max_depth = max_depth
        try:
            data = loader.get_single_data()
        except _TooDeepError:
            return None, f"nested too deep: a JobSpec is at most {max_depth} levels deep"
        except yaml.YAMLError as err:
            return None, f"not valid YAML: {err}"
        except RecursionError:
            return None, f"nested too deep: a JobSpec is at most {max_depth} levels deep"
        finally:
            loader.dispose()
    else:
        try:
            data = json.loads(body)
        except RecursionError:
            return None, f"nested too deep: a JobSpec is at most {max_depth} levels deep"
        except ValueError:
            return None, None
    depth = _depth(data, max_depth)
    if depth > max_depth:
        return None, (
            f"nested more than {max_depth} levels deep; a JobSpec is a few levels deep (see "
            "docs/jobspec.md)"
        )
    if not yaml_body:
        return None, None
    try:
        return json.dumps(data, default=str).encode(), None
    except ValueError as err:
        return None, f"cannot be read as a JobSpec: {err}"


_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)


def _flow_depth(body: bytes) -> int:
    """How deep YAML's flow collections (``[`` and ``{``) nest, counted on the raw bytes
    before parsing: PyYAML's scanner is quadratic in them (it keeps a possible key per open
    bracket and checks them all on every token: 30 000 brackets cost 0.5 s of CPU before any
    depth check could run). Brackets inside quoted strings count too; a JobSpec never has 32
    of them open at once."""
    deepest = depth = 0
    for bracket in body.translate(None, _NOT_BRACKETS):
        depth = depth + 1 if bracket in b"[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests lists and dicts, counted up to ``limit + 1`` (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


class _TooDeepError(yaml.YAMLError, KaisaRayError):  # type: ignore[misc]
    """A YAML body nested deeper than the loader's ``max_depth``."""


class _NoAliasLoader(yaml.SafeLoader):  # type: ignore[misc]
    """YAML's safe loader without aliases: ``*name`` repeats a node by reference, so a few
    hundred bytes can stand for gigabytes once written out as JSON (a "billion laughs").

    Its depth is bounded while it composes: PyYAML parses as it composes, so a body of 30 000
    nested brackets stops at level ``max_depth`` + 1 after reading a few dozen bytes, instead
    of recursing to Python's limit first (0.6-1.9 s of CPU per request)."""

    max_depth = 32
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not accepted in a JobSpec", event.start_mark
            )
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise _TooDeepError(f"nested deeper than {self.max_depth} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
