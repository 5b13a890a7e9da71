"""Where a workload's time goes inside servelm: every C++ kernel call and every oneDNN / torch linear timed
per call (wall clock, in the engine's own process), split into decode-sized calls (at most --decode-rows
rows) and prefill-sized ones, beside the whole `LLM.generate` wall time. Prints one JSON object.

  python bench/step_profile.py --model ~/.cache/servelm-bench/models/smollm2-135m --workload W1 --threads 1

The timers add a few microseconds per call (thousands of calls per step), so "rest" (scheduler, sampler,
Python glue, norms done in torch) is an upper bound. A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers" / "workers"))
from common import output_len, prompts  # noqa: E402  (the peers' workload drawing, shared)

from servelm.model.kernels import cpu as cpu_kernels  # noqa: E402
from servelm.model.layers import linear_kernels  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def _rows(name: str, args) -> int:
    """Rows of the call's input: a linear's first argument, else the smallest leading dimension among its
    tensors (caches are larger than a decode step's rows; a packed weight's block count need not be)."""
    if "linear" in name and args and isinstance(args[0], torch.Tensor):
        return args[0].shape[0]
    return min((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), default=0)


def timed(name: str, fn, decode_rows: int):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        entry = TIMES[f"{name} {'decode' if _rows(name, args) <= decode_rows else 'prefill'}"]
        entry[0] += time.perf_counter() - t
        entry[1] += 1
        return out

    return wrapper


class TimedModule:
    """The compiled kernel module with each function wrapped in a timer."""

    def __init__(self, module, decode_rows: int) -> None:
        self._module, self._rows = module, decode_rows

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        if callable(attr) and not name.endswith("_supported"):
            return timed(name, attr, self._rows)
        return attr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face folder")
    p.add_argument("--workload", default="W1", choices=["W1", "W2"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens (default: the workload's; 1 times TTFT)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="one request of this many prompt tokens (drawn as W2's) instead of the workload's")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmups", type=int, default=1, help="untimed whole runs first")
    p.add_argument("--decode-rows", type=int, default=64, help="calls with at most this many rows count as decode")
    p.add_argument("--python-loop", action="store_true",
                   help="decode steps through the Python layer loop (the same kernels, each one timed) "
                        "instead of replaying kernel tapes from C++ (run_tape, timed as a whole)")
    args = p.parse_args()
    module = cpu_kernels.load()
    if module is not None:  # every caller asks load(), so the wrapped module is what the model holds
        cpu_kernels._module = TimedModule(module, args.decode_rows)
    linear_kernels._onednn_linear = timed("onednn_linear", linear_kernels._onednn_linear, args.decode_rows)
    linear_kernels.F.linear = timed("torch_linear", torch.nn.functional.linear, args.decode_rows)

    from servelm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)
    if args.python_loop:
        llm.engine.core.model.tapes = None
    batch, out = prompts(args.workload), args.max_tokens or output_len(args.workload)
    if args.prompt_tokens:
        rng = np.random.Generator(np.random.PCG64(args.prompt_tokens))
        batch = [[1] + [int(i) for i in rng.integers(4, 32000, size=args.prompt_tokens - 1)]]
    sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    for _ in range(args.warmups):  # whole runs first: the KV cache's pages are touched (faulted in) once
        llm.generate(batch, sp, use_tqdm=False)
    TIMES.clear()
    t = time.perf_counter()
    llm.generate(batch, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    parts = {k: {"s": round(v[0], 3), "calls": v[1]} for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1][0])}
    print(json.dumps({"workload": args.workload, "prompt_tokens": len(batch[0]), "dtype": args.dtype, "threads": args.threads, "kernels": module is not None,
                      "wall_s": round(wall, 3), "output_tok_per_s": round(len(batch) * out / wall, 1),
                      "parts": parts, "rest_s": round(wall - sum(v[0] for v in TIMES.values()), 3)}, indent=1))


if __name__ == "__main__":
    main()
