"""Paged attention in Triton for NVIDIA GPUs: one kernel for decodes and prefill chunks over a cached prefix.

Every sequence in the batch is a row (query start, query length, context length, block table); a decode is
a row with one query. A program handles one (row, KV head, tile of query x query-head pairs), so the query
heads that share a KV head read its keys and values once, and walks the row's context in tiles of positions
through its block table (any block size) with an online softmax: no contiguous copy of the context is
made. Causal and sliding-window masks are computed from positions.

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
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(q_lens_ptr + row)
        # the tile's M rows are (query, query head of this KV head) pairs, query-major: a decode's GROUP
        # heads share one pass over the KV blocks instead of each reading them
        if tile * BLOCK_M < q_len * GROUP:
            q_start = tl.load(q_starts_ptr + row)
            ctx_len = tl.load(ctx_lens_ptr + row)
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            query = offs_m // GROUP
            head = kv_head * GROUP + offs_m % GROUP
            offs_d = tl.arange(0, BLOCK_D)
            offs_n = tl.arange(0, BLOCK_N)
            m_ok = query < q_len
            d_ok = offs_d < HEAD_DIM
            q = tl.load(q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            q_pos = ctx_len - q_len + query  # absolute positions of the rows' queries
            last_pos = ctx_len - q_len + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
            first_pos = ctx_len - q_len + (tile * BLOCK_M) // GROUP
            lo = 0
            if window > 0:
                lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # KV tiles of BLOCK_N positions whatever the cache's block size: each position finds its block
            for start in range(lo, last_pos + 1, BLOCK_N):
                kv_pos = start + offs_n
                n_ok = kv_pos < ctx_len
                block = tl.load(block_tables_ptr + row * stride_bt + kv_pos // BLOCK_SIZE, mask=n_ok, other=0)
                slot = kv_pos % BLOCK_SIZE
                kv_mask = n_ok[:, None] & d_ok[None, :]
                k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                            + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                            + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
                ok = (kv_pos[None, :] <= q_pos[:, None]) & n_ok[None, :]
                if window > 0:
                    ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                m_i = m_new
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


class TritonPagedAttention(AttentionBackend):
    """All sequences of a step (decodes and prefill chunks) in one kernel launch per layer."""

    BLOCK_N = 32  # KV positions per tile (tl.dot needs 16 or more, whatever the cache's block size)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the Triton attention backend needs the triton package")
        super().__init__(num_heads, num_kv_heads, head_dim, scale)

    def derive(self, meta: AttentionMetadata) -> dict:
        """Per-row query start, query length, context length and a block table, as int32 tensors on the
        host (the runner moves them with the rest of the step's metadata: one copy each per step)."""
        starts, lens, ctx, tables = [], [], [], []
        width = max([meta.decode_block_tables.shape[1] if meta.num_decodes else 0]
                    + [int(s.block_table.numel()) for s in meta.prefills])
        if meta.num_decodes:
            starts.append(meta.decode_idx.cpu())
            lens.append(torch.ones_like(starts[-1]))
            ctx.append(meta.decode_seq_lens.cpu())
            tables.append(meta.decode_block_tables.cpu())
        for span in meta.prefills:
            starts.append(torch.tensor([span.start]))
            lens.append(torch.tensor([span.q_len]))
            ctx.append(torch.tensor([span.ctx_len]))
            tables.append(span.block_table[None].cpu())  # (the runner's are on the host; a caller's may not be)
        bt = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]).to(torch.int32)
        return {"triton_rows": (*(torch.cat(x).to(torch.int32) for x in (starts, lens, ctx)), bt)}

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sliding_window):
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        rows = meta.derived.get("triton_rows")
        if rows is None:  # metadata built without the runner (tests): derive here, once for all layers
            rows = meta.derived["triton_rows"] = tuple(t.to(q.device) for t in self.derive(meta)["triton_rows"])
        q_starts, q_lens, ctx_lens, bt = rows
        group = self.num_heads // self.num_kv_heads
        max_q = max([1] + [s.q_len for s in meta.prefills])
        block_m = 16 if max_q == 1 else 64
        grid = (bt.shape[0], self.num_kv_heads, triton.cdiv(max_q * group, block_m))
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache, bt, q_starts, q_lens, ctx_lens,
            self.scale, sliding_window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
            GROUP=group, HEAD_DIM=self.head_dim, BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)),
            BLOCK_M=block_m, BLOCK_N=self.BLOCK_N, BLOCK_SIZE=meta.block_size,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # exact float32 dots keep greedy parity
        )
        return out
