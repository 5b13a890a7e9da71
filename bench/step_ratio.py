#!/usr/bin/env python3
"""The engine's host time per iteration (256 running and 1,000 waiting requests, `EngineCore.step` with the
stand-in runner of bench/engine_overheads.py, whose own time is left out, and the engine process's GC
settings), divided by the time of a fixed pure-Python loop run right after each step in the same process. On a
machine whose speed drifts from minute to minute, the ratio compares checkouts where raw times cannot; run two at
once, one pinned to each CPU, and swap the CPUs between pairs:

    PYTHONPATH=/path/to/old taskset -c 0 python bench/step_ratio.py old & PYTHONPATH=. taskset -c 1 python bench/step_ratio.py new

Prints one JSON object. A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_overheads as eo  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("label", help="what to call this checkout in the output")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--count", action="store_true",
                   help="also count the Python bytecodes and C calls one step executes (traced, after the timing): "
                        "a measure of the interpreter's work that no load changes")
    a = p.parse_args()
    running, waiting = 256, 1000
    wl = eo.make_serving_workload(eo.VOCAB, num_requests=running + waiting, seed=4)
    model = eo.fake_model(1, 1, 8, torch.bfloat16, 8192)
    longest = max(len(x) for x in wl.prompts) + a.steps + 64
    core, fwd = eo.make_core(running * (-(-longest // 16) + 1) + 64, running, model, scheduling_policy="priority")
    for i in range(running):  # they never finish while timed
        eo.add(core, f"run{i}", wl.prompts[i], core.max_model_len - len(wl.prompts[i]))
    while any(s.num_to_compute > 1 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for i in range(running, running + waiting):
        eo.add(core, f"wait{i}", wl.prompts[i], core.max_model_len - len(wl.prompts[i]))
    for _ in range(10):
        core.step()
    gc.freeze()  # the engine process's settings
    gc.set_threshold(10000)
    numbers = list(range(300))

    def loop() -> int:
        total = 0
        for x in numbers:
            total += x
        return total

    ratios, steps, loops = [], [], []
    for _ in range(a.steps):
        f0 = fwd.seconds
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
        step = t1 - t0 - (fwd.seconds - f0)  # the stand-in forward's time left out
        loop()
        loop()
        t2 = time.perf_counter()
        ratios.append(step / ((t2 - t1) / 2))
        steps.append(step)
        loops.append((t2 - t1) / 2)
    result = {"label": a.label, "step_over_loop": round(statistics.median(ratios), 2),
              "step_us": round(statistics.median(steps) * 1e6, 1), "loop_us": round(statistics.median(loops) * 1e6, 2)}
    if a.count:
        result.update(count_work(core, fwd, 50))
    print(json.dumps(result))


def count_work(core, fwd, steps: int) -> dict:
    """Bytecodes and C-function calls per `EngineCore.step`, the stand-in forward's left out. NumPy operators
    (an array's `+=`, indexing) are neither: their cost is the timed ratio's to show."""
    counts = {"bytecodes": 0, "c_calls": 0}
    stand_in = type(fwd).__call__.__code__

    def trace(frame, event, arg):
        if frame.f_code is stand_in:
            return None
        frame.f_trace_opcodes = True

        def local(frame, event, arg):
            if event == "opcode":
                counts["bytecodes"] += 1
            return local
        return local

    def profile(frame, event, arg):
        if event == "c_call" and frame.f_code is not stand_in:
            counts["c_calls"] += 1

    sys.settrace(trace)
    sys.setprofile(profile)
    for _ in range(steps):
        core.step()
    sys.settrace(None)
    sys.setprofile(None)
    return {k + "_per_step": round(v / steps, 1) for k, v in counts.items()}


if __name__ == "__main__":
    main()
