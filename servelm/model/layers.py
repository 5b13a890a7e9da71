"""Building blocks of the decoder: RMSNorm, rotary embedding, SiLU-and-multiply (fused C++ kernels for bf16 on
CPU, PyTorch elsewhere), and a linear layer with prepacked weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.model import cpu_kernels


def fused_kernels(dtype: torch.dtype, device: torch.device | str = "cpu"):
    """The C++ module when its fused bf16 norm/rotary/SiLU kernels apply to this model, else None."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.fused_elementwise_supported(torch.empty(1, dtype=dtype)) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused=None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm over the last dim (into `out` when given; it may be x). The fused kernel rounds to bf16 where
    transformers does; torch's own kernel (elsewhere) rounds once where transformers rounds twice, a
    difference of at most one bf16 ulp."""
    if fused is not None:
        out = torch.empty_like(x) if out is None else out
        fused.rms_norm_bf16(out, x, weight, eps)
        return out
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused=None
                 ) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm(residual): a sublayer's residual add fused with the next norm."""
    if fused is not None:
        out = torch.empty_like(residual)
        fused.add_rms_norm_bf16(out, delta, residual, weight, eps)
        return out
    residual.add_(delta)
    return rms_norm(residual, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] (the half-split "rotate_half" convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
            fused=None) -> None:
    """Rotates x [T, H, D] in place. cos/sin are the [T, D] rows of x's positions, or, with `positions`,
    the [max_pos, D] tables read there (the fused kernel reads the tables directly)."""
    if fused is not None and positions is not None:
        fused.rotary_bf16_(x, positions, cos, sin)
        return
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    x.copy_(apply_rotary(x, cos, sin))


def silu_mul(x: torch.Tensor, fused=None) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    if fused is not None:
        return fused.silu_mul_bf16(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _can_prepack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _gemv_kernels(w: torch.Tensor):
    """The C++ kernels when they take single bf16 rows of this weight, else None."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not w.is_contiguous():
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.bf16_gemv_supported(w.shape[1]) else None


class Linear:
    """y = x W^T + b. On CPU in bf16 the weight is reordered once into oneDNN's blocked layout: with a
    model's worth of distinct weights (cold caches) that measured 1.2-1.6x faster than F.linear for
    1 to 128 rows, with identical results. A single row (batch-1 decode) goes to the C++ matrix-vector
    kernel instead, which needs the checkpoint's row-major weight: with it both layouts are kept, twice
    the weight memory for 2-3x faster batch-1 matmuls. Elsewhere it is plain F.linear; also the seam
    for quantized weight formats."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.gemv = _gemv_kernels(weight)
        if _can_prepack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
                if self.gemv is None:
                    self.weight = None  # keep only the packed copy
            except RuntimeError:
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] == 1:
            return self.gemv.bf16_gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
