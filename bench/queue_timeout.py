"""What a queue timeout costs: one burst of S1 requests (streamed completions, prompts 64..512 tokens, outputs
32..256) sent at once to `servelm serve` with the default model, once per --queue-timeout-s value (0: none),
each on a fresh server. A request answered 408 is one that a server without the timeout would have served:
the run without it shows how long the same burst took to finish whole.

    python bench/queue_timeout.py --timeouts 30,0 --requests 200

Prints one JSON line per setting (completed, 408s, other failures, TTFT and end-to-end percentiles, the time the
last request finished) and a summary line. Run it on an otherwise idle machine; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from servelm.bench.serve import _run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(timeout_s: float, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", "--port", str(port), "--embedding-model",
           "none", "--num-threads", str(threads), "--queue-timeout-s", str(timeout_s),
           "--queue-high-watermark", "100000", "--queue-low-watermark", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"servelm serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)  # polling for readiness
    proc.kill()
    raise SystemExit("servelm serve did not become ready in 600 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeouts", default="30,0", help="comma-separated --queue-timeout-s values (0: none)")
    p.add_argument("--requests", type=int, default=200, help="S1 requests in the burst")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--server-args", default="", help="extra `servelm serve` arguments, space-separated")
    args = p.parse_args()
    rows = []
    for t in [float(x) for x in args.timeouts.split(",")]:
        proc, url = start_server(t, args.threads, args.server_args.split())
        try:
            ns = argparse.Namespace(base_url=url, model=None, rate=float("inf"), concurrency=None,
                                    num_requests=args.requests, seed=4, vocab_size=49152, slo_ttft_ms=500.0,
                                    slo_tpot_ms=50.0, label="servelm", output=None, workload="S1")
            report = asyncio.run(_run(ns))
        finally:
            proc.terminate()
            proc.wait(60)
        timeouts = sum(1 for e in report["errors"] if "408" in e)
        row = {"queue_timeout_s": t or None, "requests": args.requests, "completed": report["completed"],
               "failed": report["failed"], "error_kinds": report["errors"], "408_seen": timeouts > 0,
               "ttft_ms": report["ttft_ms"], "e2e_ms": report["e2e_ms"], "duration_s": report["duration_s"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": [{k: r[k] for k in ("queue_timeout_s", "completed", "failed", "duration_s")}
                                  for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
