"""Native GGUF loading with the `gguf` package: metadata, dequantized (or kept quantized) tensors, HF-style
names."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from servelm.model.loading.gguf_header import (  # noqa: F401 (re-exported)
    GGUFHeader,
    read_gguf_file_header,
    read_gguf_header,
)
from servelm.model.quant.gguf import FORMATS, GGUFBlocks, kept_at_load
from servelm.model.quant.weight_only import is_linear_weight
from servelm.progress import progress

logger = logging.getLogger(__name__)

# GGUF tensor name (per block) -> Hugging Face name suffix.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma: ffn_norm is the norm in front of the MLP, and two more norms follow the sublayers.
_SANDWICH_NAMES = {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3: Q/K/V in one tensor, and ffn_up holds gate and up (gate first), as the Hugging Face checkpoint does.
_PHI3_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Mixture of experts (servelm/model/families/moe.py): the router, every expert's projection stacked in one 3-D tensor
# (named without a .weight suffix, as transformers 5 names its stacked experts), Qwen2-MoE's shared expert.
_EXPERT_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                 "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                 "ffn_gate_up_exps": "mlp.experts.gate_up_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                 "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                 "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# OLMo 2/3, EXAONE 4: no norm before the sublayers, one after each (llama.cpp names them as Gemma's).
_POST_NORM_NAMES = {k: v for k, v in _SANDWICH_NAMES.items() if k not in ("attn_norm", "ffn_norm")}
# Seed-OSS: llama.cpp names the norm in front of the MLP post_attention_norm.
_SEED_OSS_NAMES = {**{k: v for k, v in _BLOCK_NAMES.items() if k != "ffn_norm"},
                   "post_attention_norm": "post_attention_layernorm"}
# GLM-4: sandwich norms under its own Hugging Face names, and ffn_up holding gate and up (gate first), as Phi-3's.
_GLM4_NAMES = {**_BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj", "ffn_norm": "post_attention_layernorm",
               "post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm"}
# Cohere: one norm per layer, the attention's and the MLP's input at once.
_COHERE_NAMES = {k: v for k, v in _BLOCK_NAMES.items() if k != "ffn_norm"}
_ARCH_NAMES = {"gemma3": _SANDWICH_NAMES, "phi3": _PHI3_NAMES, "olmo2": _POST_NORM_NAMES, "exaone4": _POST_NORM_NAMES,
               "seed_oss": _SEED_OSS_NAMES, "glm4": _GLM4_NAMES, "command-r": _COHERE_NAMES, "cohere2": _COHERE_NAMES}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that go into the config rather than the weights (llama.cpp's Llama-3 RoPE frequency factors, Phi-3's
# LongRoPE factors).
_CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
# llama.cpp's converter permutes Q/K rows for rotary only for these architectures (its Llama converter's, which
# Granite's and SmolLM3's inherit).
_PERMUTED_ARCHS = {"llama", "mistral", "granite", "smollm3"}


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_NAMES.get(arch, _BLOCK_NAMES)
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    name = names.get(m.group(2)) or _EXPERT_NAMES.get(m.group(2))
    if name is None:
        return None
    if m.group(2).endswith("_exps"):  # stacked experts: no suffix
        return f"model.layers.{m.group(1)}.{name}" if m.group(3) == "weight" else None
    return f"model.layers.{m.group(1)}.{name}.{m.group(3)}"


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving (its converter pairs rotary halves for ggml's rope)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Block formats whose gguf.quants class decodes any number of blocks in one call (no lookup grids).
_WHOLE_TENSOR_QUANTS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})


def dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """gguf.quants' block formulas applied to a whole tensor at once. gguf.quants.dequantize walks it in
    small row groups (thousands of numpy splits per tensor: ~2 s of SmolLM2's Q4_1 load); same values."""
    import gguf

    if qtype.name not in _WHOLE_TENSOR_QUANTS:
        return gguf.quants.dequantize(raw, qtype)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = getattr(gguf.quants, qtype.name).dequantize_blocks(raw.reshape(-1, block_bytes))
    return blocks.reshape(*raw.shape[:-1], -1)


# Block formats kept quantized (quantization=gguf) as GGUFBlocks (model/quant/gguf.py, servelm's kernels):
# Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K. The Q4 ones are also exactly PyTorch's int4 groups of 32
# (KEPT_INT4, int4_blocks), the path where servelm's kernels do not run. The rest (float types, IQ and Q2/Q3
# types) are dequantized, as every type is with quantization=none.
KEPT_INT4 = frozenset({"Q4_0", "Q4_1", "Q4_K"})
KEPT = frozenset(FORMATS)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (a block's float16 field)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def int4_blocks(raw: np.ndarray, qname: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor's rows [rows, row bytes] as int4 codes [rows, K] (uint8, 0..15) and float32
    scales and zero points [rows, K / 32], such that (code - 8) * scale + zero is gguf's dequantized value:
    Q4_0 d * (q - 8): scale d, zero 0. Q4_1 d * q + m: scale d, zero m + 8d. Q4_K, per 32-weight sub-block,
    (d * sc) * q - dmin * mn: scale d * sc, zero 8 * scale - dmin * mn. The float16 fields times 4- and 6-bit
    integers are exact in float32; the zero point's sum rounds only where its terms' exponents are more
    than 13 apart (then one float32 ulp)."""
    rows = raw.shape[0]
    if qname == "Q4_K":
        import gguf

        blocks = raw.reshape(-1, 144)  # d, dmin (float16), 12 bytes of 6-bit sub-scales/mins, 128 bytes of codes
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale = _f16(blocks[:, 0:2])[:, None] * sc.astype(np.float32)
        zero = 8 * scale - _f16(blocks[:, 2:4])[:, None] * mn.astype(np.float32)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = qs & np.uint8(0x0F)  # 32 bytes hold two sub-blocks: low nibbles first, then high
    else:
        size = 18 if qname == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        scale = _f16(blocks[:, 0:2])
        zero = np.zeros_like(scale) if qname == "Q4_0" else _f16(blocks[:, 2:4]) + 8 * scale
        qs = blocks[:, size - 16:]
        codes = np.concatenate([qs & np.uint8(0x0F), qs >> 4], axis=-1)  # elements 0-15 low, 16-31 high
    return codes.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def iter_gguf_tensors(path: Path, dtype: torch.dtype, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yield (hf_name, tensor) for every tensor of a GGUF file, dequantized to `dtype`; with
    `keep_quantized`, linear weights of a KEPT type (Q8_0, Q4_*, Q5_*, Q6_K) come as GGUFBlocks (the file's
    blocks, rows in the model's order)."""
    import gguf

    kept, dense = Counter(), Counter()
    head = read_gguf_file_header(path)  # a split model's files read as one
    files = [p for p, _ in head.shards] or [path]
    with contextlib.ExitStack() as maps:
        bufs = {}
        for file in files:
            f = maps.enter_context(open(file, "rb"))
            bufs[file] = maps.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        arch = head.fields.get("general.architecture")
        n_head = head.fields.get(f"{arch}.attention.head_count")
        n_kv = head.fields.get(f"{arch}.attention.head_count_kv") or n_head
        for i, (gname, shape, ttype, _) in enumerate(progress(head.tensors, desc=f"Loading {path.name}",
                                                              unit="tensor", leave=False)):
            file, offset = head.locate(i, path)
            buf = bufs[file]
            name = hf_name(gname, arch)
            if name is None:
                if gname in _CONFIG_TENSORS:
                    continue
                raise ValueError(f"{path.name}: tensor {gname} is not part of a supported model")
            qtype = gguf.GGMLQuantizationType(ttype)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            rows, row_bytes = math.prod(shape[1:]), shape[0] // block * block_bytes
            raw = np.frombuffer(buf, np.uint8, rows * row_bytes, offset).reshape(rows, row_bytes)
            permuted = arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight"))
            heads = n_head if "q_proj" in name else n_kv
            if (keep_quantized and qtype.name in KEPT and is_linear_weight(name) and len(shape) == 2
                    and kept_at_load(qtype.name, shape[0], dtype)):
                rows_raw = unpermute_rotary(raw, heads) if permuted else raw  # a row's blocks move with it
                kept[qtype.name] += 1
                yield name, GGUFBlocks(qtype.name, torch.from_numpy(np.array(rows_raw)), shape[0], dtype)
                del raw, rows_raw
                continue
            if keep_quantized and is_linear_weight(name):
                dense[qtype.name] += 1
            arr = dequantize(raw, qtype).reshape(tuple(reversed(shape)))
            if permuted:
                arr = unpermute_rotary(arr, heads)
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype)
            del raw, arr  # no view may outlive the mapping
    if keep_quantized:
        logger.info("%s: linear weights kept quantized: %s; dequantized to %s (no kernel for their type here): %s",
                    path.name, dict(kept) or "none", dtype, dict(dense) or "none")
