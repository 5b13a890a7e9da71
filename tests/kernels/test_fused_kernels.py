"""The fused elementwise kernels (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-multiply) on every kernel
build this CPU runs: in bf16 they give the same bits as the chain of bf16 PyTorch ops transformers runs, so
switching them on changes no output; in float32 they round where the chain rounds, and only RMSNorm's sum of
squares (summed in another order) and the products a compiler may fuse differ, in the last bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_variants import runnable_variants

from servelm.model.decoder import DecoderLM
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.blocks import add_rms_norm, apply_rotary, fused_kernels, rms_norm, rotary_, silu_mul

pytestmark = pytest.mark.skipif(fused_kernels(torch.bfloat16) is None, reason="CPU kernels could not be compiled here")
DTYPES = {"bf16": (torch.bfloat16, 0.0), "float32": (torch.float32, 2e-6)}  # dtype, tolerance (0: bit for bit)


@pytest.fixture(params=runnable_variants())
def kern(request):
    return cpu_kernels.load_variant(request.param)


@pytest.fixture(params=list(DTYPES))
def dt(request):
    return DTYPES[request.param]


def _close(got: torch.Tensor, expect: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got, expect, atol=tol, rtol=tol, equal_nan=True)


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


@pytest.mark.parametrize("d", [40, 64, 576, 1000])  # 40 and 1000 end in a partial vector
def test_rms_norm_and_residual_add_match_the_op_chain(kern, dt, d):
    dtype, tol = dt
    torch.manual_seed(d)
    x, delta = (torch.randn(37, d) * 3).to(dtype), torch.randn(37, d).to(dtype)
    w = torch.randn(d).to(dtype)
    _close(rms_norm(x, w, 1e-5, kern), hf_rms_norm(x, w, 1e-5), tol)
    residual = x.clone()
    out = add_rms_norm(delta, residual, w, 1e-5, kern)
    assert torch.equal(residual, x + delta)  # updated in place, rounded like the add in the dtype
    _close(out, hf_rms_norm(x + delta, w, 1e-5), tol)
    for r in (0, 5, 36):  # a row's bits do not depend on the rows beside it
        assert torch.equal(rms_norm(x[r:r + 1], w, 1e-5, kern), rms_norm(x, w, 1e-5, kern)[r:r + 1])


def test_rms_norm_in_place_on_strided_head_rows(kern, dt):
    # Qwen3's per-head q/k norm runs on a [T, H, D] view into the fused qkv output
    dtype, tol = dt
    qkv = torch.randn(7, 15 * 64).to(dtype)
    before = qkv.clone()
    heads = qkv[:, : 12 * 64].view(7, 12, 64)
    w = torch.randn(64).to(dtype)
    expect = hf_rms_norm(heads, w, 1e-6)
    rms_norm(heads, w, 1e-6, kern, out=heads)
    _close(heads, expect, tol)
    assert torch.equal(qkv[:, 12 * 64:], before[:, 12 * 64:])  # the value columns are untouched


def test_rotary_in_place_matches_the_op_chain(kern, dt):
    dtype, tol = dt
    d = 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(300).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.tensor([0, 5, 299, 7, 3, 2, 1])
    x = torch.randn(7, 12, d).to(dtype)
    expect = apply_rotary(x, cos[positions], sin[positions])
    qkv = torch.randn(7, 15 * d).to(dtype)
    view = qkv[:, : 12 * d].view(7, 12, d)
    view.copy_(x)
    rotary_(view, cos, sin, positions, kern)
    _close(view, expect, tol)
    with pytest.raises(RuntimeError, match="beyond the table"):  # never a read past the table
        rotary_(view, cos, sin, torch.tensor([0, 1, 2, 3, 4, 5, 300]), kern)


@pytest.mark.parametrize("i", [24, 1408, 1536])
def test_silu_mul_matches_the_op_chain(kern, dt, i):
    dtype, tol = dt
    torch.manual_seed(i)
    x = (torch.randn(33, 2 * i) * 4).to(dtype)
    x[0, :6] = torch.tensor([-200.0, 200.0, float("inf"), float("-inf"), 0.0, 88.0])  # exp over/underflow
    gate, up = x.chunk(2, dim=-1)
    _close(silu_mul(x, kern), F.silu(gate) * up, tol)


def test_the_kernels_refuse_mixed_dtypes(kern):
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="rms_norm"):
        kern.rms_norm(torch.empty_like(x), x, torch.ones(64).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        kern.add_rms_norm(torch.empty_like(x), x.bfloat16(), x.clone(), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul"):
        kern.silu_mul(x.half())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_decoder_uses_the_fused_path_and_tapes(model_dirs, dtype):
    from servelm.model.loading.loader import load_model

    loaded = load_model(str(model_dirs["llama"]), None, None, dtype, "cpu")
    assert isinstance(loaded.model, DecoderLM) and loaded.model.fused is not None
    assert loaded.model.tapes is not None
