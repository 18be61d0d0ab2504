"""Requests from web pages of other sites: refused (issue 30).

A browser lets any page it shows send requests to the service, and two tricks reach a
service on loopback without a token:

- **DNS rebinding**: a page of ``evil.example`` whose name the attacker then points at
  127.0.0.1 talks to the service as its own site, reads the answers and sends any request.
  Its requests name their site in ``Host``. Without a token, the service answers only
  requests addressed to a loopback name (``127.0.0.1``, ``::1``, ``localhost``) or one the
  operator allowed (``--allowed-host``); with a token it is the token that guards, as on a
  network. ``/healthz`` and ``/readyz`` say nothing and answer any name (probes).
- **Simple cross-site requests**: a form or a ``fetch`` in ``no-cors`` mode from any page
  sends a POST that the service receives although the page cannot read the answer (a
  ``text/plain`` POST once cancelled a job). A request that changes something is refused
  when it carries a body type such a request may carry (``text/plain``, a form) or an
  ``Origin`` that is not the service's own: the service's dashboard (same origin) and
  clients that are not browsers (no ``Origin``: curl, the CLI, scripts) are unaffected.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from service.middleware import send_json
from service.settings import loopback

__all__ = ["SameOrigin"]

UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# What a browser sends cross-site without asking the service first (CORS "simple" types).
SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
PROBES = frozenset({"/healthz", "/readyz"})


def host_name(host: str) -> str:
    """The name in a ``Host`` header or an origin's netloc, without its port."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class SameOrigin:
    """Refuse what only another site's page would send (see the module docstring).

    Args:
        guarded_by_token: the service has a token: any ``Host`` is answered.
        allowed_hosts: names answered without a token besides the loopback ones.
    """

    def __init__(
        self, app: ASGIApp, *, guarded_by_token: bool, allowed_hosts: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self.guarded_by_token = guarded_by_token
        self.allowed = frozenset(host_name(h) for h in allowed_hosts)

    def _ours(self, name: str) -> bool:
        return loopback(name) or name in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k: v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get(b"host")
        if (
            not self.guarded_by_token
            and host is not None
            and scope["path"] not in PROBES
            and not self._ours(host_name(host))
        ):
            await send_json(
                send,
                400,
                {
                    "detail": f"Host {host!r} is not a name of this service: without a token "
                    "it answers only requests addressed to 127.0.0.1, ::1 or localhost (a "
                    "guard against DNS rebinding). Use one of those, allow the name with "
                    "kaisa-ray serve --allowed-host, or set a token (--token-file)"
                },
            )
            return
        if scope["method"] in UNSAFE:
            problem = self._cross_site(headers, host)
            if problem is not None:
                status, detail = problem
                await send_json(send, status, {"detail": detail})
                return
        await self.app(scope, receive, send)

    def _cross_site(self, headers: dict[bytes, str], host: str | None) -> tuple[int, str] | None:
        origin = headers.get(b"origin")
        if origin is not None:
            where = urlsplit(origin.strip()).netloc.lower()
            same = host is not None and where == host.strip().lower()
            if not (same or (where and host_name(where) in self.allowed)):
                return 403, (
                    f"cross-site request refused: a page of {origin!r} may not change "
                    f"anything here (this service is {host!r}); use the service's own "
                    "dashboard, the CLI or curl"
                )
        media = headers.get(b"content-type", "").split(";", 1)[0].strip().lower()
        if media in SIMPLE_TYPES:
            return 415, (
                f"Content-Type {media} is refused on a request that changes something (any "
                "web page can send it cross-site): send JSON (Content-Type: application/json; "
                "a job may also be YAML, application/yaml), or no body"
            )
        return None
