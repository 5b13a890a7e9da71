"""`servelm bench serve`: an async load generator for any OpenAI-compatible server.

It sends workload S1 (see shared/workloads.md) as streamed /v1/completions with token-id prompts, at
Poisson arrivals of a given rate or at a fixed concurrency, and prints TTFT, TPOT, inter-token latency
and end-to-end latency (mean, p50, p90, p99), throughput and goodput under an SLO as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from servelm.bench.workloads import make_serving_workload, make_workload


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate in requests/s (inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="fixed concurrency instead of a rate")
    p.add_argument("--num-requests", type=int, default=200, help="S1's request count (the W workloads have theirs)")
    p.add_argument("--workload", default="S1", choices=["S1", "W1", "W2", "W3", "W4"],
                   help="S1 (default), or an offline workload sent to the server: W1 with --rate inf is a "
                        "server's batch throughput")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy; the sampled variant uses 0.8)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of every request (the sampled variant: 0.95)")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are drawn from [4, vocab-size)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--label", default="servelm", help="the system's name in the JSON")
    p.add_argument("--output", default=None, help="also append the JSON line to this file")
    p.set_defaults(func=run)


@dataclass
class Result:
    ok: bool = False
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, sampling: dict) -> Result:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    r = Result(start=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"].get("message")
                    return r
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if last is None:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last)
                last = now
        r.e2e = time.perf_counter() - r.start
        r.ok = r.tokens > 0
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {}
    a = np.asarray(xs) * 1000
    return {"mean": round(float(a.mean()), 2), "p50": round(float(np.percentile(a, 50)), 2),
            "p90": round(float(np.percentile(a, 90)), 2), "p95": round(float(np.percentile(a, 95)), 2),
            "p99": round(float(np.percentile(a, 99)), 2)}


async def _run(args) -> dict:
    import httpx

    url = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as client:
        model = args.model or (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        name = getattr(args, "workload", "S1")  # bench/capacity.py and concurrency.py send S1
        wl = (make_serving_workload(args.vocab_size, args.num_requests, args.seed) if name == "S1"
              else make_workload(name, args.vocab_size))
        rng = np.random.Generator(np.random.PCG64(args.seed))
        gaps = rng.exponential(1.0 / args.rate, wl.num_requests) if args.rate != float("inf") else \
            np.zeros(wl.num_requests)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        sampling = {"temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0)}

        async def gated(p, n):
            if sem is None:
                return await _one(client, url, model, p, n, sampling)
            async with sem:
                return await _one(client, url, model, p, n, sampling)

        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(wl.prompts, wl.output_lens, gaps, strict=True):
            tasks.append(asyncio.create_task(gated(p, n)))
            if sem is None and gap:
                await asyncio.sleep(gap)  # Poisson arrivals: this is the load's schedule, not a test wait
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft * 1000 <= args.slo_ttft_ms and (r.tpot or 0) * 1000 <= args.slo_tpot_ms]
    return {
        "bench": "serve", "system": args.label, "workload": name, "model": model, "requests": wl.num_requests,
        "rate": args.rate if not args.concurrency else None, "concurrency": args.concurrency,
        "temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": round(wall, 2),
        "request_throughput": round(len(ok) / wall, 3),
        "output_tok_per_s": round(sum(r.tokens for r in ok) / wall, 2),
        "ttft_ms": _summary([r.ttft for r in ok]), "tpot_ms": _summary([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _summary([x for r in ok for x in r.itl]), "e2e_ms": _summary([r.e2e for r in ok]),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "goodput_req_per_s": round(len(good) / wall, 3), "slo_attainment": round(len(good) / max(1, len(results)), 3),
    }


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(_run(args))
    line = json.dumps(report)
    print(line)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(line + "\n")
    return 0 if report["completed"] else 1
