"""The `batch_invariant` mode: a model whose every token gets the same bits whatever it was batched with.

The C++ kernels (bf16 linears, attention) already sum each row in one fixed order; this swaps in
equivalents for the parts they do not cover (float32, and bf16 with `SERVELM_CPU_KERNELS=0` or widths the
kernels do not take):

- Linears run in float32 through oneDNN over a prepacked float32 weight, at least two rows per call.
  PyTorch's default float32 matmul (MKL) gives rows different sums below 16 rows and, on two threads,
  splits some shapes' reductions between threads for some row counts; oneDNN's float32 matmul gave
  every row the same bits from 2 rows on (1-16 threads, 2-2048 rows, SmolLM2-to-Llama-7B shapes), and
  one row takes a path of its own, so a lone row is duplicated. A bf16 model's linears widen their input
  (bf16 products are exact in float32) and round the result once; the weight is kept in float32 (2x its
  memory), as oneDNN's bf16 matmul changes its blocking with the row count.
- SiLU is `g / (exp(-g) + 1)`: PyTorch's silu kernel rounds differently in its vector loop and in the
  scalar loop that finishes each thread's share of the elements, and where a share ends depends on the
  number of rows; exp gives the same bits in both.
- Attention: `attention.invariant` (prompt positions, and decodes where the C++ decode kernel is absent).

Norms, rotary, residual adds and the sampler already work row by row.
"""

from __future__ import annotations

import torch

from servelm.model.attention import CpuPagedAttention
from servelm.model.attention.invariant import InvariantCpuPagedAttention, InvariantPagedAttention
from servelm.model.decoder import DecoderLM
from servelm.model.layers import GateUpLinear, Linear


def _dense_weight(lin: Linear) -> torch.Tensor:
    """The row-major weight of a Linear that has no C++ kernel (oneDNN's blocked copy reordered back)."""
    return lin.weight if lin.weight is not None else lin.packed.to_dense()


class InvariantLinear:
    """y = x W^T + b in float32 through oneDNN, each row summed the same way whatever the row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.out_features = weight.shape[0]
        self.dtype = dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous())
        self.bias = None if bias is None else bias.float().contiguous()

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 result, before rounding to the model's dtype."""
        n = x.shape[0]
        if n == 0:
            return x.new_empty(0, self.out_features, dtype=torch.float32)
        x = x.float()
        if n == 1:  # one row takes oneDNN's matrix-vector path, which sums in another order
            x = torch.cat([x, x])
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return y[:n]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.float32(x).to(self.dtype)


class InvariantGateUp:
    """silu(x Wg^T) * (x Wu^T) in float32 (rounded once), SiLU in a form whose bits do not depend on the row
    count."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.linear = InvariantLinear(weight, None, dtype)
        self.out_features = weight.shape[0]
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        gate, up = self.linear.float32(x).chunk(2, dim=-1)
        return (gate / (torch.exp(-gate) + 1) * up).to(self.dtype)


def _convert_linear(lin: Linear, dtype: torch.dtype) -> Linear | InvariantLinear:
    if lin.tiles is not None or lin.avx512 is not None:  # a C++ kernel: one fixed order already
        return lin
    return InvariantLinear(_dense_weight(lin), lin.bias, dtype)


def _convert_gate_up(gu: GateUpLinear, dtype: torch.dtype) -> GateUpLinear | InvariantGateUp:
    if gu.linear is None:  # a C++ kernel with SiLU fused
        return gu
    return InvariantGateUp(_dense_weight(gu.linear), dtype)


def make_batch_invariant(model: DecoderLM) -> None:
    """Switch `model` (in place, for good) to the batch-invariant mode. CPU only; needs oneDNN."""
    # Gemma's layer loop and soft-capped attention, and the experts' linears, have no invariant variant
    if model.spec.sandwich_norms or model.spec.moe is not None:
        raise ValueError(f"batch_invariant is not supported for {model.spec.architecture}")
    if model.embed.device.type != "cpu":
        raise ValueError("batch_invariant runs on the CPU only")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("batch_invariant needs PyTorch built with oneDNN (torch.backends.mkldnn)")
    if getattr(model, "batch_invariant", False):
        return
    if any(getattr(lin, "quant", None) is not None for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.down)):
        raise ValueError("batch_invariant is not supported with quantized weights (quantization must be none)")
    dt = model.dtype
    model.lm_head = _convert_linear(model.lm_head, dt)
    for lw in model.layers:
        lw.qkv = _convert_linear(lw.qkv, dt)
        lw.o_proj = _convert_linear(lw.o_proj, dt)
        lw.down = _convert_linear(lw.down, dt)
        lw.gate_up = _convert_gate_up(lw.gate_up, dt)
    a = model.attn
    args = (a.num_heads, a.num_kv_heads, a.head_dim, a.scale)
    if isinstance(a, CpuPagedAttention):
        model.attn = InvariantCpuPagedAttention(*args, kernels=a.kernels)
    else:
        model.attn = InvariantPagedAttention(*args)
    if model.tapes is not None:  # recorded over the linears and attention just replaced
        model.tapes.reset()
    model.batch_invariant = True
