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
# The Open Inference Protocol's error shape, which every /v2 route answers (servelm.server.oip.codec.error_body).
OIP_ERROR_SCHEMA = {
    "type": "object", "required": ["error", "code", "param"], "additionalProperties": False,
    "properties": {"error": {"type": "string"}, "code": {"type": ["string", "null"]},
                   "param": {"type": ["string", "null"]}},
}
_WHY = {400: "invalid request", 401: "missing or invalid API key", 403: "the key may not do this",
        404: "unknown model or route", 408: "queue timeout", 413: "request body too large",
        409: "the state forbids it (lifecycle, deployment in use)", 429: "rate limit",
        503: "overloaded, or the engine or embedder is down", 507: "no room in the memory budget"}
# One server-sent event: its data line is a JSON chunk (or [DONE]).
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_GENERATION = {"/v1/completions", "/v1/chat/completions", "/generate", "/chat", "/v1/responses"}


def statuses(path: str, method: str) -> set[int]:
    """The error statuses a route can answer (gateway: body limit, keys, rate limits; then the route's own)."""
    if path in ("/health", "/v2/health/live"):
        return {413}
    if path in ("/ready", "/v2/health/ready"):
        return {413, 503}
    if path == "/metrics":
        return {401, 413}  # 401 with --metrics-require-key
    if path.startswith("/admin") and path != "/admin/config":  # the model platform's routes
        return {400, 401, 403, 404, 409, 413, 503, 507}
    if path.startswith("/admin"):
        return {401, 403, 413} | ({400} if method == "patch" else set())
    out = {401, 413} if path == "/server/stats" else {401, 403, 413, 429}
    if method == "post":
        out |= {400, 404, 503}
    if path in _GENERATION:
        out.add(408)
    if "{" in path:
        out.add(404)
    if path.startswith("/v2/models/"):
        out.add(503)  # the version cannot be loaded
    return out


def is_oip_path(path: str) -> bool:
    """Whether a path is the Open Inference Protocol's (/v2), whose errors have that protocol's shape."""
    return path == "/v2" or path.startswith("/v2/")


def route_path(scope) -> str:
    """The path a request's route is found by: its path less --root-path, which uvicorn puts in front of every
    path (a proxy serving the server under that prefix stripped it; the server's own links add it back)."""
    path, root = scope["path"], scope.get("root_path") or ""
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def is_anthropic_path(path: str) -> bool:
    """Whether a path is Anthropic's Messages API, whose errors have Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_ollama_path(path: str) -> bool:
    """Whether a path is Ollama's API (/api/...), whose errors have Ollama's shape: {"error": "message"}."""
    return path.startswith("/api/")


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


def _bound_lengths(node, max_model_len: int) -> None:
    """Every integer marked as a generation length gets the context length less one prompt token as its maximum
    (prompt plus max_tokens must fit too, a bound across two fields that JSON Schema cannot state)."""
    if isinstance(node, dict):
        if node.get("x-context-bound") and node.get("type") == "integer":
            node["maximum"] = max_model_len - 1
        for v in node.values():
            _bound_lengths(v, max_model_len)
    elif isinstance(node, list):
        for v in node:
            _bound_lengths(v, max_model_len)


# What PATCH /admin/config takes: the run-time settings, flat, with the ranges their validate() enforces.
_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
_RANGES = {"max_num_seqs": {"minimum": 1}, "priority_aging_s": {"minimum": 0},
           "scheduling_policy": {"enum": ["priority", "fcfs"]}, "queue_high_watermark": {"minimum": 1},
           "queue_low_watermark": {"minimum": 0}, "queue_timeout_s": {"minimum": 0},
           "rate_limit_rpm": {"minimum": 1}, "rate_limit_tpm": {"minimum": 1},
           "default_priority": {"enum": ["high", "normal", "low"]}, "auth_failures_per_minute": {"minimum": 1},
           "max_n": {"minimum": 1}, "max_request_tokens": {"minimum": 1}, "max_embedding_inputs": {"minimum": 1}}


def _config_patch_schema() -> dict:
    import typing

    from servelm.config.engine import choices
    from servelm.config.settings import GROUP_OF, SECTIONS, all_fields

    props: dict = {}
    nested: dict[str, dict] = {}  # {section: {field: value}}, and the older {engine: {...}, admission: {...}}
    for sec, f in all_fields():
        if not f.metadata.get("runtime"):
            continue
        tp = typing.get_type_hints(SECTIONS[sec])[f.name]
        args = [tp] if choices(tp) is not None else [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        names = choices(args[0])
        one = {"type": "string", "enum": list(names)} if names is not None else {"type": _TYPES[args[0]]}
        one.update({**_RANGES.get(f.name, {}), "description": f.metadata.get("help", "")})
        if args[0] is int:
            one.setdefault("maximum", 2**63 - 1)
        props[f.name] = {"anyOf": [one, {"type": "null"}]} if type(None) in typing.get_args(tp) else one
        nested.setdefault(sec, {})[f.name] = props[f.name]
        if GROUP_OF[sec] != sec:
            nested.setdefault(GROUP_OF[sec], {})[f.name] = props[f.name]
    for name, fields in nested.items():
        props[name] = {"type": "object", "minProperties": 1, "additionalProperties": False, "properties": fields,
                       "description": f"the {name} settings to change, by name"}
    return {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "minProperties": 1, "additionalProperties": False, "properties": props}}}}


def install_openapi(app: FastAPI, vocab_size, max_model_len) -> None:
    """Replace FastAPI's generated document with the corrected one (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas["Error"] = ERROR_SCHEMA
        schemas["OipError"] = OIP_ERROR_SCHEMA
        for path, ops in doc.get("paths", {}).items():
            ref = "#/components/schemas/" + ("OipError" if is_oip_path(path) else "Error")
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for status in sorted(statuses(path, method)):
                    responses[str(status)] = {"description": _WHY[status], "content": {
                        "application/json": {"schema": {"$ref": ref}}}}
        paths = doc.get("paths", {})
        if "/metrics" in paths:  # Prometheus text, not JSON
            paths["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
        for path in _GENERATION:  # with "stream": true, server-sent events
            if "post" in paths.get(path, {}):
                paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
        if "patch" in paths.get("/admin/config", {}):
            paths["/admin/config"]["patch"]["requestBody"] = _config_patch_schema()
        vocab, context = vocab_size(), max_model_len()
        if vocab and context:  # the model is loaded: its bounds are known, and the document final
            _bound_token_ids(schemas, vocab)
            _bound_lengths(schemas, context)
            app.openapi_schema = doc
        return doc

    app.openapi = openapi
