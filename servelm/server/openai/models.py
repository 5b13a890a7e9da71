"""Health, readiness, the version and the model list: GET /health, /ready (and SageMaker's /ping), /version,
/v1/models, /v1/models/{id}."""

from __future__ import annotations

from fastapi import FastAPI

from servelm.control.types import Kind
from servelm.server.common import Api
from servelm.server.openai.protocol import APIError
from servelm.version import __version__


def model_cards(state) -> list[dict]:
    """One card per id a request may name: each generation model (then its aliases, as vLLM lists every
    --served-model-name, each with `root` naming the model's id), each deployed version by name and by
    name:version, then the embedding model."""
    out, seen = [], set()
    for m in state.models:
        for mid in dict.fromkeys((m.name, m.served_name)):
            if mid in seen:
                continue
            seen.add(mid)
            card = {"id": mid, "object": "model", "created": state.created, "owned_by": "servelm",
                    "max_model_len": m.max_model_len}
            if m.version is not None:
                card.update(version=m.version.version, state=m.version.state.value, root=m.version.ref)
                if m.version.base is not None:  # a LoRA adapter version: its base, as vLLM lists adapters
                    card["parent"] = m.version.base
            out.append(card)
            if m.version is None:
                for alias in state.models.aliases(mid):
                    seen.add(alias)
                    out.append({**card, "id": alias, "root": mid})
    for name, (base, path) in state.models.adapters.items():  # LoRA adapters, with their base as vLLM lists them
        if name not in seen:
            seen.add(name)
            out.append({"id": name, "object": "model", "created": state.created, "owned_by": "servelm",
                        "root": path, "parent": base})
    if state.embedder and state.embed_model_name not in seen:
        seen.add(state.embed_model_name)
        out.append({"id": state.embed_model_name, "object": "model", "created": state.created,
                    "owned_by": "servelm"})
    for m in state.models.deployed(Kind.EMBED):  # deployed embedding versions
        for mid in dict.fromkeys((m.name, m.served_name)):
            if mid not in seen:
                seen.add(mid)
                out.append({"id": mid, "object": "model", "created": state.created, "owned_by": "servelm",
                            "version": m.version.version, "state": m.version.state.value,
                            "root": m.version.ref})
    return out


def add_routes(app: FastAPI, api: Api) -> None:
    state = api.state

    def cards() -> list[dict]:
        return model_cards(state)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        """The server's version, as vLLM's GET /version answers it."""
        return {"version": __version__}

    @app.get("/ready")
    async def ready():
        if not all(m.check_engine() for m in state.models.fixed()):  # the processes, not their last word
            raise APIError(503, "the engine is not ready", code="engine_unavailable")
        return {"status": "ready", "models": [c["id"] for c in cards()]}

    # SageMaker's health check (GET or POST, as vLLM takes it): 200 once the engine is ready, as /ready
    app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)(ready)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        card = next((c for c in cards() if c["id"] == model_id), None)
        if card is None:
            raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
        return card
