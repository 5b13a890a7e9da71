"""AsyncEngine.generate registers a request and releases it as one guarded unit: no exception path, before or
after the engine hears of the request, may leave a stream (a queue slot) behind; likewise a pause whose caller
gives up leaves nothing paused. No engine process is started: the handle is marked ready and the requests never
get further than the API side."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from servelm.config.engine import EngineConfig
from servelm.sampling_params import SamplingParams
from servelm.worker import messages as m
from servelm.worker.client import AsyncEngine, QueueTimeout, RequestRejected


async def _drain(engine: AsyncEngine, rid: str, ids: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(rid, ids, params):
        pass


@pytest.fixture
def engine():
    eng = AsyncEngine(EngineConfig())
    eng.ready = True  # no engine process: what is tested happens before any output
    ctx = zmq.Context()
    eng.peer = ctx.socket(zmq.PULL)  # stands in for the engine's end of the request socket
    eng.peer.connect(eng._in_addr)
    yield eng
    eng.ready = False
    ctx.destroy(linger=0)
    asyncio.run(eng.shutdown())


def _sent(eng: AsyncEngine) -> list:
    """The messages the engine would have received."""
    out = []
    while eng.peer.poll(100):
        out.append(m.input_decoder.decode(eng.peer.recv()))
    return out


@pytest.mark.parametrize("ids, params", [  # past the edge's checks, a value msgpack cannot carry
    ([1, 2**64, 3], SamplingParams()),
    ([1, -2**63 - 1], SamplingParams()),
    ([1, 2, 3], SamplingParams(stop_token_ids=[2**64])),
    ([1, 2, 3], SamplingParams(logit_bias={2**64: 1.0})),
])
def test_values_the_wire_cannot_carry_are_rejected_without_a_leak(engine, ids, params):
    for i in range(20):
        with pytest.raises(RequestRejected, match="out of range"):
            asyncio.run(_drain(engine, f"bad-{i}", ids, params))
    assert engine.streams == {} and engine.num_queued() == 0
    assert engine.output_processor.states == {}
    assert _sent(engine) == []  # the engine never heard of them


def test_a_failure_after_registration_releases_the_slot(engine, monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("output state failed")

    monkeypatch.setattr(engine.output_processor, "add_request", broken)
    with pytest.raises(RuntimeError, match="output state failed"):
        asyncio.run(_drain(engine, "r1", [1, 2, 3], SamplingParams()))
    assert engine.streams == {} and engine.num_queued() == 0


def test_a_cancelled_request_releases_the_slot(engine):
    async def main():
        task = asyncio.create_task(_drain(engine, "r2", [1, 2, 3], SamplingParams()))
        while not engine.peer.poll(0):  # the engine has the request; it waits for output that never comes
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.streams == {} and engine.output_processor.states == {}
    assert [type(x).__name__ for x in _sent(engine)] == ["AddRequest", "Abort"]  # its KV blocks are freed too


def test_a_pause_given_up_leaves_nothing_paused(engine):
    """pause_generation("keep") cancelled before the engine answers (its caller left): new requests are let in
    again, and the engine is told to release what the hold may have reached."""
    async def main():
        task = asyncio.create_task(engine.pause_generation("keep"))
        while not engine.peer.poll(0):  # the hold has been sent; its answer never comes
            await asyncio.sleep(0.01)
        assert engine.paused == "keep" and not engine._resumed.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.paused is None and engine._resumed.is_set()
    assert [(type(x).__name__, x.hold) for x in _sent(engine)] == [("HoldOp", True), ("HoldOp", False)]


def test_a_request_at_a_paused_door_keeps_its_queue_timeout(engine):
    """While paused, a new request waits before it is registered; its queue timeout counts that wait, and one
    that runs out leaves nothing behind."""
    async def main():
        engine.paused = "wait"
        engine._resumed.clear()
        with pytest.raises(QueueTimeout, match="paused"):
            async for _ in engine.generate("late", [1, 2, 3], SamplingParams(), queue_timeout=0.05):
                pass

    asyncio.run(main())
    assert engine.streams == {} and _sent(engine) == []
