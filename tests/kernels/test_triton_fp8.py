"""Rounding to float8_e4m3fn inside Triton kernels and the one-kernel per-token activation quantizer
(model/quant/triton_fp8.py), against PyTorch's casts, bit for bit, under Triton's CPU interpreter (on a GPU
machine the compiled kernels)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definitions

from servelm.model.quant import fp8, triton_fp8  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_fp8.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    bad = a.view(torch.uint8) != b.view(torch.uint8)
    assert not bad.any(), (a[bad][:8].float(), b[bad][:8].float())


def test_every_e4m3_value_midpoint_and_neighbour_rounds_as_pytorch_casts():
    """A row holding 448 has a scale of exactly 1, so its codes are its values rounded: every finite e4m3
    value, every midpoint between neighbours (ties go to the even code), the float32 values either side of
    each midpoint, the subnormals' range and signed zeros."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    values = codes[torch.isfinite(codes)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    tiny = torch.linspace(-2.0 ** -6, 2.0 ** -6, 4097)  # e4m3's subnormals and the bottom of the normals
    row = torch.cat([torch.tensor([448.0, 0.0, -0.0]), values, mids,
                     torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9)), tiny])
    got, scale = triton_fp8.quantize_rows(row[None].to(DEVICE))
    assert scale.item() == 1.0
    _same_bits(got.cpu()[0], row.to(fp8.FP8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 64), (5, 3000), (2, 1025)])
def test_activation_quantizer_gives_the_bits_of_the_pytorch_one(shape, dtype):
    """Rows spanning eleven orders of magnitude (scales far from 1, so the division matters), an all-zero
    row (the smallest scale, codes 0), rows longer than a program's block and ragged at the end."""
    t, k = shape
    g = torch.Generator().manual_seed(t * k)
    x = torch.randn(t, k, generator=g) * torch.logspace(-6, 4, t)[:, None]
    if t > 1:
        x[1] = 0
    x = x.to(dtype)
    got_codes, got_scales = triton_fp8.quantize_rows(x.to(DEVICE))
    want_codes, want_scales = fp8.quantize_rows(x)
    assert got_codes.shape == (t, k) and got_scales.shape == (t, 1) and got_scales.dtype == torch.float32
    _same_bits(got_codes.cpu(), want_codes)
    assert torch.equal(got_scales.cpu(), want_scales)


def test_a_strided_view_and_no_rows():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    view = x[:, 16:80]  # a column slice: rows not contiguous with each other
    got_codes, got_scales = triton_fp8.quantize_rows(view.to(DEVICE) if DEVICE == "cpu" else view.cuda())
    want_codes, want_scales = fp8.quantize_rows(view)
    _same_bits(got_codes.cpu(), want_codes)
    assert torch.equal(got_scales.cpu(), want_scales)
    codes, scales = triton_fp8.quantize_rows(x[:0].to(DEVICE))
    assert codes.shape == (0, 96) and scales.shape == (0, 1)
