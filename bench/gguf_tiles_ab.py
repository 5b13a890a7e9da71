"""GGUF tile path (csrc/quant_linear.cpp's bf16 path for many rows, which the engine does not use: its bits
differ from the int8 kernel's) per SmolLM2-135M layer shape, alternating
systems repeat by repeat and keeping each one's best:

- `bf16`: the bf16 tile kernel over the weight dequantized and packed (what `--quantization none` runs);
- `tiles`: quant_linear's bf16 tile path (int_rows=0);
- `int8`: quant_linear's int8-activation kernel for any number of rows (int_rows large), what the engine runs;
- with `--baseline LIB` (another build of the kernel library, e.g. main's libservelm_amx.so), `base_bf16` and
  `base_tiles`: the same two from that build, for an A/B of a kernel change in one run.

Each shape runs over `--copies` distinct weights (a model's layers, so the weights stream from memory as in a
decode step; the lm_head once), each call timed on its own. Prints JSON per shape and row count: each
system's median ms per call, and its fastest call (`_min`).

  python bench/gguf_tiles_ab.py --rows 16,24,32,48,64 --threads 2 --baseline /work/main/servelm/model/kernels/lib/libservelm_amx.so

Random blocks (bench/gguf_linear.py), which does not change a matmul's speed. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.kernels.ops import CpuKernels
from servelm.model.layers.linear_kernels import pack_weight_for_tiles
from servelm.model.quant.gguf import FORMATS, GGUFBlocks, pack_blocks

# SmolLM2-135M: name -> (N, K, format); gate_up is packed fused (gate_up=True, SiLU in the store)
SHAPES = {"o": (576, 576, "Q4_1"), "kv": (192, 576, "Q4_1"), "qkv": (960, 576, "Q4_1"),
          "gate_up": (3072, 576, "Q4_1"), "down": (576, 1536, "Q4_1"), "lm_head": (49152, 576, "Q8_0")}


def timed(call, weights: list) -> list[float]:
    """Seconds of each call, one per weight."""
    out = []
    for w in weights:
        t = time.perf_counter()
        call(w)
        out.append(time.perf_counter() - t)
    return out


def make_systems(k, base, wanted: list[str], x: torch.Tensor, n: int, f: int, gate_up: bool, dense: list,
                 quant: list) -> dict:
    """name -> a pass over the weights returning each call's seconds."""
    systems = {}
    for lib, prefix in ((k, ""), (base, "base_")):
        if lib is None:
            continue
        amx = lib.amx_linear_supported(64)
        dense_fn = ((lib.amx_linear_silu_mul if gate_up else lib.amx_linear) if amx
                    else lib.avx512_linear_silu_mul if gate_up else lib.avx512_linear)
        if "bf16" in wanted:
            systems[prefix + "bf16"] = lambda fn=dense_fn: timed(lambda w: fn(x, w, n), dense)
        if "tiles" in wanted:
            systems[prefix + "tiles"] = lambda lib=lib: timed(lambda w: lib.quant_linear(x, w, f, n, None, gate_up, 0),
                                                              quant)
        if "int8" in wanted and not prefix:
            systems["int8"] = lambda: timed(lambda w: k.quant_linear(x, w, f, n, None, gate_up, 1 << 30), quant)
    return systems


def main() -> None:
    from gguf_linear import random_blocks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="17,32,64,100")
    p.add_argument("--systems", default="bf16,tiles,int8", help="of bf16, tiles, int8 (and base_* with --baseline)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copies", type=int, default=30)
    p.add_argument("--variant", help="this checkout's build to run (default: the one servelm loads), e.g. avx512bf16")
    p.add_argument("--baseline", help="another build of the kernel library to run beside this one")
    p.add_argument("--bf16-dot", choices=["bf16", "fma"],
                   help="the AVX512 kernels' bf16 pair product (default: the CPU's; bf16 is AMD's, fma Intel's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels.load_variant(args.variant) if args.variant else cpu_kernels.load()
    base = CpuKernels(args.baseline, "baseline") if args.baseline else None
    for lib in (k, base) if args.bf16_dot else ():
        if lib is not None:
            lib.set_bf16_dot(args.bf16_dot)
    wanted = args.systems.split(",")
    rng = np.random.default_rng(0)
    out = []
    for shape in args.shapes.split(","):
        n, kk, qtype = SHAPES[shape]
        gate_up, f = shape == "gate_up", FORMATS[qtype]
        copies = 1 if shape == "lm_head" else args.copies
        blocks = [GGUFBlocks(qtype, torch.from_numpy(random_blocks(rng, qtype, n, kk)), kk, torch.bfloat16)
                  for _ in range(copies)]
        quant = [pack_blocks(b, gate_up) for b in blocks]
        dense = [pack_weight_for_tiles(b.dequantize(torch.bfloat16), gate_up=gate_up) for b in blocks]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, kk).bfloat16()
            systems = make_systems(k, base, wanted, x, n, f, gate_up, dense, quant)
            times = {name: [] for name in systems}  # every call's own time: a preempted call spoils one sample
            for fn in systems.values():
                fn()
            for _ in range(args.repeats):
                for name, fn in systems.items():
                    times[name] += fn()
            row = {"shape": shape, "rows": m,
                   **{s: round(1000 * float(np.median(v)), 3) for s, v in times.items()},
                   **{f"{s}_min": round(1000 * min(v), 3) for s, v in times.items()}}
            out.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"threads": args.threads, "ms_per_call": out}))


if __name__ == "__main__":
    main()
