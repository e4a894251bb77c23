"""The web console at `GET /ui`: static files shipped in the package (gateway/http/ui/).

    GET /ui, /ui/          the page (index.html)
    GET /ui/{name}         one of its files (app.js, chat.js, ops.js, charts.js, api.js, style.css)

No build step and no CDN: every file the page loads comes from here, so it works offline. The
files are read once, when the app is built, and only those names are served (no path from the
URL ever reaches the file system).

The page itself holds nothing secret and answers without a key; everything it shows comes
from the API it calls with the keys typed into it (`/v1/*` and `/metrics` with an API key,
`/admin/*` with an admin key), sent as `Authorization` headers, never in a URL. Every answer
carries a strict Content-Security-Policy: scripts, styles and connections only from this
origin, no inline script or style, no frames, no forms, no plugins.
`--disable-ui` leaves these routes out (404).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.gateway.errors import APIError
from zeroserve.gateway.http.error_response import error_response

UI_DIR = Path(__file__).parent / "ui"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self' data:",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Revalidate every load, so that a new gateway's page is never mixed with an old script.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class UiFile:
    body: bytes
    media_type: str


def load_ui_files(folder: Path = UI_DIR) -> dict[str, UiFile]:
    """Every servable file of the console by name (the folder is flat)."""
    files = {}
    for path in sorted(folder.iterdir()):
        media_type = MEDIA_TYPES.get(path.suffix)
        if path.is_file() and media_type is not None:
            files[path.name] = UiFile(path.read_bytes(), media_type)
    if "index.html" not in files:
        raise FileNotFoundError(f"the console's index.html is missing from {folder}")
    return files


class ConsolePages:
    def __init__(self, files: dict[str, UiFile] | None = None):
        self.files = load_ui_files() if files is None else files

    def routes(self) -> list[Route]:
        return [
            Route("/ui", self.index, methods=["GET", "HEAD"]),
            Route("/ui/", self.index, methods=["GET", "HEAD"]),
            Route("/ui/{name}", self.asset, methods=["GET", "HEAD"]),
        ]

    async def index(self, request: Request) -> Response:
        return self._send("index.html")

    async def asset(self, request: Request) -> Response:
        return self._send(request.path_params["name"])

    def _send(self, name: str) -> Response:
        found = self.files.get(name)
        if found is None:
            return error_response(APIError(404, "Not Found", code="not_found"))
        return Response(found.body, media_type=found.media_type, headers=SECURITY_HEADERS)
