"""Soak a running server with mixed traffic and watch every process's memory.

    servelm serve &
    python bench/capacity.py                      # -> capacity C req/s
    python bench/soak.py --rate 0.8C --duration-s 3600 --out soak.jsonl

Poisson arrivals of a mix: streamed chat, non-streamed completions, embeddings, streamed S1-shaped
completions, and streams the client drops after a few chunks (disconnects). Every 10 s it writes one
JSON line with the RSS of each process of the server's tree (the API process, the engine, the embedder)
and the counts so far; at the end, a summary: errors by kind (goal 0; dropped streams are not errors),
latency p50/p99 per kind, and each process's RSS growth after warm-up (the first quarter of the run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections import Counter, defaultdict

import httpx
import numpy as np
import psutil

KINDS = (("chat_stream", 0.35), ("completion", 0.25), ("embedding", 0.15), ("s1_stream", 0.15),
         ("disconnect", 0.10))
WORDS = ["the", "a", "server", "model", "token", "stream", "cache", "block", "request", "queue", "latency", "memory",
         "engine", "batch"]


def _server_pid(port: int) -> int:
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    raise SystemExit(f"no process listens on port {port} (run as the server's user, or pass --pid)")


def _rss(pid: int) -> dict[str, int]:
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            out[f"{p.pid}:{p.name()}"] = p.memory_info().rss
    return out


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str, vocab: int) -> tuple[str, float]:
    """Send one request of `kind`; returns (outcome, latency s). Outcome "ok" or an error description."""
    t0 = time.perf_counter()
    if kind == "embedding":
        r = await client.post("/v1/embeddings", json={"input": [_text(rng, rng.randint(5, 60))
                                                                 for _ in range(rng.randint(1, 8))]})
        return ("ok" if r.status_code == 200 else f"embedding HTTP {r.status_code}"), time.perf_counter() - t0
    if kind == "completion":
        r = await client.post("/v1/completions", json={"model": model, "prompt": _text(rng, rng.randint(10, 200)),
                                                       "max_tokens": rng.randint(8, 64), "temperature": 0.7})
        return ("ok" if r.status_code == 200 else f"completion HTTP {r.status_code}"), time.perf_counter() - t0
    if kind == "chat_stream" or kind == "disconnect":
        url, body = "/v1/chat/completions", {"model": model, "stream": True, "max_tokens": rng.randint(16, 128),
                                             "messages": [{"role": "user", "content": _text(rng, rng.randint(5, 80))}]}
    else:
        url, body = "/v1/completions", {"model": model, "stream": True, "ignore_eos": True,
                                        "prompt": [rng.randrange(4, vocab) for _ in range(rng.randint(64, 512))],
                                        "max_tokens": rng.randint(32, 256)}
    chunks = 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return f"{kind} HTTP {resp.status_code}", time.perf_counter() - t0
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"error"' in line[:20]:
                return f"{kind} error event", time.perf_counter() - t0
            if line.startswith("data: "):
                chunks += 1
            if kind == "disconnect" and chunks >= 3:
                return "ok", time.perf_counter() - t0  # leaving the block closes the connection mid-stream
    return ("ok" if chunks else f"{kind} empty stream"), time.perf_counter() - t0


async def _soak(args) -> dict:
    pid = args.pid or _server_pid(httpx.URL(args.base_url).port or 80)
    rng = random.Random(args.seed)
    lat: dict[str, list[float]] = defaultdict(list)
    outcomes: Counter = Counter()
    samples: list[dict] = []
    with open(args.out or "/dev/null", "a") as out:
        return await _soak_into(args, pid, rng, lat, outcomes, samples, out)


async def _soak_into(args, pid: int, rng: random.Random, lat: dict, outcomes: Counter, samples: list, out) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def run_one(kind: str) -> None:
            try:
                outcome, s = await _one(client, kind, random.Random(rng.random()), model, args.vocab_size)
            except httpx.HTTPError as e:
                outcome, s = f"{kind} {type(e).__name__}", 0.0
            outcomes[outcome] += 1
            if outcome == "ok":
                lat[kind].append(s)

        async def sampler() -> None:
            t0 = time.monotonic()
            while True:
                s = {"t_s": round(time.monotonic() - t0, 1), "rss": _rss(pid), "outcomes": dict(outcomes)}
                samples.append(s)
                out.write(json.dumps(s) + "\n")
                out.flush()
                await asyncio.sleep(args.sample_every_s)  # the sampling period, not a wait for a result

        watcher = asyncio.create_task(sampler())
        tasks, t_end = [], time.monotonic() + args.duration_s
        names, weights = zip(*KINDS, strict=True)
        while time.monotonic() < t_end:
            tasks.append(asyncio.create_task(run_one(rng.choices(names, weights)[0])))
            await asyncio.sleep(rng.expovariate(args.rate))  # Poisson arrivals: the load's schedule
        await asyncio.gather(*tasks)
        watcher.cancel()
        samples.append({"t_s": round(args.duration_s, 1), "rss": _rss(pid), "outcomes": dict(outcomes)})
    warm = samples[max(1, len(samples) // 4)]["rss"]
    last = samples[-1]["rss"]
    growth = {k: round((last[k] - warm[k]) / 2**20, 1) for k in last if k in warm}
    pct = {k: {"p50_ms": round(float(np.percentile(v, 50)) * 1000, 1),
               "p99_ms": round(float(np.percentile(v, 99)) * 1000, 1), "n": len(v)} for k, v in lat.items()}
    errors = {k: v for k, v in outcomes.items() if k != "ok"}
    return {"bench": "soak", "rate": args.rate, "duration_s": args.duration_s, "requests": sum(outcomes.values()),
            "errors": errors, "latency": pct, "rss_mib_last": {k: round(v / 2**20, 1) for k, v in last.items()},
            "rss_growth_after_warmup_mib": growth}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, default=None, help="the server's pid (default: whoever listens on the port)")
    p.add_argument("--rate", type=float, required=True, help="requests/s (Poisson)")
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=None, help="append the 10-second samples here (JSON lines)")
    args = p.parse_args()
    report = asyncio.run(_soak(args))
    print(json.dumps(report))
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
