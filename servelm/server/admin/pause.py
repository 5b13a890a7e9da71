"""POST /pause, POST /resume and GET /is_paused (admin key; vLLM's routes, which reinforcement-learning trainers
call around a weight update): a model's engine stops generating, its requests in flight ended, finished or
held, and new requests wait until it is resumed. The engine client (worker/client.py) holds the door; this
process only asks and answers."""

from __future__ import annotations

from fastapi import FastAPI, Query
from pydantic import BaseModel

from servelm.server.admin.kv import ask_engine, single_engine
from servelm.server.openai.protocol import APIError
from servelm.worker.client import PAUSE_MODES


class PauseOut(BaseModel):
    status: str  # "paused" | "resumed", as vLLM's answers
    model: str


class PausedOut(BaseModel):
    is_paused: bool
    mode: str | None = None


def add_pause_routes(app: FastAPI, state) -> None:
    def engine_of(model: str | None):
        return single_engine(state, model, "pausing holds a single engine's requests", "invalid_pause_request",
                             needs="pause_generation")

    @app.post("/pause", response_model=PauseOut, responses={400: {"description": "an unknown mode"}})
    async def pause(mode: str = Query("abort", description="abort: end the requests in flight (finish reason "
                                                           "abort); wait: let them finish; keep: hold them to "
                                                           "go on after /resume"),
                    wait_for_inflight_requests: bool = Query(False, description="vLLM's older form of "
                                                                                "mode=wait"),
                    clear_cache: bool = Query(True, description="after abort or wait, forget every cached "
                                                                "prefix"),
                    model: str | None = Query(None, description="the served model (default: the default model)")):
        """Stop generating so that weights can change between requests, as vLLM's route; it answers once the
        requests in flight are ended, finished or held. Requests made while paused wait (their timeouts apply)
        until POST /resume."""
        served = engine_of(model)
        mode = "wait" if wait_for_inflight_requests else mode
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode is one of {', '.join(PAUSE_MODES)}, not {mode!r}", "mode",
                           "invalid_pause_request")
        await ask_engine(lambda: served.engine.pause_generation(mode, clear_cache))
        return PauseOut(status="paused", model=served.served_name)

    @app.post("/resume", response_model=PauseOut)
    async def resume(model: str | None = Query(None, description="the served model (default: the default "
                                                                 "model)")):
        """Go on after POST /pause: held requests run again and waiting ones are let in."""
        served = engine_of(model)
        await ask_engine(served.engine.resume_generation)
        return PauseOut(status="resumed", model=served.served_name)

    @app.get("/is_paused", response_model=PausedOut)
    async def is_paused(model: str | None = Query(None, description="the served model (default: the default "
                                                                    "model)")):
        """Whether the model's engine is paused, as vLLM's route, and in which mode."""
        served = engine_of(model)
        return PausedOut(is_paused=served.engine.paused is not None, mode=served.engine.paused)
