"""Paged attention with soft-capped scores (Gemma 2: scores = cap * tanh(scores / cap) before the mask and
softmax). SDPA and the C++ kernels have no soft-cap, so this computes the scores explicitly, in float32,
on any device: the PyTorch reference path, chosen by the decoder only for models that soft-cap."""

from __future__ import annotations

import torch

from servelm.model.attention.base import AttentionMetadata
from servelm.model.attention.torch_paged import TorchPagedAttention, _window_mask


class SoftcapPagedAttention(TorchPagedAttention):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.softcap = softcap

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, Q, D], k/v [B, KVH, K, D], mask [B or 1, 1, Q, K] (True: attend) -> [B, H, Q, D]."""
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1).float(), v.repeat_interleave(rep, dim=1).float()
        s = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scale
        s = torch.tanh(s / self.softcap) * self.softcap
        s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v).to(q.dtype)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, sliding_window):
        k_cache, v_cache = kv_cache
        bt = meta.decode_block_tables
        b, nb = bt.shape
        kk = k_cache[bt].view(b, nb * meta.block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vv = v_cache[bt].view(b, nb * meta.block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(nb * meta.block_size, device=q.device)
        lens = meta.decode_seq_lens[:, None]
        mask = pos[None, :] < lens
        if sliding_window is not None:
            mask &= pos[None, :] > lens - 1 - sliding_window
        return self._attend(q.unsqueeze(2), kk, vv, mask[:, None, None, :]).squeeze(2)

    def _prefill(self, q, k, v, kv_cache, span, block_size, sliding_window):
        if span.ctx_len == span.q_len:
            kk, vv = k, v
        else:
            k_cache, v_cache = kv_cache
            nb = (span.ctx_len + block_size - 1) // block_size
            blocks = span.block_table[:nb]
            kk = k_cache[blocks].view(-1, self.num_kv_heads, self.head_dim)[: span.ctx_len]
            vv = v_cache[blocks].view(-1, self.num_kv_heads, self.head_dim)[: span.ctx_len]
        q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=q.device)
        mask = _window_mask(q_pos, span.ctx_len, sliding_window)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
        return self._attend(qt, kt, vt, mask[None, None]).squeeze(0).transpose(0, 1)
