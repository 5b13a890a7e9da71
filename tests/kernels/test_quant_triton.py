"""The Triton quantized matmul (model/quant/triton_matmul.py) against dequantize-then-matmul, under Triton's CPU
interpreter (on a GPU machine the compiled kernel): int8 per row, int4 in groups of 32 and 128, a GGUF Q4_1
block tensor taken as int4, ragged shapes that leave partial tiles, fp16 activations, and float32 dots in
IEEE precision (not TF32)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's definition

from servelm.model.quant import triton_matmul as quant_triton  # noqa: E402
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
