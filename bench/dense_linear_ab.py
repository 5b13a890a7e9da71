"""The fixed-order dense kernel (csrc/dense_linear.cpp: every output summed over its inputs in order, whatever the
row count) against what it replaced, PyTorch's matmul (MKL in float32; oneDNN's prepacked bf16 matmul where the
CPU has it, else F.linear), per SmolLM2-135M layer shape and row count, alternating the two repeat by repeat and
keeping each one's median. Prints one JSON object: per dtype, shape and row count, each side's ms per call, the
kernel's GFLOP/s and the ratio torch / kernel (above 1: the kernel is faster).

  python bench/dense_linear_ab.py --threads 2 --rows 1,16,64,512 --dtypes float32,bfloat16

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.linear_kernels import _onednn_packed, pack_dense_weight

# SmolLM2-135M: fused qkv, o_proj, fused gate/up, down, the tied LM head
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16,64,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    k = cpu_kernels.load()
    if k is None:
        raise SystemExit("the C++ kernels are not built (python -m servelm.model.kernels.build)")
    out: dict = {"variant": k.variant, "threads": a.threads, "results": {}}
    torch.manual_seed(0)
    for dt in (getattr(torch, d) for d in a.dtypes.split(",")):
        for name in a.shapes.split(","):
            n, kk = SHAPES[name]
            w = torch.randn(n, kk).to(dt) * 0.02
            panels, packed = pack_dense_weight(w), _onednn_packed(w)

            def torch_side(x, w=w, packed=packed):
                if packed is not None:
                    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                return F.linear(x, w)

            for m in map(int, a.rows.split(",")):
                x = torch.randn(m, kk).to(dt)
                reps = max(2, int(2e8 / (2 * m * n * kk)))  # about 0.2 GFLOP a side per repeat
                sides: dict[str, list[float]] = {"kernel": [], "torch": []}
                for r in range(a.repeats):
                    order = ("kernel", "torch") if r % 2 == 0 else ("torch", "kernel")
                    for side in order:
                        fn = (lambda x=x, n=n, panels=panels: k.dense_linear(x, panels, n)) if side == "kernel" \
                            else (lambda x=x, f=torch_side: f(x))
                        sides[side].append(timed(fn, reps))
                med = {s: statistics.median(v) for s, v in sides.items()}
                out["results"][f"{str(dt).removeprefix('torch.')}/{name}/{m}"] = {
                    "kernel_ms": round(1e3 * med["kernel"], 3), "torch_ms": round(1e3 * med["torch"], 3),
                    "kernel_gflops": round(2 * m * n * kk / med["kernel"] / 1e9, 1),
                    "torch_over_kernel": round(med["torch"] / med["kernel"], 3),
                    "torch_path": "onednn" if packed is not None else "F.linear"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
