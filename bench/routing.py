"""Workers and routing strategies, measured in-process on a Deployment (no HTTP): W1 throughput and S1 latency
for 1 worker against 2 workers under each strategy, prefix-aware against least-loaded on W3 with 2 workers
(throughput and prefix-cache hit rate), and the time to swap a deployment to another version (request to
switch-over, then drain). Prints one JSON object. A benchmark, not a test: run it on a quiet machine.

  python bench/routing.py --model ~/.cache/servelm-bench/models/llama-rand-60m --dtype bfloat16 --threads 1
  python bench/routing.py --quick        # a smoke run on a tiny random-weight Llama built on the spot: < 1 min

Each swap starts a new version of `--swap-model` (default: `--model`; e.g. a SmolLM2 folder for the issue's
figure) and switches to it. On 2 cores, two 1-thread workers compete with the API process for the cores: more
workers may not help (the figures say whether they do). A full run takes about 15 minutes (S1: 200 requests at 2/s, five
times).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from servelm import SamplingParams
from servelm.bench.workloads import Workload, make_serving_workload, make_workload
from servelm.config.engine import EngineConfig
from servelm.control.deployments import Deployment
from servelm.control.router import STRATEGIES, make_strategy
from servelm.control.types import Kind, ModelVersion, State
from servelm.sampling_params import OutputKind


def _version(path: str, version: int) -> ModelVersion:
    return ModelVersion("bench", version, State.PRODUCTION, Kind.GENERATE, path, "", path)


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    q = np.percentile(xs, [50, 90, 99])
    return {"p50": round(float(q[0]) * 1000, 1), "p90": round(float(q[1]) * 1000, 1),
            "p99": round(float(q[2]) * 1000, 1)}


async def _one(dep: Deployment, rid: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    # DELTA: each output holds only the new tokens (the default, CUMULATIVE, repeats the whole output so far)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=OutputKind.DELTA)
    async for out in dep.generate(rid, prompt, params):
        k = sum(len(c.token_ids) for c in out.outputs)
        if k:
            now = time.perf_counter()
            first, last, n = first or now, now, n + k
    return {"ttft": first - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "e2e": last - t0, "n": n}


async def _batch(dep: Deployment, wl: Workload, tag: str) -> dict:
    """Every request at once: output tokens/s over the whole batch."""
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_one(dep, f"{tag}-{i}", p, n)
                                 for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))))
    wall = time.perf_counter() - t0
    return {"requests": len(res), "output_tokens_per_s": round(sum(r["n"] for r in res) / wall, 1),
            "wall_s": round(wall, 2)}


async def _serving(dep: Deployment, wl: Workload, rate: float, tag: str) -> dict:
    """Poisson arrivals at `rate` req/s: TTFT, TPOT and E2E percentiles (ms)."""
    gaps = np.random.Generator(np.random.PCG64(4)).exponential(1.0 / rate, wl.num_requests)

    async def gated(i: int, delay: float) -> dict:
        await asyncio.sleep(delay)
        return await _one(dep, f"{tag}-{i}", wl.prompts[i], wl.output_lens[i])

    starts = np.cumsum(gaps)
    res = await asyncio.gather(*(gated(i, float(s)) for i, s in enumerate(starts)))
    return {"rate": rate, "requests": len(res), "ttft_ms": _pct([r["ttft"] for r in res]),
            "tpot_ms": _pct([r["tpot"] for r in res if r["tpot"] is not None]), "e2e_ms": _pct([r["e2e"] for r in res])}


def _cut(wl: Workload, n: int, max_out: int | None) -> Workload:
    outs = [min(o, max_out) if max_out else o for o in wl.output_lens[:n]]
    return Workload(wl.name, wl.prompts[:n], outs)


async def _strategies(args, dep: Deployment, w1: Workload, s1: Workload) -> dict:
    """Each strategy in turn on the same warm 2-worker deployment, then on it scaled to 1 worker."""
    out: dict[str, dict] = {}
    for name in STRATEGIES:
        dep.strategy = make_strategy(name, dep.config.cache_config.block_size)
        out[f"2 workers, {name}"] = {"W1": await _batch(dep, w1, f"w1-{name}"),
                                     "S1": await _serving(dep, s1, args.rate, f"s1-{name}")}
    await dep.scale(1)
    out["1 worker"] = {"W1": await _batch(dep, w1, "w1-one"), "S1": await _serving(dep, s1, args.rate, "s1-one")}
    return out


async def _prefix(deps: dict[str, Deployment], w3: Workload) -> dict:
    """W3 (448 shared + 64 own tokens) on fresh 2-worker deployments, one after the other: prefix-cache hit rate
    and throughput per strategy."""
    out: dict[str, dict] = {}
    for name, dep in deps.items():
        before = dep.stats
        res = await _batch(dep, w3, f"w3-{name}")
        st = dep.stats
        queries = st.prefix_cache_queries - before.prefix_cache_queries
        res["prefix_cache_hit_rate"] = round((st.prefix_cache_hits - before.prefix_cache_hits) / queries, 3) \
            if queries else None
        res["routed"] = [w.routed for w in dep.workers]
        out[name] = res
    return out


def _tree_rss_mib() -> float:
    """Resident memory of this process and every process under it (the workers), MiB."""
    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return round(total / 2**20, 1)


async def _swap(args, dep: Deployment) -> dict:
    """Seconds from swap() to the switch-over (new workers started and warm), and to the old ones drained; RSS
    of the process tree before the first swap and after the last (the old workers' memory is returned)."""
    runs = []
    rss_before = _tree_rss_mib()
    for k in range(args.swaps):
        target = _version(args.swap_model or args.model, k + 2)
        t0 = time.perf_counter()
        await dep.swap(target)
        runs.append({"to_switch_over_s": round(dep.last_swap["start_s"], 2),
                     "total_s": round(time.perf_counter() - t0, 2)})
    return {"workers": len(dep.workers), "runs": runs, "tree_rss_mib_before": rss_before,
            "tree_rss_mib_after": _tree_rss_mib(),
            "median_to_switch_over_s": statistics.median(r["to_switch_over_s"] for r in runs)}


async def _started(base: EngineConfig, model: str, workers: int, strategy: str) -> Deployment:
    dep = Deployment(_version(model, 1), base, workers, strategy)
    await dep.start()
    return dep


def _tiny_model(out: Path) -> str:
    """A tiny random-weight Llama with the default model's tokenizer (as the tests build theirs), for --quick."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from servelm.model.loading.metadata import load_gguf_config_and_tokenizer
    from servelm.model.loading.source import default_model_path

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    load_gguf_config_and_tokenizer(default_model_path())[1].save_pretrained(out)
    return str(out)


async def main(args) -> dict:
    base = EngineConfig(dtype=args.dtype, num_threads=args.threads, num_kv_blocks=args.num_kv_blocks,
                        max_model_len=args.max_model_len)
    from servelm.model.loading.metadata import load_config, resolve_model

    vocab = load_config(resolve_model(args.model)).vocab_size
    n, max_out = (8, 16) if args.quick else (None, None)
    w1, w3 = make_workload("W1", vocab), make_workload("W3", vocab)
    s1 = make_serving_workload(vocab, num_requests=args.s1_requests)
    if args.quick:
        w1, w3, s1 = _cut(w1, n, max_out), _cut(w3, n, max_out), _cut(s1, n, max_out)
    t0 = time.perf_counter()
    deps: list[Deployment] = []
    try:
        # all workers start together (the W3 ones idle, with empty caches, until their turn)
        deps = list(await asyncio.gather(*(_started(base, args.model, 2, s)
                                           for s in ("least_loaded", "least_loaded", "prefix_aware"))))
        main_dep, w3_deps = deps[0], {"least_loaded": deps[1], "prefix_aware": deps[2]}
        result = {"model": args.model, "dtype": args.dtype, "threads_per_worker": args.threads, "quick": args.quick,
                  "W3_2_workers": await _prefix(w3_deps, w3)}
        for d in deps[1:]:
            await d.shutdown()
        result["strategies"] = await _strategies(args, main_dep, w1, s1)
        result["swap"] = await _swap(args, main_dep)
    finally:
        await asyncio.gather(*(d.shutdown() for d in deps))
    result["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (or .gguf file); --quick builds a tiny one")
    p.add_argument("--swap-model", default=None, help="the model whose versions the swaps start (default: --model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: 1 GiB)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--rate", type=float, default=2.0, help="S1 arrival rate, requests/s")
    p.add_argument("--s1-requests", type=int, default=200)
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="8 requests per workload, 16 output tokens, 1 swap")
    args = p.parse_args(argv)
    if args.model is None and not args.quick:
        p.error("--model is required (or --quick, which builds a tiny model)")
    if args.quick:
        args.swaps, args.rate = 1, 8.0
        if args.num_kv_blocks is None:
            args.num_kv_blocks = 256
    return args


if __name__ == "__main__":
    args = parse()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model, args.dtype = _tiny_model(Path(tmp) / "tiny-llama"), "float32"
        print(json.dumps(asyncio.run(main(args)), indent=1))
