"""The linear kernel is chosen once per weight, by one function (model/layers/linear_kernels.py): from the weight's
dtype, device and format, and whether servelm's C++ kernels are built. Each choice computes x W^T (+ b), and the
ones the batch-invariant mode accepts (`fixed_order`) give a row the same bits alone or in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers import linear_kernels as lk
from servelm.model.layers.blocks import GateUpLinear, Linear
from servelm.model.quant.weight_only import quantize_int4, quantize_int8

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")


def _bf16_kernel_name() -> str:
    """What this CPU's build runs a bf16 weight of 64 inputs on."""
    if kernels.amx_linear_supported(64):
        return "amx"
    return "avx512" if kernels.avx512_linear_supported(64) else "dense"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_weights_on_the_cpu_take_a_fixed_order_cpp_kernel(dtype):
    torch.manual_seed(0)
    w, b, x = torch.randn(40, 64, dtype=dtype), torch.randn(40, dtype=dtype), torch.randn(7, 64, dtype=dtype)
    k = lk.select_linear(w, b)
    assert k.name == ("dense" if dtype == torch.float32 else _bf16_kernel_name()) and k.fixed_order
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(k(x, b).float(), ref, rtol=2e-2, atol=5e-2)
    assert torch.equal(k(x[3:4], b), k(x, b)[3:4])  # a row alone or among others: the same bits


@needs_kernels
def test_a_bias_of_another_dtype_keeps_the_weight_off_the_cpp_kernels():
    """Their stores add a bias of the weight's dtype; a float32 bias beside bf16 weights goes to PyTorch."""
    w, b = torch.randn(32, 64).bfloat16(), torch.randn(32)
    k = lk.select_linear(w, b)
    assert k.name in ("onednn", "torch") and not k.fixed_order


def test_without_the_cpp_kernels_bf16_takes_onednn_and_float32_takes_torch(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    torch.manual_seed(1)
    w32, x32 = torch.randn(24, 32), torch.randn(3, 32)
    k32 = lk.select_linear(w32)
    assert k32.name == "torch" and k32.tensors() == [w32]
    torch.testing.assert_close(k32(x32), x32 @ w32.T)
    w16 = w32.bfloat16()
    expected = "onednn" if lk._onednn_packed(w16) is not None else "torch"
    k16 = lk.select_linear(w16)
    assert k16.name == expected and not k16.fixed_order
    torch.testing.assert_close(k16(x32.bfloat16()).float(), (x32.bfloat16().float() @ w16.float().T),
                               rtol=2e-2, atol=5e-2)
    assert Linear(w32).weight is w32  # the row-major weight is kept only where F.linear reads it


def test_another_device_takes_torch():
    w = torch.empty(16, 32, device="meta")
    k = lk.select_linear(w)
    assert k.name == "torch" and k(torch.empty(2, 32, device="meta")).shape == (2, 16)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_weight_stays_quantized(kind):
    torch.manual_seed(2)
    w = torch.randn(32, 64).bfloat16()
    q = quantize_int8(w, torch.bfloat16) if kind == "int8" else quantize_int4(w, 32, torch.bfloat16)
    lin = Linear(q, torch.randn(32).bfloat16())
    assert lin.kernel.name == kind and lin.quant is lin.kernel.matmul and lin.weight is None
    x = torch.randn(4, 64).bfloat16()
    torch.testing.assert_close(lin(x).float(), (F.linear(x, q.dequantize()) + lin.bias).float(), rtol=2e-2, atol=1e-1)


@needs_kernels
def test_gate_up_fuses_where_the_halves_are_whole_16_row_groups():
    torch.manual_seed(3)
    x, gate, up = torch.randn(5, 64), torch.randn(32, 64), torch.randn(32, 64)
    fused = GateUpLinear(gate, up)
    assert fused.kernel is not None and fused.kernel.name == "dense" and fused.linear is None
    torch.testing.assert_close(fused(x), F.silu(x @ gate.T) * (x @ up.T), rtol=1e-5, atol=1e-5)
    # the kernel's interleaved store, put back in [gate | up] order
    torch.testing.assert_close(fused.preactivation(x), torch.cat([x @ gate.T, x @ up.T], dim=1), rtol=1e-5, atol=1e-5)
    odd = GateUpLinear(torch.randn(40, 64), torch.randn(40, 64))  # 40 rows: not whole 16-row groups
    assert odd.kernel is None and odd.linear is not None and odd.linear.kernel.name == "dense"
    gelu = GateUpLinear(gate, up, act="gelu_tanh")  # no kernel fuses GeGLU
    assert gelu.kernel is None and gelu.linear is not None
