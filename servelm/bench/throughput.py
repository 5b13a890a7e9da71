"""`servelm bench throughput`: run a shared workload on servelm and on transformers in one process, one
after the other with the same threads, and print one JSON object with the figures and their ratios."""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import time
from typing import TYPE_CHECKING

from servelm.bench.workloads import Workload, make_workload
from servelm.config.engine import EngineConfig
from servelm.progress import progress
from servelm.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:  # torch is imported where used: every CLI start builds this module's parser
    import torch

BASELINES = ("hf-static", "hf-sequential")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="W1", help="W1 | W2 | W3 | W4 (see shared/workloads.md)")
    p.add_argument("--baselines", default="hf-static,hf-sequential",
                   help="comma-separated: hf-static (padded static batches), hf-sequential, or none")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the workload's requests to run")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats for servelm; the median is kept")
    p.add_argument("--static-batch", type=int, default=64, help="hf-static batch size")
    p.add_argument("--sequential-requests", type=int, default=2,
                   help="hf-sequential times only this many requests (it is slow) and reports their rate")
    p.add_argument("--output", default=None, help="also append the JSON line to this file")
    p.set_defaults(func=run)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hardware_bounds() -> dict:
    """Large-copy memory bandwidth and matmul peak, measured now with the current thread count."""
    import torch

    from servelm.model.memory import lazy_zeros

    x = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)  # 256 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bw = 5 * 2 * x.numel() * 4 / (time.perf_counter() - t) / 1e9
    # A batch-1 decode step only reads (the weights, from huge pages): the ceiling of a large reduction over
    # a huge-page buffer, which on 2-vCPU Zen 4 sat at 30-34 GB/s where the copy counted 29-48.
    r = lazy_zeros((64 * 2**20,), torch.float32).fill_(1.0)
    r.sum()
    t = time.perf_counter()
    for _ in range(5):
        r.sum()
    read = 5 * r.numel() * 4 / (time.perf_counter() - t) / 1e9
    out = {"mem_bandwidth_gb_s": round(bw, 1), "mem_read_gb_s": round(read, 1)}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(1024, 1024).to(dt)
        a @ a
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        out[f"matmul_{name}_gflop_s"] = round(10 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9, 1)
    return out


def run_servelm(cfg: EngineConfig, wl: Workload, repeats: int, label: str = "servelm") -> dict:
    from servelm.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("warmup", wl.prompts[0][:32], warm)
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.kv.pool.reset_prefix_cache()
    runs = []
    for rep in range(repeats):
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
            engine.add_request(f"{rep}-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                               output_kind=OutputKind.DELTA))
        first, last = {}, {}
        with progress(total=wl.num_requests, desc=f"{label} {wl.name}", unit="req", leave=False) as bar:
            while engine.has_unfinished_requests():
                outs = engine.step()
                now = time.perf_counter()
                for o in outs:
                    first.setdefault(o.request_id, now)
                    if o.finished:
                        last[o.request_id] = now
                        bar.update(1)
        wall = time.perf_counter() - start
        ttft = [first[r] - start for r in first]
        tpot = [(last[r] - first[r]) / (n - 1) for r, n in zip(first, wl.output_lens, strict=True) if n > 1]
        runs.append({"wall_s": wall, "output_tok_per_s": sum(wl.output_lens) / wall,
                     "ttft_ms": 1000 * _median(ttft), "tpot_ms": 1000 * _median(tpot)})
        stats = engine.get_stats()
        engine.core.kv.pool.reset_prefix_cache()
    best = sorted(runs, key=lambda r: r["output_tok_per_s"])[len(runs) // 2]
    return {"system": label, **{k: round(v, 2) for k, v in best.items()}, "load_s": round(load_s, 2),
            "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 3), "preemptions": stats.num_preemptions,
            "peak_rss_mb": round(_peak_rss_mb())}


def _hf_model(engine_cfg: EngineConfig, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from servelm.model.loading.source import resolve_model

    src = resolve_model(engine_cfg.model_config.model, engine_cfg.model_config.gguf_file)
    if src.kind == "gguf":
        m = AutoModelForCausalLM.from_pretrained(src.path.parent, gguf_file=src.path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype)
    m.generation_config.eos_token_id = None  # outputs run to full length, as in every workload
    return m.eval()


def _hf_generate(model, batch: list[list[int]], max_new: int) -> None:
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, generation_config=gen)


def run_hf_static(model, wl: Workload, batch_size: int) -> dict:
    """Padded static batches in arrival order: each batch runs until its longest output is done."""
    start = time.perf_counter()
    for i in progress(range(0, wl.num_requests, batch_size), desc=f"hf-static {wl.name}", leave=False):
        _hf_generate(model, wl.prompts[i:i + batch_size], max(wl.output_lens[i:i + batch_size]))
    wall = time.perf_counter() - start
    return {"system": "transformers-static", "batch_size": batch_size, "wall_s": round(wall, 2),
            "output_tok_per_s": round(sum(wl.output_lens) / wall, 2), "peak_rss_mb": round(_peak_rss_mb())}


def run_hf_sequential(model, wl: Workload, n_requests: int) -> dict:
    """One request at a time; TTFT from a one-token generate, TPOT from the rest."""
    ttfts, tpots, tokens, wall = [], [], 0, 0.0
    for p, n in progress(list(zip(wl.prompts, wl.output_lens, strict=True))[:n_requests], desc="hf-sequential",
                     leave=False):
        t = time.perf_counter()
        _hf_generate(model, [p], 1)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        _hf_generate(model, [p], n)
        total = time.perf_counter() - t
        ttfts.append(ttft)
        tpots.append((total - ttft) / max(1, n - 1))
        tokens += n
        wall += total
    return {"system": "transformers-sequential", "requests_timed": len(ttfts),
            "output_tok_per_s": round(tokens / wall, 2), "ttft_ms": round(1000 * _median(ttfts), 2),
            "tpot_ms": round(1000 * _median(tpots), 2), "peak_rss_mb": round(_peak_rss_mb())}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(args: argparse.Namespace) -> int:
    import torch

    from servelm.config.args import engine_config_from_args
    from servelm.model.loading.loader import load_model

    cfg = engine_config_from_args(args)
    if cfg.device_config.num_threads:
        torch.set_num_threads(cfg.device_config.num_threads)
    probe = load_model(cfg.model_config.model, cfg.model_config.gguf_file, cfg.model_config.tokenizer, cfg.model_config.dtype)
    spec, tok = probe.model.spec, probe.tokenizer
    bos = tok.bos_token_id if tok.bos_token_id is not None else 1
    wl = make_workload(args.workload, spec.vocab_size, bos, args.scale)
    dtype = probe.model.dtype
    del probe
    report = {"bench": "throughput", "workload": wl.name, "requests": wl.num_requests,
              "model": cfg.model_config.model or "SmolLM2-135M-Instruct (default)", "dtype": str(dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "git_commit": _git_commit(), "hardware": hardware_bounds()}
    results = [run_servelm(cfg, wl, args.repeats)]
    if wl.name == "W3":
        off = EngineConfig(**{**cfg.to_dict(), "enable_prefix_caching": False})
        results.append(run_servelm(off, wl, args.repeats, label="servelm-no-prefix-cache"))
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {BASELINES}")
    if baselines:
        hf = _hf_model(cfg, dtype)
        if "hf-static" in baselines and wl.num_requests > 1:
            results.append(run_hf_static(hf, wl, args.static_batch))
        if "hf-sequential" in baselines:
            results.append(run_hf_sequential(hf, wl, args.sequential_requests))
    ours = results[0]
    ratios = {}
    for r in results[1:]:
        ratios[f"output_tok_per_s servelm/{r['system']}"] = round(ours["output_tok_per_s"] / r["output_tok_per_s"], 2)
        if "tpot_ms" in r and r.get("tpot_ms"):
            ratios[f"tpot_ms {r['system']}/servelm"] = round(r["tpot_ms"] / ours["tpot_ms"], 2)
    report.update(results=results, ratios=ratios)
    line = json.dumps(report)
    print(line)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(line + "\n")
    return 0
