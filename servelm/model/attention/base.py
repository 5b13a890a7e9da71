"""The attention backend interface: paged attention over a flattened, unpadded token batch."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from servelm.model.attention.kv_quant import as_stored, raw, scales


@dataclass
class PrefillSpan:
    """One sequence computing several tokens this step (a prompt chunk, possibly after a cached prefix)."""

    start: int  # offset of its first query token in the flattened batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in its KV cache once this step's tokens are written
    block_table: torch.Tensor  # [num_blocks] int64, enough blocks for ctx_len


@dataclass
class BackendMetadata:
    """What one backend derives from a step's metadata once and reads in every layer: a dataclass of tensors of
    its own (the Triton backend's per-row arrays, say), built by `AttentionBackend.derive`."""

    def to(self, device: torch.device | str) -> BackendMetadata:
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device, non_blocking=True)
                                            for f in dataclasses.fields(self)})


@dataclass
class AttentionMetadata:
    """Where each token of the batch reads and writes the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per new token
    decode_idx: torch.Tensor  # [Bd] int64: batch positions of single-token (decode) sequences
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int64, padded with block 0
    decode_seq_lens: torch.Tensor  # [Bd] int64: context length including the new token
    prefills: list[PrefillSpan]
    block_size: int
    # what the backend derives from the above once per step and reuses in every layer (None: nothing)
    derived: BackendMetadata | None = field(default=None, repr=False)
    # the longest row's query count where `prefills` cannot say it: a captured mixed step's token count (its
    # rows live on the device only); 0: from `prefills`
    max_query_len: int = 0

    @property
    def num_decodes(self) -> int:
        return int(self.decode_idx.numel())

    def to(self, device: torch.device) -> AttentionMetadata:
        """A copy on `device` (the same object where it is already there)."""
        if self.slot_mapping.device == torch.device(device):
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(move(self.slot_mapping), move(self.decode_idx), move(self.decode_block_tables),
                                 move(self.decode_seq_lens), self.prefills, self.block_size,
                                 None if self.derived is None else self.derived.to(device), self.max_query_len)


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the new keys/values into the paged cache.

    KV cache layout, per layer: key and value tensors of shape [num_blocks, block_size, kv_heads, head_dim], in
    the model's dtype or fp8 with the layer's scales (attention/kv_quant.py: `KVCache`).
    """

    # What the decoder may hand a backend beyond `forward(q, k, v, ...)` with q and v contiguous: `strided_qkv`,
    # views of the fused QKV projection read through their strides (no copies); `attends_written_cache`,
    # `attend` over a cache the caller already wrote the step's keys and values into (RoPE fused with the write)
    strided_qkv: ClassVar[bool] = False
    attends_written_cache: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def derive(self, meta: AttentionMetadata) -> BackendMetadata | None:
        """What this backend computes from a step's host-side metadata once for all layers (into
        `meta.derived`, moved to the device with the rest); nothing by default."""
        return None

    def derive_decode(self, meta: AttentionMetadata) -> BackendMetadata | None:
        """`derive` for a pure-decode step whose metadata is already on the device, with device ops only (no
        host reads: it runs inside a CUDA graph's capture, once per replay); nothing by default."""
        return None

    # Mixed steps in CUDA graphs (engine/mixed_graphs.py) need a backend that attends from per-row arrays on the
    # device alone, with a grid fixed by the graph's size: one that sets `mixed_graphs` and implements these.
    mixed_graphs: ClassVar[bool] = False

    def mixed_tiles(self, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attention programs of a mixed step whose rows have `q_lens` queries: (row, tile) each."""
        raise NotImplementedError

    def max_mixed_tiles(self, num_tokens: int, num_rows: int) -> int:
        """The most programs `mixed_tiles` gives a step of `num_tokens` tokens in at most `num_rows` rows."""
        raise NotImplementedError

    def derive_mixed(self, q_starts, q_lens, ctx_lens, block_tables, tile_rows, tile_ids) -> BackendMetadata:
        """`derive` for a mixed step from its rows on the device, with device ops only (captured)."""
        raise NotImplementedError

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               sliding_window: int | None) -> torch.Tensor:
        """Attention of q [T, num_heads, head_dim] over the cache, the step's keys and values already in it
        (only where `attends_written_cache`)."""
        raise NotImplementedError(f"{type(self).__name__} writes the cache itself: call forward")

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 slot_mapping: torch.Tensor) -> None:
        """The step's new keys and values into their slots, quantized where the cache is fp8."""
        k_scale, v_scale = scales(kv_cache)
        for x, cache, scale in ((k, kv_cache[0], k_scale), (v, kv_cache[1], v_scale)):
            # as bytes for fp8: PyTorch has no float8 index_copy_ on the CPU
            raw(cache).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, raw(as_stored(x, cache, scale)))
