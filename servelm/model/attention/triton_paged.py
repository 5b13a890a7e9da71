"""Paged attention in Triton for NVIDIA GPUs: one kernel for decodes and prefill chunks over a cached prefix,
and a split-KV (flash-decoding) pair of kernels for decodes.

Every sequence in the batch is a row (query start, query length, context length, block table); a decode is
a row with one query. A program handles one (row, KV head, tile of query x query-head pairs), so the query
heads that share a KV head read its keys and values once, and walks the row's context in tiles of positions
through its block table (any block size) with an online softmax: no contiguous copy of the context is
made. Causal and sliding-window masks are computed from positions, and only where a tile needs them: the
KV tiles that every query of a tile sees whole (before its first query, with no window) run without masks,
the same arithmetic with fewer instructions; the tiles along the diagonal run masked. The programs are the rows' tiles listed
one after the other (`tile_map`, built with the step's metadata), not rows x the longest row's tiles, which
beside a 2,048-token chunk gave each decode as many programs as the chunk has tiles, all but one idle.

A small decode batch gives that kernel few programs (batch 1 of an 8-KV-head model: 8 thread blocks on a GPU
of 132 SMs), each walking the whole context alone. With split-KV the decode rows run instead as programs of
(row, KV head, split): each split walks its share of the row's visible context and writes a partial softmax
state (running max, sum of exponentials, unnormalised weighted sum of values) to a float32 scratch buffer,
and a second kernel merges a row's splits into its output. The number of splits comes from the batch's row
count, the number of KV heads and the block table's width (shapes, fixed for a captured CUDA graph), never
from the context lengths: each row divides its own context among the splits at run time, and splits past
its end write an empty state that the merge weighs zero. Prefill rows stay on the single-pass kernel.

Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks
it against the PyTorch reference. This module imports without Triton; `HAS_TRITON` says if it can run.

An fp8 KV cache (--kv-cache-dtype fp8) is read tile by tile: each loaded tile of keys and values is converted
to the queries' dtype and multiplied by the layer's scale in registers (`_dequant`, the same arithmetic as
attention/kv_quant.py), so no dequantized copy of the cache is ever made; KV_FP8 is a compile-time flag, so a
cache in the model's dtype runs the same code as before. Compiled, fp8 needs a GPU of compute capability 8.9
or newer (Ada, Hopper), where Triton converts float8_e4m3fn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from servelm.model.attention.base import AttentionBackend, AttentionMetadata, BackendMetadata
from servelm.model.attention.kv_quant import is_fp8, scales

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the backend is simply unavailable
    HAS_TRITON = False

if HAS_TRITON:

    @triton.jit
    def _dequant(x, scale, like):
        """fp8 cache entries loaded into registers as `like`'s dtype: kv_quant.dequantize, tile by tile."""
        return (x.to(tl.float32) * scale).to(like.dtype)

    @triton.jit
    def _load_kv(k_cache_ptr, v_cache_ptr, block, slot, kv_head, offs_d, kv_mask, k_scale, v_scale, like,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, KV_FP8: tl.constexpr):
        """A tile's keys and values, [positions, head dim], from the cache blocks and slots of its positions, in
        `like`'s dtype (an fp8 cache dequantized in registers)."""
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k, v = _dequant(k, k_scale, like), _dequant(v, v_scale, like)
        return k, v

    @triton.jit
    def _attend_tile(acc, m_i, l_i, q, start, q_pos, ctx_len, window, row, kv_head, offs_n, offs_d, d_ok, scale,
                     k_scale, v_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                     BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                     MASKED: tl.constexpr):
        """One KV tile of `_paged_attention_kernel`'s online softmax: the tile's keys and values found through
        the block table, scores, the running max, sum and weighted values updated. With MASKED, positions
        past the context, after a query's own or outside its window score -inf; without, every position of
        the tile is visible to every query (the same arithmetic, less of it)."""
        kv_pos = start + offs_n
        if MASKED:
            n_ok = kv_pos < ctx_len
            block = tl.load(block_tables_ptr + row * stride_bt + kv_pos // BLOCK_SIZE, mask=n_ok, other=0)
            kv_mask = n_ok[:, None] & d_ok[None, :]
        else:
            block = tl.load(block_tables_ptr + row * stride_bt + kv_pos // BLOCK_SIZE)
            kv_mask = d_ok[None, :]
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block, kv_pos % BLOCK_SIZE, kv_head, offs_d, kv_mask, k_scale,
                        v_scale, q, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, KV_FP8)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        if MASKED:
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
        return acc, m_new, l_i

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        q_starts_ptr, q_lens_ptr, ctx_lens_ptr, tile_rows_ptr, tile_ids_ptr,
        scale, window, k_scale, v_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        # one program per (query tile of a row, KV head): the step's tiles listed row by row, so that a long
        # prompt chunk beside many decodes launches no programs for the decodes' tiles it has and they lack
        at = tl.program_id(0)
        kv_head = tl.program_id(1)
        row = tl.load(tile_rows_ptr + at)
        tile = tl.load(tile_ids_ptr + at)
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
            # the KV tiles every query of this tile sees whole (at or before its first query, no window) need
            # no mask; only the tiles along the diagonal (and, with a window, every tile) are masked
            full_end = lo
            if window == 0:
                full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # KV tiles of BLOCK_N positions whatever the cache's block size: each position finds its block
            for start in range(lo, full_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, start, q_pos, ctx_len, window, row, kv_head, offs_n, offs_d, d_ok, scale,
                    k_scale, v_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    BLOCK_SIZE, PRECISION, KV_FP8, False)
            for start in range(full_end, last_pos + 1, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, start, q_pos, ctx_len, window, row, kv_head, offs_n, offs_d, d_ok, scale,
                    k_scale, v_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    BLOCK_SIZE, PRECISION, KV_FP8, True)
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


    @triton.jit
    def _paged_decode_split_kernel(
        m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_starts_ptr, ctx_lens_ptr,
        scale, window, num_splits, k_scale, v_scale,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(q_starts_ptr + row)
        ctx_len = tl.load(ctx_lens_ptr + row)
        # a decode sees positions [lo, ctx_len): all of them, or the last `window`
        lo = ctx_len * 0
        if window > 0:
            lo = tl.maximum(ctx_len - window, 0)
        # num_splits shares of whole KV tiles (tiles never straddle two splits); a short context leaves the
        # last splits empty, and their loop below runs no iteration
        per = ((ctx_len - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = lo + split * per
        end = tl.minimum(start + per, ctx_len)
        # the tile's M rows are the GROUP query heads of this KV head (padded to the tile)
        offs_m = tl.arange(0, BLOCK_M)
        head = kv_head * GROUP + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        m_ok = offs_m < GROUP
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + q_start * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            kv_pos = tile_start + offs_n
            n_ok = kv_pos < end
            block = tl.load(block_tables_ptr + row * stride_bt + kv_pos // BLOCK_SIZE, mask=n_ok, other=0)
            k, v = _load_kv(k_cache_ptr, v_cache_ptr, block, kv_pos % BLOCK_SIZE, kv_head, offs_d,
                            n_ok[:, None] & d_ok[None, :], k_scale, v_scale, q,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, KV_FP8)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            # every tile holds at least its first position, so each row's maximum is finite from here on
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        # scratch [rows, NUM_HEADS, num_splits] (m, l) and [rows, NUM_HEADS, num_splits, HEAD_DIM] (acc); an
        # empty split stores m = -inf, l = 0, acc = 0
        state = (row * NUM_HEADS + head) * num_splits + split
        tl.store(m_ptr + state, m_i, mask=m_ok)
        tl.store(l_ptr + state, l_i, mask=m_ok)
        tl.store(acc_ptr + state[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _combine_splits_kernel(
        out_ptr, m_ptr, l_ptr, acc_ptr, q_starts_ptr, stride_ot, stride_oh, num_splits,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < num_splits
        d_ok = offs_d < HEAD_DIM
        state = (row * NUM_HEADS + head) * num_splits + offs_s
        m = tl.load(m_ptr + state, mask=s_ok, other=float("-inf"))
        l_s = tl.load(l_ptr + state, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + state[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                      other=0.0)
        # the first split always holds the last position, so the maximum is finite; empty splits weigh zero
        m_max = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
        total = tl.sum(l_s * w, 0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        q_start = tl.load(q_starts_ptr + row)
        tl.store(out_ptr + q_start * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
                 mask=d_ok)


@dataclass
class TritonRows(BackendMetadata):
    """The kernels' view of a step: per row (decodes first, in `decode_idx` order, then prompt chunks) its first
    query's batch position, its query count, its context length and its block table (int32 or int64); and the
    single-pass kernel's programs, one per query tile of a row (`tile_rows`: the row, `tile_ids`: which of its
    tiles), listed row by row at the tile height `block_m_for` gives the step."""

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    block_tables: torch.Tensor
    tile_rows: torch.Tensor
    tile_ids: torch.Tensor

    def __iter__(self):  # unpacks in the kernels' argument order
        return iter((self.q_starts, self.q_lens, self.ctx_lens, self.block_tables))

    def rows(self, start: int, stop: int | None = None) -> TritonRows:
        """Rows start:stop for the split-KV kernels, which read no tiles."""
        empty = self.tile_rows[:0]
        return TritonRows(*(t[start:stop] for t in self), empty, empty)


DECODE_BLOCK_M = 16  # a step of decodes alone: a tile of 16 (query, query head) pairs, tl.dot's smallest


@dataclass(frozen=True)
class PrefillTiling:
    """How the single-pass kernel is launched for a step with prompt chunks: the (query, query head) pairs of
    a tile, the KV positions a loop iteration reads, warps and pipeline stages (Triton's defaults: 4 and 3).
    A step of decodes alone keeps tiles of DECODE_BLOCK_M pairs and BLOCK_N positions at the defaults.
    bench/gpu_check.py's `prefill_attention` times other settings on a 2,048-token prompt to choose the
    defaults on a GPU."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PrefillTiling.{name} must be a power of two of at least 16, got {v}")


def block_m_for(max_q: int, prefill: PrefillTiling = PrefillTiling()) -> int:
    """The single-pass kernel's query tile height: DECODE_BLOCK_M rows of (query, query head) pairs for a step
    of decodes alone, the prefill tiling's where a row has several queries."""
    return DECODE_BLOCK_M if max_q == 1 else prefill.block_m


def tiles_of(q_len, group: int, block_m: int):
    """The single-pass kernel's query tiles for a row of `q_len` queries (an int or an array of them): its
    (query, query head) pairs in tiles of block_m."""
    return -(-q_len * group // block_m)


def tile_map(q_lens: np.ndarray, group: int, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, tile of the row) of each single-pass program, row by row (`tiles_of` each)."""
    per_row = tiles_of(q_lens, group, block_m)
    rows = np.repeat(np.arange(len(q_lens), dtype=np.int32), per_row)
    firsts = np.cumsum(per_row) - per_row
    return rows, (np.arange(len(rows)) - np.repeat(firsts, per_row)).astype(np.int32)


class TritonPagedAttention(AttentionBackend):
    """All sequences of a step in one kernel launch per layer; with `split_kv` (the default) the decode rows
    instead in two (the splits, then their merge) wherever the batch leaves the GPU short of programs.
    `num_splits` fixes the split count (tests, benchmarks) instead of choosing it from the batch."""

    strided_qkv = attends_written_cache = True  # the kernels take q's strides; `attend` reads only the cache
    BLOCK_N = 32  # KV positions per tile (tl.dot needs 16 or more, whatever the cache's block size)
    MAX_SPLITS = 32
    # programs per SM the split count aims for. Measured on an H200 (bench/gpu_check.py's decode_attention, bf16,
    # 8 KV heads): at batch 64, 512 programs with 2 splits ran 0.78-0.91x the single pass at head size 128 and
    # 1.03-1.26x at 64, while 256 programs (4 KV heads) gained 1.4-1.9x from splitting; 2 per SM splits the
    # latter and leaves the former single-pass
    PROGRAMS_PER_SM = 2
    # without a GPU (the interpreter): a nominal machine, small enough that a few decode rows still split
    CPU_TARGET_PROGRAMS = 8

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, split_kv: bool = True,
                 num_splits: int | None = None, prefill: PrefillTiling = PrefillTiling()) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the Triton attention backend needs the triton package")
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.split_kv = split_kv
        self.num_splits = num_splits
        self.prefill = prefill
        self._target: dict[torch.device, int] = {}

    def derive(self, meta: AttentionMetadata) -> TritonRows:
        """Per-row query start, query length, context length and a block table, as int32 tensors on the
        host (the runner moves them with the rest of the step's metadata: one copy each per step). Decode
        rows come first, in the order of `meta.decode_idx`."""
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
        q_starts, q_lens, ctx_lens = (torch.cat(x).to(torch.int32) for x in (starts, lens, ctx))
        block_m = block_m_for(max([1] + [s.q_len for s in meta.prefills]), self.prefill)
        tiles = tile_map(q_lens.numpy(), self.num_heads // self.num_kv_heads, block_m)
        return TritonRows(q_starts, q_lens, ctx_lens, bt, *(torch.from_numpy(t) for t in tiles))

    def derive_decode(self, meta: AttentionMetadata) -> TritonRows:
        """The same rows for a pure-decode step, from the step's device metadata: each row's query is its own
        batch position, one token long. int32, as `derive` gives them (the compiled kernels mix them with int32
        values; a few small device casts, captured with the graph)."""
        i32 = torch.int32
        idx = meta.decode_idx.to(i32)
        per_row = tiles_of(1, self.num_heads // self.num_kv_heads, DECODE_BLOCK_M)
        at = torch.arange(idx.numel() * per_row, dtype=i32, device=idx.device)
        return TritonRows(idx, torch.ones_like(idx), meta.decode_seq_lens.to(i32), meta.decode_block_tables.to(i32),
                          at // per_row, at % per_row)

    mixed_graphs = True

    def mixed_tiles(self, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # a mixed step's rows are tiled as prompt chunks are
        return tile_map(np.asarray(q_lens), self.num_heads // self.num_kv_heads, self.prefill.block_m)

    def max_mixed_tiles(self, num_tokens: int, num_rows: int) -> int:
        # the sum over rows of tiles_of(q) is at most tiles_of(all the tokens) + one partial tile a row
        return tiles_of(num_tokens, self.num_heads // self.num_kv_heads, self.prefill.block_m) + num_rows

    def derive_mixed(self, q_starts, q_lens, ctx_lens, block_tables, tile_rows, tile_ids) -> TritonRows:
        i32 = torch.int32
        return TritonRows(*(t.to(i32) for t in (q_starts, q_lens, ctx_lens, block_tables, tile_rows, tile_ids)))

    def splits_for(self, rows: int, capacity: int, device: torch.device | str) -> int:
        """How many splits `rows` decode rows get, whose block tables hold `capacity` positions: enough
        (row, KV head, split) programs to fill the device, at most MAX_SPLITS and one KV tile of the table
        each; 1 (the single-pass kernel) where the rows alone fill it. Only shapes go in, so a captured
        graph's choice holds for every replay."""
        if not self.split_kv or rows == 0:
            return 1
        if self.num_splits is not None:
            return self.num_splits
        programs = rows * self.num_kv_heads
        want = -(-self._target_programs(device) // programs)
        return max(1, min(want, self.MAX_SPLITS, -(-capacity // self.BLOCK_N)))

    def _target_programs(self, device: torch.device | str) -> int:
        device = torch.device(device)
        if device not in self._target:
            if device.type == "cuda":
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                self._target[device] = self.PROGRAMS_PER_SM * sms
            else:
                self._target[device] = self.CPU_TARGET_PROGRAMS
        return self._target[device]

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sliding_window):
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, sliding_window)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               sliding_window: int | None) -> torch.Tensor:
        """Attention of the step's queries over the cache (the new keys and values already in it)."""
        out = torch.empty_like(q)
        rows = meta.derived
        if not isinstance(rows, TritonRows):  # metadata built without the runner (tests): derive here, once
            rows = meta.derived = self.derive(meta).to(q.device)
        n_dec = meta.num_decodes
        splits = self.splits_for(n_dec, rows.block_tables.shape[1] * meta.block_size, q.device)
        max_q = meta.max_query_len or max([1] + [s.q_len for s in meta.prefills])
        tiling = self.prefill if max_q > 1 else PrefillTiling(DECODE_BLOCK_M, self.BLOCK_N)
        if splits == 1:
            self._single_pass(out, q, kv_cache, rows, rows.tile_rows, rows.tile_ids, tiling, meta, sliding_window)
            return out
        self._split_decode(out, q, kv_cache, rows.rows(0, n_dec), meta.block_size, sliding_window, splits)
        if meta.prefills:  # the prompt chunks' tiles: after the decodes', one tile each
            first = n_dec * tiles_of(1, self.num_heads // self.num_kv_heads, tiling.block_m)
            self._single_pass(out, q, kv_cache, rows, rows.tile_rows[first:], rows.tile_ids[first:], tiling, meta,
                              sliding_window)
        return out

    def _block_d(self) -> int:
        return max(16, triton.next_power_of_2(self.head_dim))

    @staticmethod
    def _precision(q: torch.Tensor) -> str:
        return "ieee" if q.dtype == torch.float32 else "tf32"  # exact float32 dots keep greedy parity

    def _single_pass(self, out, q, kv_cache, rows, tile_rows, tile_ids, tiling: PrefillTiling,
                     meta: AttentionMetadata, sliding_window) -> None:
        """The single-pass kernel over the tiles (`tile_rows`, `tile_ids`) of `rows`, cut and launched as
        `tiling` says (block_m: the height the tile map was built with)."""
        k_cache, v_cache = kv_cache
        q_starts, q_lens, ctx_lens, bt = rows
        group = self.num_heads // self.num_kv_heads
        grid = (tile_rows.shape[0], self.num_kv_heads)
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache, bt, q_starts, q_lens, ctx_lens, tile_rows, tile_ids,
            self.scale, sliding_window or 0, *scales(kv_cache),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
            GROUP=group, HEAD_DIM=self.head_dim, BLOCK_D=self._block_d(),
            BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_SIZE=meta.block_size, PRECISION=self._precision(q),
            KV_FP8=is_fp8(k_cache), num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        )

    def _split_decode(self, out, q, kv_cache, rows, block_size: int, sliding_window, splits: int) -> None:
        """The decode rows `rows` (one query each) in `splits` splits, then their merge into `out`. The
        scratch is allocated here, in the step's stream: inside a captured graph it comes from the graph's
        pool, at the same addresses on every replay."""
        k_cache, v_cache = kv_cache
        q_starts, _, ctx_lens, bt = rows
        n = bt.shape[0]
        group = self.num_heads // self.num_kv_heads
        m = torch.empty(n, self.num_heads, splits, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(n, self.num_heads, splits, self.head_dim, dtype=torch.float32, device=q.device)
        block_d = self._block_d()
        _paged_decode_split_kernel[(n, self.num_kv_heads, splits)](
            m, l_sum, acc, q, k_cache, v_cache, bt, q_starts, ctx_lens,
            self.scale, sliding_window or 0, splits, *scales(kv_cache),
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
            NUM_HEADS=self.num_heads,
            GROUP=group, HEAD_DIM=self.head_dim, BLOCK_D=block_d,
            BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=self.BLOCK_N, BLOCK_SIZE=block_size,
            PRECISION=self._precision(q), KV_FP8=is_fp8(k_cache),
        )
        # the split count is a run-time argument and the merge reads a fixed tile of MAX_SPLITS: one compiled
        # variant of each kernel serves every batch size the engine captures
        _combine_splits_kernel[(n, self.num_heads)](
            out, m, l_sum, acc, q_starts, out.stride(0), out.stride(1), splits,
            NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim,
            BLOCK_S=max(self.MAX_SPLITS, triton.next_power_of_2(splits)), BLOCK_D=block_d,
        )
