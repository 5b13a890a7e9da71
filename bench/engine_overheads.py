#!/usr/bin/env python3
"""The engine's host-side overheads against the product's targets (engine NFR-1/2/6/10), measured on
the real engine classes with no model forward: the block pool and KV cache manager, `EngineCore.step` (the
scheduler and the update from the step's output) with a stand-in runner that returns one token per sampled
sequence, and the runner's own block copies for swapping. Prints one JSON object:

- `block_allocation`: microseconds per block to allocate and to free, in the pool alone and through
  `KVCacheManager.allocate`/`free` for 1,024-token sequences (target < 1 us per block), and the same when
  every free block still holds a cached prefix (each allocation evicts one);
- `scheduler`: host time per engine iteration with 256 running (decoding) and 1,000 waiting requests,
  `Scheduler.schedule()` plus the update from the output (token appends, prefix-cache commits, outputs),
  the stand-in forward excluded (target < 100 us); also the engine process's other per-step work, its stats and
  the encoding of the step's outputs (`stats_us_median`, `encode_outputs_us_median`, not in the target's time);
- `fragmentation`: KV slots allocated but holding no token / slots allocated, averaged over steady-state
  steps of an S1 mix (prompts 64..512, outputs 32..256, a new request whenever one ends) at a fixed
  concurrency (target < 5%);
- `swap`: swap-out plus swap-in of a 1,024-token request's blocks (bookkeeping and the copies of every
  layer's keys and values, SmolLM2-135M's KV geometry in bf16 by default; target < 10 ms).

    python bench/engine_overheads.py                    # everything, SmolLM2's KV geometry
    python bench/engine_overheads.py --only scheduler --iters 100
    python bench/engine_overheads.py --only scheduler --gc-freeze --gc-threshold 10000   # the engine process's GC

A benchmark, not a test: CI does not run it. Times are wall clock on a shared machine: compare runs taken one
after the other (a 'before' checkout with PYTHONPATH pointing at it runs this same file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from servelm.bench.workloads import make_serving_workload
from servelm.config.engine import EngineConfig
from servelm.engine.block_pool import BlockPool
from servelm.engine.core import EngineCore
from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.scheduler import SchedulerOutput
from servelm.engine.sequence import Request, Sequence
from servelm.engine.step_outputs import SampleResult
from servelm.sampling_params import SamplingParams
from servelm.worker import messages

try:  # what the runner returns (checkouts older than it returned a tuple)
    from servelm.engine.step_outputs import RunnerOutput
except ImportError:
    RunnerOutput = None

VOCAB = 49152
TOKEN = 7  # what the stand-in forward "samples": never an EOS (requests ignore EOS anyway)


def fake_model(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_len: int) -> SimpleNamespace:
    """What EngineCore and ModelRunner read of a model when nothing runs a forward: its KV geometry."""
    spec = SimpleNamespace(moe=None, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=VOCAB,
                           max_position_embeddings=max_len)
    return SimpleNamespace(spec=spec, dtype=dtype, embed=torch.empty(0, dtype=dtype), tp=None)


class StandInForward:
    """The runner's `execute` without a model: the step's block copies run for real, then every row that samples
    gets TOKEN, as the sampler returns it. Also runs against older checkouts (PYTHONPATH at one), whose runner
    returned the decode batch's tokens and one result per entry of every `sample_seqs`."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.seconds = 0.0

    def __call__(self, out: SchedulerOutput):
        t = time.perf_counter()
        self.runner.apply_block_ops(out.ops)
        if hasattr(out, "sampled"):  # a step of the running batch: one token per sampling row
            ran = RunnerOutput([TOKEN] * (len(out.seqs) if out.all_sampled else int(np.count_nonzero(out.sampled))))
        else:
            ran = ([TOKEN] * len(out.decode_seqs), [[SampleResult(TOKEN)] for s in out.scheduled for _ in s.sample_seqs])
            if RunnerOutput is not None:  # checkouts whose runner returned a RunnerOutput of those two, then
                ran = RunnerOutput(*ran)  # prompt logprobs (older ones: the two as a tuple)
        self.seconds += time.perf_counter() - t
        return ran


def make_core(num_blocks: int, max_num_seqs: int, model: SimpleNamespace, **kw) -> tuple[EngineCore, StandInForward]:
    config = EngineConfig(num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_model_len=min(model.spec.max_position_embeddings, num_blocks * 16), **kw)
    core = EngineCore(config, model)
    fwd = StandInForward(core.runner)
    core.runner.execute = fwd
    core.runner.prompt_logprobs = []
    return core, fwd


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(Request(rid, prompt, params))


# -- 1. block allocation ----------------------------------------------------------------------------------
def bench_blocks(num_blocks: int, repeats: int) -> dict:
    res: dict[str, list[float]] = {k: [] for k in ("pool_alloc", "pool_free", "kv_alloc", "kv_free",
                                                    "kv_alloc_evicting")}
    seq_tokens, bs = 1024, 16
    for _ in range(repeats):
        pool = BlockPool(num_blocks, enable_caching=True)
        t = time.perf_counter()
        blocks = [pool.allocate() for _ in range(num_blocks)]
        res["pool_alloc"].append((time.perf_counter() - t) / num_blocks)
        t = time.perf_counter()
        for b in blocks:
            pool.release(b)
        res["pool_free"].append((time.perf_counter() - t) / num_blocks)

        kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True, num_cpu_blocks=0)
        prompt = list(range(seq_tokens))
        seqs = [Sequence(Request(f"r{i}", prompt, SamplingParams()), 0, list(prompt))
                for i in range(num_blocks * bs // seq_tokens)]
        n = len(seqs) * seq_tokens // bs
        t = time.perf_counter()
        for s in seqs:
            kv.allocate(s, seq_tokens)
        res["kv_alloc"].append((time.perf_counter() - t) / n)
        for i, s in enumerate(seqs):  # give each block a distinct cached prefix (untimed: hashing)
            s.token_ids = [i] + prompt[1:]
            s.num_computed_tokens = seq_tokens
            kv.commit_computed(s)
        t = time.perf_counter()
        for s in seqs:
            kv.free(s)
        res["kv_free"].append((time.perf_counter() - t) / n)
        for s in seqs:
            s.num_computed_tokens, s.block_hashes = 0, []
        t = time.perf_counter()  # now every free block holds a cached prefix: each allocation evicts one
        for s in seqs:
            kv.allocate(s, seq_tokens)
        res["kv_alloc_evicting"].append((time.perf_counter() - t) / n)
    out = {f"{k}_us_per_block": round(statistics.median(v) * 1e6, 3) for k, v in res.items()}
    worst = max(out.values())
    return {**out, "blocks": num_blocks, "repeats": repeats, "target_us_per_block": 1.0, "meets_target": worst < 1.0}


# -- 2. scheduler overhead ----------------------------------------------------------------------------------
def bench_scheduler(running: int, waiting: int, iters: int, policy: str, gc_freeze: bool = False,
                    gc_threshold: int = 0) -> dict:
    wl = make_serving_workload(VOCAB, num_requests=running + waiting, seed=4)
    model = fake_model(1, 1, 8, torch.bfloat16, 8192)  # the KV tensors are never touched: keep them small
    longest = max(len(p) for p in wl.prompts) + iters + 64
    core, fwd = make_core(running * (-(-longest // 16) + 1) + 64, running, model, scheduling_policy=policy)
    for i in range(running):  # they never finish while timed: as many tokens as the context holds
        add(core, f"run{i}", wl.prompts[i], core.max_model_len - len(wl.prompts[i]))
    while any(s.num_to_compute > 1 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill all of them: from here on every running request decodes
    for i in range(running, running + waiting):
        add(core, f"wait{i}", wl.prompts[i], core.max_model_len - len(wl.prompts[i]))
    sch = core.scheduler
    schedule = sch.schedule
    sched_s = [0.0]

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        sched_s[0] += time.perf_counter() - t
        return out

    sch.schedule = timed_schedule
    for _ in range(10):
        core.step()
    if gc_freeze:  # what the engine process does once its state is built: older objects are never traversed
        gc.freeze()
    thresholds = gc.get_threshold()
    if gc_threshold:  # what the engine process's gc_young_threshold sets
        gc.set_threshold(gc_threshold, *thresholds[1:])
    totals, scheds, fwds, stats_s, encode_s = [], [], [], [], []
    gc_time = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}  # generation -> [collections, seconds]
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            entry = gc_time[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    for _ in range(iters):
        sched_s[0], fwd.seconds = 0.0, 0.0
        t = time.perf_counter()
        outs, decodes = core.step()
        total = time.perf_counter() - t
        assert len(outs) + len(decodes) == running and len(sch.running) == running and len(sch.waiting) == waiting
        totals.append(total - fwd.seconds)
        scheds.append(sched_s[0])
        fwds.append(fwd.seconds)
        # what the engine process does next with every step (worker/process.py), outside the iteration's time
        t = time.perf_counter()
        stats = core.stats()
        t1 = time.perf_counter()
        messages.encoder.encode(messages.StepOutputs(outs, [], stats, 0.0, 0, decodes))
        stats_s.append(t1 - t)
        encode_s.append(time.perf_counter() - t1)
    gc.callbacks.remove(on_gc)
    if gc_freeze:
        gc.unfreeze()
    gc.set_threshold(*thresholds)
    us = [x * 1e6 for x in totals]
    med = statistics.median(us)
    return {
        "running": running, "waiting": waiting, "iterations": iters, "policy": policy,
        "per_iteration_us_median": round(med, 1), "per_iteration_us_mean": round(statistics.mean(us), 1),
        "per_iteration_us_p90": round(sorted(us)[int(0.9 * len(us))], 1),
        "schedule_us_median": round(statistics.median(scheds) * 1e6, 1),
        "update_us_median": round(statistics.median(t - s for t, s in zip(totals, scheds, strict=True)) * 1e6, 1),
        "stand_in_forward_us_median": round(statistics.median(fwds) * 1e6, 1),
        # the engine process's other per-step host work, not in the times above: EngineCore.stats() and encoding
        # the step's outputs for the API process
        "stats_us_median": round(statistics.median(stats_s) * 1e6, 1),
        "encode_outputs_us_median": round(statistics.median(encode_s) * 1e6, 1),
        # the cyclic garbage collector's share (it runs inside whatever allocates): per generation, collections
        # and milliseconds over all timed iterations, and the mean per iteration
        "gc_freeze": gc_freeze, "gc_threshold0": gc_threshold or thresholds[0], "gc_tracked_objects": len(gc.get_objects()),
        "gc_collections_ms": {g: [n, round(t * 1e3, 1)] for g, (n, t) in gc_time.items()},
        "gc_us_per_iteration_mean": round(sum(t for _, t in gc_time.values()) / iters * 1e6, 1),
        "target_us": 100.0, "meets_target": med < 100.0,
    }


# -- 3. fragmentation -----------------------------------------------------------------------------------
def used_slots(core: EngineCore) -> tuple[int, int]:
    """(slots allocated, slots holding a computed token) over the device blocks in use: a block shared by
    several sequences counts once, as full as its fullest holder."""
    bs = core.kv.block_size
    filled: dict[int, int] = {}
    for seq in core.scheduler.running:
        for i, b in enumerate(seq.block_table):
            filled[b] = max(filled.get(b, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
    pool = core.kv.pool
    allocated = pool.num_blocks - pool.num_free
    assert allocated == len(filled), "a block in use that no running sequence holds"
    return allocated * bs, sum(filled.values())


def bench_fragmentation(concurrency: int, warm: int, steps: int, model: SimpleNamespace, kv_gb: float) -> dict:
    wl = make_serving_workload(VOCAB, num_requests=2000, seed=4)
    core, _ = make_core(int(kv_gb * 2**30) // max(1, _block_bytes(model)), 256, model)
    nxt = 0

    def top_up() -> None:
        nonlocal nxt
        while len(core.requests) < concurrency:
            i = nxt % wl.num_requests
            add(core, f"s{nxt}", wl.prompts[i], wl.output_lens[i])
            nxt += 1

    alloc = unused = 0
    worst = 0.0
    for step in range(warm + steps):
        top_up()
        core.step()
        if step >= warm:
            a, u = used_slots(core)
            alloc, unused = alloc + a, unused + (a - u)
            worst = max(worst, (a - u) / a if a else 0.0)
    frac = unused / alloc if alloc else 0.0
    return {"concurrency": concurrency, "steps": steps, "warmup_steps": warm, "block_size": core.kv.block_size,
            "requests_done": nxt - len(core.requests), "preemptions": core.scheduler.num_preemptions,
            "fragmentation": round(frac, 4), "worst_step": round(worst, 4), "target": 0.05, "meets_target": frac < 0.05}


def _block_bytes(model: SimpleNamespace) -> int:
    s = model.spec
    return 2 * s.num_layers * 16 * s.num_kv_heads * s.head_dim * model.dtype.itemsize


# -- 4. swap preemption ----------------------------------------------------------------------------------
def bench_swap(tokens: int, repeats: int, model: SimpleNamespace) -> dict:
    bs = 16
    blocks = -(-tokens // bs) + 1
    swap_gb = (2 * blocks + 1) * _block_bytes(model) / 2**30
    core, _ = make_core(2 * blocks, 4, model, preemption_mode="swap", swap_space_gb=swap_gb)
    kv, runner = core.kv, core.runner
    g = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:  # real contents, so every page is mapped and every copy moves bytes
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    prompt = [1] + list(range(4, tokens + 3))
    seq = Sequence(Request("swap", prompt, SamplingParams()), 0, list(prompt))
    assert kv.allocate(seq, tokens)
    seq.num_computed_tokens = tokens
    kv.commit_computed(seq)
    first_layer_k = runner.kv_caches[0][0][torch.tensor(seq.block_table)].clone()
    outs, ins = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        kv.swap_out(seq)
        runner.apply_block_ops(kv.take_ops())
        kv.end_step()
        t1 = time.perf_counter()
        assert kv.swap_in(seq, 1)
        runner.apply_block_ops(kv.take_ops())
        kv.end_step()
        t2 = time.perf_counter()
        outs.append(t1 - t)
        ins.append(t2 - t1)
        got = runner.kv_caches[0][0][torch.tensor(seq.block_table[:-(-tokens // bs)])]
        assert torch.equal(got, first_layer_k), "swap round trip changed the KV"
        kv.roll_back(seq)  # the block swap_in added for the next token: the next repeat starts as the first
    med_out, med_in = statistics.median(outs[1:] or outs) * 1e3, statistics.median(ins[1:] or ins) * 1e3
    nbytes = -(-tokens // bs) * _block_bytes(model)
    return {"tokens": tokens, "blocks": -(-tokens // bs), "bytes_per_direction": nbytes, "repeats": repeats,
            "mode": "swap (preemption_mode='swap' exists; recompute is the default)",
            "swap_out_ms_median": round(med_out, 3), "swap_in_ms_median": round(med_in, 3),
            "swap_out_plus_in_ms_median": round(med_out + med_in, 3),
            "first_round_ms": round((outs[0] + ins[0]) * 1e3, 3),
            "target_ms": 10.0, "meets_target": med_out + med_in < 10.0}


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__import__("servelm").__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "servelm": str(Path(__import__("servelm").__file__).parent),
            "commit": commit}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="blocks,scheduler,fragmentation,swap", help="comma-separated parts to run")
    p.add_argument("--blocks", type=int, default=65536, help="pool size for the allocation timing")
    p.add_argument("--repeats", type=int, default=5, help="allocation and swap repeats (median kept)")
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--iters", type=int, default=300, help="timed scheduler iterations")
    p.add_argument("--policy", default="priority", choices=["priority", "fcfs"])
    p.add_argument("--gc-freeze", action="store_true", help="scheduler: gc.freeze() before the timed iterations")
    p.add_argument("--gc-threshold", type=int, default=0,
                   help="scheduler: the young generation's collection threshold while timed (0: Python's)")
    p.add_argument("--concurrency", default="64,256", help="fragmentation: requests in flight (comma-separated)")
    p.add_argument("--frag-steps", type=int, default=600)
    p.add_argument("--kv-gb", type=float, default=4.0, help="fragmentation: KV cache size (the engine default)")
    p.add_argument("--swap-tokens", type=int, default=1024)
    p.add_argument("--kv-geometry", default="30,3,64", help="layers,kv_heads,head_dim (default SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the swap copies)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    layers, heads, dim = (int(x) for x in a.kv_geometry.split(","))
    model = fake_model(layers, heads, dim, torch.bfloat16, 8192)
    only = set(a.only.split(","))
    result: dict = {"machine": machine()}
    gc.collect()
    if "blocks" in only:
        result["block_allocation"] = bench_blocks(a.blocks, a.repeats)
    if "scheduler" in only:
        result["scheduler"] = bench_scheduler(a.running, a.waiting, a.iters, a.policy, a.gc_freeze, a.gc_threshold)
    if "fragmentation" in only:
        result["fragmentation"] = [bench_fragmentation(int(c), 300, a.frag_steps, model, a.kv_gb)
                                   for c in a.concurrency.split(",")]
    if "swap" in only:
        result["swap"] = bench_swap(a.swap_tokens, max(a.repeats, 3), model)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
