"""An operator's own middleware, as `--middleware` names it: each adds its mark to the response's x-trail
header, so a test sees which ran and in what order."""

from __future__ import annotations


class Trail:
    """A pure ASGI middleware class."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def marked(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": _mark(message.get("headers", []), b"class")}
            await send(message)
        await self.app(scope, receive, marked)


async def stamp(request, call_next):
    """An HTTP middleware function."""
    response = await call_next(request)
    trail = response.headers.get("x-trail")
    response.headers["x-trail"] = f"{trail},function" if trail else "function"
    return response


def _mark(headers, mark: bytes):
    old = [v for k, v in headers if k.lower() == b"x-trail"]
    rest = [(k, v) for k, v in headers if k.lower() != b"x-trail"]
    return rest + [(b"x-trail", old[0] + b"," + mark if old else mark)]


NOT_MIDDLEWARE = 42
