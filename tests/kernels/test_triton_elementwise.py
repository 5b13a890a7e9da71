"""The fused Triton elementwise kernels (model/kernels/triton_elementwise.py: residual add + RMSNorm, RMSNorm,
SiLU-and-multiply) against the PyTorch functions they replace on CUDA, run by Triton's CPU interpreter; on a
GPU machine the same tests run the compiled kernels, bfloat16 included, and check that model/layers/blocks.py routes
CUDA tensors to them. Inputs and references are computed on the host; the kernels get them on DEVICE."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

from servelm.model.kernels import triton_elementwise  # noqa: E402
from servelm.model.layers import blocks as layers  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_elementwise.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5

# numpy, under the interpreter, has no bfloat16: it is checked where the kernels really compile (a GPU). The
# tolerances are one unit in the last place of the dtype (reductions and exp are summed and rounded
# differently from PyTorch's), well under what a wrong formula gives.
HALF = [(torch.bfloat16, 8e-3)] if torch.cuda.is_available() else []
DTYPES = [(torch.float32, 2e-6), (torch.float16, 1e-3), *HALF]


def _randn(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _dev(t: torch.Tensor) -> torch.Tensor:
    """A copy on DEVICE (never the host tensor itself, which the kernels may write in place)."""
    return t.to(DEVICE, copy=True)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 16), (1, 1000)])
def test_rms_norm_matches_torch(shape, dtype, tol):
    """Rows of a width that is not a power of two (the tail masked), [T, heads, D] rows, one long row."""
    x = _randn(*shape, dtype=dtype, seed=0, scale=3.0)
    w = _randn(shape[-1], dtype=dtype, seed=1)
    want = F.rms_norm(x.float(), (shape[-1],), w.float(), EPS).to(dtype)  # float32, rounded once
    _close(triton_elementwise.rms_norm(_dev(x), _dev(w), EPS), want, tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rms_norm_in_place_on_a_column_slice_of_a_fused_projection(dtype, tol):
    """The q/k norms: the heads of a [T, q+k+v] projection viewed [T, heads, D], normed in place through their
    strides; the columns beside them are left alone."""
    t, heads, d = 3, 5, 16
    qkv = _randn(t, (heads + 2) * d, dtype=dtype, seed=2, scale=2.0)
    w = _randn(d, dtype=dtype, seed=3)
    want = qkv.clone()
    want[:, : heads * d] = F.rms_norm(qkv[:, : heads * d].float().view(t, heads, d), (d,), w.float(),
                                      EPS).to(dtype).view(t, heads * d)
    dev = _dev(qkv)
    part = dev[:, : heads * d].view(t, heads, d)
    assert not part.is_contiguous()
    assert triton_elementwise.rms_norm(part, _dev(w), EPS, out=part) is part
    _close(dev, want, tol)
    assert torch.equal(dev[:, heads * d:].cpu(), qkv[:, heads * d:])


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("width", [64, 200])
def test_add_rms_norm_matches_torch(width, dtype, tol):
    """residual += delta in place, rounded to the dtype exactly as `residual.add_` rounds, and the norm of
    the rounded sum."""
    residual = _randn(4, width, dtype=dtype, seed=4, scale=2.0)
    delta = _randn(4, width, dtype=dtype, seed=5)
    w = _randn(width, dtype=dtype, seed=6)
    want_res = residual + delta
    want = F.rms_norm(want_res.float(), (width,), w.float(), EPS).to(dtype)
    res_dev = _dev(residual)
    out = triton_elementwise.add_rms_norm(_dev(delta), res_dev, _dev(w), EPS)
    assert torch.equal(res_dev.cpu(), want_res)
    _close(out, want, tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows, inter", [(3, 48), (2, 1100)])
def test_silu_mul_matches_torch(rows, inter, dtype, tol):
    """[gate | up] rows: one column block, and two with a masked tail (1100 > the 1024-column block). SiLU
    rounds to the dtype before the multiply, as the two PyTorch ops do."""
    x = _randn(rows, 2 * inter, dtype=dtype, seed=7, scale=4.0)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = triton_elementwise.silu_mul(_dev(x))
    assert got.is_contiguous()
    _close(got, want, tol)


def test_what_the_kernels_take():
    """CUDA tensors of float dtypes with a unit last stride; everything else stays on PyTorch."""
    cpu = torch.ones(2, 8)
    w = torch.ones(8)
    assert not triton_elementwise.norm_applies(cpu, w) and not triton_elementwise.silu_mul_applies(cpu)
    assert layers._gpu_kernels(cpu) is None  # the CPU paths never reach Triton
    if torch.cuda.is_available():
        x = torch.ones(2, 8, device="cuda")
        assert triton_elementwise.norm_applies(x, w.cuda()) and triton_elementwise.silu_mul_applies(x)
        assert not triton_elementwise.norm_applies(x.t(), torch.ones(2, device="cuda"))  # columns: strided
        assert not triton_elementwise.norm_applies(x.double(), w.cuda().double())
        assert not triton_elementwise.norm_applies(torch.ones(2, 20000, device="cuda"),
                                                   torch.ones(20000, device="cuda"))  # a row too wide
        assert not triton_elementwise.silu_mul_applies(torch.ones(2, 7, device="cuda"))
        assert layers._gpu_kernels(x) is None  # eager steps keep torch's kernels: cheaper to launch


def test_layers_route_device_tensors_to_the_kernels(monkeypatch):
    """layers.rms_norm, add_rms_norm and silu_mul call the kernels for a device tensor (on the CPU, with the
    interpreted kernels standing in for CUDA) and give what their PyTorch path gives. (They are chosen while a
    CUDA graph is captured; here they are chosen for every tensor.)"""
    monkeypatch.setattr(layers, "_gpu_kernels", lambda x: triton_elementwise)
    if not torch.cuda.is_available():
        monkeypatch.setattr(triton_elementwise, "_on_gpu", lambda x: True)
    calls = []
    for name in ("rms_norm", "add_rms_norm", "silu_mul"):
        real = getattr(triton_elementwise, name)
        monkeypatch.setattr(triton_elementwise, name,
                            lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    dtype, tol = torch.float32, 2e-6
    h = _randn(3, 40, dtype=dtype, seed=8)
    delta = _randn(3, 40, dtype=dtype, seed=9)
    w = _randn(40, dtype=dtype, seed=10)
    _close(layers.rms_norm(_dev(h), _dev(w), EPS), F.rms_norm(h, (40,), w, EPS), tol)
    res = _dev(h)
    _close(layers.add_rms_norm(_dev(delta), res, _dev(w), EPS), F.rms_norm(h + delta, (40,), w, EPS), tol)
    assert torch.equal(res.cpu(), h + delta)
    x = _randn(3, 80, dtype=dtype, seed=11)
    _close(layers.silu_mul(_dev(x)), F.silu(x[:, :40]) * x[:, 40:], tol)
    assert calls == ["rms_norm", "add_rms_norm", "silu_mul"]
