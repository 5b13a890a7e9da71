"""Batch-invariant paged attention (the `batch_invariant` mode): a query's result is the same bits whatever
else shares its step, however its prompt was chunked and whatever the prefix cache held.

PyTorch's SDPA changes its blocking with the number of queries and keys, so a query's sums depend on its
chunk. Here every query goes through the same arithmetic, in float32 whatever the model's dtype:

- scores: one batched matmul over the head size per (sequence, KV head), at least 2 query rows (MKL's
  one-row path sums in another order; from 2 rows on, the tested CPUs give a row the same bits whatever
  the number of rows, columns or batch entries);
- softmax: the row's exact max over its unmasked keys, exp (the same bits in PyTorch's vector and scalar
  loops, unlike sigmoid or silu), masked keys exactly 0;
- P @ [V | 1]: per fixed block of `KEY_BLOCK` key positions (aligned to position 0) one batched matmul,
  which also sums the block's probabilities in its last column;
- the blocks' partial results added in position order by a cumulative sum (sequential by definition):
  the blocks past a query's last key add exact zeros, so how many there are does not matter.
"""

from __future__ import annotations

import torch

from servelm.model.attention.base import AttentionMetadata
from servelm.model.attention.torch_paged import CpuPagedAttention, TorchPagedAttention

KEY_BLOCK = 128  # key positions per partial sum; fixed, so a query's summation order never changes
_QUERY_TILE = 256  # prompt queries per pass: later tiles read more keys (causal), memory stays bounded


def _pad_rows(x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """At least two query rows per (sequence, KV head): one row would take the matmul's one-row path."""
    if x.shape[-2] >= 2:
        return x, pos
    return torch.cat([x, x], dim=-2), torch.cat([pos, pos], dim=-1)


def block_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """Attention of float32 queries q [S, Hkv, R, D] (R rows per KV head: queries x heads of its group) at
    positions q_pos [S, R] over the keys k_t [S, Hkv, D, L] (transposed: unit stride along L; a transposed
    view of [L, D] keys takes another matmul path, whose sums depend on the row count) and values v
    [S, Hkv, L, D] at positions 0..L-1 (L a multiple of KEY_BLOCK; keys past a row's position are masked, as
    are those outside its window). Returns [S, Hkv, R, D] float32."""
    rows = q.shape[-2]
    q, q_pos = _pad_rows(q, q_pos)
    s, hkv, d, length = k_t.shape
    nb = length // KEY_BLOCK
    scores = torch.matmul(q * scale, k_t)  # [S, Hkv, R, L]
    key_pos = torch.arange(length)
    masked = key_pos[None, None, :] > q_pos[:, :, None]  # [S, R, L]
    if sliding_window is not None:
        masked |= key_pos[None, None, :] <= q_pos[:, :, None] - sliding_window
    scores.masked_fill_(masked[:, None], float("-inf"))
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # masked keys: exp(-inf) = 0 exactly
    r = q.shape[-2]
    p = p.view(s, hkv, r, nb, KEY_BLOCK).transpose(2, 3).contiguous()  # [S, Hkv, nb, R, KEY_BLOCK]
    v_ext = torch.ones(s, hkv, nb, KEY_BLOCK, d + 1)
    v_ext[..., :d] = v.view(s, hkv, nb, KEY_BLOCK, d)
    partial = torch.matmul(p, v_ext)  # [S, Hkv, nb, R, D + 1]: each block's P @ V and its sum of P
    total = partial.cumsum(dim=2)[:, :, -1]  # the blocks added one after another, in position order
    return (total[..., :d] / total[..., d:])[:, :, :rows]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int, keys: bool) -> torch.Tensor:
    """[S, nblocks] block ids -> float32 keys [S, Hkv, D, length] or values [S, Hkv, length, D], contiguous
    (block 0 pads a short table: finite values, masked or multiplied by 0)."""
    bs = cache.shape[1]
    need = length // bs
    if blocks.shape[1] < need:
        blocks = torch.cat([blocks, blocks.new_zeros(blocks.shape[0], need - blocks.shape[1])], dim=1)
    x = cache[blocks[:, :need]]  # [S, need, bs, Hkv, D]
    x = x.view(x.shape[0], length, *x.shape[3:])
    x = x.permute(0, 2, 3, 1) if keys else x.transpose(1, 2)
    return torch.empty(x.shape, dtype=torch.float32).copy_(x)  # one copy, contiguous, whatever the dtype


def _padded_len(n: int, block_size: int) -> int:
    step = max(KEY_BLOCK, block_size)  # both powers of two: a multiple of each
    return -(-n // step) * step


class InvariantAttentionMixin:
    """Prompt chunks (and, without the C++ decode kernel, decodes) through `block_attention`."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    def _invariant_prefill(self, q, kv_cache, span, block_size, sliding_window):
        hkv, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        n = q.shape[0]
        first = span.ctx_len - span.q_len  # position of the chunk's first query
        out = torch.empty_like(q)
        qf = q.float().view(n, hkv, g, d)
        full = _padded_len(span.ctx_len, block_size)
        keys = _gather(kv_cache[0], span.block_table[None], full, keys=True)
        values = _gather(kv_cache[1], span.block_table[None], full, keys=False)
        for a in range(0, n, _QUERY_TILE):
            b = min(n, a + _QUERY_TILE)
            length = _padded_len(first + b, block_size)  # the tile's keys: up to its last query (causal)
            k, v = keys[..., :length], values[:, :, :length]
            rows = qf[a:b].permute(1, 0, 2, 3).reshape(1, hkv, (b - a) * g, d)
            pos = torch.arange(first + a, first + b).repeat_interleave(g)[None]
            o = block_attention(rows, k, v, pos, self.scale, sliding_window)
            out[a:b] = o.view(hkv, b - a, g, d).permute(1, 0, 2, 3).reshape(b - a, hkv * g, d)
        return out

    def _invariant_decode(self, q, kv_cache, meta: AttentionMetadata, sliding_window):
        hkv, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        bsz = q.shape[0]
        lens = meta.decode_seq_lens
        length = _padded_len(int(lens.max()), meta.block_size)
        k = _gather(kv_cache[0], meta.decode_block_tables, length, keys=True)
        v = _gather(kv_cache[1], meta.decode_block_tables, length, keys=False)
        rows = q.float().view(bsz, hkv, g, d)
        pos = (lens - 1)[:, None].expand(bsz, g)
        o = block_attention(rows, k, v, pos, self.scale, sliding_window)
        return o.reshape(bsz, hkv * g, d).to(q.dtype)


class InvariantPagedAttention(InvariantAttentionMixin, TorchPagedAttention):
    """The PyTorch backend with every query through `block_attention` (prompt and generated positions)."""

    def _prefill(self, q, k, v, kv_cache, span, block_size, sliding_window):
        return self._invariant_prefill(q, kv_cache, span, block_size, sliding_window)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, sliding_window):
        return self._invariant_decode(q, kv_cache, meta, sliding_window)


class InvariantCpuPagedAttention(InvariantAttentionMixin, CpuPagedAttention):
    """The C++ kernels where they run (decodes in every dtype, bf16 prompt chunks: each already gives a
    query the same bits whatever else is in the step); prompt chunks they do not take (float32, head sizes
    the prefill kernel lacks) through `block_attention` instead of SDPA."""

    def _prefill(self, q, k, v, kv_cache, span, block_size, sliding_window):
        if self.kernel_prefill and q.dtype == torch.bfloat16:
            return super()._prefill(q, k, v, kv_cache, span, block_size, sliding_window)
        return self._invariant_prefill(q, kv_cache, span, block_size, sliding_window)
