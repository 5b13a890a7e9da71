"""Quantized linears on NVIDIA GPUs: a Triton matmul that dequantizes `QuantWeight` tiles on the fly.

The same formats as the CPU kernels (model/quant/weight_only.py), from the same codes: int8 with one scale per output
row (w = code * scale), and int4 in groups along the inputs with a scale and a zero point each
(w = (code - 8) * scale + zero), which also holds a GGUF file's Q4_0, Q4_1 and Q4_K blocks. int4 codes are
packed two to a byte (the even input in the low nibble), so a decode step reads half a byte per weight.
Each program computes a [BLOCK_M, BLOCK_N] tile of x W^T, accumulating in float32. A tile of weights is
dequantized in float32, then rounded to the activations' dtype: bf16 and fp16 tiles multiply on the tensor
cores in that dtype, float32 ones in IEEE float32 (`input_precision="ieee"`; Triton's default for float32
dots is TF32, whose 10-bit mantissa costs about 1e-3 relative error per product).

Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks it
against dequantize-then-matmul. This module imports without Triton; `HAS_TRITON` says if it can run.
"""

from __future__ import annotations

import torch

from servelm.model.quant.weight_only import QuantWeight

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
