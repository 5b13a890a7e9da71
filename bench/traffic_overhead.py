"""Cost of traffic management per request, in-process: TrafficService.complete() (the prediction-log write
awaited before the last byte, metrics, drift, canary/experiment bookkeeping) for each prediction-log mode,
sequential and with 300 concurrent requests (group commit), and TrafficPolicy.choose.

    python bench/traffic_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from servelm.config.settings import ServerConfig
from servelm.control.deployments import DeploymentManager
from servelm.control.registry import Registry
from servelm.control.traffic import RequestAttrs, split
from servelm.server.observability.telemetry import RequestRecord
from servelm.server.traffic import TrafficService


def _record(rid: str) -> RequestRecord:
    """A finished 200-token prompt / 32-token answer, as the gateway hands it over."""
    r = RequestRecord(rid, "POST", "/v1/completions")
    r.model, r.prompt_ids, r.prompt_tokens, r.completion_tokens = "m", list(range(200)), 200, 32
    r.prompt_text, r.completion_text = json.dumps("hello world " * 60), "x" * 200
    r.first_token, r.last_token = r.start + 0.01, r.start + 0.2
    return r


async def main(n: int = 300) -> None:
    reg = Registry(None, Path(tempfile.mkdtemp()))
    cp = SimpleNamespace(registry=reg, deployments=DeploymentManager())
    for mode in ("off", "metadata", "full"):
        svc = TrafficService(cp, ServerConfig(prediction_log=mode), CollectorRegistry(), None)
        t = time.perf_counter()
        for i in range(n):
            await svc.complete(_record(f"{mode}-s{i}"))
        seq = (time.perf_counter() - t) / n
        t = time.perf_counter()
        await asyncio.gather(*(svc.complete(_record(f"{mode}-c{i}")) for i in range(n)))
        conc = (time.perf_counter() - t) / n
        await svc.close()
        print(f"prediction log {mode:8}: complete() {seq * 1e3:.2f} ms/request sequential, "
              f"{conc * 1e3:.2f} ms/request with {n} concurrent")
    policy = split("m", {1: 90, 2: 10}, sticky=True)
    t = time.perf_counter()
    for i in range(100_000):
        policy.choose(RequestAttrs(user=f"u{i}"))
    print(f"TrafficPolicy.choose (sticky): {(time.perf_counter() - t) / 100_000 * 1e6:.1f} us")
    reg.close()


if __name__ == "__main__":
    asyncio.run(main())
