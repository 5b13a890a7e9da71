"""A burst of simultaneous streams against a running server: how many are served, how many are turned away,
and how fast a refusal comes.

    servelm serve &
    python bench/burst.py --streams 1000

All the streamed completions (a short prompt each, `--max-tokens` out) are sent at once. It prints one JSON line:
the count per HTTP status, the streams that ended with `data: [DONE]`, the refusals' time to answer (p50, p99,
max, in ms: a 503 from admission should come at once, not after a queue wait), the time until the last stream
ended, and how many had no answer within `--timeout-s` (hung). With the default watermarks a burst of 1,000
gets the watermark's worth of streams queued and the rest 503 with Retry-After; sized for the burst
(`--queue-high-watermark` at least the burst), every stream is served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np


async def _one(client: httpx.AsyncClient, i: int, max_tokens: int, t0: float) -> tuple[int, float, bool, float]:
    """(status, seconds to the status line, ended with [DONE], seconds to the end)."""
    body = {"model": None, "prompt": f"Count to ten, stream {i}:", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json={k: v for k, v in body.items() if v is not None}) as r:
        status_s = time.perf_counter() - t0
        text = "".join([chunk async for chunk in r.aiter_text()])
        return r.status_code, status_s, text.rstrip().endswith("data: [DONE]"), time.perf_counter() - t0


async def burst(url: str, streams: int, max_tokens: int, timeout_s: float) -> dict:
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, i, max_tokens, t0) for i in range(streams)),
                                       return_exceptions=True)
    done = [r for r in results if not isinstance(r, BaseException)]
    hung = sum(isinstance(r, httpx.TimeoutException) for r in results)
    errors = [type(r).__name__ for r in results if isinstance(r, BaseException)
              and not isinstance(r, httpx.TimeoutException)]
    statuses: dict[str, int] = {}
    for status, *_ in done:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    refused = np.array([s for status, s, _, _ in done if status != 200]) * 1e3
    ends = [end for status, _, _, end in done if status == 200]
    return {"streams": streams, "statuses": statuses, "complete_streams": sum(ok for _, _, ok, _ in done),
            "refused_ms_p50": round(float(np.percentile(refused, 50)), 1) if refused.size else None,
            "refused_ms_p99": round(float(np.percentile(refused, 99)), 1) if refused.size else None,
            "refused_ms_max": round(float(refused.max()), 1) if refused.size else None,
            "last_stream_end_s": round(max(ends), 1) if ends else None, "hung": hung,
            "client_errors": errors[:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=600.0, help="a stream with no answer by then counts as hung")
    a = p.parse_args()
    print(json.dumps(asyncio.run(burst(a.url, a.streams, a.max_tokens, a.timeout_s))))


if __name__ == "__main__":
    main()
