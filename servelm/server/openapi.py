"""servelm's own OpenAPI document (`/openapi.json`), made to say what the server really does: errors are
OpenAI's error object with the statuses the gateway and routes answer (never FastAPI's 422), and token ids and
lengths carry the served model's real bounds."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_WHY = {400: "invalid request", 401: "missing or invalid API key", 403: "the key may not do this",
        404: "unknown model or route", 408: "queue timeout", 413: "request body too large",
        429: "rate limit", 503: "overloaded, or the engine or embedder is down"}
_GENERATION = {"/v1/completions", "/v1/chat/completions", "/generate", "/chat"}


def statuses(path: str, method: str) -> set[int]:
    """The error statuses a route can answer (gateway: body limit, keys, rate limits; then the route's own)."""
    if path == "/health":
        return {413}
    if path == "/ready":
        return {413, 503}
    if path == "/metrics":
        return {401, 413}  # 401 with --metrics-require-key
    if path.startswith("/admin"):
        return {401, 403, 413} | ({400} if method == "patch" else set())
    out = {401, 413} if path == "/server/stats" else {401, 403, 413, 429}
    if method == "post":
        out |= {400, 404, 503}
    if path in _GENERATION:
        out.add(408)
    if "{" in path:
        out.add(404)
    return out


def _bound_token_ids(node, vocab: int) -> None:
    """Every integer array item named a token id in the schemas gets the vocabulary as its range."""
    if isinstance(node, dict):
        if node.get("type") == "array" and node.get("items", {}).get("type") == "integer" \
                and node.get("x-token-ids"):
            node["items"] = {**node["items"], "minimum": 0, "maximum": vocab - 1}
        for v in node.values():
            _bound_token_ids(v, vocab)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab)


def install_openapi(app: FastAPI, vocab_size) -> None:
    """Replace FastAPI's generated document with the corrected one (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas["Error"] = ERROR_SCHEMA
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for status in sorted(statuses(path, method)):
                    responses[str(status)] = {"description": _WHY[status], "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        vocab = vocab_size()
        if vocab:
            _bound_token_ids(schemas, vocab)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
