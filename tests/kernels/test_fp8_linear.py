"""FP8 linears (model/quant/fp8.py): the per-row weight and per-token activation quantizers' error bounds, the
reference kernel against a float matmul, the `_scaled_mm` path's arithmetic where this CPU's torch runs it,
the kernel choice, row fusion, and bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.layers.blocks import Linear
from servelm.model.layers.linear_kernels import Fp8Kernel, select_linear
from servelm.model.quant.fp8 import (
    FP8,
    Fp8ReferenceMatmul,
    Fp8ScaledMatmul,
    Fp8Weight,
    fp8_matmul,
    quantize_fp8,
    quantize_rows,
    requantize_per_row,
    scaled_mm_applies,
)
from servelm.model.quant.weight_only import RowParts, fuse_rows

# e4m3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; below 2^-6 (times the scale) the
# subnormals' spacing of 2^-9 holds, so within 2^-10 of the scale absolutely
REL, SUB = 2.0 ** -4, 2.0 ** -10


def _bound(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.maximum(w.abs() * REL, scales * SUB)


def test_per_row_quantizer_error_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different ranges
    w[5] = 0.0  # an all-zero row
    q = quantize_fp8(w, torch.float32)
    assert q.codes.dtype == FP8 and q.scales.shape == (64, 1) and q.scales.dtype == torch.float32
    assert q.group_size == 96 and q.per_row and q.source == "fp8"
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= _bound(w, q.scales)).all()
    live = torch.arange(64) != 5
    assert torch.equal(q.codes.float().abs().amax(dim=1)[live], torch.full((63,), 448.0))  # no code saturates
    assert (q.dequantize()[5] == 0).all()
    # the model's dtype is what the reference path rounds the dequantized weight to
    assert quantize_fp8(w, torch.bfloat16).dequantize().dtype == torch.bfloat16


def test_per_token_activation_quantizer_error_is_within_e4m3_rounding():
    x = torch.randn(7, 128, dtype=torch.bfloat16) * 30
    x[3] = 0
    codes, scales = quantize_rows(x)
    assert codes.dtype == FP8 and scales.shape == (7, 1) and scales.dtype == torch.float32
    assert ((codes.float() * scales - x.float()).abs() <= _bound(x.float(), scales)).all()
    assert (codes[3].float() == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_kernel_is_dequantize_then_matmul_and_close_to_the_float_matmul(dtype):
    g = torch.Generator().manual_seed(1)
    w, x, bias = torch.randn(48, 80, generator=g), torch.randn(5, 80, generator=g), torch.randn(48, generator=g)
    q = quantize_fp8(w, dtype)
    lin = Linear(q, bias.to(dtype))
    assert isinstance(lin.kernel, Fp8Kernel) and lin.kernel.path == "reference" and lin.kernel.name == "fp8"
    assert lin.quant is not None and lin.quant.kind == "fp8" and lin.weight is None
    assert not lin.kernel.fixed_order  # batch_invariant refuses it
    y = lin(x.to(dtype))
    assert y.dtype == dtype
    assert torch.equal(y, F.linear(x.to(dtype), q.dequantize(dtype)) + bias.to(dtype))
    # against the unquantized weight: each product within the weight's rounding (plus the dtype's own)
    exact = F.linear(x, w) + bias
    bound = x.abs() @ _bound(w, q.scales).T
    slack = 0 if dtype == torch.float32 else 2.0 ** -8 * exact.abs() + 2.0 ** -8 * (x.abs() @ w.abs().T)
    assert ((y.float() - exact).abs() <= bound * 1.001 + slack + 1e-5).all()


def test_block_scaled_weight_dequantizes_by_groups_and_requantizes_per_row():
    g = torch.Generator().manual_seed(2)
    codes = (torch.randn(32, 40, generator=g) * 100).clamp(-448, 448).to(FP8)
    scales = torch.rand(32, 3, generator=g) + 0.1  # groups of 16 inputs, the last one ragged (8)
    w = Fp8Weight(codes, scales, 16, torch.float32, "fp8/block16x16")
    full = scales.repeat_interleave(16, dim=1)[:, :40]
    assert torch.equal(w.dequantize(), codes.float() * full)
    mm = Fp8ReferenceMatmul(w)
    x = torch.randn(3, 40, generator=g)
    assert torch.equal(mm(x), F.linear(x, codes.float() * full))
    r = requantize_per_row(w)
    assert r.per_row and r.source.endswith("/per-row")
    assert ((r.dequantize() - w.dequantize()).abs() <= _bound(w.dequantize(), r.scales)).all()


def test_scaled_mm_path_arithmetic_on_this_cpu_where_torch_runs_it():
    """The fast path's own steps (row padding, per-token scales, [T, 1] x [1, N] scaling) checked against the
    same arithmetic in float32, on the CPU where this torch's `_scaled_mm` takes row-wise scales (on GPUs:
    tests/gpu/test_fp8_gpu.py)."""
    g = torch.Generator().manual_seed(3)
    w = quantize_fp8(torch.randn(48, 64, generator=g), torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    xq, sa = quantize_rows(x)
    want = (xq.float() * sa) @ (w.codes.float() * w.scales).T
    for rows in (1, 16):  # 5 rows as they are, and padded to 16 inside
        try:
            y = Fp8ScaledMatmul(w, rows)(x)
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"this torch's CPU _scaled_mm does not take row-wise scales: {e}")
        assert y.shape == (5, 48) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


def test_the_fast_path_is_only_chosen_where_it_applies():
    w = quantize_fp8(torch.randn(32, 32), torch.bfloat16)
    assert scaled_mm_applies(w) == "on cpu"
    assert isinstance(fp8_matmul(w), Fp8ReferenceMatmul)
    assert isinstance(select_linear(w), Fp8Kernel)


def test_fused_rows_stack_fp8_weights_and_keep_other_formats_apart():
    g = torch.Generator().manual_seed(4)
    q, k, v = (quantize_fp8(torch.randn(n, 64, generator=g), torch.float32) for n in (64, 32, 32))
    fused = fuse_rows([q, k, v])
    assert isinstance(fused, Fp8Weight) and fused.shape == (128, 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in (q, k, v)]))
    dense = torch.randn(32, 64, generator=g)
    mixed = fuse_rows([q, k, dense])
    assert isinstance(mixed, RowParts) and [type(p) for p in mixed.parts] == [Fp8Weight, torch.Tensor]
    assert mixed.source == "fp8+float32"
    x = torch.randn(3, 64, generator=g)
    from servelm.model.layers.blocks import linear_for

    torch.testing.assert_close(linear_for(mixed)(x), F.linear(x, mixed.dequantize(torch.float32)))


def test_bad_fp8_weights_are_refused():
    codes = torch.zeros(4, 8).to(FP8)
    with pytest.raises(ValueError, match="codes must be float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 8), torch.ones(4, 1), 8, torch.float32, "fp8")
    with pytest.raises(ValueError, match=r"must be float32 \[4, 1\]"):
        Fp8Weight(codes, torch.ones(4), 8, torch.float32, "fp8")
    with pytest.raises(ValueError, match=r"must be float32 \[4, 2\]"):
        Fp8Weight(codes, torch.ones(4, 1), 4, torch.float32, "fp8")
    with pytest.raises(ValueError, match="must be float32"):
        Fp8Weight(codes, torch.ones(4, 1, dtype=torch.bfloat16), 8, torch.float32, "fp8")
