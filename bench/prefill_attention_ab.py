"""Two builds of servelm's prefill attention kernel side by side in one process, on a model's shapes
(SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64): one 2,048-query chunk at the start of a prompt
(context 2k) and the chunks of an 8k prompt prefilled 2,048 at a time (contexts 2k, 4k, 6k, 8k), over a
paged bf16 cache with its blocks scattered. The builds alternate each repeat; prints one JSON object with
medians, causal GFLOP/s (4 x H x D x the number of query-key pairs) and the new/base speed-up, and the
largest difference between the builds' outputs.

  git worktree add /tmp/base main
  python bench/prefill_attention_ab.py --base /tmp/base            # this checkout's kernels as "new"
  python bench/prefill_attention_ab.py --base-lib old/libservelm_amx.so --new-lib new/libservelm_amx.so

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.kernels.ops import CpuKernels

MODELS = {"smollm2": (9, 3, 64), "60m": (8, 4, 64)}  # query heads, kv heads, head dim


def load(checkout: Path | None, lib: Path | None) -> CpuKernels:
    if lib is not None:
        return CpuKernels(lib, lib.stem.removeprefix("libservelm_"))
    return cpu_kernels.build(checkout / "servelm" / "model" / "csrc")


def chunks(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(queries, context) of each prefill chunk of a prompt."""
    return [(min(chunk, prompt - s), min(prompt, s + chunk)) for s in range(0, prompt, chunk)]


def causal_flop(h: int, d: int, parts: list[tuple[int, int]]) -> float:
    pairs = sum(q * (ctx - q) + q * (q + 1) / 2 for q, ctx in parts)
    return 4.0 * h * d * pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=None, help="checkout whose kernels are the baseline")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1], help="default: this checkout")
    p.add_argument("--base-lib", type=Path, default=None, help="a built library as the baseline instead")
    p.add_argument("--new-lib", type=Path, default=None, help="a built library as the new side instead")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--prompts", default="2048,8192", help="prompt lengths")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (the engine's step budget)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--cpu-time", action="store_true",
                   help="time the process's CPU seconds, not wall time (steadier on a busy machine; with --threads 1)")
    a = p.parse_args()
    if a.base is None and a.base_lib is None:
        raise SystemExit("--base or --base-lib")
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.cpu_time else time.perf_counter
    base, new = load(a.base, a.base_lib), load(a.new, a.new_lib)
    h, kv, d = MODELS[a.model]
    res: dict = {"model": a.model, "threads": a.threads, "clock": "cpu" if a.cpu_time else "wall", "base": str(base.path), "new": str(new.path)}
    torch.manual_seed(0)
    for prompt in map(int, a.prompts.split(",")):
        bs = a.block_size
        nb = -(-prompt // bs)
        kc, vc = torch.randn(nb + 4, bs, kv, d).bfloat16(), torch.randn(nb + 4, bs, kv, d).bfloat16()
        table = torch.randperm(nb + 4)[:nb]
        qkv = torch.randn(prompt, (h + 2 * kv) * d).bfloat16()  # queries as views into a fused projection
        q = qkv[:, : h * d].view(prompt, h, d)
        parts = chunks(prompt, a.chunk)
        outs = {"base": torch.empty(prompt, h, d, dtype=torch.bfloat16), "new": torch.empty(prompt, h, d,
                                                                                           dtype=torch.bfloat16)}

        def run(mod, out, parts=parts, q=q, kc=kc, vc=vc, table=table):
            def call():
                for n, ctx in parts:
                    mod.paged_prefill_attention(out[ctx - n:ctx], q[ctx - n:ctx], kc, vc, table, ctx, d ** -0.5,
                                                a.window)
            return call

        fa, fb = run(base, outs["base"]), run(new, outs["new"])
        fa(), fb()
        diff = (outs["base"].float() - outs["new"].float()).abs().max().item()
        ta, tb = [], []
        for r in range(a.repeats):
            for f, t in ((fa, ta), (fb, tb)) if r % 2 == 0 else ((fb, tb), (fa, ta)):
                start = clock()
                f()
                t.append(clock() - start)
        sa, sb = statistics.median(ta), statistics.median(tb)
        flop = causal_flop(h, d, parts)
        res[f"prompt={prompt} chunk={a.chunk}"] = {
            "base_ms": round(sa * 1e3, 1), "new_ms": round(sb * 1e3, 1), "new_speedup": round(sa / sb, 3),
            "base_gflop_s": round(flop / sa / 1e9, 1), "new_gflop_s": round(flop / sb / 1e9, 1),
            "base_min_ms": round(min(ta) * 1e3, 1), "new_min_ms": round(min(tb) * 1e3, 1), "max_abs_diff": diff}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
