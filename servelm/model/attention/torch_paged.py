"""Paged attention on PyTorch (CPU, and any device as a reference) built on scaled_dot_product_attention.

An fp8 KV cache (--kv-cache-dtype fp8) is read here on every device without Triton: the gathered blocks are
dequantized (attention/kv_quant.py), and a prompt chunk reads its own keys and values back from the cache too,
so that its attention sees what later steps and the Triton kernels see: the quantized values."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.model.attention.base import AttentionBackend, AttentionMetadata
from servelm.model.attention.kv_quant import dequantize, is_fp8, raw, scales


def _window_mask(q_pos: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean [Q, kv_len] mask: causal, and within the sliding window when there is one."""
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    mask = kv_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def _gather(cache: torch.Tensor, blocks: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """cache[blocks], as `dtype` values where the cache is fp8."""
    if not is_fp8(cache):
        return cache[blocks]
    return dequantize(raw(cache)[blocks].view(cache.dtype), scale, dtype)


class TorchPagedAttention(AttentionBackend):
    """Decodes are batched into one SDPA call over their gathered blocks; prefill chunks run one by one."""

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sliding_window):
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        if not meta.prefills:  # a pure decode batch: every token is a decode, in order
            return self._decode(q, kv_cache, meta, sliding_window)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[meta.decode_idx] = self._decode(q[meta.decode_idx], kv_cache, meta, sliding_window)
        for span in meta.prefills:
            sl = slice(span.start, span.start + span.q_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], kv_cache, span, meta.block_size, sliding_window)
        return out

    def _decode(self, q, kv_cache, meta: AttentionMetadata, sliding_window):
        k_cache, v_cache = kv_cache
        k_scale, v_scale = scales(kv_cache)
        bt = meta.decode_block_tables
        b, nb = bt.shape
        shape = (b, nb * meta.block_size, self.num_kv_heads, self.head_dim)
        kk = _gather(k_cache, bt, k_scale, q.dtype).view(shape).transpose(1, 2)
        vv = _gather(v_cache, bt, v_scale, q.dtype).view(shape).transpose(1, 2)
        pos = torch.arange(nb * meta.block_size, device=q.device)
        lens = meta.decode_seq_lens[:, None]
        mask = pos[None, :] < lens
        if sliding_window is not None:
            mask &= pos[None, :] > lens - 1 - sliding_window
        return self._attend(q.unsqueeze(2), kk, vv, mask[:, None, None, :]).squeeze(2)

    def _prefill(self, q, k, v, kv_cache, span, block_size, sliding_window):
        k_cache, v_cache = kv_cache
        if span.ctx_len == span.q_len and not is_fp8(k_cache):
            # No cached prefix: attend to this chunk's own keys, no cache read needed.
            kk, vv = k, v
        else:
            k_scale, v_scale = scales(kv_cache)
            nb = (span.ctx_len + block_size - 1) // block_size
            blocks = span.block_table[:nb]
            shape = (-1, self.num_kv_heads, self.head_dim)
            kk = _gather(k_cache, blocks, k_scale, q.dtype).view(shape)[: span.ctx_len]
            vv = _gather(v_cache, blocks, v_scale, q.dtype).view(shape)[: span.ctx_len]
        # 4-D inputs: with 3-D ones SDPA on CPU falls back from its flash kernel to the slow math path.
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
        mask = None  # plain causal: SDPA's is_causal path, no mask to build
        if span.ctx_len != span.q_len or sliding_window is not None:
            q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=q.device)
            mask = _window_mask(q_pos, span.ctx_len, sliding_window)
        return self._attend(qt, kt, vt, mask).squeeze(0).transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, Q, D], k/v [B, KVH, K, D], mask broadcastable to [B, 1, Q, K] (True: attend) or None for
        causal -> [B, H, Q, D]. The one place scores are computed, so a variant overrides only this."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)


class CpuPagedAttention(TorchPagedAttention):
    """Attention in the C++ kernels, every query summed in an order of its own, whatever else is in the step
    (a token's bits never depend on its batch, its prompt's chunking, the prefix cache or preemption).
    Decodes run in a kernel that reads keys and values in place through the block tables; new keys and values
    are copied into their slots row by row. bf16 prompt chunks with a head size the AVX512-BF16 decode kernel
    takes (32, 64, 128, 256) run in a prefill kernel over the paged cache (AMX tiles where present, else
    AVX512-BF16; 3.4x PyTorch's flash attention on Zen 4) that gives each query the decode kernel's bits.
    Every other prompt chunk (float32, CPUs without AVX512-BF16, other head sizes) goes through the decode
    kernel itself, one query per row at its own context length (the kernel walks rows that share a block table
    together, each summed as alone): SDPA would sum a query in an order that
    depends on the chunk it came in. The kernels read caches in the model's dtype only: an fp8 cache takes
    the PyTorch path of the parent class (dequantized blocks), so it has no batch invariance."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kernels) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernels = kernels
        probe = torch.empty(1, num_heads, head_dim, dtype=torch.bfloat16)
        self.kernel_prefill = kernels.prefill_attention_supported(probe) and head_dim in (32, 64, 128, 256)

    def _prefill(self, q, k, v, kv_cache, span, block_size, sliding_window):
        if is_fp8(kv_cache[0]):
            return super()._prefill(q, k, v, kv_cache, span, block_size, sliding_window)
        out = torch.empty_like(q)
        if self.kernel_prefill and q.dtype == torch.bfloat16:
            self.kernels.paged_prefill_attention(out, q, kv_cache[0], kv_cache[1], span.block_table, span.ctx_len,
                                                 self.scale, sliding_window or 0)
            return out
        # each query a decode: its own row of the block table and its context up to and including itself
        tables = span.block_table[None].expand(span.q_len, -1).contiguous()
        lens = torch.arange(span.ctx_len - span.q_len + 1, span.ctx_len + 1, dtype=torch.int64)
        self.kernels.paged_decode_attention(out, q.contiguous(), kv_cache[0], kv_cache[1], tables, lens, self.scale,
                                            sliding_window or 0)
        return out

    def write_kv(self, k, v, kv_cache, slot_mapping) -> None:
        if is_fp8(kv_cache[0]):
            return super().write_kv(k, v, kv_cache, slot_mapping)
        self.kernels.write_kv(kv_cache[0], kv_cache[1], k, v, slot_mapping)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, sliding_window):
        if is_fp8(kv_cache[0]):
            return super()._decode(q, kv_cache, meta, sliding_window)
        out = torch.empty_like(q)
        self.kernels.paged_decode_attention(out, q.contiguous(), kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                            meta.decode_seq_lens, self.scale, sliding_window or 0)
        return out
