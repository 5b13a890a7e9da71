"""The ASGI gateway in front of every route: request id, body size limit, API keys, rate-limit headers, and
the end-of-request hand-off to telemetry (metrics, the JSON log line, traces).

It is plain ASGI rather than a Starlette BaseHTTPMiddleware, so streaming responses and client disconnects
pass through untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.routing import Match

from servelm.server.middleware.auth import KeyStore, presented_key
from servelm.server.middleware.ratelimit import FailureLimiter
from servelm.server.observability.telemetry import RequestRecord
from servelm.server.openai.protocol import REQUEST_ID_PATTERN, APIError
from servelm.server.openapi import is_oip_path, is_ollama_path, route_path

logger = logging.getLogger("servelm.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics", "/load", "/v2/health/live", "/v2/health/ready"})
# Routes outside /admin that change the server or say how it runs (vLLM's adapter routes, the prefix-cache reset,
# weight updates, sleep mode, pausing) take the admin key like /admin
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache",
                         "/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume",
                         "/is_paused"})
QUIET_PATHS = OPEN_PATHS | {"/server/stats"}  # not logged or traced
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


class Gateway:
    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state  # ServerState: config, keys, limiter, telemetry
        self.auth_failures = FailureLimiter()  # per client address
        self._entry = cors(state.config.server, self._handle)

    async def __call__(self, scope, receive, send):
        await self._entry(scope, receive, send)

    async def _handle(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("http_version") == "1.0":
            send = _whole_body(send)
        st = self.state
        headers = Headers(scope=scope)
        incoming = headers.get("x-request-id")
        named = bool(incoming and _REQUEST_ID.match(incoming))
        path = route_path(scope)
        rec = RequestRecord(incoming if named else uuid.uuid4().hex, scope["method"], path,
                            traceparent=headers.get("traceparent"), tracestate=headers.get("tracestate"),
                            client_named=named)
        scope.setdefault("state", {})["record"] = rec
        response_started = False
        body_done = False

        async def send_wrapped(message):
            nonlocal response_started, body_done
            if message["type"] == "http.response.start":
                response_started = True
                rec.status = message["status"]
                extra = [(b"x-request-id", rec.request_id.encode())]  # (a body's request_id may name it)
                if rec.model_version is not None:
                    extra.append((b"x-servelm-model-version", rec.model_version.encode()))
                if rec.arm is not None:
                    extra.append((b"x-servelm-arm", rec.arm.encode()))
                if rec.load_wait_s is not None:
                    extra.append((b"x-servelm-load-wait-s", f"{rec.load_wait_s:.3f}".encode()))
                present = {k.lower() for k, _ in message.get("headers", [])}
                for k, v in self._limit_headers(rec).items():
                    if k.encode() not in present:
                        extra.append((k.encode(), v.encode()))
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            elif message["type"] == "http.response.body":
                if rec.first_byte is None and message.get("body"):
                    rec.first_byte = time.monotonic()
                last = not message.get("more_body", False)
                traffic = getattr(st, "traffic", None)
                if traffic is not None and not rec.traffic_done and (last or _is_done(message)):
                    await traffic.complete(rec)  # the prediction log is durable before the last byte
                if last:
                    body_done = True
            await send(message)
            if body_done:
                self._finish(rec)

        try:
            error = _oversized_head(scope) or self._method_not_allowed(scope) or self._check(scope, headers, rec)
            body = b""
            if error is None:
                body, error = await _read_body(receive, headers, st.config.server.api_config.max_request_body_bytes)
            if error is not None:
                await _send_error(send_wrapped, error, oip=is_oip_path(path), ollama=is_ollama_path(path), path=path)
                return
            await self.app(scope, replay(body, receive), send_wrapped)
        except Exception:
            # A bug, not input. The app's catch-all already answered a JSON 500 and logged it; swallow the
            # exception Starlette re-raises, or the server would reset a keep-alive connection. A response cut
            # off mid-stream cannot be mended: that connection is closed.
            if body_done:
                return
            if not response_started:
                logger.exception("unhandled error in %s %s (request %s)", scope["method"], path, rec.request_id)
                await _send_error(send_wrapped, APIError(500, "internal server error", code="internal_error"),
                                  ollama=is_ollama_path(path))
                return
            raise
        except BaseException:
            if not response_started:
                rec.status = 500
            raise
        finally:
            for served in rec.leases:  # the request is over: its pin on a deployment generation goes
                served.release()
            if not body_done:
                if response_started or rec.status == 200:
                    rec.status = 499  # the client went away before the response was complete
                self._finish(rec)

    def _method_not_allowed(self, scope) -> APIError | None:
        """405 for a method no route at this path takes (TRACE, CONNECT, ...), before keys are asked for: which
        methods a route takes is no secret, and a 401/403 would tell the client the wrong thing to fix."""
        allowed: set[str] = set()
        for route in getattr(self.app, "routes", ()):
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return None
            if match == Match.PARTIAL:
                allowed |= getattr(route, "methods", None) or set()
        if not allowed:
            return None  # no such path: the app answers 404 (after the key check)
        return APIError(405, "method not allowed", headers={"Allow": ", ".join(sorted(allowed))})

    def _check(self, scope, headers: Headers, rec: RequestRecord) -> APIError | None:
        """Authenticate: None when the request may proceed."""
        st, path = self.state, route_path(scope)
        keys: KeyStore = st.keys
        presented = presented_key(headers)
        address = (scope.get("client") or ("unknown",))[0]
        if path.startswith("/admin") or path in ADMIN_PATHS:
            if keys.admin_digest is None and not any(k.admin for k in keys.keys):
                return APIError(403, "admin routes are disabled: start the server with --admin-key", code="forbidden")
            if (blocked := self._auth_blocked(address)) is not None:
                return blocked
            if presented is None:
                return APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                                code="invalid_api_key")
            if not keys.is_admin(presented):
                if keys.lookup(presented) is None:  # a valid key without admin rights is not a guess
                    self._auth_failed(address)
                return APIError(403, "this key may not use admin routes", code="forbidden")
            admin = keys.lookup(presented)  # a keys-file key marked admin is named in logs and the audit trail
            rec.key_name = admin.name if admin is not None and admin.admin else "admin"
            return None
        if scope["method"] in ("GET", "HEAD") and (path == "/" or path.startswith("/ui/")):
            return None  # the web chat page's static files: public, the page asks for a key itself
        if path in OPEN_PATHS and not (path == "/metrics" and st.config.server.auth_config.metrics_require_key):
            return None
        if keys.enabled:
            if (blocked := self._auth_blocked(address)) is not None:
                return blocked
            key = keys.lookup(presented)
            if key is None:
                if presented is None:
                    return APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                                    code="invalid_api_key")
                self._auth_failed(address)
                return APIError(401, "invalid API key", code="invalid_api_key")
            rec.key_name, rec.api_key = key.name, key
        if path in QUIET_PATHS:
            return None
        try:
            st.admission.take_request(rec)
        except APIError as e:
            return e
        return None

    def _auth_blocked(self, address: str) -> APIError | None:
        """429 while `address` has used up its failed authentications (whatever key it sends now)."""
        limit = self.state.config.admission.auth_failures_per_minute
        wait = self.auth_failures.retry_after(address, limit) if limit else 0.0
        if not wait:
            return None
        self.state.metrics.rate_limited.labels("-", "auth_failures").inc()
        secs = max(1, int(wait + 0.999))
        return APIError(429, f"too many failed authentications from this address (limit {limit} per minute); "
                             f"retry in {secs}s", code="too_many_auth_failures", headers={"Retry-After": str(secs)})

    def _auth_failed(self, address: str) -> None:
        limit = self.state.config.admission.auth_failures_per_minute
        if limit and self.auth_failures.record_failure(address, limit):
            logger.warning("client address %s used up its %d failed authentications per minute; refusing it "
                           "with 429 until the limit refills", address, limit)

    def _limit_headers(self, rec: RequestRecord) -> dict[str, str]:
        if rec.path in OPEN_PATHS:
            return {}
        return self.state.admission.limit_headers(rec)

    def _finish(self, rec: RequestRecord) -> None:
        if rec._ended:
            return
        self.state.admission.settle(rec)
        self.state.telemetry.finish(rec, quiet=rec.path in QUIET_PATHS)


def cors(srv, app):
    """`app` behind Starlette's CORS middleware when --allowed-origins names any (as vLLM's flags): it answers
    a browser's preflight (OPTIONS with Origin and Access-Control-Request-Method) before keys are asked for,
    since browsers send no credentials there, and adds the Access-Control-Allow-* headers to every response to
    an allowed origin, errors included. Without allowed origins, `app` itself: no cross-origin access."""
    if not srv.api_config.allowed_origins:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(app, allow_origins=list(srv.api_config.allowed_origins), allow_methods=list(srv.api_config.allowed_methods),
                          allow_headers=list(srv.api_config.allowed_headers), allow_credentials=srv.api_config.allow_credentials)


def _is_done(message) -> bool:
    """Whether a streamed body chunk ends with the SSE terminator (the client may stop reading there)."""
    return message.get("body", b"").endswith(b"data: [DONE]\n\n")


async def _read_body(receive, headers: Headers, limit: int) -> tuple[bytes, APIError | None]:
    """Read the whole body up front (JSON APIs), refusing more than `limit` bytes with 413."""
    too_big = APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return b"", too_big
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b"", APIError(499, "client disconnected")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", too_big
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks), None


def replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then passes through (for disconnects)."""
    sent = False

    async def inner():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return inner


MAX_HEAD_BYTES = 16 * 1024  # h11's limit on a request's head (the request line and headers)


def _oversized_head(scope) -> APIError | None:
    """431 for request headers over MAX_HEAD_BYTES: httptools (uvicorn's parser where installed) has no limit,
    and a server should not carry megabytes of headers into every layer."""
    size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
    if size > MAX_HEAD_BYTES:
        return APIError(431, f"request headers of {size} bytes; at most {MAX_HEAD_BYTES} are accepted",
                        code="request_header_fields_too_large")
    return None


def _whole_body(send):
    """`send` for an HTTP/1.0 client, which cannot read chunked encoding: the response is held until its last
    body message and sent with a Content-Length and Connection: close. uvicorn's httptools protocol chunks any
    response without a length whatever the request's version, so a stream would reach such a client as chunk
    sizes mixed into the events and `data: [DONE]` would not be the last thing it reads; held whole, it is."""
    start: dict | None = None
    parts: list[bytes] = []

    async def send_whole(message):
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            return await send(message)
        parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(parts)
        headers = [(k, v) for k, v in start.get("headers", [])
                   if k.lower() not in (b"content-length", b"transfer-encoding", b"connection")]
        headers += [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return send_whole


async def _send_error(send, err: APIError, oip: bool = False, ollama: bool = False, path: str = "") -> None:
    """The error response; `oip`, `ollama`: in the Open Inference Protocol's or Ollama's shape, which their
    clients parse."""
    import json

    from servelm.server.errors import error_content
    from servelm.server.oip.codec import error_body

    content = error_body(err) if oip else {"error": err.message} if ollama else error_content(err, path)
    body = json.dumps(content).encode()  # ASCII: a message quoting the input encodes
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
