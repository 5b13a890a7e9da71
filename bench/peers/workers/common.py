"""Shared by every peer worker; standard library and numpy only, since each worker runs in its peer's own
virtual environment. Prompts are drawn exactly as in ../shared/workloads.md (token ids, PCG64)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

WORKLOADS = {"W1": dict(n=64, prompt=128, out=128, seed=0), "W2": dict(n=1, prompt=512, out=128, seed=1),
             "W1-sampled": dict(n=64, prompt=128, out=128, seed=0, sampled=True)}
# The sampled variant's settings (../shared/workloads.md): what chat traffic sends, where greedy decoding is rare.
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
# Beam search (beam_search_peers.py): n prompts of `prompt` tokens searched together, `width` beams, `out` steps.
BEAM = dict(n=8, prompt=64, out=32, width=4, seed=2)


def sampled(workload: str) -> bool:
    return WORKLOADS[workload].get("sampled", False)


def prompts(workload: str, vocab: int = 32000, bos: int = 1) -> list[list[int]]:
    w = WORKLOADS[workload]
    rng = np.random.Generator(np.random.PCG64(w["seed"]))
    return [[bos] + [int(i) for i in rng.integers(4, vocab, size=w["prompt"] - 1)] for _ in range(w["n"])]


def output_len(workload: str) -> int:
    return WORKLOADS[workload]["out"]


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", required=True, help="Hugging Face folder (or .gguf file for llama.cpp)")
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-requests", type=int, default=None,
                   help="time only this many W1 requests (for systems that run one request at a time)")
    p.add_argument("--dtype", default="bfloat16", help="the model's compute dtype (bfloat16, float32)")
    p.add_argument("--quantization", default="auto", help="servelm only: its --quantization (auto, servelm's "
                   "default: gguf for a GGUF file, whose quantized blocks are kept as llama.cpp reads them)")
    p.add_argument("--paired", action="store_true",
                   help="stay loaded: print READY, then measure each workload named on stdin (one line each)")
    return p


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.start


def latency(run_one, prompt: list[int], out: int, reps: int) -> dict:
    """TTFT from a one-token request, TPOT from a full one: the method used for every offline system."""
    run_one(prompt, 1)  # warm-up
    ttft, e2e = [], []
    for _ in range(reps):
        with Timer() as t1:
            run_one(prompt, 1)
        with Timer() as t2:
            run_one(prompt, out)
        ttft.append(t1.s)
        e2e.append(t2.s)
    t, e = median(ttft), median(e2e)
    return {"ttft_ms": round(1000 * t, 2), "tpot_ms": round(1000 * (e - t) / (out - 1), 3)}


def throughput(run_batch, batch: list[list[int]], out: int, reps: int) -> dict:
    """Output tokens/s of the whole batch submitted at once (median of reps after one warm-up)."""
    run_batch(batch[:2], 4)
    walls = []
    for _ in range(reps):
        with Timer() as t:
            run_batch(batch, out)
        walls.append(t.s)
    return {"output_tok_per_s": round(len(batch) * out / median(walls), 1), "requests_timed": len(batch)}


def measure(args: argparse.Namespace, run_batch) -> dict:
    """W1 through `throughput`, W2 through `latency`; run_batch(prompts, max_tokens, sampled) generates greedily,
    or with SAMPLED's settings when `sampled`."""
    ps, out, s = prompts(args.workload), output_len(args.workload), sampled(args.workload)
    if len(ps) > 1:
        return throughput(lambda b, n: run_batch(b, n, s), ps, out, args.reps)
    return latency(lambda p, n: run_batch([p], n, s), ps[0], out, args.reps)


def report(system: str, version: str, args: argparse.Namespace, load_s: float, figures: dict) -> None:
    row = {"system": system, "version": version, "workload": args.workload, "threads": args.threads,
           "load_s": round(load_s, 2), **figures}
    print("RESULT " + json.dumps(row), flush=True)


def serve(system: str, version: str, args: argparse.Namespace, load_s: float, measure_one) -> None:
    """Measure `args.workload` once and exit, or with --paired stay loaded and measure every workload
    named on stdin (one repeat each, the parent alternates systems between lines) until stdin closes.
    `measure_one(args)` returns the figures of args.workload."""
    if not args.paired:
        report(system, version, args, load_s, measure_one(args))
        return
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip():
            run = argparse.Namespace(**{**vars(args), "workload": line.strip(), "reps": 1})
            report(system, version, run, load_s, measure_one(run))


def beam_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", required=True, help="Hugging Face folder")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="the model's compute dtype (bfloat16, float32)")
    return p


def beam_prompts(vocab: int = 32000, bos: int = 1) -> list[list[int]]:
    rng = np.random.Generator(np.random.PCG64(BEAM["seed"]))
    return [[bos] + [int(i) for i in rng.integers(4, vocab, size=BEAM["prompt"] - 1)] for _ in range(BEAM["n"])]


def report_beam(system: str, version: str, args: argparse.Namespace, load_s: float, search) -> None:
    """Time `search(prompts)` (a list of sequences of token ids per prompt, best first, prompt included) after a
    warm-up: the median of args.reps, and each prompt's best beam (its own tokens) for the comparison."""
    ps = beam_prompts()
    search(ps[:1])
    walls, best = [], None
    for _ in range(args.reps):
        with Timer() as t:
            out = search(ps)
        walls.append(t.s)
        best = [seqs[0][len(p):] for p, seqs in zip(ps, out, strict=True)]
    s = median(walls)
    row = {"system": system, "version": version, "threads": args.threads, "load_s": round(load_s, 2),
           "seconds": round(s, 3), "beam_tok_per_s": round(BEAM["n"] * BEAM["width"] * BEAM["out"] / s, 1),
           "best": best}
    print("RESULT " + json.dumps(row), flush=True)
