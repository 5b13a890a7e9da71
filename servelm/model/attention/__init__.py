"""Attention backends behind one interface; `get_backend` picks one for a device."""

from servelm.model.attention.base import AttentionBackend, AttentionMetadata, PrefillSpan
from servelm.model.attention.torch_paged import TorchPagedAttention


def get_backend(device: str) -> type[AttentionBackend]:
    """The attention backend class for a device. Only the PyTorch one exists so far."""
    return TorchPagedAttention


__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "TorchPagedAttention", "get_backend"]
