"""The web chat page: GET / and its static files under /ui/ (shipped in the package; no CDN, no build step).

The page is plain HTML, CSS and JavaScript that talk to this server's own OpenAI API, so it needs nothing the
API does not already offer; where the server wants an API key, the page asks for one. The files are public (the
gateway lets GET / and /ui/* through without a key: they hold no data), and they are served with a Content
Security Policy that allows this server's own scripts only, a second guard against HTML injection from model
text (the page itself never turns model text into HTML). `--ui none` leaves these routes out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from servelm.server.common import Api
from servelm.server.openai.protocol import APIError

UI_DIR = Path(__file__).resolve().parent / "ui"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def _file(name: str, root: str = "") -> Response:
    """A file of the page; index.html's links to the others carry `root` (--root-path, where a proxy serves the
    server under a prefix), and app.js finds the API from its own address."""
    path = UI_DIR / name
    if path.suffix not in TYPES or path.parent != UI_DIR or not path.is_file():  # no way out of the folder
        raise APIError(404, "not found")
    body = path.read_bytes()
    if root:
        body = body.replace(b'"/ui/', f'"{root}/ui/'.encode())
    return Response(body, media_type=TYPES[path.suffix],
                    headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                             "Cache-Control": "no-cache"})


def add_routes(app: FastAPI, api: Api) -> None:
    if api.state.config.server.api_config.ui == "none":
        return

    root = api.state.config.server.api_config.root_path  # checked at start: a plain path, no quotes or <>

    @app.get("/", include_in_schema=False)
    async def index():
        return _file("index.html", root)

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        return _file(name)
