"""The dashboard and the API docs: pages and their files, served by the service itself (no
token: they hold no data; the page asks for the token the API wants), with no file from
another origin (plotly.js and Swagger UI come from the packages installed beside the
service)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["PAGE_POLICY", "SECURITY_HEADERS", "STATIC", "router", "swagger_ui"]

STATIC = Path(__file__).parents[1] / "static"
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'"
)
"""The Content-Security-Policy of everything the service serves (the dashboard, the API docs,
their files, the API's answers): nothing from another origin and no inline scripts (Plotly's
and Swagger UI's inline styles aside, which they set on their own elements)."""
SECURITY_HEADERS = {
    "Content-Security-Policy": PAGE_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def swagger_ui() -> Path:
    """Swagger UI's files, from the swagger-ui-bundle package (served, never a CDN's)."""
    import swagger_ui_bundle  # type: ignore[import-untyped]

    return Path(swagger_ui_bundle.swagger_ui_path)


DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>kaisa-ray API</title>
  <link rel="stylesheet" href="/static/vendor/swagger/swagger-ui.css">
  <link rel="icon" href="/static/favicon.svg" type="image/svg+xml">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/static/vendor/swagger/swagger-ui-bundle.js"></script>
  <script src="/static/docs.js"></script>
</body>
</html>
"""


def plotly_js() -> Path:
    """The plotly.js bundle that the plotly package ships in its wheel."""
    spec = importlib.util.find_spec("plotly")
    bundle = (
        Path(spec.origin).parent / "package_data" / "plotly.min.js"
        if spec and spec.origin
        else None
    )
    if bundle is None or not bundle.is_file():
        raise StarletteHTTPException(
            404,
            "plotly.js is not installed here: the dashboard's charts need the plotly "
            "package (pip install plotly; kaisa-ray depends on it)",
        )
    return bundle


router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(
        STATIC / "index.html",
        headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"},
    )


@router.get("/docs")
async def docs() -> HTMLResponse:
    return HTMLResponse(DOCS_PAGE, headers={"Cache-Control": "no-cache"})


@router.get("/static/vendor/plotly.min.js")
async def plotly() -> FileResponse:
    return FileResponse(
        plotly_js(),
        media_type="text/javascript",
        headers={"Cache-Control": "public, max-age=86400"},
    )
