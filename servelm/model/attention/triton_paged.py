"""Paged attention in Triton for NVIDIA GPUs: one kernel for decodes and prefill chunks over a cached prefix.

Every sequence in the batch is a row (query start, query length, context length, block table); a decode is
a row with one query. A program handles one (row, query head, tile of queries) and walks the row's KV blocks
in place through its block table with an online softmax, so no contiguous copy of the context is made.
Causal and sliding-window masks are computed from positions. GQA maps a query head to its KV head.

Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks
it against the PyTorch reference. This module imports without Triton; `HAS_TRITON` says if it can run.
"""

from __future__ import annotations

import torch

from servelm.model.attention.base import AttentionBackend, AttentionMetadata

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the backend is simply unavailable
    HAS_TRITON = False

if HAS_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        q_starts_ptr, q_lens_ptr, ctx_lens_ptr,
        scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(q_lens_ptr + row)
        if tile * BLOCK_M < q_len:
            q_start = tl.load(q_starts_ptr + row)
            ctx_len = tl.load(ctx_lens_ptr + row)
            kv_head = head // GROUP
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_n = tl.arange(0, BLOCK_SIZE)
            m_ok = offs_m < q_len
            d_ok = offs_d < HEAD_DIM
            q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            # absolute positions of this tile's queries in the sequence
            q_pos = ctx_len - q_len + offs_m
            last_pos = ctx_len - q_len + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len) - 1
            first_pos = ctx_len - q_len + tile * BLOCK_M
            lo = 0
            if window > 0:
                lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_SIZE
            hi = last_pos // BLOCK_SIZE + 1
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for blk in range(lo, hi):
                block = tl.load(block_tables_ptr + row * stride_bt + blk)
                kv_pos = blk * BLOCK_SIZE + offs_n
                k = tl.load(k_cache_ptr + block * stride_kb + offs_n[:, None] * stride_ks + kv_head * stride_kh
                            + offs_d[None, :], mask=d_ok[None, :], other=0.0)
                v = tl.load(v_cache_ptr + block * stride_vb + offs_n[:, None] * stride_vs + kv_head * stride_vh
                            + offs_d[None, :], mask=d_ok[None, :], other=0.0)
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
                ok = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < ctx_len)
                if window > 0:
                    ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
                m_i = m_new
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


class TritonPagedAttention(AttentionBackend):
    """All sequences of a step (decodes and prefill chunks) in one kernel launch per layer."""

    BLOCK_M = 16

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the Triton attention backend needs the triton package")
        super().__init__(num_heads, num_kv_heads, head_dim, scale)

    @staticmethod
    def rows(meta: AttentionMetadata, device) -> tuple[torch.Tensor, ...]:
        """Per-row query start, query length, context length and a padded block table."""
        starts, lens, ctx, tables = [], [], [], []
        if meta.num_decodes:  # assembled on the host (.cpu() is a no-op there), then copied once
            starts.append(meta.decode_idx.cpu())
            lens.append(torch.ones_like(starts[-1]))
            ctx.append(meta.decode_seq_lens.cpu())
            tables.extend(meta.decode_block_tables.cpu())
        for span in meta.prefills:
            starts.append(torch.tensor([span.start]))
            lens.append(torch.tensor([span.q_len]))
            ctx.append(torch.tensor([span.ctx_len]))
            tables.append(span.block_table)
        width = max(int(t.numel()) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : t.numel()] = t
        cat = [torch.cat(x).to(device=device, dtype=torch.int32) for x in (starts, lens, ctx)]
        return (*cat, bt.to(device))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sliding_window):
        self.write_kv(k, v, kv_cache, meta.slot_mapping.to(q.device, non_blocking=True))  # no-op if there
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        rows = meta.derived.get("triton_rows")
        if rows is None:  # once per step, not per layer: it is host work plus four copies to the device
            rows = meta.derived["triton_rows"] = self.rows(meta, q.device)
        q_starts, q_lens, ctx_lens, bt = rows
        max_q = max([1] + [s.q_len for s in meta.prefills])
        grid = (bt.shape[0], self.num_heads, triton.cdiv(max_q, self.BLOCK_M))
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache, bt, q_starts, q_lens, ctx_lens,
            self.scale, sliding_window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
            GROUP=self.num_heads // self.num_kv_heads, HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim), BLOCK_M=self.BLOCK_M, BLOCK_SIZE=meta.block_size,
        )
        return out
