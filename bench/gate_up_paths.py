"""The MLP's gate/up projection in a real model, two ways: oneDNN's matmul then SiLU-and-multiply (what
prefill chunks use) beside the AMX tile kernel with SiLU-and-multiply fused into its store (what decode
rows use), switched layer by layer between alternating `LLM.generate` calls in one process, so the
machine's drift hits both alike. Prints one JSON object: each path's times and the ratio.

  python bench/gate_up_paths.py --model ~/.cache/servelm-bench/models/smollm2-135m --workload W2 --repeats 12

W2 times one 512-token prompt with one output token (TTFT); W1 the whole 64-request workload. A
benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from servelm import LLM, SamplingParams
from servelm.bench.workloads import make_workload
from servelm.model.layers.blocks import GateUpLinear


class _FusedTiles:
    """A GateUpLinear forced onto the fused tile kernel for every row count."""

    def __init__(self, layer: GateUpLinear) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        g = self.layer
        return g.kernel.silu_mul(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a bf16 Hugging Face folder")
    p.add_argument("--workload", choices=["W1", "W2"], default="W2")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    llm = LLM(args.model, dtype="bfloat16", num_threads=args.threads, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    layers = [lw.gate_up for lw in model.layers]
    if any(g.kernel is None or g.kernel.name != "amx" for g in layers):
        raise SystemExit("needs the C++ kernels on a CPU with AMX and oneDNN")
    paths = {"onednn_then_silu": layers, "fused_tiles": [_FusedTiles(g) for g in layers]}
    wl = make_workload(args.workload, llm.engine.tokenizer.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=1 if args.workload == "W2" else wl.output_lens[0], ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(args.repeats + 1):  # repeat 0 warms up
        for name in (list(paths) if r % 2 else list(reversed(paths))):
            for lw, g in zip(model.layers, paths[name], strict=True):
                lw.gate_up = g
            t = time.perf_counter()
            llm.generate(wl.prompts, sp, use_tqdm=False)
            if r:
                times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "workload": args.workload, "repeats": args.repeats,
        "best_s": {k: round(v, 4) for k, v in best.items()}, "median_s": {k: round(v, 4) for k, v in med.items()},
        "fused_tiles_over_onednn": {"best": round(best["fused_tiles"] / best["onednn_then_silu"], 3),
                                    "median": round(med["fused_tiles"] / med["onednn_then_silu"], 3)},
    }))


if __name__ == "__main__":
    main()
