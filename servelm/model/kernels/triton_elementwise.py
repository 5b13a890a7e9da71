"""Fused elementwise kernels in Triton for the decoder's per-layer work on NVIDIA GPUs: residual add + RMSNorm,
RMSNorm, and SiLU-and-multiply.

Why: a decode step of a small model on a GPU is bound by kernel launches and by the activations' round trips
through memory, not by arithmetic. In PyTorch the residual add and the norm after it are separate kernels, as
are SiLU and the multiply (each writing a full intermediate that the next reads back); here each is one kernel
that reads its inputs once. `model/layers/blocks.py` calls these for CUDA tensors where Triton is installed; the CPU
keeps its own paths (the C++ kernels, PyTorch).

Rounding follows the PyTorch path they replace: RMSNorm computes in float32 and rounds to the dtype once at the
end (as `F.rms_norm`), the residual add rounds its sum to the dtype (as `residual.add_`) before the norm reads it,
and SiLU rounds to the dtype before the multiply (as `F.silu(gate) * up`). Reductions and `exp` are not
PyTorch's own, so a result may differ from it in the last bit.

Without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks them
against the PyTorch functions. This module imports without Triton; `HAS_TRITON` says if it can run.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the kernels are simply unavailable
    HAS_TRITON = False

MAX_NORM_WIDTH = 16384  # one program holds a whole row in registers; wider rows stay on PyTorch
SILU_BLOCK = 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        out_ptr, x_ptr, res_ptr, w_ptr, n, inner, eps,
        sx0, sx1, so0, so1, sr0, sr1,
        ADD: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # one program per row; rows are (outer, inner) pairs of up to two leading dims with their own strides,
        # so a column slice of a fused projection ([T, heads, head_dim] views) is normed in place
        row = tl.program_id(0)
        a = (row // inner).to(tl.int64)
        b = (row % inner).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + a * sx0 + b * sx1 + offs, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            r_ptrs = res_ptr + a * sr0 + b * sr1 + offs
            r = (tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32) + x).to(res_ptr.dtype.element_ty)
            tl.store(r_ptrs, r, mask=ok)
            x = r.to(tl.float32)
        mean_sq = tl.sum(x * x, 0) / n
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(mean_sq + eps) * w
        tl.store(out_ptr + a * so0 + b * so1 + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(out_ptr, x_ptr, n, sx, so, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        gate = tl.load(x_ptr + row * sx + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * sx + n + offs, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * so + offs, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """t [..., D] as (rows, inner, outer stride, inner stride) with a unit last stride, or None where its
    leading dims do not fit two strides."""
    if t.stride(-1) != 1 or t.dim() < 1:
        return None
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0] * t.shape[1], max(1, t.shape[1]), t.stride(0), t.stride(1)
    try:
        return _rows(t.view(-1, t.shape[-1]))
    except RuntimeError:  # leading dims that no view flattens
        return None


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def _warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def norm_applies(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the norm kernels take x (and the other tensors of its shape): CUDA, Triton, a row that fits."""
    return (HAS_TRITON and _on_gpu(x) and x.dtype in DTYPES and x.shape[-1] <= MAX_NORM_WIDTH and x.numel() > 0
            and weight.is_contiguous() and weight.numel() == x.shape[-1]
            and all(t is None or (t.shape == x.shape and t.dtype == x.dtype and _rows(t) is not None)
                    for t in (x, *others)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim into `out` (a new tensor when None; it may be x itself)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _launch_norm(out, x, None, weight, eps)
    return out


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm(residual) into a new tensor."""
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch_norm(out, delta, residual, weight, eps)
    return out


def _launch_norm(out, x, residual, weight, eps) -> None:
    n = x.shape[-1]
    rows, inner, sx0, sx1 = _rows(x)
    _, _, so0, so1 = _rows(out)
    _, _, sr0, sr1 = _rows(residual) if residual is not None else (0, 1, 0, 0)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        out, x, x if residual is None else residual, weight, n, inner, eps,
        sx0, sx1, so0, so1, sr0, sr1,
        ADD=residual is not None, BLOCK=block, num_warps=_warps(block),
    )


def silu_mul_applies(x: torch.Tensor) -> bool:
    return (HAS_TRITON and _on_gpu(x) and x.dtype in DTYPES and x.shape[-1] % 2 == 0 and x.numel() > 0
            and _rows(x) is not None)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim, into a new contiguous tensor."""
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out2 = out.view(-1, n)
    rows = out2.shape[0]
    _silu_mul_kernel[(rows, triton.cdiv(n, SILU_BLOCK))](out2, x2, n, x2.stride(0), out2.stride(0),
                                                          BLOCK=SILU_BLOCK)
    return out
