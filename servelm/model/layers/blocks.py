"""Building blocks of the decoder: RMSNorm, rotary embedding, SiLU-and-multiply (fused C++ kernels for float32
and bf16 on CPU, fused Triton kernels for the norms, SiLU-and-multiply and RoPE with the KV-cache write on CUDA, PyTorch
elsewhere), and the linear layers over the kernel chosen once per weight (model/layers/linear_kernels.py)."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.linear_kernels import (
    GateUpKernel,
    LinearKernel,
    QuantKernel,
    TorchKernel,
    select_gate_up,
    select_linear,
)
from servelm.model.quant.fp8 import Fp8ReferenceMatmul, Fp8ScaledMatmul, Fp8Weight
from servelm.model.quant.gguf import GGUFBlocks, GGUFMatmul, ReferenceMatmul
from servelm.model.quant.weight_only import QuantMatmul, QuantWeight, RowParts, fuse_rows


def fused_kernels(dtype: torch.dtype, device: torch.device | str = "cpu"):
    """The C++ module when its fused norm/rotary/SiLU kernels apply to this model (float32 or bf16 on the CPU),
    else None. With them every op of a decode step is a kernel call, so the step can be replayed from a tape."""
    if torch.device(device).type != "cpu":
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.fused_elementwise_supported(torch.empty(1, dtype=dtype)) else None


_graph_warmup = threading.local()  # set while a decode graph's eager warm-up runs (`graph_warmup`)


@contextlib.contextmanager
def graph_warmup():
    """The eager pass before a CUDA graph's capture runs the kernels the capture will (so that Triton compiles
    and loads them here, outside the capture, which records launches only)."""
    _graph_warmup.on = True
    try:
        yield
    finally:
        _graph_warmup.on = False


def _gpu_kernels(x: torch.Tensor):
    """model/kernels/triton_elementwise.py for a CUDA tensor while a CUDA graph is being captured (or warmed up), where Triton is
    installed, else None (imported on first use: a CPU process never imports Triton for these). Only in graphs:
    a replay launches them for free, while an eager launch of a Triton kernel costs the host several times a
    torch kernel's. Measured on an H200 with them in every step: batch-1 decode (graphs) 14-32% faster, but the
    eager prefill-heavy W1-big 18% slower on the 1B shape and 256-row greedy decoding of the 60M shape 33% slower."""
    if not x.is_cuda or not (torch.cuda.is_current_stream_capturing() or getattr(_graph_warmup, "on", False)):
        return None
    from servelm.model.kernels import triton_elementwise

    return triton_elementwise if triton_elementwise.HAS_TRITON else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused=None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm over the last dim (into `out` when given; it may be x). The fused kernel rounds to the dtype where
    transformers does; torch's own kernel (elsewhere) rounds once where transformers rounds twice, a
    difference of at most one bf16 ulp. On CUDA one Triton kernel, rounding as torch's."""
    if fused is not None:
        out = torch.empty_like(x) if out is None else out
        fused.rms_norm(out, x, weight, eps)
        return out
    gpu = _gpu_kernels(x)
    if gpu is not None and gpu.norm_applies(x, weight, out):
        return gpu.rms_norm(x, weight, eps, out)
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused=None
                 ) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm(residual): a sublayer's residual add fused with the next norm
    (one kernel on the CPU and on CUDA)."""
    if fused is not None:
        out = torch.empty_like(residual)
        fused.add_rms_norm(out, delta, residual, weight, eps)
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
        fused.rotary_(x, positions, cos, sin)
        return
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    x.copy_(apply_rotary(x, cos, sin))


def _gpu_rope(x: torch.Tensor):
    """model/kernels/triton_rope.py under `_gpu_kernels`' rule (a CUDA tensor while a graph is captured), else None."""
    if _gpu_kernels(x) is None:
        return None
    from servelm.model.kernels import triton_rope

    return triton_rope if triton_rope.HAS_TRITON else None


def rotary_write_kv(qk: torch.Tensor, v: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> bool:
    """RoPE over the queries and keys of qk [T, H + KVH, D] (the queries rotated in place) with the rotated keys
    and the values v [T, KVH, D] written into the paged cache at `slots`: one Triton kernel on CUDA, where it
    takes the tensors (cos/sin: the whole [max_pos, D] tables). False, having done nothing, elsewhere: the
    caller then runs `rotary_` and the attention backend writes the cache."""
    gpu = _gpu_rope(qk)
    if gpu is None or not gpu.applies(qk, v, cos, sin, kv_cache):
        return False
    gpu.rope_write_kv(qk, v, num_heads, positions, cos, sin, kv_cache, slots)
    return True


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
    """silu(gate) * up for x = [gate | up] along the last dim (one kernel on the CPU and on CUDA)."""
    if fused is not None:
        return fused.silu_mul(x)
    gpu = _gpu_kernels(x)
    if gpu is not None and gpu.silu_mul_applies(x):
        return gpu.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class Linear:
    """y = x W^T + b through the kernel `select_linear` chose for the weight (model/layers/linear_kernels.py): on
    the CPU one of servelm's C++ kernels wherever one takes the weight (AMX tiles, AVX512-BF16, or the dense
    kernel), each summing every output row in one fixed order whatever the number of rows, so a token gets the
    same bits in a decode batch of any size and in a prefill chunk of any length (oneDNN's bf16 matmul changes
    its blocking with the row count and gave rows that differed in a few elements from 65 rows on, which made
    outputs depend on scheduling). Without the C++ kernels, bf16 weights run on oneDNN's blocked layout and the
    rest on F.linear; quantized weights stay quantized (int8/int4 on PyTorch or Triton, GGUF blocks on
    servelm's kernels, fp8 on `torch._scaled_mm` or its reference)."""

    def __init__(self, weight: torch.Tensor | QuantWeight | GGUFBlocks | Fp8Weight, bias: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[0]
        self.kernel: LinearKernel = select_linear(weight, bias)
        # the C++ kernels' stores read the bias as a contiguous row
        self.bias = bias.contiguous() if bias is not None and not isinstance(self.kernel, TorchKernel) else bias

    @property
    def quant(self) -> QuantMatmul | GGUFMatmul | ReferenceMatmul | Fp8ScaledMatmul | Fp8ReferenceMatmul | None:
        """The quantized matmul where the weight stays quantized, else None."""
        return self.kernel.matmul if isinstance(self.kernel, QuantKernel) else None

    @property
    def weight(self) -> torch.Tensor | None:
        """The row-major weight where the kernel reads that layout (F.linear), else None (no such copy is kept)."""
        return self.kernel.weight if isinstance(self.kernel, TorchKernel) else None

    def __call__(self, x: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """x W^T + b in x's dtype; with `float32`, the kernel's float32 sums unrounded where it stores them
        (`stores_float32`: servelm's C++ kernels), else its output as it is."""
        if float32 and self.kernel.stores_float32:
            return self.kernel(x, self.bias, out_dtype=torch.float32)
        return self.kernel(x, self.bias)


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
        self.weight = None
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
        # a kernel with the SiLU-and-multiply in its store; else a plain linear and the activation after it
        self.kernel: GateUpKernel | None = select_gate_up(weight, gate.shape[0]) if act == "silu" else None
        self.linear = linear_for(weight) if self.kernel is None else None

    @property
    def quant(self) -> GGUFMatmul | None:
        """The GGUF matmul where the fused kernel keeps the weight in GGUF blocks, else None."""
        return self.kernel.matmul if isinstance(self.kernel, QuantKernel) else None

    def preactivation(self, x: torch.Tensor) -> torch.Tensor:
        """x [Wg; Wu]^T before the activation, as [T, 2I] = [gate | up] (what a LoRA update is added to). The
        kernels that fuse the activation store their outputs with gate and up interleaved 16 columns at a time
        (`pack_weight_for_tiles`' gate_up order); that order is undone here, one activation-sized copy."""
        if self.linear is not None:
            return self.linear(x)
        pre = self.kernel(x, None)
        t = pre.shape[0]
        return pre.view(t, -1, 2, 16).transpose(1, 2).reshape(t, self.out_features)

    def activate(self, pre: torch.Tensor, fused=None) -> torch.Tensor:
        """act(gate) * up of a [gate | up] pre-activation (`preactivation`'s layout)."""
        if self.act == "gelu_tanh":
            gate, up = pre.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        return silu_mul(pre, fused)

    def __call__(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.silu_mul(x)
        return self.activate(self.linear(x), fused)
