"""Amazon SageMaker's hosting contract, as vLLM serves it: POST /invocations runs the API its JSON body is shaped
for: chat completions
(`messages`), completions (`prompt`), reranking (`query` and `documents`), scores (`text_1`, `queries` or
`data_1`), and embeddings or, for a sequence classifier, /classify (`input`). SageMaker's adapter header names
the LoRA adapter (or model) a request runs with, as the body's `model`. (SageMaker's health check, /ping, is
/ready's: servelm/server/openai/models.py.)

/invocations passes the request on to the route it names inside the app, so keys, limits, validation,
streaming and errors are that route's own.
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.routing import Route

from servelm.server.middleware.gateway import replay
from servelm.server.openai.protocol import APIError

ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"
# (what the body holds, the route it goes to), in the order they are tried
_SHAPES = (
    (("messages",), "/v1/chat/completions"),
    (("prompt",), "/v1/completions"),
    (("query", "documents"), "/rerank"),
    (("text_1",), "/score"), (("queries",), "/score"), (("data_1",), "/score"),
)
EXPECTED = ("chat completions (messages), completions (prompt), rerank (query and documents), score (text_1 or "
            "queries), embeddings or classify (input)")


def invocation_path(body: dict, classifier: bool) -> str:
    """The route an /invocations body is shaped for; a 400 naming the shapes when it fits none."""
    for keys, path in _SHAPES:
        if all(k in body for k in keys):
            return path
    if "input" in body:
        return "/classify" if classifier else "/v1/embeddings"
    raise APIError(400, f"cannot tell which API this request is for; /invocations takes {EXPECTED}", "body",
                   "unknown_invocation")


def _body(raw: bytes, adapter: str | None) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not JSON: {e}", "body", "invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "body")
    if adapter:
        body["model"] = adapter
    return body


class _Invocations:
    """The ASGI endpoint of POST /invocations: reads the body, then runs the app's router on the route the body
    names (the gateway in front has already authenticated and admitted the request)."""

    def __init__(self, app: FastAPI, state) -> None:
        self.app, self.state = app, state

    def _classifies(self, model) -> bool:
        """Whether an `input` body's model is a sequence classifier (then /classify, else /v1/embeddings)."""
        return _task_of(self.state, model) == "classify"

    async def __call__(self, scope, receive, send) -> None:
        raw, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        adapter = Headers(scope=scope).get(ADAPTER_HEADER)
        body = _body(raw, adapter)
        path = invocation_path(body, self._classifies(body.get("model")))
        if adapter:
            raw = json.dumps(body).encode()
        rec = scope.get("state", {}).get("record")
        if rec is not None:  # logged, counted and recorded (prediction log, canaries, drift) as that route's
            rec.path = path
        # the route reads the body, then the client's disconnect (to notice it)
        await self.app.router({**scope, "path": path, "raw_path": path.encode()}, replay(raw, receive), send)


def _task_of(state, model) -> str:
    """The task of the embedding-process model a body names ("embed" when it names none of them)."""
    if model is None or model == state.embed_model_name:
        return getattr(state.embedder, "task", "embed")
    from servelm.control.types import Kind

    for m in state.models.deployed(Kind.EMBED):
        if model in (m.name, m.served_name):
            return getattr(m, "task", "embed")
    return "embed"


def add_routes(app: FastAPI, state) -> None:
    app.router.routes.append(Route("/invocations", _Invocations(app, state), methods=["POST"]))
