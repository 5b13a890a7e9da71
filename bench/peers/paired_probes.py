"""Paired probes: the same requests sent in turn to two (or more) OpenAI-compatible servers that run at once.

On a shared machine absolute speed drifts by 2x within an hour, so sequential runs of two systems compare
two different hours. Here every repeat sends each probe to each server back to back and the medians over
repeats are compared, so drift hits both sides alike. Start the servers first (one engine thread each), e.g.

  servelm serve MODEL --dtype bfloat16 --num-threads 1 --port 8411 --no-enable-prefix-caching
  vllm serve MODEL --dtype bfloat16 --port 8412 --no-enable-prefix-caching    # OMP_NUM_THREADS=1
  python bench/peers/paired_probes.py servelm=http://127.0.0.1:8411 vllm=http://127.0.0.1:8412

Probes: TTFT of a 512- and a 128-token prompt (one output token), TPOT of one stream after a 512-token
prompt, and TPOT of 32 concurrent streams of 400-token prompts (over the second half of their 64 tokens,
when every prompt of the batch is prefilled). Prints one JSON object: medians in ms, and each server's
ratio to the first one (above 1: the first is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


def _ids(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(10, 30000) for _ in range(n - 1)]


async def _model(c: httpx.AsyncClient, url: str) -> str:
    return (await c.get(url + "/v1/models")).json()["data"][0]["id"]


async def _ttft(c: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> float:
    t = time.perf_counter()
    r = await c.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                     "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t


async def _tpot(c: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int) -> float:
    """Mean inter-token time over the second half of a streamed completion of n tokens."""
    times = []
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    h = len(times) // 2
    return (times[-1] - times[h]) / (len(times) - 1 - h)


async def run(servers: dict[str, str], repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as c:
        models = {k: await _model(c, u) for k, u in servers.items()}
        res: dict[str, dict[str, list[float]]] = {
            k: {"ttft_512": [], "ttft_128": [], "tpot_b1": [], "tpot_b32": []} for k in servers}
        for _ in range(repeats):
            p512, p128 = _ids(rng, 512), _ids(rng, 128)
            batch = [_ids(rng, 400) for _ in range(32)]
            for k, u in servers.items():
                m = models[k]
                res[k]["ttft_512"].append(await _ttft(c, u, m, p512))
                res[k]["ttft_128"].append(await _ttft(c, u, m, p128))
                res[k]["tpot_b1"].append(await _tpot(c, u, m, p512, 128))
                res[k]["tpot_b32"].append(statistics.median(
                    await asyncio.gather(*[_tpot(c, u, m, p, 64) for p in batch])))
    med = {k: {probe: round(statistics.median(v) * 1e3, 1) for probe, v in d.items()} for k, d in res.items()}
    first = next(iter(med))
    ratios = {k: {probe: round(v / med[first][probe], 2) for probe, v in d.items()} for k, d in med.items() if k != first}
    return {"repeats": repeats, "median_ms": med, f"ratio_to_{first}": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("servers", nargs="+", help="NAME=BASE_URL, at least two; ratios are against the first")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    servers = dict(s.split("=", 1) for s in a.servers)
    if len(servers) < 2:
        p.error("give at least two servers")
    print(json.dumps(asyncio.run(run(servers, a.repeats, a.seed))))


if __name__ == "__main__":
    main()
