"""Attention backends behind one interface; `get_backend` picks the best one for a device."""

from __future__ import annotations

import functools

from servelm.model.attention.base import AttentionBackend, AttentionMetadata, PrefillSpan
from servelm.model.attention.torch_paged import CpuPagedAttention, TorchPagedAttention


def get_backend(device: str):
    """A factory `(num_heads, num_kv_heads, head_dim, scale) -> AttentionBackend` for the device."""
    if device.startswith("cuda"):
        from servelm.model.attention.triton_paged import HAS_TRITON, TritonPagedAttention

        if HAS_TRITON:
            return TritonPagedAttention
    if device == "cpu":
        from servelm.model.kernels import cpu as cpu_kernels

        kernels = cpu_kernels.load()
        if kernels is not None:
            return functools.partial(CpuPagedAttention, kernels=kernels)
    return TorchPagedAttention


__all__ = ["AttentionBackend", "AttentionMetadata", "CpuPagedAttention", "PrefillSpan", "TorchPagedAttention",
           "get_backend"]
