"""Paged attention with soft-capped scores (Gemma 2: scores = cap * tanh(scores / cap) before the mask and
softmax). SDPA and the C++ kernels have no soft-cap, so this computes the scores explicitly, in float32,
on any device: the PyTorch reference path, chosen by the decoder only for models that soft-cap."""

from __future__ import annotations

import torch

from servelm.model.attention.torch_paged import TorchPagedAttention, _window_mask


class SoftcapPagedAttention(TorchPagedAttention):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.softcap = softcap

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:  # causal over a chunk with no cached prefix
            mask = _window_mask(torch.arange(q.shape[-2], device=q.device), k.shape[-2], None)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1).float(), v.repeat_interleave(rep, dim=1).float()
        s = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scale
        s = torch.tanh(s / self.softcap) * self.softcap
        s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v).to(q.dtype)
