"""Which CPU binding serves S1 best on this machine: `servelm serve` started once per variant and repeat,
the same S1 traffic (`servelm bench serve`, Poisson arrivals) sent to each, variants alternated repeat by
repeat so that a noisy machine hits them alike. Prints one JSON line per run, then a summary: per variant
the median over repeats of p95 TTFT, p95 TPOT, p99 ITL and goodput (requests/s within 500 ms TTFT and
50 ms TPOT), and its ratio to the first variant.

On two cores the API process (HTTP, tokenization, streaming), the engine's compute threads and the load
generator share the CPUs; the variants are:
  default      servelm's defaults: the engine uses every CPU, nothing bound
  bind-all     --cpu-bind 0-(n-1): engine threads pinned one per CPU
  engine-1     --num-threads 1 --cpu-bind (n-1): the engine on the last CPU, the rest left to the API process
  api-split    engine-1, and the API process's threads pinned to the other CPUs (os.sched_setaffinity)

    python bench/serve_binding.py --rate 1.75 --num-requests 120 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from servelm.model.loading.source import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from run_peers import running_server  # noqa: E402  (the peers harness's server start, readiness and stop)


def variants(cpus: list[int]) -> dict[str, tuple[list[str], list[int] | None]]:
    """name -> (extra `servelm serve` arguments, CPUs to pin the API process to or None)."""
    last, rest = cpus[-1], cpus[:-1]
    engine_one = ["--num-threads", "1", "--cpu-bind", str(last)]
    return {"default": ([], None), "bind-all": (["--cpu-bind", ",".join(map(str, cpus))], None),
            "engine-1": (engine_one, None), "api-split": (engine_one, rest or None)}


def pin_tree_threads(pid: int, cpus: list[int]) -> None:
    """Pins every thread of the API process `pid` (not its children: the engine binds itself)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def run_one(model: str, extra: list[str], api_cpus: list[int] | None, rate: float, n: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", model, "--port", "{port}", "--embedding-model",
           "none", *extra]
    with running_server("servelm serve " + " ".join(extra), cmd, threads) as (url, _ready_s, peak):
        if api_cpus:
            pin_tree_threads(peak.proc.pid, api_cpus)
        res = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "bench", "serve", "--base-url", url,
                              "--rate", str(rate), "--num-requests", str(n), "--vocab-size", "49152"],
                             capture_output=True, text=True, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model path (default: servelm's default model)")
    p.add_argument("--rate", type=float, default=1.75, help="S1 Poisson rate, requests/s")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="default,bind-all,engine-1,api-split")
    p.add_argument("--output", type=Path, default=None, help="append each run's JSON line here")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    table = variants(cpus)
    names = [v for v in a.variants.split(",") if v]
    model = a.model or default_model_path()
    runs: dict[str, list[dict]] = {v: [] for v in names}
    for rnd in range(a.repeats):
        for name in names if rnd % 2 == 0 else names[::-1]:
            extra, api = table[name]
            row = {"variant": name, "repeat": rnd, **run_one(str(model), extra, api, a.rate, a.num_requests,
                                                            len(cpus))}
            runs[name].append(row)
            print(json.dumps(row), flush=True)
            if a.output:
                with a.output.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")

    def med(rows: list[dict], *keys: str) -> float | None:
        vals = []
        for r in rows:
            v = r
            for k in keys:
                v = v.get(k, {}) if isinstance(v, dict) else {}
            if isinstance(v, (int, float)):
                vals.append(v)
        return round(statistics.median(vals), 2) if vals else None

    summary = {v: {"ttft_p95_ms": med(rs, "ttft_ms", "p95"), "tpot_p95_ms": med(rs, "tpot_ms", "p95"),
                   "itl_p99_ms": med(rs, "itl_ms", "p99"), "goodput": med(rs, "goodput_req_per_s"),
                   "failed": sum(r.get("failed", 0) for r in rs)} for v, rs in runs.items()}
    base = summary[names[0]]
    for s in summary.values():
        s["goodput_vs_first"] = round(s["goodput"] / base["goodput"], 3) if base["goodput"] and s["goodput"] else None
    print(json.dumps({"rate": a.rate, "num_requests": a.num_requests, "cpus": cpus, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
