"""/docs (Swagger UI) and /redoc (ReDoc), served with their scripts and styles from this server.

FastAPI's own pages load them from a CDN, so on a machine without internet access they were blank. The
assets come from the `fastapi-offline` package (MIT; Swagger UI is Apache-2.0, ReDoc MIT); where it is
not installed, both pages are off (404) and the server says so once.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from fastapi import Request

logger = logging.getLogger("servelm.server")

ASSETS_URL = "/docs-assets"


def _assets_dir() -> Path | None:
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(next(iter(spec.submodule_search_locations))) / "static"
    needed = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
    return static if all((static / f).is_file() for f in needed) else None


def add_docs_routes(app) -> bool:
    """Add /docs, /redoc and their assets to an app made with docs_url=None, redoc_url=None."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    static = _assets_dir()
    if static is None:
        logger.warning("/docs and /redoc are off: install fastapi-offline for their assets (no CDN is used)")
        return False
    app.mount(ASSETS_URL, StaticFiles(directory=static), name="docs-assets")
    title = app.title

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request):
        root = request.scope.get("root_path") or ""  # behind a proxy's prefix (--root-path), links carry it
        return get_swagger_ui_html(
            openapi_url=root + app.openapi_url, title=f"{title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css", swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from swagger.io

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        root = request.scope.get("root_path") or ""
        return get_redoc_html(openapi_url=root + app.openapi_url, title=f"{title} - ReDoc",
                              redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png", with_google_fonts=False)

    return True
