"""Kernel launches per decoder layer in one captured decode step on CUDA, with RoPE fused into the KV-cache
write (model/kernels/triton_rope.py) and without it, and each graph's replay time. Prints one JSON object.

  python bench/kernel_count.py [--batch 8] [--heads 16] [--kv-heads 4] [--head-dim 64]

A random-weight bf16 Llama of 2 and of 4 layers is captured as the engine captures decode graphs
(engine/cuda_graphs.py); the profiler counts the kernels one replay runs, and the per-layer figure is the
difference between the two depths over 2 (what is outside the layers cancels). A benchmark, not a test: it
needs a GPU and exits with a message elsewhere.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def _graphs(layers: int, args, fused_rope: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from servelm.engine.cuda_graphs import DecodeGraphs
    from servelm.model.attention.triton_paged import TritonPagedAttention
    from servelm.model.decoder import DecoderLM
    from servelm.model.layers import blocks
    from servelm.model.spec import ModelSpec

    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.heads * args.head_dim, num_hidden_layers=layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      intermediate_size=4 * args.heads * args.head_dim, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        weights = dict(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).state_dict())
    model = DecoderLM(ModelSpec.from_hf_config(cfg), weights, torch.bfloat16, TritonPagedAttention)
    blocks_n, block_size, max_blocks = 64, 16, 16
    shape = (blocks_n + 1, block_size, args.kv_heads, args.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
               torch.zeros(shape, dtype=torch.bfloat16, device="cuda")) for _ in range(layers)]
    real = blocks._gpu_rope
    blocks._gpu_rope = real if fused_rope else (lambda x: None)
    try:
        graphs = DecodeGraphs(model, caches, block_size, max_blocks, blocks_n, [args.batch], capture=True)
    finally:
        blocks._gpu_rope = real
    n = args.batch  # each sequence 100 tokens in, its tables in blocks of its own
    rows = np.arange(n)
    graphs.run(rows, np.full(n, 100), rows * 4 * block_size + 100 % block_size, rows[:, None] * 4 + np.arange(4),
               np.full(n, 101))
    return graphs.graphs[args.batch][0]


def _kernels(graph) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _replay_us(graph, reps: int = 200) -> float:
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / reps, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernel_count.py counts kernels in captured CUDA graphs: no CUDA device here")
    out = {"device": torch.cuda.get_device_name(), "batch": args.batch}
    for name, fused in (("fused_rope", True), ("unfused", False)):
        g2, g4 = _graphs(2, args, fused), _graphs(4, args, fused)
        k2, k4 = _kernels(g2), _kernels(g4)
        out[name] = {"kernels_2_layers": k2, "kernels_4_layers": k4, "per_layer": (k4 - k2) / 2,
                     "replay_us_4_layers": _replay_us(g4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
