"""End-to-end latency of a tabular model over the Open Inference Protocol, batching window on vs off.

Trains a gradient-boosted tree model (XGBoost, 20 features), registers it twice in a fresh server's
registry (one version with the batch window, one with `batch_window_ms: 0`), then sends single-row
requests open-loop at a fixed rate (each request's latency counts from when it was due, so a stalled
client cannot hide queueing), alternating the two setups in repeats so a noisy minute hits both alike.
Prints one JSON object: per setup p50/p99/mean latency in ms, the achieved rate, errors and the mean
requests per predictor call (from /metrics), and the ratios window-on / window-off. A benchmark, not a
test: run it on an idle machine.

  python bench/oip_latency.py --rate 100 --duration 20 --repeats 3 --window-ms 2 --protocol rest
  python bench/oip_latency.py --rate 20 --duration 2 --repeats 1 --trees 10   # smoke run

The server also serves an LLM (`servelm serve` always does): `--model` (default: the packaged one) with
`--embedding-model none`; it idles while this runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ADMIN = "bench-admin-key-1"
FEATURES = 20


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(path: Path, trees: int) -> None:
    import xgboost

    rng = np.random.default_rng(0)
    x = rng.normal(size=(5000, FEATURES)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] + np.sin(x[:, 2]) - x[:, 3] > 0).astype(np.float32)
    booster = xgboost.train({"objective": "binary:logistic", "max_depth": 6, "nthread": 2},
                            xgboost.DMatrix(x, label=y), num_boost_round=trees)
    booster.save_model(str(path))


def start_server(args, data: Path, http_port: int, grpc_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", *([args.model] if args.model else []),
           "--port", str(http_port), "--grpc-port", str(grpc_port), "--data-dir", str(data), "--admin-key", ADMIN,
           "--embedding-model", "none", "--no-log-requests", "--max-model-len", "512",
           "--model-roots", str(data)]  # the trained model it registers lives there
    with open(data / "server.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(data / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


async def run_rest(url: str, model: str, rows: np.ndarray, rate: float, duration: float) -> tuple[list, int]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        async def one(row: np.ndarray) -> None:
            body = {"inputs": [{"name": "input-0", "datatype": "FP32", "shape": [1, FEATURES],
                                "data": row.tolist()}]}
            r = await client.post(f"/v2/models/{model}/infer", json=body)
            r.raise_for_status()
        return await _open_loop(one, rows, rate, duration)


async def run_grpc(address: str, model: str, rows: np.ndarray, rate: float, duration: float) -> tuple[list, int]:
    import grpc

    from servelm.server.rpc.stubs import load

    pb, pb_grpc = load("servelm_oip_v2")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(row: np.ndarray) -> None:
            req = pb.ModelInferRequest(model_name=model)
            req.inputs.add(name="input-0", datatype="FP32", shape=[1, FEATURES])
            req.raw_input_contents.append(row.astype("<f4").tobytes())
            await stub.ModelInfer(req)
        return await _open_loop(one, rows, rate, duration)


async def _open_loop(one, rows: np.ndarray, rate: float, duration: float) -> tuple[list, int]:
    """Send request i at t0 + i/rate whatever the earlier ones are doing; latency from that due time."""
    n = int(rate * duration)
    lat: list[float] = []
    errors = 0
    t0 = time.perf_counter() + 0.05

    async def timed(i: int) -> None:
        nonlocal errors
        due = t0 + i / rate
        try:
            await one(rows[i % len(rows)])
            lat.append(time.perf_counter() - due)
        except Exception:  # noqa: BLE001 (counted, the run goes on)
            errors += 1

    tasks = []
    for i in range(n):
        wait = t0 + i / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(timed(i)))
    await asyncio.gather(*tasks)
    return lat, errors


def batch_stats(url: str, model: str) -> tuple[float, float]:
    """(predictor calls, requests in them) so far for a model, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    calls = reqs = 0.0
    for f in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if f.name == "servelm:oip_batch_requests":
            for s in f.samples:
                if s.labels.get("model_name") == model:
                    calls += s.value if s.name.endswith("_count") else 0
                    reqs += s.value if s.name.endswith("_sum") else 0
    return calls, reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per setup per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window-ms", type=float, default=2.0, help="the batch window of the 'on' setup")
    ap.add_argument("--trees", type=int, default=100, help="boosting repeats (depth 6)")
    ap.add_argument("--protocol", choices=("rest", "grpc"), default="rest")
    ap.add_argument("--model", default=None, help="the LLM the server also serves (default: the packaged one)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        train(data / "gbt.ubj", args.trees)
        http_port, grpc_port = _free_port(), _free_port()
        proc = start_server(args, data, http_port, grpc_port)
        url = f"http://127.0.0.1:{http_port}"
        try:
            setups = {"window_on": {"batch_window_ms": str(args.window_ms)}, "window_off": {"batch_window_ms": "0"}}
            for name, labels in setups.items():
                r = httpx.post(url + "/admin/models", headers={"x-api-key": ADMIN}, timeout=120,
                               json={"name": f"gbt-{name}", "path": str(data / "gbt.ubj"), "labels": labels,
                                     "validate": True})
                r.raise_for_status()
            rows = np.random.default_rng(1).normal(size=(1000, FEATURES)).astype(np.float32)
            results = {name: {"latencies": [], "errors": 0} for name in setups}
            for name in setups:  # warm: the first request loads the model
                asyncio.run(run_rest(url, f"gbt-{name}", rows, 10, 0.5))
            before = {name: batch_stats(url, f"gbt-{name}:1") for name in setups}
            for rnd in range(args.repeats):
                order = list(setups) if rnd % 2 == 0 else list(reversed(setups))
                for name in order:
                    if args.protocol == "rest":
                        lat, err = asyncio.run(run_rest(url, f"gbt-{name}", rows, args.rate, args.duration))
                    else:
                        lat, err = asyncio.run(run_grpc(f"127.0.0.1:{grpc_port}", f"gbt-{name}", rows, args.rate,
                                                        args.duration))
                    results[name]["latencies"] += lat
                    results[name]["errors"] += err
            out: dict = {"rate": args.rate, "duration_s": args.duration, "repeats": args.repeats,
                         "protocol": args.protocol, "window_ms": args.window_ms, "trees": args.trees,
                         "features": FEATURES, "cpus": os.cpu_count(), "setups": {}}
            for name, res in results.items():
                lat = sorted(res["latencies"])
                calls, reqs = (a - b for a, b in zip(batch_stats(url, f"gbt-{name}:1"), before[name], strict=True))
                out["setups"][name] = {
                    "requests": len(lat), "errors": res["errors"],
                    "p50_ms": round(1000 * lat[len(lat) // 2], 2) if lat else None,
                    "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2) if lat else None,
                    "mean_ms": round(1000 * statistics.fmean(lat), 2) if lat else None,
                    "requests_per_batch": round(reqs / calls, 2) if calls else None}
            on, off = out["setups"]["window_on"], out["setups"]["window_off"]
            out["ratio_on_over_off"] = {k: round(on[k] / off[k], 3) if on[k] and off[k] else None
                                        for k in ("p50_ms", "p99_ms", "mean_ms")}
            print(json.dumps(out, indent=2))
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
