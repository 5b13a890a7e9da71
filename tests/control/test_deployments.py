"""Deployments: routing strategies (pure, with stand-in workers), the memory budget, and real deployments of
tiny random-weight models: N workers, a worker SIGKILLed or hung under load, scaling under load, hot-swap under
16 concurrent streams, a failed swap, and the manager's name resolution and eviction."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny_models import build_model

from servelm import SamplingParams
from servelm.config.engine import EngineConfig
from servelm.control import router as routing
from servelm.control.budget import Footprint, MemoryBudget, worker_footprint
from servelm.control.errors import Conflict, ControlError, InsufficientMemory, NotFound
from servelm.control.traffic import split
from servelm.control.types import Kind, ModelVersion, State
from servelm.worker.client import EngineDeadError
from servelm.worker.handle import HealthSettings

# -- routing strategies --------------------------------------------------------------------------------


@dataclass
class W:
    """A stand-in worker: its load and free KV blocks are whatever the test says."""

    id: int
    n: int = 0
    free: int | None = 100

    def load(self) -> int:
        return self.n

    def free_blocks(self) -> int | None:
        return self.free


def _req(tokens: list[int] | None = None, max_tokens: int = 0, salt: str | None = None) -> routing.RouteRequest:
    return routing.RouteRequest(tokens if tokens is not None else [1, 2, 3], max_tokens, salt)


def test_round_robin_takes_each_worker_in_turn():
    ws = [W(0, n=9), W(1), W(2)]
    rr = routing.RoundRobin()
    assert [rr.pick(ws, _req()).id for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_fewest_running_plus_waiting_and_shares_ties():
    ws = [W(0, n=3), W(1, n=1), W(2, n=1)]
    ll = routing.LeastLoaded()
    assert {ll.pick(ws, _req()).id for _ in range(4)} == {1, 2}  # never the loaded one; ties alternate
    ws[2].n = 0
    assert ll.pick(ws, _req()).id == 2


def test_memory_aware_needs_room_for_prompt_plus_max_tokens():
    # 40 prompt tokens + 40 to generate = 80 tokens = 5 blocks of 16
    ws = [W(0, n=0, free=4), W(1, n=5, free=5), W(2, n=9, free=50)]
    ma = routing.MemoryAware(block_size=16)
    assert ma.pick(ws, _req(list(range(40)), 40)).id == 1  # the least loaded of those with room
    assert ma.pick(ws, _req(list(range(40)), 0)).id == 0  # 3 blocks: everyone has room; least loaded
    ws[2].free = 3
    assert ma.pick(ws, _req(list(range(40)), 200)).id == 1  # nobody has room: the most free blocks


def test_block_hashes_key_whole_blocks_by_prefix_and_salt():
    a = routing.block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial third block is not cacheable
    assert routing.block_hashes(list(range(32)) + [7] * 8, 16) == a
    b = routing.block_hashes([0] + list(range(1, 40)), 16, salt="k")
    assert b[0] != a[0]
    assert routing.block_hashes(list(range(16)) + [99] * 16, 16)[0] == a[0] != routing.block_hashes([5] * 32, 16)[0]


def test_prefix_aware_returns_a_prefix_to_its_worker_until_it_is_too_busy():
    ws = [W(0), W(1)]
    pa = routing.PrefixAware(block_size=4, max_imbalance=2)
    shared = list(range(100, 132))
    first = pa.pick(ws, _req(shared + [1, 2, 3, 4]))
    ws[first.id].n = 1
    other = ws[1 - first.id]
    assert pa.pick(ws, _req(list(range(200, 240)))).id == other.id  # no known prefix: least loaded
    other.n = 1
    for k in range(2):  # same prefix, own suffix: back to the worker that has it, though equally loaded
        assert pa.pick(ws, _req(shared + [5 + k] * 4)).id == first.id
        ws[first.id].n += 1
    ws[first.id].n = 4  # now 3 above the other: the prefix spreads to the other worker...
    assert pa.pick(ws, _req(shared + [9] * 4)).id == other.id
    ws[first.id].n = other.n = 0
    assert {pa.pick(ws, _req(shared)).id for _ in range(4)} == {0, 1}  # ...which holds it too from now on
    pa.forget(first.id)
    other.n = 1
    assert pa.pick(ws, _req(shared)).id == other.id  # a restarted worker holds nothing
    assert pa.pick(ws, _req(shared, salt="tenant")).id == first.id  # another salt is another prefix


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="round_robin, least_loaded, memory_aware, prefix_aware"):
        routing.make_strategy("random")


# -- memory budget ---------------------------------------------------------------------------------------


def _version(path: Path, name: str = "tiny", version: int = 1, state: State = State.PRODUCTION,
             **engine) -> ModelVersion:
    return ModelVersion(name=name, version=version, state=state, kind=Kind.GENERATE, artifact=str(path),
                        sha256="0" * 64, source=str(path), engine=engine)


def test_footprint_kv_pool_is_what_the_engine_allocates(llama_dir):
    from servelm.engine.model_runner import kv_bytes_per_block
    from servelm.model.loading.loader import load_model

    cfg = EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=48)
    v = dataclasses.replace(_version(llama_dir), num_params=1000)
    fp = worker_footprint(v, cfg)
    model = load_model(str(llama_dir), dtype="float32", with_tokenizer=False).model
    assert fp.kv_pool == 48 * kv_bytes_per_block(model, 16)
    assert fp.weights == 4000 and fp.total == fp.weights + fp.kv_pool + fp.runtime
    assert worker_footprint(v, cfg.replace(num_kv_blocks=None, kv_cache_memory_gb=0.5)).kv_pool == 2**29


def test_default_budget_is_80_percent_of_ram_or_the_whole_gpu(monkeypatch):
    from servelm.control import budget as b

    assert MemoryBudget().total == int(0.8 * b.ram_bytes())
    monkeypatch.setattr(b, "gpu_bytes", lambda device: 80 * 2**30 if device == "cuda:1" else None)
    assert MemoryBudget(device="cuda:1").total == 80 * 2**30  # each worker takes its utilization's share
    assert MemoryBudget(device="cuda:0").total == int(0.8 * b.ram_bytes())  # unreadable: RAM


def test_a_gpu_worker_sized_by_utilization_takes_its_share_of_the_device(llama_dir, monkeypatch):
    """As the engine sizes itself on a GPU (engine/kv_sizing.py): gpu_memory_utilization of the device, weights
    included; two default workers (0.9 each) cannot share one GPU, two at 0.45 can."""
    from servelm.control import budget as b

    monkeypatch.setattr(b, "gpu_bytes", lambda device: 80 * 2**30)
    v = dataclasses.replace(_version(llama_dir), num_params=2**30)
    cfg = EngineConfig(model=str(llama_dir), dtype="bfloat16", device="cuda")
    fp = worker_footprint(v, cfg)
    assert fp.total == int(0.9 * 80 * 2**30) and fp.weights == 2**31
    half = worker_footprint(v, cfg.replace(gpu_memory_utilization=0.45))
    budget = MemoryBudget(device="cuda")
    with pytest.raises(ControlError):
        budget.check(fp.total, fp.total, "a second default worker")
    budget.check(half.total, half.total, "a second worker at 0.45")
    # a KV cache sized by hand is sized as on the CPU
    fixed = worker_footprint(v, cfg.replace(kv_cache_memory_gb=2))
    assert fixed.kv_pool == 2 * 2**30


def test_budget_refusal_is_507_naming_the_numbers():
    budget = MemoryBudget(total_bytes=3 * 2**30)
    budget.check(2**30, 2**30, "x")  # fits
    with pytest.raises(ControlError) as e:
        budget.check(Footprint(2**30, 2**30, 0).total, 2 * 2**30, "deploying tiny:1 with 1 worker(s)")
    assert isinstance(e.value, InsufficientMemory) and e.value.code == "insufficient_memory"
    assert "deploying tiny:1" in e.value.message and "needs 2.00 GiB" in e.value.message
    assert "1.00 GiB of the 3.00 GiB" in e.value.message


def test_with_cpu_bind_each_worker_gets_its_own_share_of_the_cpus(llama_dir):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    base = EngineConfig(cpu_bind=f"{cpus[0]},{cpus[1]}")
    dep = _deployment(_version(llama_dir), 2, "least_loaded", base=base)
    shares = [dep._worker_config(dep.config, slot) for slot in (0, 1, 2)]
    assert [c.device_config.cpu_bind for c in shares] == [str(cpus[0]), str(cpus[1]), str(cpus[0])]
    assert all(c.device_config.num_threads == 1 for c in shares)
    one = _deployment(_version(llama_dir), 1, "least_loaded", base=base)
    assert one._worker_config(one.config, 0) == one.config  # a lone worker keeps every CPU


# -- real deployments --------------------------------------------------------------------------------------

BASE = EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256, num_threads=1)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama2_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The same architecture with other weights (seed 1): its greedy outputs differ from llama_dir's."""
    return build_model("llama", tmp_path_factory.mktemp("v2") / "llama", tokenizer_dir, seed=1)


def _alive(pid: int | None) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def _until(cond, what: str, timeout: float = 120.0) -> None:
    """Poll until cond() holds (a bounded wait for a state, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _run(dep, rid: str, prompt: list[int], max_tokens: int) -> tuple[str, set[str | None], bool]:
    """(text, versions its outputs were tagged with, whether it produced output before any error)."""
    text, versions = "", set()
    async for out in dep.generate(rid, prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)):
        text += out.outputs[0].text
        versions.add(out.model_version)
    return text, versions, True


def _deployment(version: ModelVersion, workers: int, strategy: str, **kw):
    from servelm.control.deployments import Deployment

    return Deployment(version, kw.pop("base", BASE), workers, strategy, **kw)


def test_two_workers_share_requests_and_agree(llama_dir):
    async def main():
        dep = _deployment(_version(llama_dir), 2, "round_robin")
        await dep.start()
        try:
            assert dep.ready and dep.check_engine() and dep.max_model_len == 256 and dep.info.vocab_size == 49152
            results = await asyncio.gather(*(_run(dep, f"r{i}", [1, 5, 9, 200], 8) for i in range(6)))
            assert len({r[0] for r in results}) == 1  # greedy: the same text from either worker
            assert all(r[1] == {"tiny:1"} for r in results)  # every output names the version that served it
            assert [w.routed for w in dep.workers] == [3, 3]
            assert dep.stats.num_kv_blocks == 128 and dep.num_in_flight() == 0
            assert dep.stats.kv_cache_dtype == dep.workers[0].engine.stats.kv_cache_dtype == "float32"  # not summed
            assert len({w.pid for w in dep.workers}) == 2
        finally:
            await dep.shutdown()

    asyncio.run(main())


def _collect(dep, n: int, max_tokens: int, prompt=(1, 7, 7, 3)):
    """n requests as tasks; each remembers whether it streamed any output before it failed."""
    streamed: dict[str, bool] = {}

    async def one(rid: str):
        streamed[rid] = False
        text = ""
        async for out in dep.generate(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **GREEDY)):
            streamed[rid] = True
            text += out.outputs[0].text
        return text

    return {f"q{i}": asyncio.create_task(one(f"q{i}")) for i in range(n)}, streamed


@pytest.mark.parametrize("how", ["sigkill", "hung"])
def test_a_dead_or_hung_worker_is_replaced_and_its_queued_requests_served_by_the_other(llama_dir, how):
    async def main():
        base = BASE.replace(max_num_seqs=2)  # a third request waits in the worker's queue
        dep = _deployment(_version(llama_dir), 2, "round_robin", base=base,
                          health=HealthSettings(interval_s=0.2, timeout_s=1.5, kill_after_s=4.0))
        replaced = []  # what the deployment reports for the audit trail
        dep.on_replaced = lambda before, after: replaced.append((before, after))
        await dep.start()
        try:
            victim, other = dep.workers
            tasks, streamed = _collect(dep, 8, 150)
            await _until(lambda: victim.engine.num_queued() == 2 and victim.engine.num_in_flight() == 4,
                         "the victim to run two requests (both streaming) and queue two")
            queued = {rid for rid, s in victim.engine.streams.items() if not s.started}
            running = set(victim.engine.streams) - queued
            pid, routed_before = victim.pid, other.routed
            os.kill(pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
            done = await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 120)
            results = dict(zip(tasks, done, strict=True))
            for rid in running:  # they had streamed: a clean error, never silence
                assert isinstance(results[rid], EngineDeadError) and streamed[rid]
            ok = [rid for rid, r in results.items() if isinstance(r, str)]
            assert set(ok) == set(tasks) - running and len({results[r] for r in ok}) == 1
            assert other.routed == routed_before + len(queued)  # the queued ones were re-sent to the other
            await _until(lambda: victim.engine.ready and victim.engine.restarts == 1, "the victim to come back")
            assert victim.pid != pid and not _alive(pid)
            assert replaced == [({"worker": victim.id, "pid": pid, "exit_code": -signal.SIGKILL,
                                  "cause": "died" if how == "sigkill" else "hung"},
                                 {"worker": victim.id, "pid": victim.pid, "restarts": 1})]
            before = victim.routed
            await asyncio.gather(*(_run(dep, f"after{i}", [1, 2], 2) for i in range(2)))
            assert victim.routed == before + 1  # back in rotation
        finally:
            await dep.shutdown()

    asyncio.run(main())


def test_a_paused_worker_leaves_rotation_its_queue_moves_and_it_rejoins_when_it_answers(llama_dir):
    async def main():
        base = BASE.replace(max_num_seqs=2)
        dep = _deployment(_version(llama_dir), 2, "round_robin", base=base,
                          health=HealthSettings(interval_s=0.2, timeout_s=1.5, kill_after_s=600.0))
        await dep.start()
        try:
            victim, other = dep.workers
            tasks, _ = _collect(dep, 8, 150)
            await _until(lambda: victim.engine.num_queued() == 2 and victim.engine.num_in_flight() == 4,
                         "the victim to run two requests (both streaming) and queue two")
            queued = {rid for rid, s in victim.engine.streams.items() if not s.started}
            routed_before = other.routed
            os.kill(victim.pid, signal.SIGSTOP)  # alive, answering nothing: a long step, or hung
            await _until(lambda: not victim.routable and other.routed == routed_before + len(queued),
                         "the victim to leave rotation and its queued requests to move")
            os.kill(victim.pid, signal.SIGCONT)
            done = await asyncio.wait_for(asyncio.gather(*tasks.values()), 120)
            assert len(set(done)) == 1  # every request served, the running ones by the victim once it woke
            await _until(lambda: victim.routable, "the victim to rejoin")
            assert victim.engine.restarts == 0 and victim.pid is not None and _alive(victim.pid)
        finally:
            await dep.shutdown()

    asyncio.run(main())


async def _load(dep, stop: asyncio.Event, prompt: list[int], client: int, max_tokens: int = 12):
    """Client `client`'s requests, one after another until stopped: (texts, versions of each, failures)."""
    texts, versions, failures = [], [], []
    k = 0
    while not stop.is_set():
        k += 1
        try:
            text, vs, _ = await _run(dep, f"c{client}-{k}", prompt, max_tokens)
            texts.append(text)
            versions.append(vs)
        except Exception as e:  # counted, and the test fails on any
            failures.append(repr(e))
    return texts, versions, failures


def test_scale_1_to_3_to_1_under_load_fails_no_request(llama_dir):
    async def main():
        dep = _deployment(_version(llama_dir), 1, "least_loaded")
        await dep.start()
        try:
            stop = asyncio.Event()
            clients = [asyncio.create_task(_load(dep, stop, [1, 10 + i, 3], i)) for i in range(4)]
            await dep.scale(3)
            assert len(dep.workers) == 3 and all(w.engine.ready for w in dep.workers)
            first = dep.workers[0]
            await _until(lambda: all(w.routed > 0 for w in dep.workers), "the new workers to take requests")
            pids = {w.pid for w in dep.workers}
            await dep.scale(1)
            assert len(dep.workers) == 1
            gone = pids - {dep.workers[0].pid}
            assert len(gone) == 2 and not any(_alive(p) for p in gone)
            routed = dep.workers[0].routed
            await _until(lambda: dep.workers[0].routed > routed + 4, "requests to go on after scaling down")
            stop.set()
            results = await asyncio.gather(*clients)
            assert all(r[2] == [] for r in results), [r[2] for r in results]
            assert sum(len(r[0]) for r in results) > 0
            assert first in dep.workers or first.stopped
        finally:
            await dep.shutdown()

    asyncio.run(main())


def test_swap_back_and_forth_under_16_streams(llama_dir, llama2_dir):
    async def main():
        v1, v2 = _version(llama_dir), _version(llama2_dir, version=2)
        dep = _deployment(v1, 1, "least_loaded")
        await dep.start()
        try:
            stop = asyncio.Event()
            prompt = [1, 42, 43, 44]
            clients = [asyncio.create_task(_load(dep, stop, prompt, i)) for i in range(16)]
            await _until(lambda: dep.workers[0].routed >= 16, "the streams to start")
            for target in (v2, v1, v2, v1, v2):  # five swaps back and forth, as the issue asks
                old = [w.pid for w in dep.workers]
                await dep.swap(target)
                assert dep.version is target and dep.served_name == target.ref
                assert not any(_alive(p) for p in old)  # the old workers are gone
                await _until(lambda n=dep.workers[0].routed: dep.workers[0].routed > n + 16, "requests on the new version")
            stop.set()
            results = await asyncio.gather(*clients)
            assert all(r[2] == [] for r in results), [r[2] for r in results]
            by_version: dict[str, set[str]] = {}
            for texts, versions, _ in results:
                for text, vs in zip(texts, versions, strict=True):
                    assert len(vs) == 1  # each response from exactly one version...
                    by_version.setdefault(vs.pop(), set()).add(text)
            assert set(by_version) == {"tiny:1", "tiny:2"}
            assert all(len(t) == 1 for t in by_version.values())  # ...and all of it from that version
            assert by_version["tiny:1"] != by_version["tiny:2"]
            assert dep.last_swap["start_s"] > 0
        finally:
            await dep.shutdown()

    asyncio.run(main())


def test_a_swap_that_cannot_start_keeps_the_old_version_serving(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in llama_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not weights")

    async def main():
        dep = _deployment(_version(llama_dir), 1, "least_loaded")
        await dep.start()
        try:
            pids = [w.pid for w in dep.workers]
            with pytest.raises(ControlError) as e:
                await dep.swap(_version(broken, version=2))
            assert isinstance(e.value, Conflict) and "tiny:2 failed to start" in e.value.message
            assert "tiny:1 keeps serving" in e.value.message
            assert dep.version.ref == "tiny:1" and [w.pid for w in dep.workers] == pids
            assert (await _run(dep, "after", [1, 2, 3], 3))[1] == {"tiny:1"}
        finally:
            await dep.shutdown()

    asyncio.run(main())


def test_manager_resolves_names_and_versions_and_evicts_idle_deployments_to_fit(llama_dir, llama2_dir):
    from servelm.control.deployments import DeploymentManager

    async def main():
        changes = []
        per_worker = worker_footprint(_version(llama_dir), BASE.replace(model=str(llama_dir))).total
        mgr = DeploymentManager(BASE, MemoryBudget(int(2.5 * per_worker)), lambda a, r: changes.append((a, r["id"])),
                                reap_every_s=0.2)
        try:
            d1 = await mgr.create(_version(llama_dir))
            d2 = await mgr.create(_version(llama2_dir, version=2, state=State.STAGING))
            assert mgr.resolve("tiny") is d1 and mgr.resolve("tiny:2") is d2 and mgr.resolve("tiny:1") is d1
            mgr.policy_of = lambda name: split("tiny", {1: 0, 2: 1}) if name == "tiny" else None
            routed, decision = mgr.route("tiny")
            assert routed is d2 and decision.version == 2  # the traffic policy picks the version of a bare name
            assert mgr.route("tiny:1") == (d1, None)  # a pinned version is never redirected
            mgr.policy_of = lambda name: split("tiny", {9: 1})
            assert mgr.route("tiny") == (d1, None)  # a chosen version that is not deployed: as resolved
            mgr.policy_of = None
            with pytest.raises(ControlError) as e:
                mgr.resolve("other")
            assert isinstance(e.value, NotFound) and "tiny, tiny:1, tiny:2" in e.value.message
            with pytest.raises(ControlError) as e:
                await mgr.scale(d1.id, 3)  # 4 workers > 2.5 even without tiny:2: refused, nothing unloaded
            assert isinstance(e.value, InsufficientMemory) and "scaling tiny-v1 to 3 workers" in e.value.message
            assert len(mgr.list()) == 2 and len(d1.workers) == 1
            await _run(d1, "x", [1, 2], 2)  # tiny:2 is now the least recently used
            d3 = await mgr.create(_version(llama2_dir, name="other"))  # fits once idle tiny:2 is unloaded
            assert [d.id for d in mgr.list()] == [d1.id, d3.id] and mgr.resolve("other") is d3
            assert ("evict", d2.id) in changes and not any(_alive(w.pid) for w in d2.workers)
            assert mgr.resolve("tiny") is d1
            with pytest.raises(ControlError, match="exists already"):
                await mgr.create(_version(llama2_dir, name="other"))
            await mgr.unload(d3.id)
            with pytest.raises(ControlError) as e:
                mgr.get(d3.id)
            assert isinstance(e.value, NotFound)
            assert [a for a, _ in changes] == ["create", "create", "evict", "create", "unload"]
            assert mgr.in_use() == per_worker
            # on demand: the first requests for an unloaded model share one load, and say how long they waited
            other = _version(llama2_dir, name="other")
            asked = []

            def find(model: str) -> ModelVersion | None:
                asked.append(model)
                return other if model == "other" else None

            (a, wa), (b, wb) = await asyncio.gather(mgr.ensure("other", find, keep_alive_s=0.0),
                                                    mgr.ensure("other", find, keep_alive_s=0.0))
            assert a is b and a.version is other and wa > 0 and wb > 0 and asked == ["other", "other"]
            assert changes[-1] == ("create", "other-v1") and len(changes) == 6
            assert await mgr.ensure("tiny", find) == (d1, 0.0)
            with pytest.raises(ControlError) as e:
                await mgr.ensure("nope", find)
            assert isinstance(e.value, NotFound)
            await _until(lambda: changes[-1] == ("expire", "other-v1"), "the idle on-demand deployment to expire")
            assert mgr.list() == [d1] and not any(_alive(w.pid) for w in a.workers)
        finally:
            await mgr.shutdown()

    asyncio.run(main())


def test_an_embedding_version_deploys_as_the_embedding_worker(llama_dir):
    from servelm.control.deployments import DeploymentManager, EmbedDeployment
    from servelm.runtimes.embedder import default_embedding_path

    path = default_embedding_path()
    if path is None:
        pytest.skip("the default embedding model's package is not installed")
    minilm = dataclasses.replace(_version(path, name="minilm"), kind=Kind.EMBED)

    async def main():
        changes = []
        mgr = DeploymentManager(BASE, on_change=lambda a, r: changes.append((a, r["kind"])))
        try:
            d = await mgr.create(minilm, workers=3)
            assert isinstance(d, EmbedDeployment) and mgr.resolve("minilm") is d and d.ready
            vecs, tokens = await d.embed(["a cat", "a dog"])
            assert len(vecs) == 2 and vecs[0].shape == (384,) and tokens > 2
            assert abs(float((vecs[0] ** 2).sum()) - 1) < 1e-4
            assert mgr.in_use() == worker_footprint(minilm, None).total  # one process, however many were asked
            with pytest.raises(ControlError) as e:
                await mgr.swap(d.id, _version(llama_dir, name="minilm", version=2))
            assert e.value.code == "wrong_kind" and d.version is minilm
            assert changes.pop() == ("swap_failed", "embed")  # reported for the audit trail too
            pid = d.embedder.pid
            await mgr.unload(d.id)
            assert changes == [("create", "embed"), ("unload", "embed")] and mgr.in_use() == 0
            await _until(lambda: not _alive(pid), "the embedding process to exit")
        finally:
            await mgr.shutdown()

    asyncio.run(main())


def test_deployments_come_back_from_their_records(llama_dir):
    from servelm.control.deployments import DeploymentManager

    v = _version(llama_dir)

    async def main():
        records: list[dict] = []
        first = DeploymentManager(BASE, on_change=lambda a, r: records.append(r))
        await first.create(v, workers=1, strategy="prefix_aware", keep_alive_s=60.0, deployment_id="chat")
        await first.shutdown()
        again = DeploymentManager(BASE)
        try:
            broken = {**records[-1], "id": "gone", "version": 7}  # its version no longer exists: skipped

            def version_of(name: str, number: int) -> ModelVersion:
                if number != 1:
                    raise NotFound(f"no version {name}:{number}")
                return v

            restored = await again.restore([records[-1], broken], version_of)
            d = again.get("chat")
            assert restored == [d] and again.resolve("tiny:1") is d and d.ready
            assert (d.strategy_name, d.num_workers, d.keep_alive_s) == ("prefix_aware", 1, 60.0)
        finally:
            await again.shutdown()

    asyncio.run(main())


def test_workers_figures_add_up_and_their_adapters_join():
    """A deployment's stats: counts summed, what describes each worker (KV dtype, adapter slots) taken once, and
    the adapters running or waiting on any worker named once (lora_requests_info)."""
    from types import SimpleNamespace

    from servelm.control.deployment import Deployment
    from servelm.engine.step_outputs import EngineStats

    def worker(running: list[str], waiting: list[str], n: int):
        st = EngineStats(num_running=n, num_waiting=1, num_swapped=0, kv_usage=0.0, num_kv_blocks=64,
                         num_free_blocks=32, prefix_cache_queries=10, prefix_cache_hits=5,
                         prefix_cache_hit_rate=0.5, num_preemptions=0, num_swaps=0, num_evictions=0, num_steps=3,
                         prompt_tokens=7, generation_tokens=9, kv_cache_dtype="float32", max_loras=2,
                         running_lora_adapters=running, waiting_lora_adapters=waiting)
        return SimpleNamespace(engine=SimpleNamespace(stats=st))

    dep = SimpleNamespace(_gen=SimpleNamespace(workers=[worker(["sql"], ["chat"], 2), worker(["chat", "sql"], [], 1)]))
    st = Deployment.stats.fget(dep)
    assert (st.num_running, st.num_kv_blocks, st.generation_tokens) == (3, 128, 18)
    assert (st.kv_usage, st.prefix_cache_hit_rate, st.kv_cache_dtype, st.max_loras) == (0.5, 0.5, "float32", 2)
    assert (st.running_lora_adapters, st.waiting_lora_adapters) == (["chat", "sql"], ["chat"])
