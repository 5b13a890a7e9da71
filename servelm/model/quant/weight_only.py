"""Weight-only quantized linears that stay quantized in memory, run by PyTorch's own CPU kernels.

Two formats, both dequantized on the fly inside the matmul (activations stay in the model's dtype):

- int8: one symmetric scale per output row, w = code * scale (code in [-127, 127]);
  `torch.ops.aten._weight_int8pack_mm`.
- int4: one scale and one zero point per group of `group_size` inputs of a row,
  w = (code - 8) * scale + zero (code in [0, 15]), torchao's int4 weight-only formula;
  `torch.ops.aten._weight_int4pack_mm_for_cpu` over `_convert_weight_to_int4pack_for_cpu`'s layout.

A checkpoint's linears are quantized at load (`quantize_linears`), or a GGUF file's Q4_0, Q4_1 and Q4_K
tensors are taken as they are (gguf_loader): each 32-weight block of those has one scale and one offset,
which is exactly int4 with groups of 32 (the codes exactly; the float16 scales as the model's dtype
holds them: exactly in float32, rounded to 8 significant bits in bfloat16).

The kernels read scales and activations in one dtype, and on x86 are vectorized for bfloat16 only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from servelm.model.quant.fp8 import Fp8Weight
from servelm.model.quant.gguf import GGUFBlocks

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel takes
# The linears that are quantized: attention and MLP projections. Embeddings and lm_head stay in the
# model's dtype (the embedding is read a row at a time; a tied lm_head is the same tensor).
LINEAR_WEIGHTS = tuple(f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"))
_INNER_K_TILES = 2  # the CPU packing ignores it beyond validating it; torchao passes 2, 4 or 8


def is_linear_weight(name: str) -> bool:
    return name.endswith(LINEAR_WEIGHTS)


@dataclass
class QuantWeight:
    """A linear's [N, K] weight as integer codes plus scales (and zero points); not yet packed for a kernel.

    `dtype` is the model's dtype: the kernels take activations, scales and zero points in one dtype, so the
    scales (float32 as a GGUF file's blocks give them) are rounded to it when packed, and `dequantize`
    rounds them likewise: it gives the weight the kernel computes with."""

    kind: str  # int8 | int4
    codes: torch.Tensor  # [N, K]: int8 in [-127, 127] (int8), uint8 in [0, 15] (int4)
    scales: torch.Tensor  # [N] (int8) or [N, K / group_size] (int4)
    zeros: torch.Tensor | None  # int4: [N, K / group_size]
    group_size: int  # int4: inputs per scale; int8: K
    dtype: torch.dtype
    source: str  # what it was made from (int8, int4, Q4_1, ...): for log lines

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def to(self, device: torch.device | str) -> QuantWeight:
        """The same weight with its codes, scales and zero points on `device` (a GPU: model/quant/triton_matmul.py)."""
        return QuantWeight(self.kind, self.codes.to(device), self.scales.to(device),
                           None if self.zeros is None else self.zeros.to(device), self.group_size, self.dtype,
                           self.source)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight the kernels compute with (float32 arithmetic, then `dtype`, default the model's)."""
        scales = self.scales.to(self.dtype).float()
        if self.kind == "int8":
            w = self.codes.float() * scales[:, None]
        else:
            n, k = self.shape
            grouped = self.codes.reshape(n, k // self.group_size, self.group_size).float() - 8
            w = (grouped * scales[..., None] + self.zeros.to(self.dtype).float()[..., None]).reshape(n, k)
        return w.to(dtype or self.dtype)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (what the kernel will read), kept in float32 for the arithmetic around it."""
    return x.to(dtype).float()


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> QuantWeight:
    """Symmetric per-output-row int8: scale = max|w| / 127 (rounded to `dtype` first, as the kernel reads it)."""
    w32 = w.float()
    scales = (w32.abs().amax(dim=1) / 127).to(dtype)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # an all-zero row: codes 0, any scale
    codes = torch.round(w32 / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight("int8", codes, scales, None, w.shape[1], dtype, "int8")


def quantize_int4(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> QuantWeight:
    """Asymmetric group-wise int4 (torchao's int4 weight-only): per group, scale = (max - min) / 15 and
    zero = min + 8 * scale, so that w = (code - 8) * scale + zero spans [min, max]."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"a linear with {k} inputs cannot be quantized in groups of {group_size} "
                         f"(quantization_group_size must divide every linear's input width)")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = _rounded((hi - lo).clamp(min=1e-6) / 15, dtype)
    zeros = _rounded(lo + 8 * scales, dtype)
    codes = torch.round((g - (zeros - 8 * scales)[..., None]) / scales[..., None]).clamp_(0, 15)
    return QuantWeight("int4", codes.to(torch.uint8).reshape(n, k), scales.to(dtype), zeros.to(dtype), group_size,
                       dtype, "int4")


def quantize_linears(tensors: Iterable[tuple[str, torch.Tensor]], kind: str, group_size: int,
                     dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """The checkpoint's tensors with every attention/MLP linear weight quantized (one at a time, as loaded)."""
    for name, t in tensors:
        if is_linear_weight(name) and isinstance(t, torch.Tensor) and t.dim() == 2:
            t = quantize_int8(t, dtype) if kind == "int8" else quantize_int4(t, group_size, dtype)
        yield name, t


@dataclass
class RowParts:
    """A fused weight (Q/K/V, gate/up) whose row blocks keep different formats: a GGUF file's Q6_K V beside
    Q4_K Q and K, or a kept part beside one dequantized for want of a kernel. Each part keeps its own format
    and runs its own kernel into its columns of the one output (layers.PartsLinear); neighbours in one format
    are fused into one part (one kernel call)."""

    parts: list  # torch.Tensor | QuantWeight | GGUFBlocks, in row order

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def source(self) -> str:
        return "+".join(_format(p) for p in self.parts)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight in `dtype` (default the model's): each part dequantized as it would be alone."""
        ref = next(p for p in self.parts if not isinstance(p, torch.Tensor))
        dtype = dtype or ref.dtype
        return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype)
                          for p in self.parts]).contiguous()


def _format(p) -> str:
    """What a part is stored as: a GGUF type, int8/int4, fp8, or the float dtype of a dense tensor."""
    return str(p.dtype).removeprefix("torch.") if isinstance(p, torch.Tensor) else p.source


def _same_format(a, b) -> bool:
    """Whether two row blocks can be stacked into one weight of their common format."""
    if isinstance(a, GGUFBlocks) and isinstance(b, GGUFBlocks):
        return (a.qtype, a.in_features) == (b.qtype, b.in_features)
    if isinstance(a, QuantWeight) and isinstance(b, QuantWeight):
        return (a.kind, a.group_size, a.scales.dtype) == (b.kind, b.group_size, b.scales.dtype)
    if isinstance(a, Fp8Weight) and isinstance(b, Fp8Weight):
        return (a.group_size, a.scales.shape[1]) == (b.group_size, b.scales.shape[1])
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def _stack(parts: list) -> torch.Tensor | QuantWeight | GGUFBlocks:
    """Row blocks of one format as one weight of it."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, GGUFBlocks):
        return GGUFBlocks(first.qtype, torch.cat([p.raw for p in parts]), first.in_features, first.dtype)
    if isinstance(first, QuantWeight):
        return QuantWeight(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           None if first.zeros is None else torch.cat([p.zeros for p in parts]), first.group_size,
                           first.dtype, first.source)
    if isinstance(first, Fp8Weight):
        return Fp8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), first.group_size,
                         first.dtype, first.source)
    return torch.cat(parts).contiguous()


def fuse_rows(parts: list) -> torch.Tensor | QuantWeight | GGUFBlocks | RowParts:
    """Weights stacked along their output rows (fused Q/K/V, gate/up): one weight where all parts share one
    format (dense tensors, as always with quantization none), else a RowParts of the runs of neighbours in one
    format, each kept in its own (a Q4_K_M file's Q6_K V beside Q4_K Q and K)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts).contiguous()
    runs: list[list] = []
    for p in parts:
        if runs and _same_format(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) == 1:
        return _stack(runs[0])
    return RowParts([_stack(r) for r in runs])


class QuantMatmul:
    """x W^T for a QuantWeight, through PyTorch's packed int8/int4 CPU kernels. On x86 they are vectorized
    (AVX512 or AVX2, accumulating in float32) for bfloat16 only; float32 and float16 take a scalar loop."""

    def __init__(self, w: QuantWeight) -> None:
        self.kind, self.group_size, self.dtype = w.kind, w.group_size, w.dtype
        self.out_features, self.in_features = w.shape
        if w.kind == "int8":
            self.codes = w.codes.contiguous()
            self.scales = w.scales.to(w.dtype).contiguous()
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32).contiguous(),
                                                                             _INNER_K_TILES)
            # [K / group, N, 2]: (scale, zero) pairs, the kernels' layout
            self.scales_zeros = torch.stack([w.scales, w.zeros], dim=-1).to(w.dtype).transpose(0, 1).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        x = x.to(self.dtype)
        if not x.is_contiguous() or x.data_ptr() % 64:  # the int8 kernel's vector loads assume aligned rows
            x = x.clone(memory_format=torch.contiguous_format)
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)

    def tensors(self) -> list[torch.Tensor]:
        """What it keeps in memory."""
        return [self.codes, self.scales] if self.kind == "int8" else [self.packed, self.scales_zeros]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quant_matmul(w: QuantWeight):
    """A kernel for w, or None (logged) where the kernels do not take it: the caller dequantizes then.
    On the CPU PyTorch's: the int4 kernel needs N a multiple of 16, the int8 kernel K a multiple of 32 (its
    vector loop has no tail). On a GPU the Triton kernel (model/quant/triton_matmul.py), where Triton is installed."""
    if w.codes.device.type == "cuda":
        from servelm.model.quant.triton_matmul import HAS_TRITON, TritonQuantMatmul

        if HAS_TRITON:
            return TritonQuantMatmul(w, w.codes.device)
    if w.codes.device.type != "cpu":
        logger.info("quantized weight on %s: no kernel, dequantized", w.codes.device)
        return None
    if w.kind == "int8" and w.shape[1] % 32:
        logger.info("int8 weight %s: inputs not a multiple of 32, dequantized", list(w.shape))
        return None
    try:
        mm = QuantMatmul(w)
        mm(torch.zeros(1, mm.in_features, dtype=w.dtype))  # the kernels check shapes only when called
        return mm
    except RuntimeError as e:
        logger.info("%s weight %s: no %s kernel for this shape (%s); dequantized", w.source, list(w.shape), w.kind,
                    str(e).splitlines()[0])
        return None
