"""POST /admin/kv/save and /admin/kv/load (admin key): a model's engine saves its prefix cache to a file, or
restores it from one; POST /reset_prefix_cache (vLLM's route, admin key) empties it. The engine process does
the work between steps; this process only asks and answers."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from servelm.server.openai.protocol import APIError

# the engine's refusal -> (status, code)
_ERRORS = {"mismatch": (409, "kv_cache_mismatch"), "corrupt": (400, "kv_cache_corrupt"),
           "not_found": (404, "kv_cache_not_found"), "invalid": (400, "invalid_kv_cache_request"),
           "internal": (500, "internal_error")}


class KVBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="the served model whose cache to save or restore (default: the default model)")
    path: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        None, description="a file, or a directory holding one file per model, on the server's machine "
                          "(default: the --kv-cache-persist directory)")


class ResetOut(BaseModel):
    model: str
    num_blocks: int = Field(description="cached blocks dropped")


class KVOut(BaseModel):
    model: str
    path: str
    num_blocks: int = Field(description="blocks written, or restored into the cache")
    num_skipped: int = Field(description="load: blocks already cached, or left out for want of free blocks")
    size_bytes: int
    seconds: float


def single_engine(state, model: str | None, what: str, code: str = "invalid_kv_cache_request",
                  needs: str = "kv_cache"):
    """The served model named `model` (default: the default model), which must run on one engine of its own,
    one with the method `needs` (404 for a model not served from start; 400 with `code` for one on several
    workers: `what` says what needs one engine)."""
    served = state.models.default if model is None else \
        next((m for m in state.models.fixed() if m.served_name == model), None)
    if served is None:
        raise APIError(404, f"no model {model!r} is served from start", "model", "model_not_found")
    if not hasattr(served.engine, needs):
        raise APIError(400, f"{served.served_name} runs on several workers; {what}", "model", code)
    return served


async def ask_engine(call, code: str | None = None, field: str | None = None):
    """`await call()` on a model's engine: an engine that is down is a 503; with `code`, a ValueError (what the
    engine refused, changing nothing) is a 400 naming `field`."""
    from servelm.worker.client import EngineDeadError

    try:
        return await call()
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    except ValueError as e:
        if code is None:
            raise
        raise APIError(400, str(e), field, code) from e


def add_kv_routes(app: FastAPI, state) -> None:
    def engine_of(model: str | None, what: str):
        return single_engine(state, model, f"{what} a single engine's cache")

    async def run(action: str, body: KVBody | None) -> KVOut:
        body = body or KVBody()
        served = engine_of(body.model, "save or load")
        done = await ask_engine(lambda: served.engine.kv_cache(action, body.path))
        if done.error is not None:
            status, code = _ERRORS.get(done.error, (500, "internal_error"))
            raise APIError(status, done.message, "path" if status in (400, 404) else None, code)
        return KVOut(model=served.served_name, path=done.path, num_blocks=done.num_blocks,
                     num_skipped=done.num_skipped, size_bytes=done.size_bytes, seconds=done.seconds)

    @app.post("/reset_prefix_cache", response_model=ResetOut, responses={409: {"description": "requests in flight"}})
    async def reset_prefix_cache(model: str | None = None):
        """Forget every cached prefix of the model (`?model=NAME`, default: the default model), as vLLM's route:
        after its weights changed, or between benchmark runs. 409 while requests are in flight, changing
        nothing."""
        served = engine_of(model, "reset")
        dropped = await ask_engine(served.engine.reset_prefix_cache)
        if dropped is None:
            raise APIError(409, "requests are in flight: the prefix cache is reset only while the engine is idle",
                           code="prefix_cache_in_use")
        return ResetOut(model=served.served_name, num_blocks=dropped)

    @app.post("/admin/kv/save", response_model=KVOut)
    async def kv_save(body: KVBody | None = None):
        """Save the model's prefix cache (every cached block) to a file."""
        return await run("save", body)

    @app.post("/admin/kv/load", response_model=KVOut)
    async def kv_load(body: KVBody | None = None):
        """Restore a saved prefix cache into the model's free blocks. 409 if the file was saved for another
        model, dtype or block size; 400 if it is damaged (the cache is left as it was)."""
        return await run("load", body)
