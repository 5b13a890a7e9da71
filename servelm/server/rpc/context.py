"""What every gRPC call shares with HTTP: the gateway's key check and per-minute request count, the request
record (metrics, the JSON log line, traces), and errors as gRPC status codes.

A gRPC call is handed to `servelm.server.common.Api` as an `RpcRequest`, which offers what Api reads from a
Starlette request (`state.record`, `headers`, `is_disconnected()`), so generation, admission, priorities and
abort-on-disconnect run the very code the HTTP routes run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
from pydantic import ValidationError
from starlette.datastructures import Headers

from servelm.control.errors import ControlError
from servelm.server.errors import _best, _validation_message, control_api_error
from servelm.server.observability.telemetry import RequestRecord
from servelm.server.openai.protocol import APIError

logger = logging.getLogger("servelm.server")

# HTTP status of an APIError -> the gRPC status code a gRPC client expects for it
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         405: grpc.StatusCode.UNIMPLEMENTED, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
         409: grpc.StatusCode.FAILED_PRECONDITION, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
         503: grpc.StatusCode.UNAVAILABLE, 507: grpc.StatusCode.RESOURCE_EXHAUSTED}


class RpcRequest:
    """One gRPC call, seen as the HTTP machinery sees a request."""

    def __init__(self, context: grpc.aio.ServicerContext, method: str) -> None:
        self.context = context
        md = context.invocation_metadata() or ()
        self.headers = Headers(raw=[(k.encode(), v.encode()) for k, v in md if isinstance(v, str)])
        incoming = self.headers.get("x-request-id")
        rid = incoming if incoming and len(incoming) <= 128 and incoming.isprintable() else uuid.uuid4().hex
        self.record = RequestRecord(rid, "POST", method, traceparent=self.headers.get("traceparent"))
        self.state = SimpleNamespace(record=self.record)

    @property
    def client(self) -> str:
        """The peer's address without port ('ipv4:127.0.0.1:5000' -> '127.0.0.1'), for auth-failure limits."""
        peer = self.context.peer() or "unknown"
        kind, _, rest = peer.partition(":")
        if kind in ("ipv4", "ipv6"):
            return rest.rsplit(":", 1)[0].strip("[]")
        return peer

    async def is_disconnected(self) -> bool:
        return self.context.cancelled() or self.context.done()


def validation_error(e: ValidationError) -> APIError:
    """The HTTP API's 400 for a request that fails its pydantic model."""
    errors = list(e.errors())
    if not errors:
        return APIError(400, "invalid request")
    param, message = _validation_message(_best(errors))
    return APIError(400, message, param or None)


class Calls:
    """Opens and closes gRPC calls against one HTTP gateway (its keys, auth-failure limiter and telemetry)."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway
        self.state = gateway.state

    def check(self, req: RpcRequest) -> None:
        """Authenticate and count a call, as the gateway does for an HTTP request; raises APIError."""
        scope = {"path": req.record.path, "method": "POST", "client": (req.client, 0)}  # as an HTTP request
        err = self.gateway._check(scope, req.headers, req.record)
        if err is not None:
            raise err

    def end(self, req: RpcRequest, status: int, error: str | None = None) -> None:
        rec = req.record
        rec.status, rec.error = status, error or rec.error
        self.gateway._finish(rec)

    async def fail(self, context, req: RpcRequest | None, e: Exception) -> None:
        """End the call with `e` as a gRPC status (trailing metadata: the error's JSON code and headers)."""
        if isinstance(e, ValidationError):
            e = validation_error(e)
        elif isinstance(e, ControlError):
            e = control_api_error(e)
        elif not isinstance(e, APIError):
            rid = req.record.request_id if req else None
            logger.error("unhandled %s in gRPC call (request %s)", type(e).__name__, rid, exc_info=e)
            e = APIError(500, "internal server error", code="internal_error")
        if req is not None:
            self.end(req, e.status, e.message)
        md = [("x-request-id", req.record.request_id)] if req else []
        if e.code:
            md.append(("x-servelm-error-code", e.code))
        md += [(k.lower(), str(v)) for k, v in (e.headers or {}).items()]
        await context.abort(CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message, tuple(md))

    @contextlib.asynccontextmanager
    async def unary(self, context, method: str, *, open_access: bool = False) -> AsyncIterator[RpcRequest]:
        """A call answered once: errors become statuses, the record is finished either way."""
        req = RpcRequest(context, method)
        try:
            if not open_access:
                self.check(req)
            yield req
        except asyncio.CancelledError:  # the client cancelled (or the server is stopping)
            self.end(req, 499, "client cancelled")
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await self.fail(context, req, e)
        else:
            context.set_trailing_metadata(self.trailers(req))
            self.end(req, 200)

    def trailers(self, req: RpcRequest) -> tuple:
        """A successful call's trailing metadata: its request id and the key's rate-limit state, as the HTTP
        response headers carry them."""
        limits = self.state.admission.limit_headers(req.record)
        return (("x-request-id", req.record.request_id), *((k.lower(), str(v)) for k, v in limits.items()))
