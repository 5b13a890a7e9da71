"""Random weights in the formats tests feed servelm: GGUF blocks of each quantized type, and PEFT LoRA adapters
for a tiny model (with the merged model, the oracle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from servelm.model.quant.gguf import GGUFBlocks


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 3) -> GGUFBlocks:
    """Random blocks: gguf's quantizer over random weights, or (the K types, which it cannot quantize) random
    bytes with sane float16 d (and dmin)."""
    import gguf

    rng = np.random.default_rng(seed)
    if qtype in ("Q4_K", "Q5_K"):  # codes and 6-bit sub-scales and mins random, d and dmin sane
        raw = rng.integers(0, 256, (rows * cols // 256, 144 if qtype == "Q4_K" else 176), dtype=np.uint8)
        raw[:, 0:4] = rng.uniform(0.01, 0.1, (len(raw), 2)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(rows, -1)
    elif qtype == "Q6_K":  # codes and int8 sub-scales random, d sane
        raw = rng.integers(0, 256, (rows * cols // 256, 210), dtype=np.uint8)
        raw[:, 208:210] = rng.uniform(0.001, 0.01, (len(raw), 1)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                   gguf.GGMLQuantizationType[qtype])
    return GGUFBlocks(qtype, torch.from_numpy(np.ascontiguousarray(raw)), cols, torch.bfloat16)


def make_adapter(base_dir: Path, out: Path, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int):
    """A random PEFT adapter for the model in base_dir, saved to out; returns the merged float32 model (the
    oracle). PEFT starts lora_B at zero, which would make the adapter a no-op: both matrices are drawn."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                                                      target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora_A" in name else 0.05))
    model.save_pretrained(out)
    return model.merge_and_unload().eval()
