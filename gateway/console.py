"""The web console: one page at `/` and its assets under `/console/`, plain files kept in the package
(`console_assets/`), served by the gateway itself. They hold no data; the page reads the API."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import ApiError

ASSETS = Path(__file__).parent / "console_assets"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page may load and call only this gateway: nothing from another host, nothing inline.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def asset_names() -> list[str]:
    """The files the console serves: those of `console_assets/` with a known type."""
    return sorted(p.name for p in ASSETS.iterdir() if p.is_file() and p.suffix in TYPES)


def _file(name: str) -> Response:
    if name not in asset_names():
        raise ApiError(404, f"no console asset {name!r}")
    path = ASSETS / name
    return Response(path.read_bytes(), media_type=TYPES[path.suffix], headers=HEADERS)


async def page(request: Request) -> Response:
    return _file("index.html")


async def asset(request: Request) -> Response:
    return _file(request.path_params["name"])


routes = [
    Route("/", page, methods=["GET"], include_in_schema=False),
    Route("/console/{name}", asset, methods=["GET"], include_in_schema=False),
]
