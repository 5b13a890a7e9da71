"""A bf16 model's logits in float32: servelm's C++ linear kernels sum in float32 and, asked for float32
(`out_dtype`), store those sums unrounded. Checked on every kernel and build variant this CPU runs: the
float32 output rounds to exactly the kernel's bf16 output (the same sums, one rounding less), keeps bits bf16
cannot hold, and is the same for a row alone or in a batch. Then the model: `DecoderLM.logits` of a bf16
model is float32, so two tokens whose logits differ by less than one bf16 step no longer tie (a tie goes to
the lower token id, whatever the model preferred)."""

from __future__ import annotations

import pytest
import torch
from kernel_variants import runnable_variants
from random_weights import random_blocks

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.blocks import Linear
from servelm.model.layers.linear_kernels import pack_dense_weight, pack_weight_for_tiles
from servelm.model.quant.gguf import FORMATS, pack_blocks

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")
ROWS = (1, 3, 4, 5, 13, 17, 64, 65, 200)  # the kernels' few-row, row-group, tile and chunk paths


def _check(call, x: torch.Tensor, k: int) -> None:
    """call(rows, out_dtype) on every row count: float32 out rounds to the bf16 out bit for bit, holds more
    than bf16's bits, and each row is the same alone and in the batch."""
    full32 = call(x, torch.float32)
    assert full32.dtype == torch.float32
    assert torch.equal(full32.bfloat16(), call(x, None))
    assert not torch.equal(full32, full32.bfloat16().float())  # not bf16 values widened
    for m in ROWS:
        assert torch.equal(call(x[:m], torch.float32), full32[:m]), m
        assert torch.equal(call(x[m - 1:m], torch.float32), full32[m - 1:m]), m


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("bias", [False, True])
def test_the_dense_kernel_stores_its_float32_sums_for_bf16_rows(variant, bias):
    kern = cpu_kernels.load_variant(variant)
    torch.manual_seed(1)
    n, k = 1003, 96  # a partial block of 32 columns and of 16
    w, x = torch.randn(n, k).bfloat16(), torch.randn(200, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    panels = pack_dense_weight(w)
    _check(lambda rows, dt: kern.dense_linear(rows, panels, n, b, out_dtype=dt), x, k)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    got = kern.dense_linear(x, panels, n, b, out_dtype=torch.float32).double()
    assert ((got - want).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T + 1)).all()  # float32 sums


@pytest.mark.parametrize("bias", [False, True])
def test_the_tile_packed_kernels_store_their_float32_sums(bias, dot):
    """The AVX512-BF16 kernel (both ways to multiply bf16 pairs), and the AMX tile matmul where the CPU has it."""
    if not kernels.avx512_linear_supported(64):
        pytest.skip("no AVX512-BF16 on this CPU")
    torch.manual_seed(2)
    n, k = 1003, 576
    w, x = torch.randn(n, k).bfloat16(), torch.randn(200, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    tiled = pack_weight_for_tiles(w)
    _check(lambda rows, dt: kernels.avx512_linear(rows, tiled, n, b, dt), x, k)
    if kernels.amx_linear_supported(k):
        _check(lambda rows, dt: kernels.amx_linear(rows, tiled, n, b, dt), x, k)


def _int_variants() -> list:
    return [p for p in runnable_variants() if cpu_kernels.load_variant(p.values[0]).quant_linear_supported(0, 64)]


@pytest.mark.parametrize("variant", _int_variants())
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
def test_the_gguf_kernels_store_their_float32_sums(variant, qtype):
    """The int8-activation kernel (AVX512-VNNI's store and AVX2's), and where the build has it the bf16 tile
    path over the GGUF blocks (every row past int_rows=0)."""
    kern = cpu_kernels.load_variant(variant)
    n, k = 1003, 256
    w = random_blocks(qtype, n, k)
    packed, fmt = pack_blocks(w), FORMATS[qtype]
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(200, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    _check(lambda rows, dt: kern.quant_linear(rows, packed, fmt, n, b, out_dtype=dt), x, k)
    if kern.quant_linear_supported(fmt, k) == 2:
        _check(lambda rows, dt: kern.quant_linear(rows, packed, fmt, n, b, int_rows=0, out_dtype=dt), x, k)


def test_float32_is_refused_where_it_means_nothing():
    w, x = torch.randn(64, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    panels = pack_dense_weight(torch.cat([w, w]), gate_up=True)
    with pytest.raises(RuntimeError, match="silu_mul stores the input's dtype"):
        kernels.dense_linear(x, panels, 128, silu_mul=True, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype must be the input's dtype or float32"):
        kernels.dense_linear(x, pack_dense_weight(w), 64, out_dtype=torch.float16)
    # the C entry point checks its `store` argument itself
    out = torch.empty(2, 64)
    assert kernels._dense_linear(1, out.data_ptr(), x.data_ptr(), 2, 64, 64, pack_dense_weight(w).data_ptr(), 64,
                                 None, 3) != 0
    assert "store must be 0, 1 or 2" in kernels._last_error().decode()


def _tied_logits_model(weight_kind: str | None):
    """Hidden [1, 2^-10, 0, ...] against lm_head rows 0: [0, ...], 1: [1, 0, ...] and 2: [1, 1, 0, ...]: token
    2's logit is 1 + 2^-10, token 1's 1, which round to the same bf16 (one step at 1 is 2^-7)."""
    from servelm.model.decoder import DecoderLM

    model = DecoderLM.__new__(DecoderLM)  # only the lm_head and the spec's logit options matter here
    model.spec = type("Spec", (), {"final_softcap": None, "logits_divisor": None, "logits_scale": None})()
    w = torch.zeros(48, 64)
    w[1, 0] = w[2, 0] = w[2, 1] = 1.0
    model.lm_head = Linear(w.bfloat16())
    assert weight_kind is None or model.lm_head.kernel.name == weight_kind
    hidden = torch.zeros(1, 64)
    hidden[0, 0], hidden[0, 1] = 1.0, 2.0 ** -10
    return model, hidden.bfloat16()


def test_a_bf16_models_logits_keep_what_bf16_would_tie():
    kind = "amx" if kernels.amx_linear_supported(64) else "avx512" if kernels.avx512_linear_supported(64) else "dense"
    model, hidden = _tied_logits_model(kind)
    logits = model.logits(hidden)
    assert logits.dtype == torch.float32 and logits[0, 2] == 1 + 2.0 ** -10 and logits[0, 1] == 1
    assert int(logits.argmax()) == 2
    assert int(logits.bfloat16().argmax()) == 1  # what bf16 logits would pick: the tie's lower id


def test_without_the_cpp_kernels_logits_stay_in_the_models_dtype(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    model, hidden = _tied_logits_model(None)
    assert model.lm_head.kernel.name in ("onednn", "torch")
    assert model.logits(hidden).dtype == torch.bfloat16
