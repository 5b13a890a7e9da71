"""How a linear layer's weight is multiplied: one `LinearKernel` per path, chosen once per weight by
`select_linear` (any linear) or `select_gate_up` (a [gate; up] weight whose SiLU-and-multiply a kernel fuses).

A float weight on the CPU takes the first of these that applies:

- `TileKernel`: the C++ AMX tile matmul (bf16 on CPUs with AMX) over tile-packed weights;
- `Avx512Kernel`: the C++ AVX512-BF16 kernel over the same packing (bf16 on Zen 4/5 and Intel without AMX);
- `DenseKernel`: the C++ fixed-order dense kernel over 16-column panels (float32, or bf16 on any other CPU);
- `OneDnnKernel`: oneDNN's blocked layout, where servelm's kernels are off or not built (bf16 only);
- `TorchKernel`: `F.linear` (the GPU, float16, and the rest).

A quantized weight keeps its format in a `QuantKernel`: int8/int4 on PyTorch's CPU kernels or the Triton
matmul on a GPU (model/quant/weight_only.py), GGUF blocks on servelm's kernels (model/quant/gguf.py). An fp8
weight takes an `Fp8Kernel`: on GPUs of compute capability 8.9 and newer, a Triton weight-only kernel for
decode-sized steps and `torch._scaled_mm` on the FP8 tensor cores for larger ones, else the exact reference
(dequantize, then matmul; model/quant/fp8.py).

The three C++ float kernels and the GGUF block kernel sum each output row in one fixed order whatever the
number of rows (`fixed_order`), so a token's bits never depend on what it was batched with; the
`batch_invariant` mode accepts only those (model/layers/invariant.py). They also take a [gate; up] weight with
the SiLU-and-multiply fused into the store of each finished block (`silu_mul`), where the weight's halves are
whole 16-row groups, and store their float32 sums unrounded when asked (`stores_float32`, `out_dtype`): a bf16
model's logits, where rounding to bf16 would tie tokens whose logits differ by less than one bf16 step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.quant.fp8 import Fp8ByRows, Fp8ReferenceMatmul, Fp8ScaledMatmul, Fp8Weight, fp8_matmul
from servelm.model.quant.gguf import (
    GGUFBlocks,
    GGUFMatmul,
    ReferenceMatmul,
    gguf_kernels,
    gguf_matmul,
    reference_selected,
)
from servelm.model.quant.weight_only import QuantMatmul, QuantWeight, quant_matmul

if TYPE_CHECKING:  # imported where it runs: Triton loads only with a GPU's kernels
    from servelm.model.quant.triton_matmul import TritonFp8Matmul


class LinearKernel(Protocol):
    """y = x W^T (+ bias) over a weight held in the kernel's own layout."""

    name: str  # amx | avx512 | dense | onednn | torch | the quantized format (int8, int4, q4_k, ...)
    fixed_order: bool  # each row summed in one order whatever the row count (batch invariant)
    # sums in float32 and, called with out_dtype=torch.float32 (a keyword only these kernels take), stores the
    # sums (+ bias) unrounded instead of in the input's dtype
    stores_float32: bool

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds (what the weight costs in memory)."""
        ...


class GateUpKernel(LinearKernel, Protocol):
    """A kernel over a [gate; up] weight packed with its halves interleaved 16 rows at a time, which can fuse
    silu(gate) * up into its store. Its plain call returns that interleaved order (`preactivation` undoes it)."""

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor: ...


# --- the kernels' weight layouts ----------------------------------------------------------------------------
def _rows_in_blocks_of_32(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """w's rows zero padded to a multiple of 32, after (with `gate_up`: w is [gate; up], halves of a multiple of
    16 rows) interleaving its halves 16 rows at a time, so that each block of 32 rows holds 16 gate rows and the
    matching 16 up rows: the order the kernels' fused SiLU-and-multiply stores read."""
    if gate_up:
        w = w.reshape(2, w.shape[0] // 32, 16, w.shape[1]).transpose(0, 1).reshape(w.shape)
    n, k = w.shape
    n_pad = (n + 31) // 32 * 32
    return torch.cat([w, w.new_zeros(n_pad - n, k)]) if n_pad != n else w


def pack_weight_for_tiles(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """[N, K] -> the AMX kernel's order: per 32 output rows (N zero padded), per 32 inputs, two tiles of
    [16 input pairs][16 outputs][2] ([N/32, K/32, 2, 16, 32]). With `gate_up`, w is [gate; up] (halves of
    a multiple of 16 rows) and the halves are first interleaved 16 rows at a time, so that each block of
    32 holds matching gate and up outputs for the kernel's fused SiLU-and-multiply."""
    w = _rows_in_blocks_of_32(w, gate_up)
    n_pad, k = w.shape
    return w.reshape(n_pad // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def pack_dense_weight(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """[N, K] -> the dense kernel's panels of 16 output columns, [N_pad / 16, K, 16] (N zero padded to a
    multiple of 32), in the gate/up order of `pack_weight_for_tiles` with `gate_up`."""
    w = _rows_in_blocks_of_32(w, gate_up)
    n_pad, k = w.shape
    return w.reshape(n_pad // 16, 16, k).transpose(1, 2).contiguous()


def _onednn_packed(w: torch.Tensor) -> torch.Tensor | None:
    """w reordered once into oneDNN's blocked layout for `_linear_pointwise`, or None where it does not apply."""
    if not (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except RuntimeError:
        return None


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# --- the kernels --------------------------------------------------------------------------------------------
class TileKernel:
    """The AMX tile matmul over `pack_weight_for_tiles`' layout (1.2-1.8x faster than oneDNN for 1-32 rows,
    within 0.8-1.25x of it for prefill chunks)."""

    name = "amx"
    fixed_order = True
    stores_float32 = True

    def __init__(self, kernels, weight: torch.Tensor, gate_up: bool = False) -> None:
        self.kernels, self.out_features = kernels, weight.shape[0]
        self.tiled = pack_weight_for_tiles(weight, gate_up)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        return self.kernels.amx_linear(x, self.tiled, self.out_features, bias, out_dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.amx_linear_silu_mul(x, self.tiled, self.out_features)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tiled]


class Avx512Kernel(TileKernel):
    """The AVX512-BF16 kernel over the tile layout (on Zen 4, cold weights: 2.1x oneDNN at 1 row, 1.9x at 8,
    1.16x at 64, 1.02-1.04x at 256-2048; `bench/decode_linear.py`)."""

    name = "avx512"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        return self.kernels.avx512_linear(x, self.tiled, self.out_features, bias, out_dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.avx512_linear_silu_mul(x, self.tiled, self.out_features)


class DenseKernel:
    """The fixed-order dense kernel (csrc/dense_linear.cpp) over `pack_dense_weight`'s panels: each output summed
    over the inputs in order (oneDNN's and MKL's matmuls change their sums with the row count, differently on each
    CPU)."""

    name = "dense"
    fixed_order = True
    stores_float32 = True

    def __init__(self, kernels, weight: torch.Tensor, gate_up: bool = False) -> None:
        self.kernels, self.out_features = kernels, weight.shape[0]
        self.panels = pack_dense_weight(weight, gate_up)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        return self.kernels.dense_linear(x, self.panels, self.out_features, bias, out_dtype=out_dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.dense_linear(x, self.panels, self.out_features, silu_mul=True)

    def tensors(self) -> list[torch.Tensor]:
        return [self.panels]


class OneDnnKernel:
    """oneDNN's bf16 matmul over its blocked layout, reordered once (no promise about a row's bits)."""

    name = "onednn"
    fixed_order = False
    stores_float32 = False

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _onednn_linear(x, self.packed, bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


class TorchKernel:
    """F.linear over the row-major weight."""

    name = "torch"
    fixed_order = False
    stores_float32 = False  # cuBLAS sums bf16 in float32 too, but F.linear returns the input's dtype

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


class QuantKernel:
    """A weight kept quantized: `matmul` is the int8/int4 (PyTorch or Triton) or GGUF-block matmul. The GGUF
    kernels add a bf16 bias in their store (`bias_inside`), and store float32 when asked; the others add it
    after."""

    def __init__(self, matmul: QuantMatmul | GGUFMatmul | ReferenceMatmul, bias: torch.Tensor | None,
                 gate_up: bool = False) -> None:
        self.matmul = matmul
        self.name = matmul.kind
        self.fixed_order = isinstance(matmul, GGUFMatmul)
        self.bias_inside = isinstance(matmul, (GGUFMatmul, ReferenceMatmul)) and (
            bias is None or bias.dtype == torch.bfloat16)
        self.stores_float32 = isinstance(matmul, GGUFMatmul) and self.bias_inside

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        if out_dtype is not None:  # only where stores_float32
            return self.matmul(x, bias, out_dtype=out_dtype)
        if self.bias_inside:
            return self.matmul(x, bias)
        y = self.matmul(x)
        return y if bias is None else y + bias

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, None, silu_mul=True)

    def tensors(self) -> list[torch.Tensor]:
        return self.matmul.tensors()


class Fp8Kernel(QuantKernel):
    """An fp8 weight (model/quant/fp8.py): `path` says which matmul runs it: triton (weight-only), scaled_mm
    (activations quantized per token, FP8 tensor cores), triton+scaled_mm (split by the step's rows) or
    reference (the weight dequantized at each call). The bias is added after."""

    def __init__(self, matmul: Fp8ByRows | Fp8ScaledMatmul | Fp8ReferenceMatmul | TritonFp8Matmul) -> None:
        super().__init__(matmul, None)
        self.path = matmul.path


# --- choosing ------------------------------------------------------------------------------------------------
def _float_cpu_kernel(weight: torch.Tensor, gate_up: bool) -> TileKernel | DenseKernel | None:
    """The C++ kernel that takes this float weight on the CPU (AMX, else AVX512-BF16, else dense), or None."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    k = cpu_kernels.load()
    if k is None:
        return None
    if weight.dtype == torch.bfloat16 and k.amx_linear_supported(weight.shape[1]):
        return TileKernel(k, weight, gate_up)
    if weight.dtype == torch.bfloat16 and k.avx512_linear_supported(weight.shape[1]):
        return Avx512Kernel(k, weight, gate_up)
    return DenseKernel(k, weight, gate_up)


def select_linear(weight: torch.Tensor | QuantWeight | GGUFBlocks | Fp8Weight, bias: torch.Tensor | None = None
                  ) -> LinearKernel:
    """The kernel for `weight` (with `bias`, added by the kernel or after it). A quantized weight no kernel
    takes in its format is dequantized (an fp8 one always has a kernel: the reference runs anywhere); a bias
    of another dtype than the weight keeps it off the C++ kernels, whose stores add a bias of the weight's dtype."""
    if isinstance(weight, Fp8Weight):
        return Fp8Kernel(fp8_matmul(weight))
    if isinstance(weight, (QuantWeight, GGUFBlocks)):
        matmul = quant_matmul(weight) if isinstance(weight, QuantWeight) else gguf_matmul(weight)
        if matmul is not None:
            return QuantKernel(matmul, bias)
        weight = weight.dequantize()
    if bias is None or bias.dtype == weight.dtype:
        kernel = _float_cpu_kernel(weight, gate_up=False)
        if kernel is not None:
            return kernel
    packed = _onednn_packed(weight)
    return OneDnnKernel(packed) if packed is not None else TorchKernel(weight)


def select_gate_up(weight: torch.Tensor | QuantWeight | GGUFBlocks, half_rows: int) -> GateUpKernel | None:
    """A kernel that fuses silu(gate) * up into its store for the [gate; up] `weight` (halves of `half_rows`),
    or None where none takes it (quantized int8/int4, halves not whole 16-row groups, other devices)."""
    if half_rows % 16:
        return None
    if isinstance(weight, GGUFBlocks):
        k = None if reference_selected() else gguf_kernels(weight)
        return QuantKernel(GGUFMatmul(weight, k, gate_up=True), None) if k is not None else None
    if not isinstance(weight, torch.Tensor):
        return None
    return _float_cpu_kernel(weight, gate_up=True)
