"""Building blocks of the decoder: RMSNorm, rotary embedding, and a linear layer with prepacked weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.model import cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused kernel accumulates in float32 like transformers; in bf16 it rounds once where
    # transformers rounds twice (before and after the weight), a difference of at most one bf16 ulp.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] (the half-split "rotate_half" convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


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
