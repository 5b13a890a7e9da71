"""FP8 (float8_e4m3fn) linear weights with float32 scales, and their two matmuls.

A weight is kept as e4m3 codes plus one float32 scale per output row, or, as block-scaled checkpoints give
them (DeepSeek-V3, Qwen3-FP8: one scale per 128x128 block), one per row and group of `group_size` inputs:
w = code * scale. Quantized at load (`quantize_fp8`), a row's scale is absmax / 448, e4m3's largest finite
value, so no code saturates.

- `Fp8ScaledMatmul` (CUDA, compute capability >= 8.9, bfloat16 activations): each token's activations are
  quantized to e4m3 with a scale of their own (absmax / 448; one Triton kernel, model/quant/triton_fp8.py),
  then `torch._scaled_mm` multiplies codes by codes on the FP8 tensor cores and applies both scales (row-wise:
  [T, 1] and [1, N]) in its epilogue. A block-scaled weight is dequantized and requantized per row for it
  (row-wise scaling takes one scale per output), which rounds each weight a second time.
- `TritonFp8Matmul` (model/quant/triton_matmul.py; CUDA, compute capability >= 8.9, with Triton): the weight
  alone in fp8, converted to the activations' dtype in registers, for any dtype. A step of up to
  `WEIGHT_ONLY_ROWS` rows (decode) reads the weight and little else, and quantizing its activations would add
  kernels without saving bytes, so `Fp8ByRows` sends such steps there and larger ones (prefill, where the FP8
  tensor cores' rate is what counts) to `_scaled_mm`; where `_scaled_mm` does not apply, it takes every step.
- `Fp8ReferenceMatmul` (everywhere else: the CPU, older GPUs, other dtypes or shapes): the weight dequantized
  to the activations' dtype, then an ordinary matmul. Exact with respect to the stored weight, so tests on the
  CPU hold the numerics of the checkpoint to transformers run on the dequantized weights; activations are
  not quantized there, which is the one way it differs from the fast path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # imported where it runs: Triton loads only for a GPU's kernels
    from servelm.model.quant.triton_matmul import TritonFp8Matmul

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# up to this many rows a step runs the weight-only kernel. On an H200 at the 8B shape's linears it was the
# faster of the two at 16 rows (0.111 ms for the four against 0.146) and the slower at 64 (0.185 against
# 0.135), where the weight-only kernel's larger row tiles cost more than _scaled_mm's activation quantization
WEIGHT_ONLY_ROWS = 16
MIN_SCALE = 1e-12  # an all-zero row or token: codes 0 whatever the scale; never divide by zero


@dataclass
class Fp8Weight:
    """A linear's [N, K] weight as e4m3 codes and float32 scales ([N, ceil(K / group_size)]; one column for
    a per-row scale, where group_size is K). `dtype` is the model's: what the reference path dequantizes to."""

    codes: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N, G] float32
    group_size: int
    dtype: torch.dtype
    source: str  # fp8 (quantized at load), fp8/tensor, fp8/channel, fp8/block128x128: for log lines

    kind = "fp8"

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.codes.dtype != FP8:
            raise ValueError(f"fp8 codes must be float8_e4m3fn, got {self.codes.dtype}")
        groups = -(-k // self.group_size)
        if tuple(self.scales.shape) != (n, groups) or self.scales.dtype != torch.float32:
            raise ValueError(f"fp8 scales of a [{n}, {k}] weight in groups of {self.group_size} must be float32 "
                             f"[{n}, {groups}], got {self.scales.dtype} {list(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def per_row(self) -> bool:
        return self.scales.shape[1] == 1

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.codes.to(device), self.scales.to(device), self.group_size, self.dtype, self.source)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """code * scale in float32, rounded once to `dtype` (default the model's)."""
        k = self.codes.shape[1]
        scales = self.scales if self.per_row else self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
        return (self.codes.float() * scales).to(dtype or self.dtype)


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype | None = None, source: str = "fp8") -> Fp8Weight:
    """One float32 scale per output row, absmax / 448: the row's largest weight maps to e4m3's largest value."""
    w32 = w.float()
    scales = (w32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    codes = (w32 / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(codes, scales, w.shape[1], dtype or w.dtype, source)


def requantize_per_row(w: Fp8Weight) -> Fp8Weight:
    """A group-scaled weight as one with a scale per row (what row-wise `_scaled_mm` takes); a second rounding."""
    return w if w.per_row else quantize_fp8(w.dequantize(torch.float32), w.dtype, w.source + "/per-row")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: (e4m3 codes [T, K], float32 scales [T, 1]), x ~= codes * scales."""
    x32 = x.float()
    scales = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return (x32 / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


def quantize_fp8_linears(tensors: Iterable[tuple[str, object]], dtype: torch.dtype,
                         is_linear: Callable[[str], bool]) -> Iterator[tuple[str, object]]:
    """The tensors with every 2-D float linear weight `is_linear` names quantized to fp8 (one at a time, as
    loaded); weights already in fp8 (a checkpoint's) pass as they are."""
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point() and is_linear(name):
            t = quantize_fp8(t, dtype)
        yield name, t


class Fp8ReferenceMatmul:
    """x W^T with W dequantized to x's dtype at each call: exact for the stored weight, on any device."""

    path = "reference"
    kind = "fp8"

    def __init__(self, w: Fp8Weight) -> None:
        self.w = w
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.dequantize(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [self.w.codes, self.w.scales]


class Fp8ScaledMatmul:
    """x W^T on the FP8 tensor cores: x quantized per token, `torch._scaled_mm` with row-wise scales, the
    output in x's dtype (bfloat16: what row-wise scaling returns). Where a build of `_scaled_mm` wants the row
    count a multiple of 16 (`row_multiple`, found by `fp8_matmul`'s trial call), a step's rows are zero padded
    up to one: a copy of the activations, small beside the weight read."""

    path = "scaled_mm"
    kind = "fp8"

    def __init__(self, w: Fp8Weight, row_multiple: int = 1) -> None:
        w = requantize_per_row(w)
        self.out_features, self.in_features = w.shape
        self.row_multiple = row_multiple
        self.codes = w.codes.contiguous()  # [N, K] row-major: its .t() is the column-major [K, N] mat2
        self.scale_b = w.scales.reshape(1, -1).contiguous()  # [1, N]
        self.quantize = quantize_rows
        if self.codes.is_cuda:  # one Triton kernel instead of four PyTorch ones, with the same bits
            from servelm.model.quant import triton_fp8

            if triton_fp8.HAS_TRITON:
                self.quantize = triton_fp8.quantize_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        pad = -t % self.row_multiple
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        xq, scale_a = self.quantize(x)
        y = torch._scaled_mm(xq, self.codes.t(), scale_a=scale_a, scale_b=self.scale_b, out_dtype=x.dtype)
        return y[:t] if pad else y

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale_b]


def scaled_mm_applies(w: Fp8Weight) -> str | None:
    """Why the `_scaled_mm` path does not take w here (None where it does)."""
    dev = w.codes.device
    if dev.type != "cuda":
        return f"on {dev.type}"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} < 8.9 (no FP8 tensor cores)"
    if w.dtype != torch.bfloat16:
        return f"dtype {w.dtype} (row-wise scaled FP8 matmuls return bfloat16)"
    n, k = w.shape
    if n % 16 or k % 16:
        return f"shape [{n}, {k}] not a multiple of 16"
    return None


class Fp8ByRows:
    """A step of up to `WEIGHT_ONLY_ROWS` rows through `small` (the weight-only kernel), larger ones through
    `large` (`_scaled_mm`), both over the same per-row weight."""

    path = "triton+scaled_mm"
    kind = "fp8"

    def __init__(self, small: TritonFp8Matmul, large: Fp8ScaledMatmul) -> None:
        self.small, self.large = small, large
        self.out_features, self.in_features = large.out_features, large.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= WEIGHT_ONLY_ROWS else self.large(x)

    def tensors(self) -> list[torch.Tensor]:
        return self.large.tensors()  # the same storage as small's


def weight_only_applies(w: Fp8Weight) -> str | None:
    """Why the Triton weight-only kernel does not take w here (None where it does)."""
    dev = w.codes.device
    if dev.type != "cuda":  # (before importing Triton: a CPU process never loads it)
        return f"on {dev.type}"
    from servelm.model.quant.triton_matmul import HAS_TRITON

    if not HAS_TRITON:
        return "Triton is not installed"
    if torch.cuda.get_device_capability(dev) < (8, 9):  # Triton converts e4m3 from sm89 on
        return "compute capability < 8.9"
    if not w.per_row and w.group_size % 16:
        return f"groups of {w.group_size} inputs"
    return None


def _scaled(w: Fp8Weight) -> tuple[Fp8ScaledMatmul | None, str | None]:
    """`_scaled_mm` over w where it applies and runs (rows padded to a multiple of 16 where one row is
    refused), else (None, why)."""
    why = scaled_mm_applies(w)
    if why is None:
        for rows in (1, 16):
            try:
                mm = Fp8ScaledMatmul(w, rows)
                mm(torch.zeros(1, mm.in_features, dtype=w.dtype, device=w.codes.device))  # shapes checked on call
                return mm, None
            except RuntimeError as e:
                why = f"_scaled_mm failed: {str(e).splitlines()[0]}"
    return None, why


def fp8_matmul(w: Fp8Weight) -> Fp8ByRows | TritonFp8Matmul | Fp8ScaledMatmul | Fp8ReferenceMatmul:
    """The fastest of the paths that apply (see the module's docstring): both fast paths split by rows, else
    the one that applies, else the reference (logged once per reason)."""
    scaled, why = _scaled(w)
    weight_only = weight_only_applies(w)
    if weight_only is None:
        from servelm.model.quant.triton_matmul import TritonFp8Matmul

        if scaled is not None:  # both over the per-row weight `_scaled_mm` holds: one copy
            per_row = Fp8Weight(scaled.codes, scaled.scale_b.view(-1, 1), scaled.in_features, w.dtype, w.source)
            return Fp8ByRows(TritonFp8Matmul(per_row), scaled)
        return TritonFp8Matmul(w)
    if scaled is not None:
        return scaled
    if w.codes.device.type == "cuda" and why not in _logged:
        _logged.add(why)
        logger.warning("fp8 weights run the reference path (dequantized each call): %s; %s", why, weight_only)
    return Fp8ReferenceMatmul(w)


_logged: set[str] = set()
