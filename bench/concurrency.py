"""Concurrent streams against a running server: errors and inter-token latency as the number of streams grows.

    servelm serve &
    python bench/concurrency.py --levels 1 16 64 128 160 --requests-per-stream 2

For each level it keeps that many S1 streams (streamed completions, prompts 64..512 tokens, outputs 32..256)
open at once and prints one JSON line: completed and failed requests, the client's inter-token latency
(ITL) p50/p99, and the server's own ITL over the same window, read from the
`servelm:inter_token_latency_seconds` histogram of /metrics (measured where the API process receives each
output from the engine). `client_over_server_p99` near 1 means the API process adds nothing the engine did
not: tokenization, detokenization and streaming stay off the path between engine and client. Run it on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import numpy as np

from servelm.bench.serve import _run

METRIC = "servelm:inter_token_latency_seconds_bucket"


def _buckets(text: str) -> dict[float, float]:
    """Cumulative ITL histogram counts by upper bound, summed over every label set."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(METRIC):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = out.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile (ms) of the observations between two scrapes, linearly interpolated within a bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    target, lo, below = q * total, 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= target:
            hi = b if np.isfinite(b) else lo
            frac = (target - below) / (c - below) if c > below else 1.0
            return round((lo + frac * (hi - lo)) * 1000, 2)
        lo, below = b, c
    return None


async def _scrape(url: str) -> dict[float, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        return _buckets((await client.get(url + "/metrics")).text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64, 128, 160])
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = level x this")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=49152, help="SmolLM2's vocabulary")
    args = p.parse_args()
    url = args.base_url.rstrip("/")
    for level in args.levels:
        before = asyncio.run(_scrape(url))
        report = asyncio.run(_run(argparse.Namespace(
            base_url=url, model=args.model, rate=float("inf"), concurrency=level,
            num_requests=level * args.requests_per_stream, seed=args.seed, vocab_size=args.vocab_size,
            slo_ttft_ms=1e9, slo_tpot_ms=1e9, label="servelm", output=None)))
        after = asyncio.run(_scrape(url))
        server = {"p50": _quantile(before, after, 0.5), "p99": _quantile(before, after, 0.99)}
        client = report["itl_ms"]
        ratio = round(client["p99"] / server["p99"], 3) if client.get("p99") and server["p99"] else None
        print(json.dumps({"bench": "concurrency", "streams": level, "completed": report["completed"],
                          "failed": report["failed"], "errors": report["errors"],
                          "client_itl_ms": {k: client.get(k) for k in ("p50", "p99")}, "server_itl_ms": server,
                          "client_over_server_p99": ratio, "ttft_p99_ms": report["ttft_ms"].get("p99"),
                          "output_tok_per_s": report["output_tok_per_s"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
