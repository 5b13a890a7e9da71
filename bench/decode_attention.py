"""Decode attention at W1's batch-64 step: servelm's paged kernel beside the PyTorch path (gather the
blocks, then SDPA) and beside a plain read of the same bytes (what memory bandwidth allows), over a
whole model's worth of distinct layer caches so nothing stays cached between layer calls. Systems
alternate each repeat; medians are kept. Prints one JSON object with ratios.

  python bench/decode_attention.py --model smollm2 --batch 64 --context 192 --threads 1

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from servelm.model.attention import AttentionMetadata, TorchPagedAttention
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.memory import lazy_zeros

MODELS = {"60m": (8, 8, 4, 64), "smollm2": (30, 9, 3, 64)}  # layers, q heads, kv heads, head dim


def decode_step(model: str, batch: int, context: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16):
    """Random inputs (bf16, or `dtype`) of one decode step: per layer (k_cache, v_cache) with each sequence's blocks
    scattered, then block tables, context lengths and queries."""
    layers, hq, hkv, d = MODELS[model]
    per_seq = -(-context // block_size)
    g = torch.Generator().manual_seed(0)
    shape = (batch * per_seq, block_size, hkv, d)

    def cache() -> torch.Tensor:  # in huge pages, as the engine's KV pool
        return lazy_zeros(shape, dtype).copy_(torch.randn(shape, generator=g))

    caches = [(cache(), cache()) for _ in range(layers)]
    tables = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    return caches, tables, lens, torch.randn(batch, hq, d, generator=g).to(dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=192, help="tokens of context per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("needs servelm's C++ kernels")
    layers, hq, hkv, d = MODELS[args.model]
    b, ctx, bs = args.batch, args.context, args.block_size
    caches, tables, lens, q = decode_step(args.model, b, ctx, bs)
    out = torch.empty_like(q)
    scale = d ** -0.5
    kv_bytes = layers * b * ctx * hkv * d * 2 * 2
    flat = lazy_zeros((kv_bytes // 4,), torch.float32).fill_(1)  # the same bytes, for a plain streaming read
    torch_path = TorchPagedAttention(hq, hkv, d, scale)
    meta = AttentionMetadata(torch.zeros(b, dtype=torch.long), torch.arange(b), tables, lens, [], bs)

    def servelm() -> None:
        for kc, vc in caches:
            kernels.paged_decode_attention(out, q, kc, vc, tables, lens, scale, 0)

    def pytorch() -> None:
        for kc, vc in caches:  # forward also writes this step's k/v: give it a throwaway slot 0 each time
            torch_path.forward(q, q[:, :hkv], q[:, :hkv], (kc, vc), meta, None)

    systems = {"servelm_kernel": servelm, "pytorch_gather_sdpa": pytorch, "read_same_bytes": flat.sum}
    times: dict[str, list[float]] = {n: [] for n in systems}
    for f in systems.values():
        f()
    for r in range(args.repeats):
        for name, f in (systems.items() if r % 2 == 0 else reversed(list(systems.items()))):
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    print(json.dumps({
        "model": args.model, "batch": b, "context": ctx, "threads": args.threads, "kv_mb": round(kv_bytes / 1e6, 1),
        "median_ms": {n: round(v, 2) for n, v in med.items()},
        "kernel_gb_s": round(kv_bytes / med["servelm_kernel"] / 1e6, 2),
        "read_gb_s": round(kv_bytes / med["read_same_bytes"] / 1e6, 2),
        "kernel_vs_pytorch": round(med["pytorch_gather_sdpa"] / med["servelm_kernel"], 2),
        "kernel_fraction_of_read": round(med["read_same_bytes"] / med["servelm_kernel"], 2),
    }, indent=1))


if __name__ == "__main__":
    main()
