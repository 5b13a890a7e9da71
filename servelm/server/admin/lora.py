"""LoRA adapters at run time (admin key): GET /admin/lora lists them, POST /admin/lora/load and /admin/lora/unload
change them, and vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter do the same with vLLM's bodies.
The engine of the base model loads the adapter between steps; from then on a request whose `model` is the
adapter's name runs with it on every API."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from servelm.server.admin.kv import ask_engine
from servelm.server.openai.protocol import APIError

ADAPTER_NAME = r"^[A-Za-z0-9._:/\-]+$"


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: Annotated[str, Field(min_length=1, max_length=200, pattern=ADAPTER_NAME)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096,
                                    description="a PEFT adapter folder on the server's machine")]
    base_model_name: str | None = Field(None, description="the served model it adapts (default: the default model)")


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: Annotated[str, Field(min_length=1, max_length=200)]
    lora_int_id: int | None = Field(None, description="accepted for vLLM's clients; the name identifies it")


def _engine_of(state, base: str | None):
    served = state.models.default if base is None else \
        next((m for m in state.models.fixed() if base in (m.served_name, *state.models.aliases(m.served_name))), None)
    if served is None:
        raise APIError(404, f"no model {base!r} is served from start to take adapters", "base_model_name",
                       "model_not_found")
    if not hasattr(served.engine, "lora_adapter"):
        raise APIError(400, f"{served.served_name} runs on several workers; adapters are loaded into a single "
                       "engine's model", "base_model_name", "invalid_lora_request")
    return served


def add_lora_routes(app: FastAPI, state) -> None:
    async def run(served, action: str, name: str, path: str = ""):
        done = await ask_engine(lambda: served.engine.lora_adapter(action, name, path))
        if done.error is not None:
            status = 404 if "no adapter named" in done.error else 409 if "in use" in done.error else 400
            raise APIError(status, done.error, "lora_path" if status == 400 else "lora_name", "invalid_lora_request")
        return done

    async def load(body: LoadBody) -> dict:
        if body.lora_name in state.models.names() and body.lora_name not in state.models.adapters:
            raise APIError(409, f"{body.lora_name!r} is the name of a model", "lora_name", "invalid_lora_request")
        served = _engine_of(state, body.base_model_name)
        done = await run(served, "load", body.lora_name, body.lora_path)
        state.models.add_adapter(body.lora_name, served.served_name, body.lora_path)
        return {"object": "lora_adapter", "name": body.lora_name, "base_model": served.served_name,
                "adapters": done.adapters}

    async def unload(body: UnloadBody) -> dict:
        entry = state.models.adapters.get(body.lora_name)
        if entry is None:
            raise APIError(404, f"no adapter named {body.lora_name!r} is loaded", "lora_name", "model_not_found")
        await run(_engine_of(state, entry[0]), "unload", body.lora_name)
        del state.models.adapters[body.lora_name]
        return {"object": "lora_adapter", "name": body.lora_name, "deleted": True}

    @app.get("/admin/lora")
    async def list_adapters():
        """The adapters requests may name, each with its base model and path."""
        return {"object": "list", "data": [{"name": n, "base_model": b, "path": p}
                                           for n, (b, p) in state.models.adapters.items()]}

    @app.post("/admin/lora/load")
    async def admin_load(body: LoadBody):
        """Load a PEFT LoRA adapter into a base model's engine (400 if it cannot serve that base)."""
        return await load(body)

    @app.post("/admin/lora/unload")
    async def admin_unload(body: UnloadBody):
        """Unload an adapter (409 while requests use it)."""
        return await unload(body)

    @app.post("/v1/load_lora_adapter")
    async def vllm_load(body: LoadBody):
        """vLLM's route for /admin/lora/load (the admin key is required here too)."""
        await load(body)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def vllm_unload(body: UnloadBody):
        """vLLM's route for /admin/lora/unload (the admin key is required here too)."""
        await unload(body)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
