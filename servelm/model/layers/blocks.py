"""Building blocks of the decoder: RMSNorm, rotary embedding, SiLU-and-multiply (fused C++ kernels for bf16 on
CPU, fused Triton kernels for the norms and SiLU-and-multiply on CUDA, PyTorch elsewhere), and a linear layer
with prepacked weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.quant.gguf import (
    GGUFBlocks,
    GGUFMatmul,
    ReferenceMatmul,
    gguf_kernels,
    gguf_matmul,
    reference_selected,
)
from servelm.model.quant.weight_only import QuantMatmul, QuantWeight, RowParts, fuse_rows, quant_matmul


def fused_kernels(dtype: torch.dtype, device: torch.device | str = "cpu"):
    """The C++ module when its fused bf16 norm/rotary/SiLU kernels apply to this model, else None."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.fused_elementwise_supported(torch.empty(1, dtype=dtype)) else None


def _gpu_kernels(x: torch.Tensor):
    """model/kernels/triton_elementwise.py for a CUDA tensor while a CUDA graph is being captured, where Triton is
    installed, else None (imported on first use: a CPU process never imports Triton for these). Only in graphs:
    a replay launches them for free, while an eager launch of a Triton kernel costs the host several times a
    torch kernel's. Measured on an H200 with them in every step: batch-1 decode (graphs) 14-32% faster, but the
    eager prefill-heavy W1-big 18% slower on the 1B shape and 256-row greedy decoding of the 60M shape 33% slower."""
    if not x.is_cuda or not torch.cuda.is_current_stream_capturing():
        return None
    from servelm.model.kernels import triton_elementwise

    return triton_elementwise if triton_elementwise.HAS_TRITON else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused=None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm over the last dim (into `out` when given; it may be x). The fused kernel rounds to bf16 where
    transformers does; torch's own kernel (elsewhere) rounds once where transformers rounds twice, a
    difference of at most one bf16 ulp. On CUDA one Triton kernel, rounding as torch's."""
    if fused is not None:
        out = torch.empty_like(x) if out is None else out
        fused.rms_norm_bf16(out, x, weight, eps)
        return out
    gpu = _gpu_kernels(x)
    if gpu is not None and gpu.norm_applies(x, weight, out):
        return gpu.rms_norm(x, weight, eps, out)
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused=None
                 ) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm(residual): a sublayer's residual add fused with the next norm
    (one kernel on the CPU in bf16 and on CUDA)."""
    if fused is not None:
        out = torch.empty_like(residual)
        fused.add_rms_norm_bf16(out, delta, residual, weight, eps)
        return out
    gpu = _gpu_kernels(residual)
    if gpu is not None and gpu.norm_applies(residual, weight, delta):
        return gpu.add_rms_norm(delta, residual, weight, eps)
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


def contiguous_rows(x: torch.Tensor, fused=None) -> torch.Tensor:
    """x as a contiguous tensor. A column slice of a fused projection (each row laid out contiguously) is
    copied by a kernel where the fused kernels apply, so that a decode step's kernel tape holds the copy
    (model/kernels/tape.py); the same bytes as x.contiguous()."""
    if x.is_contiguous():
        return x
    if fused is not None and x.dim() >= 2 and x.is_cpu:
        out = torch.empty(x.shape, dtype=x.dtype)
        if x.stride()[1:] == out.stride()[1:]:
            fused.copy_rows(out, x)
            return out
    return x.contiguous()


def silu_mul(x: torch.Tensor, fused=None) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim (one kernel on the CPU in bf16 and on CUDA)."""
    if fused is not None:
        return fused.silu_mul_bf16(x)
    gpu = _gpu_kernels(x)
    if gpu is not None and gpu.silu_mul_applies(x):
        return gpu.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _can_prepack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _onednn_packed(w: torch.Tensor) -> torch.Tensor | None:
    """w reordered once into oneDNN's blocked layout for `_linear_pointwise`, or None where it does not apply."""
    if not _can_prepack(w):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except RuntimeError:
        return None


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _tile_kernels(w: torch.Tensor):
    """The C++ kernels when their AMX tile matmul takes this bf16 weight, else None."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.amx_linear_supported(w.shape[1]) else None


def pack_weight_for_tiles(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """[N, K] -> the AMX kernel's order: per 32 output rows (N zero padded), per 32 inputs, two tiles of
    [16 input pairs][16 outputs][2] ([N/32, K/32, 2, 16, 32]). With `gate_up`, w is [gate; up] (halves of
    a multiple of 16 rows) and the halves are first interleaved 16 rows at a time, so that each block of
    32 holds matching gate and up outputs for the kernel's fused SiLU-and-multiply."""
    w = _rows_in_blocks_of_32(w, gate_up)
    n_pad, k = w.shape
    return w.reshape(n_pad // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def _rows_in_blocks_of_32(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """w's rows zero padded to a multiple of 32, after (with `gate_up`: w is [gate; up], halves of a multiple of
    16 rows) interleaving its halves 16 rows at a time, so that each block of 32 rows holds 16 gate rows and the
    matching 16 up rows: the order the kernels' fused SiLU-and-multiply stores read."""
    if gate_up:
        w = w.reshape(2, w.shape[0] // 32, 16, w.shape[1]).transpose(0, 1).reshape(w.shape)
    n, k = w.shape
    n_pad = (n + 31) // 32 * 32
    return torch.cat([w, w.new_zeros(n_pad - n, k)]) if n_pad != n else w


def _avx512_kernels(w: torch.Tensor):
    """The C++ kernels when their AVX512-BF16 linear kernel takes this bf16 weight, else None."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.avx512_linear_supported(w.shape[1]) else None


def _dense_kernels(w: torch.Tensor):
    """The C++ kernels when their fixed-order dense linear (csrc/dense_linear.cpp) takes this weight (float32
    or bf16 on the CPU, any build variant), else None."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernels.load()


def pack_dense_weight(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """[N, K] -> the dense kernel's panels of 16 output columns, [N_pad / 16, K, 16] (N zero padded to a
    multiple of 32), in the gate/up order of `pack_weight_for_tiles` with `gate_up`."""
    w = _rows_in_blocks_of_32(w, gate_up)
    n_pad, k = w.shape
    return w.reshape(n_pad // 16, 16, k).transpose(1, 2).contiguous()


class Linear:
    """y = x W^T + b. On CPU in bf16, where the CPU has AMX, every input goes to the C++ AMX tile matmul over
    the weight packed by `pack_weight_for_tiles` (1.2-1.8x faster than oneDNN for 1-32 rows, within
    0.8-1.25x of it for prefill chunks, shared machine). Each output row is summed in one fixed order
    whatever the number of rows, so a token gets the same bits in a decode batch of any size and in a
    prefill chunk of any length; oneDNN's bf16 matmul changes its blocking with the row count and gave
    rows that differed in a few elements from 65 rows on, which made outputs depend on scheduling. With
    AVX512-BF16 but no AMX (AMD Zen 4/5) the C++ AVX512 kernel over the same packed weight takes every
    input, with the same property (on Zen 4, cold weights: 2.1x oneDNN at 1 row, 1.9x at 8, 1.16x at 64,
    1.02-1.04x at 256-2048; `bench/decode_linear.py`).
    Where neither tile kernel takes the weight (float32 models on any CPU; bf16 on CPUs without AVX512-BF16),
    the C++ dense kernel does, over panels packed by `pack_dense_weight`: each output summed over the inputs in
    order, so again a token's bits never depend on its batch (oneDNN's and MKL's matmuls change their sums with
    the row count, differently on each CPU). Without the C++ kernels (SERVELM_CPU_KERNELS=0, another device),
    bf16 weights are reordered once into oneDNN's blocked layout where the CPU has it, and the rest is plain
    F.linear; those paths give no such promise. A `QuantWeight` (int8 or int4, model/quant/weight_only.py) stays quantized
    and runs through PyTorch's packed int8/int4 CPU kernels (`quant`), or is dequantized where they do not take
    it."""

    def __init__(self, weight: torch.Tensor | QuantWeight | GGUFBlocks, bias: torch.Tensor | None = None) -> None:
        self.quant: QuantMatmul | GGUFMatmul | ReferenceMatmul | None = None
        if isinstance(weight, (QuantWeight, GGUFBlocks)):
            self.quant = quant_matmul(weight) if isinstance(weight, QuantWeight) else gguf_matmul(weight)
            if self.quant is not None:  # no float copy and no other kernel: tiles/avx512 None keep the
                self.bias, self.out_features, self.weight = bias, weight.shape[0], None  # C++ loop off
                self.tiles = self.avx512 = self.tiled = self.packed = self.dense = self.panels = None
                # the GGUF kernels add a bf16 bias in their store
                self.bias_inside = isinstance(self.quant, (GGUFMatmul, ReferenceMatmul)) and (
                    bias is None or bias.dtype == torch.bfloat16)
                if self.bias_inside and bias is not None:
                    self.bias = bias.contiguous()
                return
            weight = weight.dequantize()
        self.bias = bias
        self.out_features = weight.shape[0]
        self.weight: torch.Tensor | None = weight
        same = bias is None or bias.dtype == weight.dtype
        self.tiles = _tile_kernels(weight) if same else None
        self.avx512 = _avx512_kernels(weight) if same and self.tiles is None else None
        if bias is not None and (self.tiles or self.avx512) is not None:
            self.bias = bias.contiguous()
        self.tiled = pack_weight_for_tiles(weight) if (self.tiles or self.avx512) is not None else None
        self.dense = _dense_kernels(weight) if same and self.tiled is None else None
        self.panels = pack_dense_weight(weight) if self.dense is not None else None
        if self.dense is not None and bias is not None:
            self.bias = bias.contiguous()
        self.packed = _onednn_packed(weight) if self.tiled is None and self.dense is None else None
        if self.packed is not None or self.tiled is not None or self.dense is not None:
            self.weight = None  # no row-major copy: oneDNN and the kernels read their own layouts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            if self.bias_inside:
                return self.quant(x, self.bias)
            y = self.quant(x)
            return y if self.bias is None else y + self.bias
        if self.tiles is not None:
            return self.tiles.amx_linear(x, self.tiled, self.out_features, self.bias)
        if self.avx512 is not None:
            return self.avx512.avx512_linear(x, self.tiled, self.out_features, self.bias)
        if self.dense is not None:
            return self.dense.dense_linear(x, self.panels, self.out_features, self.bias)
        if self.packed is not None:
            return _onednn_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class PartsLinear:
    """y = x W^T + b for a fused weight whose row blocks keep different formats (model/quant/weight_only.py RowParts: a
    Q4_K_M file's Q6_K V beside Q4_K Q and K). Each part is a `Linear` of its own (its kernel, its slice of the
    bias) and its output is copied into its columns of the one [M, N] output by the C++ row copy, so a decode
    step's kernel tape holds only kernel calls (model/kernels/tape.py); torch.cat where the kernels are not built.
    The copy is M x N activations, small beside the weights a decode step reads."""

    def __init__(self, weight: RowParts, bias: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.parts: list[Linear] = []
        self.columns: list[tuple[int, int]] = []
        # each part's format as it runs: a GGUF type or int8/int4 where kept, else the dtype it was dequantized to
        self.formats: list[str] = []
        n0 = 0
        for p in weight.parts:
            n1 = n0 + p.shape[0]
            lin = Linear(p, None if bias is None else bias[n0:n1])
            self.parts.append(lin)
            self.columns.append((n0, n1))
            self.formats.append(lin.quant.kind if lin.quant is not None else str(p.dtype).removeprefix("torch."))
            n0 = n1
        # what it keeps quantized, per part (None where nothing is: every part dense)
        self.quant = [lin.quant for lin in self.parts if lin.quant is not None] or None
        self.weight = self.tiles = self.avx512 = self.tiled = self.packed = self.dense = self.panels = None
        self.kernels = cpu_kernels.load()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [lin(x) for lin in self.parts]
        if self.kernels is None or not x.is_cpu or len({y.dtype for y in ys}) > 1:
            return torch.cat(ys, dim=-1)
        out = ys[0].new_empty(x.shape[0], self.out_features)
        for y, (n0, n1) in zip(ys, self.columns, strict=True):
            self.kernels.copy_into_rows(out[:, n0:n1], y)
        return out


def linear_for(weight: torch.Tensor | QuantWeight | GGUFBlocks | RowParts, bias: torch.Tensor | None = None
               ) -> Linear | PartsLinear:
    """The linear layer for a (possibly fused) weight: a PartsLinear where its parts keep different formats."""
    return PartsLinear(weight, bias) if isinstance(weight, RowParts) else Linear(weight, bias)


class GateUpLinear:
    """silu(x Wg^T) * (x Wu^T), the input half of a gated MLP. Where a C++ kernel takes the weight (the AMX
    tile matmul, else the AVX512-BF16 kernel, else the dense kernel; any number of rows), it runs with the
    SiLU-and-multiply in its store of each finished block, so the [T, 2I] projection never makes a round
    trip through memory, and rounds where the unfused chain does. Like `Linear`, one kernel for every row count
    keeps a token's bits independent of how it was batched (oneDNN for prefill chunks measured 1.02-1.35x
    faster at 512 tokens, but its sums change with the row count)."""

    def __init__(self, gate: torch.Tensor | QuantWeight | GGUFBlocks, up: torch.Tensor | QuantWeight | GGUFBlocks,
                 act: str = "silu") -> None:
        weight = fuse_rows([gate, up])
        self.out_features = weight.shape[0]
        self.act = act  # silu, or gelu_tanh (GeGLU: Gemma), which the fused kernels do not implement
        # GGUF blocks in servelm's kernels: the SiLU-and-multiply fused into their store as well
        self.quant = None
        if isinstance(weight, GGUFBlocks) and act == "silu" and gate.shape[0] % 16 == 0:
            k = None if reference_selected() else gguf_kernels(weight)
            if k is not None:
                self.quant = GGUFMatmul(weight, k, gate_up=True)
        if self.quant is not None:
            self.tiles = self.avx512 = self.tiled = self.linear = self.dense = self.panels = None
            return
        # the fused store takes whole 16-column groups; quantized weights go through Linear's kernels
        whole = gate.shape[0] % 16 == 0 and act == "silu" and isinstance(weight, torch.Tensor)
        self.tiles = _tile_kernels(weight) if whole else None
        self.avx512 = _avx512_kernels(weight) if whole and self.tiles is None else None
        self.tiled = pack_weight_for_tiles(weight, gate_up=True) if (self.tiles or self.avx512) is not None else None
        # no tile kernel: the dense kernel, with the SiLU-and-multiply in its store as well
        self.dense = _dense_kernels(weight) if whole and self.tiled is None else None
        self.panels = pack_dense_weight(weight, gate_up=True) if self.dense is not None else None
        self.linear = linear_for(weight) if self.tiled is None and self.dense is None else None

    def preactivation(self, x: torch.Tensor) -> torch.Tensor:
        """x [Wg; Wu]^T before the activation, as [T, 2I] = [gate | up] (what a LoRA update is added to). The
        kernels that fuse the activation store their outputs with gate and up interleaved 16 columns at a time
        (`pack_weight_for_tiles`' gate_up order); that order is undone here, one activation-sized copy."""
        if self.linear is not None:
            return self.linear(x)
        if self.quant is not None:
            pre = self.quant(x, None)
        elif self.tiles is not None:
            pre = self.tiles.amx_linear(x, self.tiled, self.out_features)
        elif self.dense is not None:
            pre = self.dense.dense_linear(x, self.panels, self.out_features)
        else:
            pre = self.avx512.avx512_linear(x, self.tiled, self.out_features)
        t = pre.shape[0]
        return pre.view(t, -1, 2, 16).transpose(1, 2).reshape(t, self.out_features)

    def activate(self, pre: torch.Tensor, fused=None) -> torch.Tensor:
        """act(gate) * up of a [gate | up] pre-activation (`preactivation`'s layout)."""
        if self.act == "gelu_tanh":
            gate, up = pre.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        return silu_mul(pre, fused)

    def __call__(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x, None, silu_mul=True)
        if self.linear is not None:
            if self.act == "gelu_tanh":
                gate, up = self.linear(x).chunk(2, dim=-1)
                return F.gelu(gate, approximate="tanh") * up
            return silu_mul(self.linear(x), fused)
        if self.tiles is not None:
            return self.tiles.amx_linear_silu_mul(x, self.tiled, self.out_features)
        if self.dense is not None:
            return self.dense.dense_linear(x, self.panels, self.out_features, silu_mul=True)
        return self.avx512.avx512_linear_silu_mul(x, self.tiled, self.out_features)
