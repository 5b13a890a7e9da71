"""GGUF block kernels (csrc/quant_linear.cpp) beside the bf16 tile kernel over a whole model's worth of distinct
linear weights (SmolLM2-135M's shapes: qkv, o, gate_up, down per layer), for several row counts: the
int8-activation path and the dequantize-to-bf16-tiles path of each format, and the bf16 kernel over the
same weights dequantized. Alternates the systems each repeat and keeps each one's best. Prints JSON: ms
per pass over all layers, weight bytes each system reads, and those bytes over the time (GB/s).

  nice python bench/gguf_linear.py --formats Q4_1,Q8_0 --rows 1,4,8,16,32 --threads 2

Weights are random blocks (random codes, sane scales), which does not change a matmul's speed. A benchmark, not
a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import time

import gguf
import numpy as np
import torch

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.linear_kernels import pack_weight_for_tiles
from servelm.model.quant.gguf import FORMATS, GGUFBlocks, pack_blocks

HIDDEN, INTER, LAYERS, Q, KV = 576, 1536, 30, 576, 192  # SmolLM2-135M


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """[n, row bytes] random blocks: random codes, float16 scales (and offsets) in a sane range."""
    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n * k // elems, size), dtype=np.uint8)
    fields = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [size - 2], "Q5_0": [0],
              "Q5_1": [0, 2], "Q5_K": [0, 2]}[qtype]
    for at in fields:
        raw[:, at:at + 2] = rng.uniform(0.001, 0.01, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="Q4_1,Q8_0")
    p.add_argument("--rows", default="1,4,8,16,32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=LAYERS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels.load()
    if k is None or not k.quant_linear_supported(0, 64):
        raise SystemExit("needs servelm's kernels with the GGUF block kernel")
    tiles = k.amx_linear if k.amx_linear_supported(64) else k.avx512_linear if k.avx512_linear_supported(64) else None
    shapes = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * args.layers
    rng = np.random.default_rng(0)
    weights = {}
    for name in args.formats.split(","):
        blocks = [GGUFBlocks(name, torch.from_numpy(random_blocks(rng, name, n, kk)), kk, torch.bfloat16)
                  for n, kk in shapes]
        weights[name] = [pack_blocks(b) for b in blocks]
        if tiles is not None and "bf16" not in weights:
            weights["bf16"] = [pack_weight_for_tiles(b.dequantize(torch.bfloat16)) for b in blocks]
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {kk: torch.randn(m, kk).bfloat16() for kk in {s[1] for s in shapes}}
        systems = {}
        for name, ws in weights.items():
            if name == "bf16":
                systems["bf16"] = lambda ws=ws, xs=xs: [tiles(xs[kk], w, n) for w, (n, kk) in zip(ws, shapes, strict=True)]
                continue
            f = FORMATS[name]
            systems[f"{name}_int8"] = lambda ws=ws, f=f, xs=xs: [k.quant_linear(xs[kk], w, f, n, int_rows=1 << 30)
                                                          for w, (n, kk) in zip(ws, shapes, strict=True)]
            if k.quant_linear_supported(f, 64) == 2:
                systems[f"{name}_tiles"] = lambda ws=ws, f=f, xs=xs: [k.quant_linear(xs[kk], w, f, n, int_rows=0)
                                                               for w, (n, kk) in zip(ws, shapes, strict=True)]
        best = dict.fromkeys(systems, float("inf"))
        for fn in systems.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in systems.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        nbytes = {name: sum(w.numel() * w.element_size() for w in weights[name.rsplit("_", 1)[0]]) for name in best}
        results.append({"rows": m, **{f"{n}_ms": round(1000 * s, 2) for n, s in best.items()},
                        **{f"{n}_gb_s": round(nbytes[n] / s / 1e9, 1) for n, s in best.items()}})
    print(json.dumps({"threads": args.threads, "layers": args.layers, "kernel": k.variant,
                      "weight_mb": {n: round(sum(w.numel() * w.element_size() for w in ws) / 1e6, 1)
                                    for n, ws in weights.items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
