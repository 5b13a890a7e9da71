"""Quantized linears on NVIDIA GPUs: Triton matmuls that dequantize weight tiles on the fly.

The same formats as the CPU kernels (model/quant/weight_only.py), from the same codes: int8 with one scale per output
row (w = code * scale), and int4 in groups along the inputs with a scale and a zero point each
(w = (code - 8) * scale + zero), which also holds a GGUF file's Q4_0, Q4_1 and Q4_K blocks. int4 codes are
packed two to a byte (the even input in the low nibble), so a decode step reads half a byte per weight.
Each program computes a [BLOCK_M, BLOCK_N] tile of x W^T, accumulating in float32. A tile of weights is
dequantized in float32, then rounded to the activations' dtype: bf16 and fp16 tiles multiply on the tensor
cores in that dtype, float32 ones in IEEE float32 (`input_precision="ieee"`; Triton's default for float32
dots is TF32, whose 10-bit mantissa costs about 1e-3 relative error per product).

FP8 weights (model/quant/fp8.py) have a kernel of their own, `TritonFp8Matmul`, for the steps where reading the
weight is the cost (a decode step's few rows): e4m3 codes convert exactly to the activations' dtype in
registers, and the scales multiply the dot's result, once at the end for a scale per row or per tile for a
block-scaled weight. It splits the inputs over more programs where the output alone gives too few to keep the
GPU's memory busy (`split_k`; a second kernel adds the partial sums in a fixed order, so a result never depends
on timing). For the fewest rows it has a second shape, `_fp8_gemv_kernel`: a matrix-vector product per row
with no `tl.dot`, whose smallest tile is 16 rows. Which rows take it is a launch setting (`Fp8Tuning`), off by
default until a GPU measures it faster (bench/gpu_check.py's `fp8_tuning`).

Without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks it
against dequantize-then-matmul. This module imports without Triton; `HAS_TRITON` says if it can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from servelm.model.quant.weight_only import QuantWeight

if TYPE_CHECKING:
    from servelm.model.quant.fp8 import Fp8Weight

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

if HAS_TRITON:

    @triton.jit
    def _quant_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                         GROUP: tl.constexpr, INT4: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # in x's own dtype
            wmask = (rn[None, :] < N) & (rk[:, None] < K)
            if INT4:
                byte = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None] // 2, mask=wmask, other=0)
                code = ((byte.to(tl.int32) >> ((rk[:, None] % 2) * 4)) & 15).to(tl.float32)
                g = rk[:, None] // GROUP
                scale = tl.load(s_ptr + rn[None, :] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + rn[None, :] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
                w = (code - 8.0) * scale + zero  # [BLOCK_K, BLOCK_N]
            else:
                code = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=wmask, other=0).to(tl.float32)
                scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
                w = code * scale[None, :]
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


    @triton.jit
    def _fp8_mm_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_qn, stride_sn, stride_ys,
                       stride_ym, GROUP: tl.constexpr, PER_ROW: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)  # which K_SPLIT-wide slice of the inputs this program sums
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_from = pid_s * K_SPLIT
        for k0 in range(k_from, tl.minimum(k_from + K_SPLIT, K), BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            code = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None],
                           mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N] e4m3
            w = code.to(x.dtype)  # exact: every e4m3 value is a bf16, fp16 and float32 value
            if PER_ROW:
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            else:  # the tile lies in one group of inputs (GROUP is a multiple of BLOCK_K, and so is K_SPLIT)
                scale = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=rn < N, other=0.0)
                acc += tl.dot(x, w, input_precision=PRECISION) * scale[None, :]
        if PER_ROW:
            acc = acc * tl.load(s_ptr + rn * stride_sn, mask=rn < N, other=0.0)[None, :]
        tl.store(y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


    @triton.jit
    def _fp8_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_qn, stride_sn, stride_ys,
                         stride_ym, GROUP: tl.constexpr, PER_ROW: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """`_fp8_mm_kernel`'s result for a few rows without `tl.dot`: a [BLOCK_N, BLOCK_K] tile of codes is read
        along the weight's rows (the inputs are contiguous there), converted once, and multiplied by each row
        of x in turn, summed over the inputs in float32. A dot's tile is at least 16 rows, so for one row it
        pads the activations 16-fold and moves the weight through the layout the tensor cores want."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, ROWS)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        k_from = pid_s * K_SPLIT
        for k0 in range(k_from, tl.minimum(k_from + K_SPLIT, K), BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :],
                        mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            if not PER_ROW:  # the tile lies in one group of inputs, as in _fp8_mm_kernel
                scale = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=rn < N, other=0.0)
            for r in tl.static_range(ROWS):
                row = tl.minimum(r, M - 1)  # the rows past M repeat the last: computed, never stored
                x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
                if not PER_ROW:
                    part = part * scale
                acc += tl.where(rm[:, None] == r, part[None, :], 0.0)
        if PER_ROW:
            acc = acc * tl.load(s_ptr + rn * stride_sn, mask=rn < N, other=0.0)[None, :]
        tl.store(y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


    @triton.jit
    def _sum_splits_kernel(p_ptr, y_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """y = the float32 partial sums [SPLITS, numel] added in split order, rounded once to y's dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < numel
        acc = tl.load(p_ptr + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(p_ptr + s * numel + i, mask=ok, other=0.0)
        tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


def dot_precision(dtype: torch.dtype) -> str:
    """The kernel's `tl.dot` input precision for activations of `dtype`: IEEE float32 for float32 (Triton's
    default there is TF32), and for bf16/fp16, whose dots multiply in that dtype anyway, Triton's default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in [0, 15] -> [N, K / 2] bytes, input 2j in the low nibble and 2j + 1 in the high one."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


class TritonQuantMatmul:
    """x W^T for a QuantWeight on a GPU (or under the interpreter): the kernel above over the weight's codes,
    scales and zero points in the model's dtype, moved to `device` once."""

    def __init__(self, w: QuantWeight, device: torch.device | str) -> None:
        if w.kind == "int4" and w.shape[1] % 2:
            raise ValueError("int4 weights need an even number of inputs to pack two codes a byte")
        self.kind, self.group_size, self.dtype = w.kind, w.group_size, w.dtype
        self.out_features, self.in_features = w.shape
        self.codes = (pack_int4(w.codes) if w.kind == "int4" else w.codes.contiguous()).to(device)
        self.scales = w.scales.to(w.dtype).contiguous().to(device)
        self.zeros = w.zeros.to(w.dtype).contiguous().to(device) if w.zeros is not None else self.scales

    def __call__(self, x: torch.Tensor, block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        x = x.contiguous()
        grid = (triton.cdiv(m, block_m), triton.cdiv(self.out_features, block_n))
        _quant_mm_kernel[grid](x, self.codes, self.scales, self.zeros, y, m, self.out_features, self.in_features,
                               x.stride(0), self.codes.stride(0), self.scales.stride(0) if self.scales.dim() > 1 else 1,
                               y.stride(0), GROUP=self.group_size, INT4=self.kind == "int4",
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               PRECISION=dot_precision(x.dtype))
        return y

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales] + ([self.zeros] if self.kind == "int4" else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


FP8_BLOCK_N = 64
FP8_PROGRAMS_PER_SM = 2  # programs in flight per SM that keep a weight-streaming kernel at memory bandwidth
FP8_MIN_TILES_PER_SPLIT = 4  # each split sums at least 4 tiles of inputs: partial sums cost a write and a read


@dataclass(frozen=True)
class Fp8Tuning:
    """How the weight-only kernel is launched: the programs per SM the split of the inputs aims at, the output
    columns a program computes, its warps and its loads' pipeline stages (Triton's defaults: 4 and 3). On an
    H200 the defaults stream the 8B shape's weights at 2.0-2.3 TB/s, about 55% of the copy rate;
    bench/gpu_check.py's `fp8_tuning` times other settings at the decode sizes to find better ones."""

    programs_per_sm: int = FP8_PROGRAMS_PER_SM
    block_n: int = FP8_BLOCK_N
    num_warps: int = 4
    num_stages: int = 3
    # steps of up to `gemv_rows` rows take `_fp8_gemv_kernel` (0: none do), in tiles of gemv_block_n outputs by
    # gemv_block_k inputs (for a block-scaled weight, at most its group)
    gemv_rows: int = 0
    gemv_block_n: int = 16
    gemv_block_k: int = 256

    def __post_init__(self) -> None:
        for name in ("block_n", "gemv_block_n", "gemv_block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Fp8Tuning.{name} must be a power of two, got {v}")


def split_k(output_tiles: int, k_tiles: int, sms: int, programs_per_sm: int = FP8_PROGRAMS_PER_SM) -> int:
    """How many slices of the inputs to sum in programs of their own: enough for `programs_per_sm` programs on
    every SM where the output's tiles alone are fewer, never slices under FP8_MIN_TILES_PER_SPLIT tiles. A
    function of the shapes and the GPU only, so a step's kernels are the same at every replay of a CUDA graph."""
    want = -(-programs_per_sm * sms // output_tiles)
    return max(1, min(want, k_tiles // FP8_MIN_TILES_PER_SPLIT))


class TritonFp8Matmul:
    """x W^T for an fp8 weight (model/quant/fp8.py's `Fp8Weight`) with `_fp8_mm_kernel`: the weight read once
    as one byte a value, for any activation dtype. `sms` (the GPU's multiprocessor count; 1 under the
    interpreter) sets the split of the inputs."""

    path = "triton"
    kind = "fp8"

    def __init__(self, w: Fp8Weight, sms: int | None = None, tuning: Fp8Tuning = Fp8Tuning()) -> None:
        self.tuning = tuning
        self.out_features, self.in_features = w.shape
        self.per_row, self.group = w.per_row, w.group_size
        self.block_k = 128 if w.per_row else _largest_tile_dividing(w.group_size)
        if self.block_k is None:
            raise ValueError(f"fp8 groups of {w.group_size} inputs: the kernel takes groups of a multiple of 16")
        self.gemv_block_k = (tuning.gemv_block_k if w.per_row
                             else min(tuning.gemv_block_k, self.block_k))  # block_k divides the group
        self.codes = w.codes.contiguous()
        self.scales = w.scales.contiguous()
        dev = self.codes.device
        self.sms = sms if sms is not None else (
            torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1)

    def __call__(self, x: torch.Tensor, splits: int | None = None) -> torch.Tensor:
        m, n, k = x.shape[0], self.out_features, self.in_features
        if m == 0:
            return x.new_empty(0, n)
        x = x.contiguous()
        tune = self.tuning
        gemv = m <= tune.gemv_rows
        block_m = triton.next_power_of_2(m) if gemv else min(64, max(16, triton.next_power_of_2(m)))
        block_n, block_k = (tune.gemv_block_n, self.gemv_block_k) if gemv else (tune.block_n, self.block_k)
        m_tiles, n_tiles, k_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        splits = splits or split_k(m_tiles * n_tiles, k_tiles, self.sms, tune.programs_per_sm)
        k_split = triton.cdiv(k_tiles, splits) * block_k
        splits = triton.cdiv(k, k_split)
        y = torch.empty(splits, m, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
        args = (x, self.codes, self.scales, y, m, n, k, k_split, x.stride(0), self.codes.stride(0),
                self.scales.stride(0), y.stride(0), y.stride(1))
        if gemv:
            _fp8_gemv_kernel[(n_tiles, splits)](
                *args, GROUP=self.group, PER_ROW=self.per_row, ROWS=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=tune.num_warps, num_stages=tune.num_stages)
        else:
            _fp8_mm_kernel[(m_tiles, n_tiles, splits)](
                *args, GROUP=self.group, PER_ROW=self.per_row, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                PRECISION=dot_precision(x.dtype), num_warps=tune.num_warps, num_stages=tune.num_stages)
        if splits == 1:
            return y[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # the partial sums added in one kernel
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](y, out, m * n, SPLITS=splits, BLOCK=SUM_BLOCK)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


def _largest_tile_dividing(group: int) -> int | None:
    return next((b for b in (128, 64, 32, 16) if group % b == 0), None)
