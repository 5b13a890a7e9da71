"""Gauges and /server/stats count what is in flight now, not as of the engine's last step: the app in-process,
with a fake engine peer that receives requests and never steps."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server


def _gauge(text: str, name: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_a_new_request_shows_in_gauges_and_stats_before_any_engine_step(tokenizer):
    from servelm.config.settings import load
    from servelm.engine.step_outputs import EngineStats
    from servelm.server.api import build_app
    from servelm.server.serve import build_state
    from servelm.worker import messages as m
    from servelm.worker.client import AsyncEngine

    idle = EngineStats(0, 0, 0, 0.0, 64, 64, 0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    async def main():
        config = load({"max_model_len": 256, "embedding_model": "none", "log_requests": False}, env={})
        engine = AsyncEngine(config.engine, tokenizer)
        peer = zmq.asyncio.Context().socket(zmq.PULL)  # stands in for the engine process: takes, never steps
        peer.connect(engine._in_addr)
        engine.info, engine.stats, engine.ready = m.Ready(256, 49152, 0, idle), idle, True
        app = build_app(build_state(config, tokenizer, engine, "tiny"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "stream": True}
            pending = asyncio.create_task(c.post("/v1/completions", json=body))
            msg = m.input_decoder.decode(await asyncio.wait_for(peer.recv(), 30))
            assert isinstance(msg, m.AddRequest)  # registered and sent; the engine has not stepped since
            text = (await c.get("/metrics")).text
            assert _gauge(text, "servelm:num_requests_waiting") == 2  # both samples, at once
            assert _gauge(text, "servelm:num_requests_running") == 0
            st = (await c.get("/server/stats")).json()
            assert (st["running"], st["waiting"], st["engine"]["in_flight"]) == (0, 2, 1)
            # the engine reports more running than the API has in flight (stale): never more than in flight
            await engine._on_step(m.StepOutputs([], [], EngineStats(5, 3, 0, 0.1, 64, 60, 0, 0, 0.0, 0, 0, 0, 1, 0, 0)))
            st = (await c.get("/server/stats")).json()
            assert (st["running"], st["waiting"]) == (2, 0)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
        await engine.shutdown()
        peer.close(linger=0)

    asyncio.run(main())
