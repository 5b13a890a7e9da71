"""How every failure is answered: OpenAI's JSON error object with the right status, for the app's own errors,
request validation, routing (404/405) and, as a last resort, any unexpected exception (a JSON 500 that keeps the
connection usable)."""

from __future__ import annotations

import functools
import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelm.control.errors import (
    Conflict,
    ControlError,
    Forbidden,
    InsufficientMemory,
    InvalidRequest,
    NotFound,
    Unavailable,
)
from servelm.server.openai.protocol import ROLES, APIError
from servelm.server.openapi import route_path

logger = logging.getLogger("servelm.server")


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message that quotes the input (even a lone surrogate) always
    encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_content(err: APIError, path: str = "") -> dict:
    """OpenAI's error object; on Ollama's routes (/api/...), Ollama's {"error": "message"}; on Anthropic's
    (/v1/messages), Anthropic's {"type": "error", "error": {"type", "message"}}."""
    from servelm.server.openapi import is_anthropic_path, is_ollama_path

    if is_ollama_path(path):
        return {"error": err.message}
    if is_anthropic_path(path):
        from servelm.server.anthropic.protocol import error_type

        return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
    return err.body()


def error_response(err: APIError, path: str = "") -> JSONResponse:
    return ErrorResponse(error_content(err, path), status_code=err.status, headers=err.headers)


def shaped_errors(route):
    """A route's refusals (APIError, ControlError) in its path's error shape (error_content): for the routes of
    other APIs (Ollama's, Anthropic's), which read their own bodies and whose clients parse their own shape."""
    @functools.wraps(route)
    async def wrapped(request: Request):
        try:
            return await route(request)
        except APIError as e:
            return error_response(e, route_path(request.scope))
        except ControlError as e:
            return error_response(control_api_error(e), route_path(request.scope))
    return wrapped


# The one place a control refusal gets its HTTP status: control/ raises by kind of refusal, and every front end
# (REST, Ollama, OIP, gRPC) answers through `control_api_error`.
CONTROL_STATUS: dict[type[ControlError], int] = {
    InvalidRequest: 400, Forbidden: 403, NotFound: 404, Conflict: 409, Unavailable: 503, InsufficientMemory: 507,
}


def control_status(e: ControlError) -> int:
    """The HTTP status for a control refusal (a subclass of a mapped class answers as its parent; an unmapped
    one is a bug: 500)."""
    return next((CONTROL_STATUS[c] for c in type(e).__mro__ if c in CONTROL_STATUS), 500)


def control_api_error(e: ControlError, param: str | None = None) -> APIError:
    """A control refusal as the API error the client sees; `param` names the field when the refusal does not."""
    return APIError(control_status(e), e.message, e.param or param, e.code)


_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|[a-z]+-[a-z\-]+)(\[.*\])?$|^[a-z]+\[.*\]$")


def _loc(e: dict) -> list:
    """An error's location without "body" and without the union-member labels pydantic puts in it (a type, or
    a message's role after its index)."""
    out: list = []
    for x in e.get("loc", []):
        if x == "body" or (isinstance(x, str) and (_UNION_TAG.match(x) or (x in ROLES and out and
                                                                        isinstance(out[-1], int)))):
            continue
        out.append(x)
    if e.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # the discriminator itself is wrong
        out.append(str((e.get("ctx") or {}).get("discriminator", "")).strip("'") or "role")
    return out


def _best(errors: list[dict]) -> dict:
    """The error that says most: a broken constraint before a wrong type (a union reports one error per member,
    most of them "not this type"), then the deepest location."""
    return max(errors, key=lambda e: (not e.get("type", "").endswith("_type"), len(_loc(e))))


def _validation_message(e: dict) -> tuple[str, str]:
    """(param, message) of one pydantic error, in OpenAI's words where OpenAI has some."""
    param = ".".join(str(x) for x in _loc(e))
    if e.get("type") == "extra_forbidden":
        return param, f"unrecognized request argument supplied: {param}"
    return param, f"{param or 'body'}: {e.get('msg')}"


def json_error_message(err: dict, doc) -> str:
    """'the request body is not valid JSON: Expecting value at line 3 column 1 (char 31)', as json.loads
    would place it (FastAPI reports only the character offset, as the error's location)."""
    pos = next((x for x in err.get("loc", ()) if isinstance(x, int)), None)
    what = (err.get("ctx") or {}).get("error") or "malformed"
    if pos is None or not isinstance(doc, (str, bytes)):
        return f"the request body is not valid JSON: {what}"
    text = doc.decode(errors="replace") if isinstance(doc, bytes) else doc
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"the request body is not valid JSON: {what} at line {line} column {column} (char {pos})"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, route_path(request.scope))

    @app.exception_handler(ControlError)
    async def _control_error(_: Request, exc: ControlError):
        """A control operation refused (unknown version, illegal transition, no room, ...): its own status."""
        return error_response(control_api_error(exc))

    from sqlalchemy.exc import DBAPIError

    @app.exception_handler(DBAPIError)
    async def _database_error(request: Request, exc: DBAPIError):
        """The control database down or restarting is the service's state, not a bug: 503 saying so (the pool
        reconnects once it is back); any other database error is a bug like any other."""
        from servelm.control import db

        if not db.unavailable(exc):
            return await _unexpected(request, exc)
        logger.warning("%s %s: the control database cannot be reached: %s", request.method, route_path(request.scope),
                       str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__)
        return error_response(APIError(503, "the control database cannot be reached (down or restarting); retry "
                                            "later", code="database_unavailable", headers={"Retry-After": "1"}),
                              route_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        if not errors:
            return error_response(APIError(400, "invalid request"))
        if errors[0].get("type") == "json_invalid":  # the body itself: say what is wrong and where, not a field
            return error_response(APIError(400, json_error_message(errors[0], exc.body)))
        param, message = _validation_message(_best(errors))
        return error_response(APIError(400, message, param or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: "not found", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)),
                              route_path(request.scope))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug, never an answer to input. Starlette re-raises after sending this; the gateway keeps the
        # connection open (see Gateway.__call__).
        rid = request.state.record.request_id if hasattr(request.state, "record") else None
        logger.error("unhandled %s in %s %s (request %s)", type(exc).__name__, request.method,
                     route_path(request.scope), rid, exc_info=exc)
        return error_response(APIError(500, "internal server error", code="internal_error"), route_path(request.scope))
