"""The Triton quantized matmuls (model/quant/triton_matmul.py) against dequantize-then-matmul, under Triton's CPU
interpreter (on a GPU machine the compiled kernels): int8 per row, int4 in groups of 32 and 128, a GGUF Q4_1
block tensor taken as int4, ragged shapes that leave partial tiles, fp16 activations, and float32 dots in
IEEE precision (not TF32); fp8 weights' weight-only kernel per row and block-scaled, split over its inputs
or not, and which steps take it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's definition

from servelm.model.quant import triton_matmul as quant_triton  # noqa: E402
from servelm.model.quant.fp8 import FP8, Fp8Weight, quantize_fp8  # noqa: E402
from servelm.model.quant.weight_only import QuantWeight, quantize_int4, quantize_int8  # noqa: E402

pytestmark = pytest.mark.skipif(not quant_triton.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32  # numpy, under the interpreter, has no bfloat16


def _check(w: QuantWeight, m: int, dtype: torch.dtype = DTYPE, tol: float = 1e-4) -> None:
    """Against float32 arithmetic on the weight as the kernel reads it (1e-4 for float32 activations: a
    TF32 dot, 10 mantissa bits per product, misses it by 1e-3 and more on these sizes)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, w.shape[1], generator=g).to(dtype)
    want = (x.float() @ w.dequantize(dtype).float().T).to(dtype)
    got = quant_triton.TritonQuantMatmul(w, DEVICE)(x.to(DEVICE)).cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("m", [1, 5, 17])
def test_int8_rows(m):
    w = torch.randn(72, 96, generator=torch.Generator().manual_seed(1))
    _check(quantize_int8(w, DTYPE), m)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups(group):
    w = torch.randn(80, 256, generator=torch.Generator().manual_seed(2))
    _check(quantize_int4(w, group, DTYPE), 3)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fp16_activations(kind):
    """Half-precision activations: the dot runs in fp16 (weights rounded to fp16 as dequantize() rounds
    them), accumulating in float32, so only the output's rounding separates it from float32 arithmetic."""
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(4))
    q = quantize_int8(w, torch.float16) if kind == "int8" else quantize_int4(w, 32, torch.float16)
    _check(q, 6, torch.float16, tol=4e-3)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(quant_triton._quant_mm_kernel, InterpretedFunction)


def test_float32_dots_are_ieee_not_tf32(monkeypatch):
    """Triton's float32 `tl.dot` defaults to TF32 on a GPU. The interpreter computes every dot in full
    precision whatever it is told, so here the dots' arguments are recorded instead: float32 operands with
    IEEE precision, fp16 ones in fp16 (not widened to float32 first). The compiled kernel (a GPU) is checked
    by its numbers: a long reduction that TF32 would miss by about 1e-2."""
    assert quant_triton.dot_precision(torch.float32) == "ieee"
    w = quantize_int8(torch.randn(64, 1024, generator=torch.Generator().manual_seed(5)), torch.float32)
    if not _interpreted():
        _check(w, 16, torch.float32, tol=1e-4)
        return
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    seen = []
    create_dot = interpreter.interpreter_builder.create_dot

    def spy(a, b, d, input_precision, *rest):
        seen.append((a.dtype, b.dtype, input_precision))
        return create_dot(a, b, d, input_precision, *rest)

    monkeypatch.setattr(interpreter.interpreter_builder, "create_dot", spy)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(6))
    quant_triton.TritonQuantMatmul(w, DEVICE)(x.to(DEVICE))
    assert seen and all(e == (tl.float32, tl.float32, ir.INPUT_PRECISION.IEEE) for e in seen), seen
    seen.clear()
    w16 = quantize_int8(torch.randn(64, 1024, generator=torch.Generator().manual_seed(5)), torch.float16)
    quant_triton.TritonQuantMatmul(w16, DEVICE)(x.to(torch.float16).to(DEVICE))
    assert seen and all(e[:2] == (tl.float16, tl.float16) for e in seen), seen


def test_int4_packing_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert quant_triton.pack_int4(codes).tolist() == [[0x21, 0x0F]]


def test_gguf_q4_1_blocks():
    """Q4_1 made by the gguf package, then read as the CPU loader reads it (int4 groups of 32)."""
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(3).standard_normal((48, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)).float()
    blocks = raw.reshape(48, 2, -1)  # per row, 2 blocks: d (f16), m (f16), 16 bytes of codes
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0])
    mn = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0])
    qs = torch.from_numpy(blocks[..., 4:].copy())
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(48, 64)  # a block: 16 low nibbles, then 16 high
    # w = code * d + m = (code - 8) * d + (m + 8 d)
    q = QuantWeight("int4", codes, d, mn + 8 * d, 32, DTYPE, "Q4_1")
    torch.testing.assert_close(q.dequantize(), dense, rtol=0, atol=1e-5)
    _check(q, 4)


def test_a_quantized_weight_on_the_gpu_gets_the_triton_kernel():
    """The kernel choice for a QuantWeight: codes on a CUDA device get TritonQuantMatmul, on the CPU
    PyTorch's kernels (without a GPU only the CPU side of the dispatch can be checked)."""
    from servelm.model.quant import weight_only as quant

    w = quantize_int4(torch.randn(32, 64), 32, DTYPE)
    if torch.cuda.is_available():
        assert isinstance(quant.quant_matmul(w.to("cuda")), quant_triton.TritonQuantMatmul)
    else:
        assert isinstance(quant.quant_matmul(w), quant.QuantMatmul)  # on the CPU: PyTorch's kernels


# --- fp8 weights: the weight-only kernel ----------------------------------------------------------------------
GEMV = quant_triton.Fp8Tuning(gemv_rows=16, gemv_block_n=16, gemv_block_k=64)  # every step here up to 16 rows


def _fp8_check(w, m: int, splits: int | None, dtype: torch.dtype = DTYPE, tol: float = 1e-4,
               tuning: quant_triton.Fp8Tuning = quant_triton.Fp8Tuning()) -> torch.Tensor:
    """The weight-only fp8 kernel against float64 arithmetic on the stored weight (codes times scales)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, w.shape[1], generator=g).to(dtype)
    want = x.double() @ w.dequantize(torch.float64).T
    got = quant_triton.TritonFp8Matmul(w.to(DEVICE), tuning=tuning)(x.to(DEVICE), splits=splits).cpu()
    assert got.dtype == dtype and got.shape == (m, w.shape[0])
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)
    return got


@pytest.mark.parametrize("m", [1, 5, 17, 70])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_weight_only_per_row(m, splits):
    """A scale per row, applied once to the dot's sum; ragged N and K leave partial tiles, and 70 rows take
    two tiles of 64. Split in three, the partial sums add up to the same result."""
    w = quantize_fp8(torch.randn(72, 300, generator=torch.Generator().manual_seed(1)), DTYPE)
    _fp8_check(w, m, splits)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_gemv_kernel_per_row(m, splits):
    """The matrix-vector shape for steps of up to `gemv_rows` rows: one row, a row count that is not a power
    of two (the rows past it are masked) and the most it takes; ragged N and K leave partial tiles."""
    w = quantize_fp8(torch.randn(72, 300, generator=torch.Generator().manual_seed(1)), DTYPE)
    _fp8_check(w, m, splits, tuning=GEMV)


def test_fp8_gemv_kernel_takes_only_steps_up_to_its_rows(monkeypatch):
    """Steps of up to `gemv_rows` rows launch the matrix-vector kernel and larger ones the dot kernel; with
    `gemv_rows` 0 (the default) every step takes the dot kernel."""
    launched = []
    for name in ("_fp8_gemv_kernel", "_fp8_mm_kernel"):
        kernel = getattr(quant_triton, name)

        class Spy:
            def __getitem__(self, grid, name=name, kernel=kernel):
                launched.append(name)
                return kernel[grid]

        monkeypatch.setattr(quant_triton, name, Spy())
    w = quantize_fp8(torch.randn(24, 64, generator=torch.Generator().manual_seed(5)), DTYPE).to(DEVICE)
    x = torch.randn(6, 64).to(DEVICE)
    for tuning, rows, want in ((quant_triton.Fp8Tuning(gemv_rows=4), 4, "_fp8_gemv_kernel"),
                               (quant_triton.Fp8Tuning(gemv_rows=4), 5, "_fp8_mm_kernel"),
                               (quant_triton.Fp8Tuning(), 1, "_fp8_mm_kernel")):
        launched.clear()
        quant_triton.TritonFp8Matmul(w, tuning=tuning)(x[:rows], splits=1)
        assert launched == [want]


def test_fp8_tuning_refuses_tiles_that_are_not_powers_of_two():
    with pytest.raises(ValueError, match="gemv_block_k must be a power of two"):
        quant_triton.Fp8Tuning(gemv_block_k=96)


@pytest.mark.parametrize("group", [128, 32])
def test_fp8_weight_only_block_scaled(group):
    """Scales per row and group of inputs (a 128 x 128 block-scaled checkpoint's, and groups of 32, which
    take tiles of 32 inputs so that a tile never spans two groups), split or not."""
    g = torch.Generator().manual_seed(2)
    codes = (torch.randn(64, 384, generator=g) * 100).clamp(-448, 448).to(FP8)
    w = Fp8Weight(codes, torch.rand(64, 384 // group, generator=g) + 0.01, group, DTYPE, "fp8/block")
    assert quant_triton.TritonFp8Matmul(w).block_k == group
    for splits in (1, 2):
        _fp8_check(w, 3, splits)
        _fp8_check(w, 3, splits, tuning=quant_triton.Fp8Tuning(gemv_rows=4, gemv_block_k=256))  # tiles of one group


def test_fp8_weight_only_fp16_activations():
    """fp16 activations: e4m3 codes convert to fp16 exactly, the dot accumulates in float32, and only the
    output's rounding separates the result from exact arithmetic."""
    w = quantize_fp8(torch.randn(48, 256, generator=torch.Generator().manual_seed(3)), torch.float16)
    _fp8_check(w, 4, None, torch.float16, tol=2e-3)
    _fp8_check(w, 4, None, torch.float16, tol=2e-3, tuning=GEMV)


def test_fp8_split_count_fills_the_gpu_only_where_the_output_cannot():
    """Splits give every SM its programs where the output's tiles are too few, never below four tiles of
    inputs a split; a CPU (one "SM") never splits."""
    assert quant_triton.split_k(output_tiles=64, k_tiles=32, sms=132) == 5  # 8B o_proj: 64 tiles of 64 outputs
    assert quant_triton.split_k(output_tiles=448, k_tiles=32, sms=132) == 1  # 8B gate_up: enough outputs
    assert quant_triton.split_k(output_tiles=1, k_tiles=8, sms=132) == 2  # short inputs: splits of 4 tiles
    assert quant_triton.split_k(output_tiles=1, k_tiles=3, sms=132) == 1
    assert quant_triton.split_k(output_tiles=2, k_tiles=100, sms=1) == 1
    assert quant_triton.split_k(output_tiles=448, k_tiles=32, sms=132, programs_per_sm=8) == 3  # more programs


@pytest.mark.parametrize("tuning", [dict(programs_per_sm=8), dict(block_n=128, num_warps=8, num_stages=4),
                                    dict(block_n=32, programs_per_sm=4)])
def test_fp8_kernel_under_other_launch_settings(tuning):
    """The settings the GPU check sweeps change how the work is cut, not the result."""
    from servelm.model.quant.fp8 import quantize_fp8

    w = quantize_fp8(torch.randn(200, 512, generator=torch.Generator().manual_seed(3)), torch.float32)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    mm = quant_triton.TritonFp8Matmul(w.to(DEVICE), sms=4, tuning=quant_triton.Fp8Tuning(**tuning))
    want = x.double() @ w.dequantize(torch.float64).T
    torch.testing.assert_close(mm(x.to(DEVICE)).cpu().double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_fp8_steps_take_the_weight_only_kernel_up_to_64_rows():
    """`Fp8ByRows`: a step of up to WEIGHT_ONLY_ROWS rows runs the weight-only kernel, a larger one the other
    path (here the reference stands in for `_scaled_mm`, which needs an FP8 GPU); each row's result is then
    exactly that path's."""
    from servelm.model.quant.fp8 import WEIGHT_ONLY_ROWS, Fp8ByRows, Fp8ReferenceMatmul

    w = quantize_fp8(torch.randn(40, 96, generator=torch.Generator().manual_seed(4)), DTYPE).to(DEVICE)
    small, large = quant_triton.TritonFp8Matmul(w), Fp8ReferenceMatmul(w)
    mm = Fp8ByRows(small, large)
    x = torch.randn(WEIGHT_ONLY_ROWS + 1, 96, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert torch.equal(mm(x[:WEIGHT_ONLY_ROWS]), small(x[:WEIGHT_ONLY_ROWS]))
    assert torch.equal(mm(x), large(x))
    assert not torch.equal(small(x)[:1], large(x)[:1])  # the two paths differ in their sums' order
    assert mm.tensors() == large.tensors()


def test_an_fp8_weight_on_the_cpu_takes_neither_gpu_path():
    from servelm.model.quant.fp8 import Fp8ReferenceMatmul, fp8_matmul, weight_only_applies

    w = quantize_fp8(torch.randn(32, 64), torch.bfloat16)
    if torch.cuda.is_available():
        return  # the choice on a GPU: tests/gpu/test_fp8_gpu.py
    assert weight_only_applies(w) == "on cpu"
    assert isinstance(fp8_matmul(w), Fp8ReferenceMatmul)
