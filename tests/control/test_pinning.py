"""A request is pinned to the deployment generation it resolved: a swap between its tokenization and its
`generate` does not send one version's token ids to another, and a deployment that requests have resolved is
not evicted (nor expires) before they run. Stand-in engines without processes: each answers with the artifact
of the version whose worker served it."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import StubEngine, stub_deployment_workers

from servelm import SamplingParams
from servelm.config.engine import EngineConfig
from servelm.control.budget import MemoryBudget, worker_footprint
from servelm.control.deployments import DeploymentManager
from servelm.control.errors import ControlError, InsufficientMemory
from servelm.control.types import Kind, ModelVersion, State
from servelm.server.directory import ModelDirectory
from servelm.worker.handle import HealthSettings

BASE = EngineConfig(dtype="float32", num_kv_blocks=None, kv_cache_memory_gb=0.01, max_model_len=256)
QUIET = HealthSettings(interval_s=3600.0)  # no health pings: the stand-ins have no process to ping


@pytest.fixture(autouse=True)
def stub_engines(monkeypatch):
    stub_deployment_workers(monkeypatch)


def _version(name: str, version: int, state: State = State.PRODUCTION) -> ModelVersion:
    return ModelVersion(name, version, state, Kind.GENERATE, f"/artifacts/{name}-v{version}", "0" * 64, "/src",
                        num_params=1000)


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _texts(m, rid: str, ids: list[int]) -> list[tuple[str, str | None]]:
    return [(o.outputs[0].text, o.model_version) async for o in m.generate(rid, ids, SamplingParams(max_tokens=1))]


def test_a_request_stays_on_the_generation_it_resolved_across_a_swap():
    """Resolved (and tokenized) on v1, generated after the switch to v2: v1's workers serve it with v1's
    tokenizer; the swap drains v1 only once the request lets go, then stops v1's workers."""
    v1, v2 = _version("tiny", 1), _version("tiny", 2)

    async def main():
        mgr = DeploymentManager(BASE, MemoryBudget(2**40), health=QUIET, reap_every_s=3600)
        directory = ModelDirectory()
        directory.deployments = mgr
        try:
            d = await mgr.create(v1, tokenizer="tokenizer-v1")
            m, _ = await directory.load("tiny")
            assert m.tokenizer == "tokenizer-v1" and m.version is v1
            swap = asyncio.create_task(mgr.swap(d.id, v2, tokenizer="tokenizer-v2"))
            await _until(lambda: d.version is v2, "the switch-over to v2")
            # the request (tokenized with v1's tokenizer) reaches generate only now
            assert await _texts(m, "r1", [5, 6, 7]) == [("/artifacts/tiny-v1", "tiny:1")]
            assert m.tokenizer == "tokenizer-v1" and m.served_name == "tiny:1" and m.max_model_len == 256
            v1_engines = [e for e in StubEngine.made if e.config.model_config.model.endswith("v1")]
            v2_engines = [e for e in StubEngine.made if e.config.model_config.model.endswith("v2")]
            assert [e.prompts for e in v1_engines] == [[[5, 6, 7]]] and all(not e.prompts for e in v2_engines)
            assert not swap.done() and not any(e.stopped for e in v1_engines)  # v1 drains after the request
            m.release()
            m.release()  # idempotent
            await asyncio.wait_for(swap, 10)
            assert all(e.stopped for e in v1_engines) and d.pinned() == 0
            m2, _ = await directory.load("tiny")
            assert m2.tokenizer == "tokenizer-v2"
            assert await _texts(m2, "r2", [1]) == [("/artifacts/tiny-v2", "tiny:2")]
            m2.release()
        finally:
            await mgr.shutdown()

    asyncio.run(main())


def test_a_resolved_deployment_is_not_evicted_before_its_request_runs():
    """Memory eviction skips a deployment that a request resolved (or loaded on demand) and has not yet run on;
    once released it is idle again and evictable."""
    a, b = _version("a", 1), _version("b", 1)
    per_worker = worker_footprint(a, a.engine_config(BASE)).total

    async def main():
        mgr = DeploymentManager(BASE, MemoryBudget(int(1.5 * per_worker)), health=QUIET, reap_every_s=3600)
        directory = ModelDirectory()
        directory.deployments = mgr
        try:
            da = await mgr.create(a, tokenizer="tok-a", keep_alive_s=0.0)
            m, _ = await directory.load("a")
            with pytest.raises(ControlError) as e:  # b does not fit beside a, and a is in use
                await mgr.create(b, tokenizer="tok-b")
            assert isinstance(e.value, InsufficientMemory) and mgr.list() == [da]
            assert await _texts(m, "r1", [1, 2]) == [("/artifacts/a-v1", "a:1")]
            m.release()
            db = await mgr.create(b, tokenizer="tok-b")  # a is idle now: evicted to make room
            assert mgr.list() == [db] and all(e.stopped for e in StubEngine.made if e.config.model_config.model.endswith("a-v1"))
            # on demand: the lease is taken while the manager still holds what it loaded
            lease, waited = await mgr.ensure("a", lambda model: a if model == "a" else None, pin=True)
            assert waited > 0 and lease.version is a and mgr.list() == [lease.deployment]  # b made room
            with pytest.raises(ControlError) as e:
                await mgr.create(b, tokenizer="tok-b")
            assert isinstance(e.value, InsufficientMemory)
            lease.release()
        finally:
            await mgr.shutdown()

    asyncio.run(main())
