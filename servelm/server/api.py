"""The OpenAI-compatible HTTP API (FastAPI). It validates, tokenizes, streams; the engine processes generate.

The routes live in one package per protocol (`openai`, `ollama`, `oip`, `native`, and `admin`, `web`) over the
shared machinery in `servelm.server.common`; this module holds the server state and assembles the app.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from servelm.config.settings import ServeConfig
from servelm.server.directory import ModelDirectory, ServedModel
from servelm.server.middleware.admission import Admission
from servelm.server.middleware.auth import KeyStore
from servelm.server.observability.metrics import Metrics
from servelm.server.observability.telemetry import Telemetry
from servelm.worker.engine_client import EngineClient


@dataclass
class ServerState:
    """Everything the routes share. `engine`, `tokenizer` and `model_name` are the default model's;
    `models` resolves any request's model (built from those three when not given)."""

    engine: EngineClient
    model_name: str
    tokenizer: object
    config: ServeConfig
    keys: KeyStore
    metrics: Metrics
    admission: Admission
    telemetry: Telemetry
    embedder: object | None = None
    embed_model_name: str | None = None
    created: int = 0
    models: ModelDirectory | None = None
    control: object | None = None  # the control plane (registry, deployments) when the server has one
    traffic: object | None = None  # server.traffic.TrafficService (control's, with the server's metrics and webhook)
    reconciler: object | None = None  # control.reconciler.Reconciler: deployment specs driven into being

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ModelDirectory()
            self.models.add(ServedModel(self.engine, self.tokenizer, self.model_name, metrics=self.metrics))
        if self.embedder is not None and self.embed_model_name is not None:
            self.models.embedding_name = self.embed_model_name  # named in the embedding routes' 404


def build_app(state: ServerState):
    """The FastAPI app wrapped in the gateway (request ids, body limit, keys, telemetry)."""
    from servelm.server.admin.kv import add_kv_routes
    from servelm.server.admin.lora import add_lora_routes
    from servelm.server.admin.ops import add_ops_routes
    from servelm.server.admin.pause import add_pause_routes
    from servelm.server.admin.sleep import add_sleep_routes
    from servelm.server.admin.weights import add_weight_routes
    from servelm.server.common import Api
    from servelm.server.errors import install_error_handlers
    from servelm.server.middleware.gateway import Gateway
    from servelm.server.native import routes as native
    from servelm.server.openai import chat, completions, embeddings, models, scoring, tokenize
    from servelm.server.openapi import install_openapi
    from servelm.server.web.docs import add_docs_routes

    docs = not state.config.server.api_config.disable_fastapi_docs
    app = FastAPI(title="servelm", description="OpenAI-compatible LLM server", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    if docs:
        add_docs_routes(app)  # Swagger UI and ReDoc with local assets: they work offline
    app.state.servelm = state
    api = Api(state)
    install_error_handlers(app)
    default = state.models.default
    install_openapi(app, lambda: default.info.vocab_size if default and default.info else None,
                    lambda: default.max_model_len if default else 0)
    for family in (models, completions, chat, tokenize, native, embeddings, scoring):
        family.add_routes(app, api)
    add_ops_routes(app, state)
    add_kv_routes(app, state)
    add_lora_routes(app, state)
    add_weight_routes(app, state)
    add_sleep_routes(app, state)
    add_pause_routes(app, state)
    from servelm.server.anthropic import routes as anthropic
    from servelm.server.ollama import routes as ollama
    from servelm.server.openai import responses
    from servelm.server.web import routes as webui
    for family in (ollama, responses, anthropic, webui):  # Ollama's /api/*, OpenAI's /v1/responses, the chat page at /
        family.add_routes(app, api)
    from servelm.server import sagemaker

    sagemaker.add_routes(app, state)  # POST /invocations
    from servelm.server.oip import (
        routes as oip,  # the Open Inference Protocol (non-LLM models); app.state.oip
    )

    oip.add_routes(app, state)
    if state.control is not None:
        from servelm.server.admin.routes import add_admin_routes

        add_admin_routes(app, state)
    if state.traffic is not None:
        from servelm.server.admin.traffic import add_traffic_routes
        from servelm.server.native import feedback

        add_traffic_routes(app, state)
        feedback.add_routes(app, state)
    if state.reconciler is not None:
        from servelm.server.admin.spec import add_spec_routes

        add_spec_routes(app, state)
    from servelm.server.middleware import user

    user.install(app, state.config.server.api_config.middleware)
    return Gateway(app, state)
