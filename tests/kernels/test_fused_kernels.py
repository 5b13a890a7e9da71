"""The fused bf16 kernels (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-multiply) give the same bits as
the chain of bf16 PyTorch ops transformers runs, so switching them on changes no output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.decoder import DecoderLM
from servelm.model.layers.blocks import add_rms_norm, apply_rotary, fused_kernels, rms_norm, rotary_, silu_mul

fused = fused_kernels(torch.bfloat16)
pytestmark = pytest.mark.skipif(fused is None, reason="no AVX512-BF16 kernels on this machine")


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


@pytest.mark.parametrize("d", [40, 64, 576, 1000])  # 40 and 1000 end in a partial vector
def test_rms_norm_and_residual_add_are_bit_exact(d):
    torch.manual_seed(d)
    x, delta = (torch.randn(37, d) * 3).bfloat16(), torch.randn(37, d).bfloat16()
    w = torch.randn(d).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5, fused), hf_rms_norm(x, w, 1e-5))
    residual = x.clone()
    out = add_rms_norm(delta, residual, w, 1e-5, fused)
    assert torch.equal(residual, x + delta)  # updated in place, rounded like the bf16 add
    assert torch.equal(out, hf_rms_norm(x + delta, w, 1e-5))


def test_rms_norm_in_place_on_strided_head_rows():
    # Qwen3's per-head q/k norm runs on a [T, H, D] view into the fused qkv output
    qkv = torch.randn(7, 15 * 64).bfloat16()
    before = qkv.clone()
    heads = qkv[:, : 12 * 64].view(7, 12, 64)
    w = torch.randn(64).bfloat16()
    expect = hf_rms_norm(heads, w, 1e-6)
    rms_norm(heads, w, 1e-6, fused, out=heads)
    assert torch.equal(heads, expect)
    assert torch.equal(qkv[:, 12 * 64:], before[:, 12 * 64:])  # the value columns are untouched


def test_rotary_in_place_is_bit_exact():
    d = 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(300).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    positions = torch.tensor([0, 5, 299, 7, 3, 2, 1])
    x = torch.randn(7, 12, d).bfloat16()
    expect = apply_rotary(x, cos[positions], sin[positions])
    qkv = torch.randn(7, 15 * d).bfloat16()
    view = qkv[:, : 12 * d].view(7, 12, d)
    view.copy_(x)
    rotary_(view, cos, sin, positions, fused)
    assert torch.equal(view, expect)
    with pytest.raises(RuntimeError, match="beyond the table"):  # never a read past the table
        rotary_(view, cos, sin, torch.tensor([0, 1, 2, 3, 4, 5, 300]), fused)


@pytest.mark.parametrize("i", [24, 1408, 1536])
def test_silu_mul_is_bit_exact(i):
    torch.manual_seed(i)
    x = (torch.randn(33, 2 * i) * 4).bfloat16()
    x[0, :6] = torch.tensor([-200.0, 200.0, float("inf"), float("-inf"), 0.0, 88.0])  # exp over/underflow
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(x, fused), F.silu(gate) * up, atol=0, rtol=0, equal_nan=True)


def test_bf16_decoder_uses_the_fused_path(model_dirs):
    from servelm.model.loading.loader import load_model

    loaded = load_model(str(model_dirs["llama"]), None, None, "bfloat16", "cpu")
    assert isinstance(loaded.model, DecoderLM) and loaded.model.fused is not None
