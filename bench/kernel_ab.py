"""Two builds of servelm's C++ kernels side by side in one process: a decode step's linear layers (AMX
tiles, or the AVX512-BF16 kernel on CPUs without AMX)
(SmolLM2's or llama-rand-60m's shapes, cold weights) and the paged decode attention at W1's batch,
alternating the builds each repeat. Outputs must be identical (the kernels promise fixed summation
order); prints one JSON object with medians and the new/base speed-up.

  git worktree add /tmp/base HEAD~1
  python bench/kernel_ab.py --base /tmp/base --rows 16,32,64
  python bench/kernel_ab.py --base /tmp/base --rows '' --variant avx2 --dtype float32   # AVX2's attention

`--base` and `--new` name checkouts (their servelm/model/kernels/csrc is built, or found in the kernel cache).
`--engine DIR` also runs a model end to end with each build's kernels in turn (one engine; W2 TPOT and,
with `--w1`, W1 throughput, alternating repeats).
A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from decode_attention import decode_step  # bench/ is on sys.path when run

from servelm.model import memory
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.linear_kernels import pack_weight_for_tiles

MODELS = {  # hidden, intermediate, layers, vocab, q heads, kv heads, head dim
    "60m": (512, 1408, 8, 32000, 8, 4, 64),
    "smollm2": (576, 1536, 30, 49152, 9, 3, 64),
}


def alternate(fa, fb, repeats: int, before=None) -> dict:
    """Median seconds of each over `repeats`, the order flipped every repeat; `before` runs untimed
    before each call."""
    ta, tb = [], []
    for r in range(repeats):
        for f, t in ((fa, ta), (fb, tb)) if r % 2 == 0 else ((fb, tb), (fa, ta)):
            if before is not None:
                before()
            start = time.perf_counter()
            f()
            t.append(time.perf_counter() - start)
    a, b = statistics.median(ta), statistics.median(tb)
    return {"base_ms": round(a * 1e3, 2), "new_ms": round(b * 1e3, 2), "new_speedup": round(a / b, 3)}


def linears(base, new, model: str, rows: list[int], repeats: int) -> dict:
    h, i, layers, vocab, nq, nkv, hd = MODELS[model]
    shapes = [((nq + 2 * nkv) * hd, h, False), (h, nq * hd, False), (2 * i, h, True), (h, i, False)] * layers
    shapes.append((vocab, h, False))
    packed = [SimpleNamespace(w=pack_weight_for_tiles(torch.randn(n, k).bfloat16(), gate_up=g)) for n, k, g in shapes]
    if memory.WEIGHTS_IN_HUGE_PAGES:  # placed as the engine places them
        memory.move_to_huge_pages([(p, "w") for p in packed])
    ws = [(p.w, n, k, g) for p, (n, k, g) in zip(packed, shapes, strict=True)]
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {s[1] for s in shapes}}

        def run(mod, xs=xs):
            tiles = mod.amx_linear_supported(64)  # else the AVX512-BF16 kernel, over the same packing
            plain, fused = (mod.amx_linear, mod.amx_linear_silu_mul) if tiles else (mod.avx512_linear, mod.avx512_linear_silu_mul)
            return lambda: [fused(xs[k], w, n) if g else plain(xs[k], w, n, None) for w, n, k, g in ws]

        fa, fb = run(base), run(new)
        if not all(torch.equal(a, b) for a, b in zip(fa(), fb(), strict=True)):
            raise SystemExit(f"linear outputs differ at {m} rows")
        out[f"linear rows={m}"] = alternate(fa, fb, repeats)
    return out


def attention(base, new, model: str, batch: int, context: int, repeats: int, allow_diff: bool = False,
              dtype: torch.dtype = torch.bfloat16) -> dict:
    _h, _i, layers, _v, hq, hkv, d = MODELS[model]
    caches, tables, lens, q = decode_step(model, batch, context, dtype=dtype)
    outs = [torch.empty_like(q), torch.empty_like(q)]

    def run(mod, o):
        return lambda: [mod.paged_decode_attention(o, q, kc, vc, tables, lens, d ** -0.5, 0) for kc, vc in caches]

    fa, fb = run(base, outs[0]), run(new, outs[1])
    fa(), fb()
    diff = (outs[0].float() - outs[1].float()).abs().max().item()
    if diff and not allow_diff:
        raise SystemExit(f"decode attention outputs differ (max |diff| {diff:.3g}; --allow-diff to time anyway)")
    kv_bytes = layers * batch * context * hkv * d * 2 * q.element_size()
    # a decode step streams the weights between layers' attention: caches that would fit the last-level
    # cache are evicted before each call by a read of 256 MB, as the weights would
    evict = torch.ones(64 << 20).sum if kv_bytes < 128 << 20 else None
    row = alternate(fa, fb, repeats, evict)
    row["max_abs_diff"] = diff
    row.update(new_gb_s=round(kv_bytes / row["new_ms"] / 1e6, 2), base_gb_s=round(kv_bytes / row["base_ms"] / 1e6, 2))
    return {f"decode attention batch={batch} context={context}": row}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="checkout whose kernels are the baseline")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1], help="default: this checkout")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--rows", default="16,32,64", help="decode rows for the linear layers ('' to skip)")
    p.add_argument("--attention", default="64x192", help="BATCHxCONTEXT for decode attention ('' to skip)")
    p.add_argument("--allow-diff", action="store_true",
                   help="time attention builds whose outputs differ (a deliberate numerics change)")
    p.add_argument("--engine", type=Path, default=None, metavar="MODEL_DIR",
                   help="also time W2 (and W1 with --w1) on this model with each build's kernels")
    p.add_argument("--w1", action="store_true")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="of the attention's cache, and of the --engine model")
    p.add_argument("--variant", default=None,
                   help="kernel build to load (avx2, portable, ...; default: this CPU's best), as SERVELM_CPU_KERNELS")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=12)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base, new = (cpu_kernels.build(c / "servelm" / "model" / "kernels" / "csrc", a.variant) for c in (a.base, a.new))
    if a.rows and not base.avx512_linear_supported(64):
        raise SystemExit("the linear layers need a build with AVX512-BF16 (--rows '' times attention alone)")
    res = {"model": a.model, "threads": a.threads, "variant": base.variant, "dtype": a.dtype}
    if a.rows:
        res.update(linears(base, new, a.model, [int(r) for r in a.rows.split(",")], a.repeats))
    if a.attention:
        batch, context = map(int, a.attention.split("x"))
        res.update(attention(base, new, a.model, batch, context, a.repeats, a.allow_diff, getattr(torch, a.dtype)))
    if a.engine:
        res["engine"] = engine(base, new, a.engine, a.threads, max(3, a.repeats // 2), a.w1, a.dtype)
    print(json.dumps(res, indent=1))


def engine(base, new, model_dir: Path, threads: int, repeats: int, w1: bool, dtype: str = "bfloat16") -> dict:
    """One engine whose attention kernels and fused-kernel module (the C++ decode layer loop and the
    elementwise kernels, bf16 only) are switched between the builds; the linear layers keep this process's
    build (SERVELM_CPU_KERNELS chooses it)."""
    from ab_repeats import alternate

    from servelm import LLM

    llm = LLM(str(model_dir), dtype=dtype, num_threads=threads, enable_prefix_caching=False)
    model = llm.engine.core.model
    if not hasattr(model.attn, "kernels"):
        raise SystemExit("the model's attention does not run on the C++ kernels here")

    def select(side: str):
        module = new if side == "new" else base
        model.attn.kernels = module
        if model.fused is not None:
            model.fused = module
        return llm

    return {"model": str(model_dir), **alternate(select, ("new", "base"), model.spec.vocab_size, repeats, w1)}


if __name__ == "__main__":
    main()
