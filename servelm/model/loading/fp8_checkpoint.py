"""FP8 checkpoints in Hugging Face's formats: float8_e4m3fn weights with float32 scales beside them.

`config.json`'s `quantization_config` says which (`fp8_checkpoint`):

- `quant_method: "fp8"` (vLLM's and transformers' fp8), `"fbgemm_fp8"`, or `"compressed-tensors"` with 8-bit
  float weights: a `<linear>.weight_scale` beside each `<linear>.weight`, one scale for the tensor ([] or [1])
  or one per output row ([N] or [N, 1]); w = code * scale.
- `quant_method: "fp8"` with `weight_block_size: [bn, bk]` (DeepSeek-V3, Qwen3-FP8): a `<linear>.weight_scale_inv`
  of [ceil(N / bn), ceil(K / bk)], one scale per block; despite the name w = code * scale_inv.

Static activation scales (`input_scale`) are dropped: servelm scales activations per token at run time. FP8
KV-cache scales (`self_attn.k_scale`, `v_scale`, `kv_scale`) pass through to the model, whose fp8 KV cache uses
them (--kv-cache-dtype fp8; model/attention/kv_quant.py) and whose cache in the model's dtype ignores them.

The attention/MLP linears stay fp8 with quantization fp8 (`Fp8Weight`, block scales spread to each row so that
fused Q/K/V and gate/up stack by rows); every other fp8 weight, and every one with another quantization, is
dequantized to the model's dtype (quantization int8/int4 requantizes that)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from servelm.model.quant.fp8 import FP8, Fp8Weight

logger = logging.getLogger(__name__)

_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
_SCALES = (".weight_scale", ".weight_scale_inv")
_DROPPED = (".input_scale", ".input_scale_ub")


@dataclass(frozen=True)
class Fp8Checkpoint:
    method: str  # quant_method
    block: tuple[int, int] | None  # weight_block_size (rows, inputs), for weight_scale_inv


def _as_dict(qc) -> dict:
    if isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def _compressed_fp8(qc: dict) -> bool:
    """Whether a compressed-tensors config quantizes its weights to 8-bit floats (its other schemes are not fp8)."""
    groups = (qc.get("config_groups") or {}).values()
    weights = [g.get("weights") or {} for g in groups if isinstance(g, dict)]
    return bool(weights) and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)


def fp8_checkpoint(hf_config) -> Fp8Checkpoint | None:
    """The fp8 format the config's `quantization_config` declares, None for an unquantized checkpoint or another
    method; ValueError for an fp8 config servelm cannot read (e5m2 weights, a malformed block size)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = _as_dict(qc)
    method = qc.get("quant_method")
    if method not in _METHODS or (method == "compressed-tensors" and not _compressed_fp8(qc)):
        return None
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint in format {qc['fmt']!r}: only e4m3 (float8_e4m3fn) weights are supported")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                          for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        block = (block[0], block[1])
    return Fp8Checkpoint(method, block)


def kept_as_stored(name: str, t: torch.Tensor) -> bool:
    """Tensors an fp8 checkpoint's reader takes in their stored dtype: fp8 codes and their float32 scales (a
    scale rounded to bfloat16 would change every weight it scales)."""
    return t.dtype in (FP8, torch.float8_e5m2) or name.endswith(_SCALES)


def _row_scales(name: str, codes: torch.Tensor, scale: torch.Tensor, scale_name: str,
                block: tuple[int, int] | None) -> tuple[torch.Tensor, int, str]:
    """(scales [N, G] float32, group_size, source) for an [N, K] weight from its checkpoint scale tensor."""
    n, k = codes.shape
    s = scale.float()
    if scale_name.endswith("_scale_inv"):
        if block is None:
            raise ValueError(f"{scale_name}: a block scale, but quantization_config has no weight_block_size")
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"{scale_name}: shape {list(s.shape)}, expected {list(want)} for a [{n}, {k}] weight "
                             f"in blocks of {bn}x{bk}")
        return s.repeat_interleave(bn, dim=0)[:n].contiguous(), bk, f"fp8/block{bn}x{bk}"
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1).contiguous(), k, "fp8/tensor"
    if s.numel() == n and s.dim() <= 2 and s.shape[0] == n:
        return s.reshape(n, 1).contiguous(), k, "fp8/channel"
    raise ValueError(f"{scale_name}: shape {list(s.shape)} is neither one scale nor one per output row of "
                     f"{name} [{n}, {k}]")


def read_fp8_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], fmt: Fp8Checkpoint, dtype: torch.dtype,
                        keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """The checkpoint's tensors with each fp8 weight joined to its scale: an `Fp8Weight` where `keep(name)`,
    else dequantized to `dtype`. A weight waits for its scale (and a scale for its weight) however the files
    order them; either left alone at the end is an error."""
    codes: dict[str, tuple[str, torch.Tensor]] = {}
    scales: dict[str, tuple[str, torch.Tensor]] = {}
    dropped = 0

    def joined(base: str) -> tuple[str, torch.Tensor | Fp8Weight]:
        name, c = codes.pop(base)
        scale_name, s = scales.pop(base)
        row_scales, group, source = _row_scales(name, c, s, scale_name, fmt.block)
        w = Fp8Weight(c, row_scales, group, dtype, source)
        return name, (w if keep(name) else w.dequantize(dtype))

    for name, t in tensors:
        if name.endswith(_DROPPED):
            dropped += 1
            continue
        if name.endswith(_SCALES):
            base = name.rsplit(".", 1)[0]
            if base in scales:
                raise ValueError(f"{base} has two scales: {scales[base][0]} and {name}")
            scales[base] = (name, t)
        elif t.dtype == torch.float8_e5m2:
            raise ValueError(f"{name} is float8_e5m2: only e4m3 (float8_e4m3fn) weights are supported")
        elif t.dtype == FP8:
            if not name.endswith(".weight") or t.dim() != 2:
                raise ValueError(f"{name}: an fp8 tensor that is no 2-D linear weight ({list(t.shape)})")
            base = name.removesuffix(".weight")
            codes[base] = (name, t)
        else:
            yield name, t
            continue
        if base in codes and base in scales:
            yield joined(base)
    if codes or scales:
        lone = [n for n, _ in codes.values()] + [n for n, _ in scales.values()]
        raise ValueError(f"fp8 checkpoint: {len(lone)} weights or scales without their pair, e.g. {lone[:3]}")
    if dropped:
        logger.info("fp8 checkpoint: %d static activation scales ignored (activations are scaled per token at "
                    "run time)", dropped)
