"""The Triton quantized matmul (model/quant_triton.py) against dequantize-then-matmul, under Triton's CPU
interpreter (on a GPU machine the compiled kernel): int8 per row, int4 in groups of 32 and 128, a GGUF Q4_1
block tensor taken as int4, ragged shapes that leave partial tiles."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's definition

from servelm.model import quant_triton  # noqa: E402
from servelm.model.quant import QuantWeight, quantize_int4, quantize_int8  # noqa: E402

pytestmark = pytest.mark.skipif(not quant_triton.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32  # numpy, under the interpreter, has no bfloat16


def _check(w: QuantWeight, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, w.shape[1], generator=g, dtype=DTYPE)
    want = x @ w.dequantize(DTYPE).T
    got = quant_triton.TritonQuantMatmul(w, DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 5, 17])
def test_int8_rows(m):
    w = torch.randn(72, 96, generator=torch.Generator().manual_seed(1))
    _check(quantize_int8(w, DTYPE), m)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups(group):
    w = torch.randn(80, 256, generator=torch.Generator().manual_seed(2))
    _check(quantize_int4(w, group, DTYPE), 3)


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
    from servelm.model import quant

    w = quantize_int4(torch.randn(32, 64), 32, DTYPE)
    if torch.cuda.is_available():
        assert isinstance(quant.quant_matmul(w.to("cuda")), quant_triton.TritonQuantMatmul)
    else:
        assert isinstance(quant.quant_matmul(w), quant.QuantMatmul)  # on the CPU: PyTorch's kernels
