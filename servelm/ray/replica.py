"""One servelm engine worker as a Ray Serve replica: the replica owns an AsyncEngine (an engine-core process on
the replica's own node) and streams RequestOutputs back to the API process through Ray."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from servelm.config.engine import EngineConfig
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams

logger = logging.getLogger("servelm.ray")


class EngineReplica:
    """The replica's state: its engine, started in the background so the constructor returns at once and Ray
    Serve's health check reports the replica healthy only once the engine is warm (see check_health)."""

    def __init__(self, engine: dict, start_timeout: float = 600.0) -> None:
        from servelm.model.loading.metadata import model_tokenizer
        from servelm.worker.client import AsyncEngine

        config = EngineConfig(**engine)
        self.engine = AsyncEngine(config, start_timeout=start_timeout)
        self.engine.launch()  # the engine process loads the model while the tokenizer loads here
        self.engine.set_tokenizer(model_tokenizer(config.model_config))
        self._started = asyncio.ensure_future(self.engine.wait_ready())

    async def ready(self) -> dict:
        """Wait until the engine is warm; what the API process needs to know of it."""
        await self._started
        info = self.engine.info
        return {"max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                "eos_token_ids": list(info.eos_token_ids), "sampling_defaults": dict(info.sampling_defaults)}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, priority: int = 1, queue_timeout: float | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        await self._started
        # the caller closing the stream cancels this generator, whose finally aborts the request in the engine
        async for out in self.engine.generate(request_id, prompt_token_ids, params, prompt, priority,
                                              queue_timeout, cache_salt):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> dict:
        """The engine's counters at its last step, for the API process's /server/stats and metrics."""
        import dataclasses

        st = self.engine.stats
        running, waiting = self.engine.live_counts()
        return {"running": running, "waiting": waiting, "stats": dataclasses.asdict(st) if st else None}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """servelm's own load signals, which Ray Serve averages over the replicas for the autoscaling policy
        (servelm.ray.app.waiting_requests_policy): requests waiting for a batch slot, and KV cache usage."""
        running, waiting = self.engine.live_counts()
        st = self.engine.stats
        return {"num_requests_waiting": float(waiting), "num_requests_running": float(running),
                "kv_cache_usage": float(st.kv_usage) if st else 0.0}

    async def check_health(self) -> None:
        """Ray Serve calls this periodically: an engine process that died and did not come back fails it, and
        Ray replaces the replica. (A dead engine is restarted by the AsyncEngine itself first.)"""
        if self._started.done() and self._started.exception() is not None:
            raise RuntimeError(f"the engine failed to start: {self._started.exception()}")
        if self._started.done() and not self.engine.check_engine() and self.engine.restarts > 3:
            raise RuntimeError("the engine process keeps dying")

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    def __del__(self) -> None:
        # Ray Serve tears replicas down without a hook we can await; the engine process also exits on its
        # own once this (its parent) process is gone
        proc = getattr(getattr(self, "engine", None), "_proc", None)
        if proc is not None and proc.is_alive():
            proc.terminate()
