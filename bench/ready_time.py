"""Seconds from `servelm serve` to a 200 on /ready, for one or more checkouts side by side, alternating
runs so a noisy minute hits every checkout alike. Prints one JSON object: per checkout and setup the
runs, the median and the engine's own load time (from its log), and each checkout's ratio to the first.

  python bench/ready_time.py --model ~/.cache/servelm-bench/models/smollm2-135m --repeats 4 \\
      --src /path/to/old/checkout --src .

Setups: `hf` (the model, no embedder), `hf+emb` (with the default embedding model) and `default`
(`servelm serve` with no model: the packaged SmolLM2 GGUF). `--cold` gives every run an empty
SERVELM_CACHE_DIR: the time of a new user's first start. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _ready_seconds(src: str, args: list[str], port: int, cold: bool) -> tuple[float, float | None]:
    src = str(Path(src).resolve())
    env = {**os.environ, "PYTHONPATH": src}
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryDirectory() as cache:
        if cold:  # a first start: nothing converted or cached yet
            env["SERVELM_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "servelm.entrypoints.cli", "serve", *args, "--port", str(port)],
                                env=env, cwd=src, stdout=log, stderr=subprocess.STDOUT)  # cwd: `-m` puts it first
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"servelm serve exited with {proc.returncode}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.05)
            seconds = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(60)
        log.seek(0)
        m = re.search(r"engine: loaded .* in ([0-9.]+)s", log.read())
    return seconds, float(m.group(1)) if m else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face folder (for the hf setups)")
    p.add_argument("--src", action="append", default=None, help="checkout to run (repeatable; default .)")
    p.add_argument("--setups", default="hf,hf+emb,default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=8399)
    p.add_argument("--cold", action="store_true", help="each run with an empty SERVELM_CACHE_DIR (a first start)")
    args = p.parse_args()
    srcs = args.src or ["."]
    setups = {"hf": [args.model, "--dtype", "bfloat16", "--embedding-model", "none"],
              "hf+emb": [args.model, "--dtype", "bfloat16"], "default": []}
    chosen = args.setups.split(",")
    runs: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    for _ in range(args.repeats):
        for src in srcs:
            for s in chosen:
                runs.setdefault((src, s), []).append(_ready_seconds(src, setups[s], args.port, args.cold))
    out: dict = {"model": args.model, "repeats": args.repeats, "cold": args.cold, "results": {}}
    for src in srcs:
        res = out["results"][src] = {}
        for s in chosen:
            secs = [r[0] for r in runs[src, s]]
            loads = [r[1] for r in runs[src, s] if r[1] is not None]
            res[s] = {"ready_s": [round(x, 2) for x in secs], "median_ready_s": round(statistics.median(secs), 2),
                      "median_engine_load_s": round(statistics.median(loads), 2) if loads else None}
            if src != srcs[0]:
                base = out["results"][srcs[0]][s]["median_ready_s"]
                res[s]["ratio_to_first"] = round(res[s]["median_ready_s"] / base, 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
