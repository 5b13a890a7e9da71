"""Deployment races and leaks: a stalled worker's queued requests leave its engine when they are re-sent,
unload/evict/expire during a swap or scale stops every worker process, a deployment id is created once, and the
drain timeout is a server setting. Tiny random-weight models, as tests/control/test_deployments.py."""

from __future__ import annotations

import asyncio

import pytest
from serving import HOLD_BLOCKS, HOLD_CONTEXT
from test_deployments import BASE, GREEDY, _alive, _deployment, _until, _version
from tiny_models import build_model

from servelm import SamplingParams
from servelm.control.errors import Conflict
from servelm.worker.client import EngineDeadError


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory, tokenizer_dir):
    """The same architecture with other weights: a second version to swap to."""
    return build_model("llama", tmp_path_factory.mktemp("v2") / "llama", tokenizer_dir, seed=1)


def test_failed_queued_requests_leave_the_engine_and_their_id_can_be_resent(long_llama_dir):
    """fail_queued (a stalled worker's queue re-sent elsewhere) must abort the requests in the engine: else it
    later runs them for nobody, and the same id re-sent to this worker is refused as 'already in use'. The running
    request asks for most of the long context, so that it is still running while the second one waits, however
    fast the machine."""
    async def main():
        base = BASE.replace(max_num_seqs=1, max_model_len=HOLD_CONTEXT, num_kv_blocks=HOLD_BLOCKS)
        dep = _deployment(_version(long_llama_dir), 1, "least_loaded", base=base)
        await dep.start()
        engine = dep.workers[0].engine
        seen: set[str] = set()  # request ids the engine produced tokens for: first tokens, then the batch's columns
        engine.on_step = lambda msg, outs: seen.update([o.request_id for o in msg.outputs], msg.decodes.request_ids)

        async def run(rid: str, max_tokens: int) -> int:
            n = 0
            async for out in engine.generate(rid, [1, 5, 9], SamplingParams(max_tokens=max_tokens, **GREEDY)):
                n = len(out.outputs[0].token_ids)
            return n

        try:
            long = HOLD_CONTEXT - 8
            first = asyncio.create_task(run("a", long))
            await _until(lambda: "a" in seen, "the first request to run")
            queued = asyncio.create_task(run("q", 4))
            await _until(lambda: engine.num_queued() == 1, "the second request to wait in the engine's queue")
            assert engine.fail_queued(EngineDeadError("re-sending")) == 1
            with pytest.raises(EngineDeadError):
                await queued
            assert "q" not in engine.streams and "q" not in engine.output_processor.states
            seen.clear()
            await _until(lambda: "a" in seen, "the running request to go on, untouched")
            await engine.abort("a")
            assert 0 < await first < long
            assert await run("b", 4) == 4  # queued behind 'q' (one sequence at a time) had 'q' stayed
            assert "q" not in seen  # the engine never ran the request nobody waits for
            assert await run("q", 4) == 4  # re-sent to the same worker under its id
            assert engine.num_in_flight() == 0
        finally:
            await dep.shutdown()

    asyncio.run(main())


def test_a_cancelled_swap_or_an_unload_during_a_swap_leaves_no_worker_running(llama_dir, v2_dir):
    """Workers launched by a swap stop if the swap is cancelled; an unload during a swap waits for it and stops
    every worker, and the unloaded deployment's record is not persisted again by the swap."""
    from servelm.control.deployments import DeploymentManager

    async def main():
        changes: list[str] = []
        mgr = DeploymentManager(BASE, on_change=lambda a, r: changes.append(a))
        try:
            d = await mgr.create(_version(llama_dir))
            launched = []
            new_worker = d._new_worker
            d._new_worker = lambda gen, slot: launched.append(new_worker(gen, slot)) or launched[-1]
            v2 = _version(v2_dir, version=2)

            swap = asyncio.create_task(mgr.swap(d.id, v2))
            await _until(lambda: launched and launched[-1].pid, "the new version's worker to launch")
            swap.cancel()
            with pytest.raises(asyncio.CancelledError):
                await swap
            await _until(lambda: not _alive(launched[0].pid), "the cancelled swap's worker to stop", timeout=30)
            assert d.version.ref == "tiny:1" and d.ready and mgr.in_use() > 0

            swap = asyncio.create_task(mgr.swap(d.id, v2))
            await _until(lambda: len(launched) == 2 and launched[-1].pid, "the second swap's worker to launch")
            await mgr.unload(d.id)
            await asyncio.gather(swap, return_exceptions=True)
            pids = [w.pid for w in launched] + [w.pid for w in d._all_workers()]
            await _until(lambda: not any(_alive(p) for p in pids), "every worker to stop", timeout=30)
            assert changes == ["create", "unload"] and mgr.list() == [] and mgr.in_use() == 0
        finally:
            await mgr.shutdown()

    asyncio.run(main())


def test_two_concurrent_creates_of_one_id_start_one_deployment(llama_dir):
    from servelm.control.deployments import DeploymentManager

    async def main():
        changes: list[str] = []
        mgr = DeploymentManager(BASE, on_change=lambda a, r: changes.append(a))
        try:
            v = _version(llama_dir)
            first, second = await asyncio.gather(mgr.create(v), mgr.create(v), return_exceptions=True)
            assert isinstance(second, Conflict) and second.code == "deployment_exists"
            assert mgr.list() == [first] and changes == ["create"]
            assert mgr.in_use() == mgr._footprints[first.id] * first.num_processes() == mgr._footprints[first.id]
        finally:
            await mgr.shutdown()

    asyncio.run(main())


def test_the_swap_drain_timeout_is_a_server_setting_passed_to_every_deployment(llama_dir, tmp_path, monkeypatch):
    """Draining workers (swap, scale-down, unload) let in-flight requests finish for server.swap_drain_timeout_s,
    not a fixed 30 s."""
    from servelm.config.settings import load
    from servelm.control.deployments import Deployment
    from servelm.control.plane import ControlPlane

    assert load({}, {}).server.lifecycle_config.swap_drain_timeout_s == 600.0
    config = load({}, {"SERVELM_SWAP_DRAIN_TIMEOUT_S": "1234", "SERVELM_DATA_DIR": str(tmp_path)})
    assert config.server.lifecycle_config.swap_drain_timeout_s == 1234.0

    async def no_processes(self):  # what is checked is the setting each deployment gets, not its workers
        return None

    monkeypatch.setattr(Deployment, "start", no_processes)

    async def main():
        plane = ControlPlane.open(config)
        try:
            d = await plane.deployments.create(_version(llama_dir))
            assert d.drain_timeout_s == 1234.0
        finally:
            await plane.close()

    asyncio.run(main())
