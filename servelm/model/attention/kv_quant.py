"""The KV cache's element type, and the one definition of how keys and values are quantized into an fp8 cache and
read back (`--kv-cache-dtype`).

An fp8 cache holds float8_e4m3fn with one scale per layer for the keys and one for the values, as vLLM's default:
1.0 unless the checkpoint gives `self_attn.k_scale` / `self_attn.v_scale`. A value x is stored as
fp8(clamp(x / scale, -448, 448)) (saturating: e4m3fn has no infinity, and an out-of-range cast is not
saturating on every device) and read as fp8.to(float32) * scale, rounded to the compute dtype. Every writer (the
backends' `write_kv`, a fused kernel) calls `quantize`, and every reader dequantizes the same way: `dequantize`
in PyTorch, the same two operations on registers in the Triton kernels.
"""

from __future__ import annotations

import torch

from servelm.model.quant.fp8 import FP8, FP8_MAX  # the one definition of the fp8 format

# the names --kv-cache-dtype takes (config.engine.KVCacheDtype) and the element type each stores
_NAMED = {"fp8": FP8, "fp8_e4m3": FP8}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a --kv-cache-dtype value: auto is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in _NAMED:
        raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {name!r}")
    return _NAMED[name]


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


class KVCache(tuple):
    """One layer's (key cache, value cache), unpacked as a plain pair everywhere, carrying the layer's scales
    so that what reads or writes the cache needs no other argument. A plain tuple of tensors reads as scales
    of 1.0 (`scales`)."""

    k_scale: float
    v_scale: float

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> KVCache:
        self = super().__new__(cls, (k, v))
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        return self

    def __getnewargs__(self) -> tuple:  # copies and pickles rebuild it from all four, not from the pair alone
        return (self[0], self[1], self.k_scale, self.v_scale)


def scales(kv_cache) -> tuple[float, float]:
    """(k_scale, v_scale) of a layer's cache."""
    return getattr(kv_cache, "k_scale", 1.0), getattr(kv_cache, "v_scale", 1.0)


def quantize(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as fp8 cache entries: divided by the scale in float32, saturated to the finite range, then rounded."""
    y = x.float()  # (x itself when it is float32: never changed in place)
    if scale != 1.0:
        y = y / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 cache entries as `dtype` values (the inverse of `quantize` up to its rounding)."""
    y = x.to(torch.float32)
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """New keys or values in the cache's element type: quantized for an fp8 cache, else as they are."""
    return quantize(x, scale) if is_fp8(cache) and not is_fp8(x) else x


def raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes for an fp8 tensor (one byte an element, the shape kept), else `t`: copies,
    gathers and scatters of cache blocks go through it because PyTorch implements few ops for float8 (the
    CPU's index_copy_, for one)."""
    return t.view(torch.uint8) if is_fp8(t) else t
