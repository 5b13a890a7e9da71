"""Caller latency with shadow mirroring on against off, side by side in one run, over HTTP on a real server:
version 1 of a model serves (PRODUCTION), version 2 (the same weights, its own workers) is the shadow that
gets a copy of every request when mirroring is on. Phases alternate off/on for `--repeats` repeats (so a
drift of the machine's speed hits both alike); each phase sends `--requests` streamed completions with
Poisson arrivals at `--rate` per second. Prints one JSON object: TTFT and total latency p50/p90/p99 (ms) for
off and on, the on/off ratios, and the shadow's own figures (mirrored, dropped, agreement). A benchmark, not a
test: run it on a quiet machine.

  python bench/shadow_latency.py --model ~/.cache/servelm-bench/models/llama-rand-60m --dtype bfloat16 \\
      --threads 1 --requests 200 --rate 2 --repeats 3 --max-tokens 64
  python bench/shadow_latency.py --quick   # a smoke run on a tiny random-weight Llama built on the spot

The shadow queue is the server's default (`--shadow-queue 64`, `--shadow-concurrency 1`): what overflows is
dropped and counted, never waited for. On a machine with few cores the shadow's workers compete with the
primary's for them: that cost is part of what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ADMIN = "sk-bench-shadow-admin"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    q = np.percentile(xs, [50, 90, 99])
    return {"p50": round(float(q[0]) * 1000, 1), "p90": round(float(q[1]) * 1000, 1),
            "p99": round(float(q[2]) * 1000, 1)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, data: Path) -> tuple[subprocess.Popen, str]:
    """`servelm serve` with a registry and no default model; returns once /ready answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", "--port", str(port), "--data-dir", str(data),
           "--embedding-model", "none", "--dtype", args.dtype, "--num-threads", str(args.threads),
           "--max-model-len", str(args.max_model_len), "--no-log-requests",
           "--model-roots", str(Path(args.model).expanduser().resolve().parent)]  # it registers args.model
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    log = open(data / "server.log", "w")  # noqa: SIM115 (the server writes to it while it runs)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                            env={**os.environ, "SERVELM_ADMIN_KEY": ADMIN})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited (log: {data / 'server.log'}): "
                               + (data / "server.log").read_text()[-3000:])
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready in 10 minutes")


def _admin(url: str, method: str, path: str, body: dict | None = None) -> dict:
    r = httpx.request(method, url + path, json=body, headers={"x-api-key": ADMIN}, timeout=900)
    if r.status_code >= 300:
        raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
    return r.json() if r.content else {}


def _setup(url: str, model: str, shadow_nice: int = 0) -> None:
    """Register the model twice: v1 PRODUCTION, v2 STAGING_TESTED (its engine at niceness +shadow_nice);
    deploy both."""
    for states, engine in ((["STAGING", "STAGING_TESTED", "CANARY", "PRODUCTION"], {}),
                           (["STAGING", "STAGING_TESTED"], {"cpu_nice": shadow_nice} if shadow_nice else {})):
        v = _admin(url, "POST", "/admin/models", {"name": "m", "path": model, "validate": True, "engine": engine})
        for s in states:
            _admin(url, "POST", f"/admin/models/m/versions/{v['version']}/transition", {"state": s})
        _admin(url, "POST", "/admin/deployments", {"model": v["ref"]})


async def _one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict | None:
    t0 = time.perf_counter()
    first = None
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.perf_counter()
    return {"ttft": (first or time.perf_counter()) - t0, "total": time.perf_counter() - t0}


async def _phase(url: str, args, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
    prompts = [[1, *rng.integers(100, 20000, args.prompt_len - 1).tolist()] for _ in range(args.requests)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def gated(i: int) -> dict | None:
            await asyncio.sleep(float(starts[i]))
            return await _one(client, prompts[i], args.max_tokens)
        res = await asyncio.gather(*(gated(i) for i in range(args.requests)))
    return [r for r in res if r is not None]


def _ratios(off: dict, on: dict) -> dict:
    return {k: round(on[k] / off[k], 3) if off.get(k) else None for k in ("p50", "p90", "p99")}


async def main(args) -> dict:
    data = Path(tempfile.mkdtemp(prefix="servelm-shadow-bench-"))
    t0 = time.perf_counter()
    proc, url = _start(args, data)
    try:
        _setup(url, args.model, args.shadow_nice)
        await _phase(url, args, 0)  # warm-up, not counted
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        failed = {"off": 0, "on": 0}
        for rnd in range(args.repeats):
            for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                if mode == "on":
                    _admin(url, "PUT", "/admin/models/m/shadow", {"version": 2, "fraction": 1.0})
                else:
                    _admin(url, "PUT", "/admin/models/m/traffic", {"arms": [{"version": 1}]})
                res = await _phase(url, args, 1 + rnd)  # the same arrivals and prompts for off and on
                failed[mode] += args.requests - len(res)
                runs[mode] += res
        shadow = _admin(url, "GET", "/admin/models/m/shadow")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(data, ignore_errors=True)  # the registry and its copy of the model
    out: dict = {"model": args.model, "shadow_nice": args.shadow_nice, "dtype": args.dtype, "threads": args.threads, "requests_per_phase":
                 args.requests, "repeats": args.repeats, "rate": args.rate, "max_tokens": args.max_tokens,
                 "prompt_len": args.prompt_len, "quick": args.quick, "failed": failed}
    for k in ("ttft", "total"):
        off, on = _pct([r[k] for r in runs["off"]]), _pct([r[k] for r in runs["on"]])
        out[f"{k}_ms"] = {"off": off, "on": on, "on_over_off": _ratios(off, on)}
    out["shadow"] = shadow.get("stats")
    out["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (or .gguf file); --quick builds a tiny one")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: 1 GiB)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=200, help="requests per phase")
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    p.add_argument("--repeats", type=int, default=3, help="off/on pairs (the order alternates)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--shadow-nice", type=int, default=0,
                   help="run the shadow version's engine at this much higher niceness (its `cpu_nice`)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 6 requests per phase, 1 repeat")
    args = p.parse_args(argv)
    if args.model is None and not args.quick:
        p.error("--model is required (or --quick, which builds a tiny model)")
    if args.quick:
        args.requests, args.repeats, args.rate, args.max_tokens, args.prompt_len = 6, 1, 8.0, 8, 16
        args.num_kv_blocks = args.num_kv_blocks or 64
        args.max_model_len = min(args.max_model_len, 256)
    return args


if __name__ == "__main__":
    args = parse()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from routing import _tiny_model

            args.model, args.dtype = _tiny_model(Path(tmp) / "tiny-llama"), "float32"
        print(json.dumps(asyncio.run(main(args)), indent=1))
