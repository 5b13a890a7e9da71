"""Decode-step linear layers: servelm's kernel over packed weights (the AMX tile matmul where the CPU has
AMX, else the AVX512-BF16 kernel in each of its two pair-product forms) beside oneDNN's prepacked bf16
matmul, over a whole model's worth of distinct, cache-cold weights, alternating the systems each repeat
and keeping each one's best. Prints one JSON object with ratios, weight bytes and flops per second.

  python bench/decode_linear.py --model 60m --rows 1,16,32,64 --threads 1

Shapes are those of `llama-rand-60m` or SmolLM2-135M (qkv, o, gate_up, down per layer, then the LM head);
weights are random, which does not change a matmul's speed. A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.linear_kernels import pack_weight_for_tiles

MODELS = {  # hidden, intermediate, layers, vocab, heads, kv heads, head dim
    "60m": (512, 1408, 8, 32000, 8, 4, 64),
    "smollm2": (576, 1536, 30, 49152, 9, 3, 64),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="60m")
    p.add_argument("--rows", default="1,16,32,64", help="comma-separated batch sizes (rows per matmul)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels.load()
    if k is None or not k.avx512_linear_supported(64):
        raise SystemExit("needs the C++ kernels on a CPU with AVX512-BF16")
    kernel = k.amx_linear if k.amx_linear_supported(64) else k.avx512_linear
    dots = [] if kernel is k.amx_linear else ["bf16", "fma"]
    default_dot = k.bf16_dot()
    h, i, layers, vocab, nq, nkv, hd = MODELS[args.model]
    shapes = [((nq + 2 * nkv) * hd, h), (h, nq * hd), (2 * i, h), (h, i)] * layers + [(vocab, h)]
    weights = [torch.randn(n, kk).bfloat16() for n, kk in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    tiled = [pack_weight_for_tiles(w) for w in weights]
    weight_bytes = sum(n * kk * 2 for n, kk in shapes)
    del weights
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {kk: torch.randn(m, kk).bfloat16() for kk in {s[1] for s in shapes}}

        def packed(xs=xs, dot=None):
            if dot is not None:
                k.set_bf16_dot(dot)
            return [kernel(xs[kk], t, n, None) for t, (n, kk) in zip(tiled, shapes, strict=True)]

        # the AVX512 kernel's two ways to multiply bf16 pairs, each timed (the AMX kernel has one)
        systems = {f"packed_{d}": (lambda d=d: packed(dot=d)) for d in dots} or {"packed": packed}
        systems["onednn"] = lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[kk], w, None, "none", [], "")
                                           for w, (n, kk) in zip(onednn, shapes, strict=True)]
        best = dict.fromkeys(systems, float("inf"))
        for f in systems.values():
            f()  # warm-up
        for _ in range(args.repeats):
            for name, f in systems.items():
                t = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t)
        flops = m * weight_bytes  # 2 flops per bf16 weight (2 bytes) per row
        row = {"rows": m, **{f"{n}_ms": round(1000 * s, 2) for n, s in best.items()},
               **{f"{n}_weight_gb_s": round(weight_bytes / s / 1e9, 1) for n, s in best.items()},
               **{f"{n}_gflop_s": round(flops / s / 1e9, 1) for n, s in best.items()},
               **{f"{n}_speedup_vs_onednn": round(best["onednn"] / s, 2) for n, s in best.items() if n != "onednn"}}
        results.append(row)
    k.set_bf16_dot(default_dot)
    print(json.dumps({"model": args.model, "threads": args.threads, "kernel": kernel.__name__,
                      "default_dot": default_dot,
                      "weight_mb": round(weight_bytes / 1e6, 1),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
