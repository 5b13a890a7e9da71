"""POST /sleep, POST /wake_up and GET /is_sleeping (admin key; vLLM's routes, which reinforcement-learning
trainers call around a training step): a model's engine, started with --enable-sleep-mode, gives back the
memory of its KV cache and weights while idle, and takes it again (engine/sleep.py). The engine process does the
work between steps; this process only asks and answers."""

from __future__ import annotations

from fastapi import FastAPI, Query
from pydantic import BaseModel, Field

from servelm.server.admin.kv import ask_engine, single_engine
from servelm.server.openai.protocol import APIError


class SleepOut(BaseModel):
    model: str
    level: int
    num_bytes: int = Field(description="bytes of memory given back (on the CPU, of ranges some of which may never "
                                       "have been written)")


class WakeOut(BaseModel):
    model: str
    asleep: list[str] = Field(description="the parts still asleep: weights, kv_cache")


class SleepingOut(BaseModel):
    is_sleeping: bool
    asleep: list[str] = Field(description="the parts asleep: weights, kv_cache")


def add_sleep_routes(app: FastAPI, state) -> None:
    def engine_of(model: str | None):
        return single_engine(state, model, "sleep mode puts a single engine to sleep", "invalid_sleep_request",
                             needs="sleep")

    def ask(call, field: str | None = None):
        return ask_engine(call, "invalid_sleep_request", field)

    @app.post("/sleep", response_model=SleepOut,
              responses={409: {"description": "requests in flight"},
                         400: {"description": "sleep mode is off, or the level is not 1 or 2"}})
    async def sleep(level: int = Query(1, description="1: the weights kept in host memory; 2: discarded"),
                    model: str | None = Query(None, description="the served model (default: the default model)")):
        """Put the model's engine to sleep while it is idle, as vLLM's route: its KV cache's memory is given back
        and every cached prefix forgotten; at level 1 its weights are kept in host memory (on a GPU they leave
        it; on the CPU they are host memory already), at level 2 discarded, for new ones to be loaded after
        waking the weights. Requests made while it sleeps wait until it is woken. 409 while requests are in
        flight, changing nothing."""
        served = engine_of(model)
        if level not in (1, 2):
            raise APIError(400, f"level is 1 (the weights kept in host memory) or 2 (discarded), not {level}",
                           "level", "invalid_sleep_request")
        released = await ask(lambda: served.engine.sleep(level))
        if released is None:
            raise APIError(409, "requests are in flight: the engine sleeps only while idle", code="engine_busy")
        return SleepOut(model=served.served_name, level=level, num_bytes=released)

    @app.post("/wake_up", response_model=WakeOut,
              responses={400: {"description": "sleep mode is off, a tag is unknown, or the checkpoint read again "
                                              "after a level-2 sleep cannot be"}})
    async def wake_up(tags: list[str] | None = Query(None, description="the parts to wake, weights and kv_cache "
                                                                       "(repeat the parameter; default both)"),
                      model: str | None = Query(None, description="the served model (default: the default model)")):
        """Wake the model's engine, as vLLM's route: `?tags=weights` first, to load new weights
        (POST /update_weights_from_disk) before `?tags=kv_cache` brings the cache back. Woken whole after a
        level-2 sleep with no weights loaded meanwhile, the engine reads the checkpoint it last loaded from
        disk again."""
        served = engine_of(model)
        asleep = await ask(lambda: served.engine.wake_up(tags), "tags")
        return WakeOut(model=served.served_name, asleep=asleep)

    @app.get("/is_sleeping", response_model=SleepingOut)
    async def is_sleeping(model: str | None = Query(None, description="the served model (default: the default "
                                                                      "model)")):
        """Whether the model's engine sleeps, as vLLM's route, and which of its parts."""
        served = engine_of(model)
        asleep = await ask(lambda: served.engine.sleeping())
        return SleepingOut(is_sleeping=bool(asleep), asleep=asleep)
