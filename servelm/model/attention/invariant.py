"""Batch-invariant paged attention (the `batch_invariant` mode): a query's result is the same bits whatever
else shares its step, however its prompt was chunked and whatever the prefix cache held.

PyTorch's SDPA changes its blocking with the number of queries and keys, so a query's sums depend on its
chunk. Here every query goes through the same arithmetic, in float32 whatever the model's dtype, over
fixed blocks of `KEY_BLOCK` key positions aligned to position 0:

- scores: per key block, one batched matmul over the head size, at least 2 query rows per (sequence, KV
  head) (one row takes the matmul's matrix-vector path, which sums in another order; from 2 rows on, the
  tested CPUs gave a row the same bits whatever the number of rows or batch entries, with the keys laid
  out [D, block], not as a transposed view of [block, D], whose path depends on the row count);
- softmax: the row's exact max over its unmasked keys, then exp (the same bits in PyTorch's vector and
  scalar loops, unlike sigmoid or silu); masked keys give exactly 0;
- per key block, P @ [V | 1] in one batched matmul: the block's weighted values and, in the last column,
  the sum of its probabilities;
- the blocks' partial results added one after another in position order: blocks past a query's last key
  add exact zeros, so how many there are (the chunk's or the batch's longest context) does not matter.
"""

from __future__ import annotations

import torch

from servelm.model.attention.base import AttentionMetadata
from servelm.model.attention.torch_paged import CpuPagedAttention, TorchPagedAttention

KEY_BLOCK = 128  # key positions per partial sum; fixed, so a query's summation order never changes
_QUERY_TILE = 256  # prompt queries per pass: later tiles read more key blocks (causal), memory stays bounded


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """Attention of float32 queries q [S, Hkv, R, D] (R rows per KV head: queries x heads of its group) at
    positions q_pos [S, R] over nb key blocks: keys [nb, S, Hkv, D, KEY_BLOCK] and values with a column of
    ones [nb, S, Hkv, KEY_BLOCK, D + 1] (`gather_blocks`, or `gather_decode_blocks` where every call has the
    same R), at positions 0..nb * KEY_BLOCK - 1. Keys past a row's position are masked, as are those outside
    its window. Returns [S, Hkv, R, D] float32."""
    rows = q.shape[2]
    if rows < 2:  # duplicate the row: one row would take the matmul's matrix-vector path
        q, q_pos = torch.cat([q, q], dim=2), torch.cat([q_pos, q_pos], dim=1)
    nb, d = keys.shape[0], q.shape[-1]
    scores = torch.matmul(q * scale, keys)  # [nb, S, Hkv, R, KEY_BLOCK]
    key_pos = torch.arange(nb * KEY_BLOCK).view(nb, 1, 1, KEY_BLOCK)
    pos = q_pos[None, :, :, None]  # [1, S, R, 1]
    # without a window only the blocks from the earliest query's on hold keys some query may not see
    first = 0 if sliding_window is not None else int(q_pos.min()) // KEY_BLOCK
    masked = key_pos[first:] > pos
    if sliding_window is not None:
        masked |= key_pos <= pos - sliding_window
    scores[first:].masked_fill_(masked[:, :, None], float("-inf"))
    scores.sub_(scores.amax(dim=(0, 4), keepdim=True)).exp_()  # masked keys: exp(-inf) = 0 exactly
    partial = torch.matmul(scores, values)  # [nb, S, Hkv, R, D + 1]
    total = partial[0].clone()
    for j in range(1, nb):  # in position order
        total += partial[j]
    return (total[..., :d] / total[..., d:])[:, :, :rows]


def gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, nb: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first nb key blocks of each of S sequences (block tables [S, n], padded with block 0: finite
    values that are masked or multiplied by 0) as float32 keys [nb, S, Hkv, D, KEY_BLOCK] and values with a
    column of ones [nb, S, Hkv, KEY_BLOCK, D + 1], contiguous."""
    k, v = _gather_rows(k_cache, v_cache, blocks, nb)
    s, hkv, d = k.shape[0], k.shape[3], k.shape[4]
    keys = torch.empty(nb, s, hkv, d, KEY_BLOCK).copy_(k.permute(1, 0, 3, 4, 2))
    return keys, _values_with_ones(v)


def gather_decode_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, nb: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `gather_blocks`, but the keys a transposed view of [nb, S, Hkv, KEY_BLOCK, D] (half the copying
    cost). Only for calls whose every query group has the same number of rows, as decodes have: with a
    fixed shape per (block, sequence, KV head) the sums do not depend on how many there are, whereas this
    layout's matmul path changes a row's sums with the row count."""
    k, v = _gather_rows(k_cache, v_cache, blocks, nb)
    s, hkv, d = k.shape[0], k.shape[3], k.shape[4]
    keys = torch.empty(nb, s, hkv, KEY_BLOCK, d).copy_(k.permute(1, 0, 3, 2, 4))
    return keys.transpose(-1, -2), _values_with_ones(v)


def _gather_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, nb: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, nb, KEY_BLOCK, Hkv, D] keys and values read through the block tables (index_select: several
    times faster than advanced indexing here)."""
    bs = k_cache.shape[1]
    need = nb * KEY_BLOCK // bs
    if blocks.shape[1] < need:
        blocks = torch.cat([blocks, blocks.new_zeros(blocks.shape[0], need - blocks.shape[1])], dim=1)
    idx = blocks[:, :need].reshape(-1)
    shape = (blocks.shape[0], nb, KEY_BLOCK, *k_cache.shape[2:])
    return k_cache.index_select(0, idx).view(shape), v_cache.index_select(0, idx).view(shape)


def _values_with_ones(v: torch.Tensor) -> torch.Tensor:
    s, nb, _, hkv, d = v.shape
    values = torch.empty(nb, s, hkv, KEY_BLOCK, d + 1)
    values[..., d] = 1
    values[..., :d] = v.permute(1, 0, 3, 2, 4)
    return values


def _num_blocks(n: int, block_size: int) -> int:
    """Key blocks covering n positions, rounded up to whole cache blocks (both powers of two)."""
    step = max(KEY_BLOCK, block_size)
    return -(-n // step) * step // KEY_BLOCK


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
        keys, values = gather_blocks(kv_cache[0], kv_cache[1], span.block_table[None],
                                     _num_blocks(span.ctx_len, block_size))
        out = torch.empty_like(q)
        qf = q.float().view(n, hkv, g, d)
        for a in range(0, n, _QUERY_TILE):
            b = min(n, a + _QUERY_TILE)
            nb = _num_blocks(first + b, block_size)  # the tile's keys: up to its last query's (causal)
            rows = qf[a:b].permute(1, 0, 2, 3).reshape(1, hkv, (b - a) * g, d)
            pos = torch.arange(first + a, first + b).repeat_interleave(g)[None]
            o = block_attention(rows, keys[:nb], values[:nb], pos, self.scale, sliding_window)
            out[a:b] = o.view(hkv, b - a, g, d).permute(1, 0, 2, 3).reshape(b - a, hkv * g, d)
        return out

    def _invariant_decode(self, q, kv_cache, meta: AttentionMetadata, sliding_window):
        hkv, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        bsz = q.shape[0]
        lens = meta.decode_seq_lens
        keys, values = gather_decode_blocks(kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                            _num_blocks(int(lens.max()), meta.block_size))
        rows = q.float().view(bsz, hkv, g, d)
        pos = (lens - 1)[:, None].expand(bsz, g)
        o = block_attention(rows, keys, values, pos, self.scale, sliding_window)
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
