"""Capacity of a running server: the highest Poisson rate of S1 requests (streamed completions, prompts
64..512 tokens, outputs 32..256) at which p99 TTFT stays under a bound, p99 TPOT stays under a bound and
no request fails.

TTFT alone is not enough: the scheduler admits new prompts ahead of running decodes (chunked prefill), so
past capacity TTFT stays low while every stream slows down and the backlog grows in the running batch.
The TPOT bound (default 100 ms: a stream slower than 10 tokens/s is not being served) is what catches it;
the probe also reports how many requests completed per second against the rate offered.

    servelm serve &                       # the default model
    python bench/capacity.py --base-url http://127.0.0.1:8000 --ttft-p99-ms 2000

Rates double from --start until one misses the bound, then bisect between the last pass and the first
miss. Prints one JSON line per probe and a final summary line. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from servelm.bench.serve import _run


def _probe_args(args, rate: float) -> argparse.Namespace:
    return argparse.Namespace(base_url=args.base_url, model=args.model, rate=rate, concurrency=None,
                              num_requests=args.num_requests, seed=args.seed, vocab_size=args.vocab_size,
                              slo_ttft_ms=args.ttft_p99_ms, slo_tpot_ms=1e9, label="servelm", output=None)


def _passes(report: dict, ttft_ms: float, tpot_ms: float) -> bool:
    inf = float("inf")
    return (report["failed"] == 0 and report["ttft_ms"].get("p99", inf) < ttft_ms
            and report["tpot_ms"].get("p99", inf) < tpot_ms)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--ttft-p99-ms", type=float, default=2000.0)
    p.add_argument("--tpot-p99-ms", type=float, default=100.0)
    p.add_argument("--start", type=float, default=0.25, help="first rate probed (req/s)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per probe")
    p.add_argument("--bisect-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=49152, help="SmolLM2's vocabulary")
    args = p.parse_args()

    def probe(rate: float) -> bool:
        report = asyncio.run(_run(_probe_args(args, rate)))
        ok = _passes(report, args.ttft_p99_ms, args.tpot_p99_ms)
        print(json.dumps({"probe_rate": rate, "pass": ok, "failed": report["failed"], "duration_s": report["duration_s"],
                          "ttft_ms": report["ttft_ms"],
                          "tpot_ms": report["tpot_ms"], "itl_ms": report["itl_ms"],
                          "request_throughput": report["request_throughput"]}), flush=True)
        return ok

    good, bad, rate = 0.0, None, args.start
    while bad is None:
        if probe(rate):
            good, rate = rate, rate * 2
        else:
            bad = rate
    for _ in range(args.bisect_steps):
        mid = (good + bad) / 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    print(json.dumps({"bench": "capacity", "workload": "S1", "ttft_p99_bound_ms": args.ttft_p99_ms,
                      "tpot_p99_bound_ms": args.tpot_p99_ms,
                      "capacity_req_per_s": round(good, 3), "first_miss_req_per_s": round(bad, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
