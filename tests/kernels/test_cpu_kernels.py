"""The C++ dense kernels against torch: argmax over rows, and the two kernels over tile-packed weights that
decode-sized linear layers (and gate/up projections, their SiLU-and-multiply fused in) use: the AVX512
kernel on CPUs without AMX, the AMX tile matmul on CPUs with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import cpu_vendor

from servelm.config import env
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.blocks import GateUpLinear, Linear, fused_kernels, silu_mul
from servelm.model.layers.linear_kernels import pack_dense_weight, pack_weight_for_tiles

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the sampler's greedy rows stay bf16
def test_argmax_matches_torch_on_ties_nan_and_inf(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 32003).to(dtype)
    x[1, 5] = x[1, 9] = x[1].max() + 1  # a tie: the first index wins, as in torch
    x[2, 30000] = float("nan")  # NaN is the maximum, as in torch
    x[3] = float("-inf")
    x[4, -1] = 1e9  # in the scalar tail after the vector part
    x[5] = x[5].round()  # many ties
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


needs_avx512_linear = pytest.mark.skipif(kernels is None or not kernels.avx512_linear_supported(64) or kernels.amx_linear_supported(64),
                                reason="needs AVX512-BF16 without AMX (with AMX the tile kernel takes decode rows)")


@needs_avx512_linear
@pytest.mark.parametrize("k", [64, 576, 1536])
@pytest.mark.parametrize("bias", [False, True])
def test_avx512_linear_matches_float32_reference_and_is_row_invariant(k, bias, dot):
    torch.manual_seed(k)
    n, m = 1003, 30  # a partial 32-column block and a partial 16-column half; row groups of 12, 12, 6
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = pack_weight_for_tiles(w)
    y = kernels.avx512_linear(x, packed, n, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # float32 sums in another order, then one rounding to bf16: within one bf16 ulp of the exact value
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3 * k**0.5)
    # a row's result does not depend on the rows beside it: alone and in fours (the few-row path), in the
    # middle of a group of 12 and in the group of 6 that ends the batch (the many-row path; with three
    # groups the FMA form's first group splits each block's lines once for the other two)
    for rows in (slice(0, 1), slice(5, 6), slice(29, 30), slice(8, 12), slice(3, 16), slice(20, 30)):
        assert torch.equal(kernels.avx512_linear(x[rows], packed, n, b), y[rows]), rows
    with pytest.raises(RuntimeError):
        kernels.avx512_linear(x, pack_weight_for_tiles(w)[1:], n, b)  # not a weight packed for n x k


@needs_avx512_linear
def test_avx512_linear_fma_form_is_the_default_on_intel_and_sums_in_the_instructions_order():
    intel = cpu_vendor() == "GenuineIntel"
    forced = env.cpu_bf16_dot()  # SERVELM_CPU_BF16_DOT runs the other vendor's form
    assert kernels.bf16_dot() == (("fma" if intel else "bf16") if forced == "auto" else forced)
    torch.manual_seed(3)
    x, w = torch.randn(40, 576).bfloat16(), torch.randn(200, 576).bfloat16()
    packed = pack_weight_for_tiles(w)
    before = kernels.bf16_dot()
    try:
        out = {}
        for mode in ("bf16", "fma"):
            kernels.set_bf16_dot(mode)
            assert kernels.bf16_dot() == mode
            out[mode] = [kernels.avx512_linear(x[:m], packed, 200, None) for m in (1, 4, 40)]
        if intel:  # the FMAs add the odd element's product first, as Intel's dot-product instruction does
            for a, b in zip(out["bf16"], out["fma"], strict=True):
                assert torch.equal(a, b)
        with pytest.raises(RuntimeError, match="'bf16' or 'fma'"):
            kernels.set_bf16_dot("fp16")
    finally:
        kernels.set_bf16_dot(before)


@needs_avx512_linear
def test_linear_takes_the_avx512_kernel_for_every_input_and_keeps_one_weight_copy():
    torch.manual_seed(1)
    w, b = torch.randn(300, 256).bfloat16(), torch.randn(300).bfloat16()
    lin = Linear(w, b)
    assert lin.kernel.name == "avx512" and lin.kernel.tensors() == [lin.kernel.tiled]
    assert lin.weight is None  # neither oneDNN's copy nor the row-major one
    x = torch.randn(600, 256).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for m in (1, 64, 600):  # decode steps and prefill chunks (chunks of 192 rows, groups of 12)
        assert torch.equal(lin(x[:m]), kernels.avx512_linear(x[:m], lin.kernel.tiled, 300, b)), m
        torch.testing.assert_close(lin(x[:m]).float(), ref[:m], rtol=2**-7, atol=2e-2)
    # the last rows of a 600-row input (the fourth 192-row chunk, groups of 12) equal the same rows alone
    assert torch.equal(lin(x)[-7:], lin(x[-7:]))


needs_tiles = pytest.mark.skipif(kernels is None or not kernels.amx_linear_supported(64), reason="no AMX on this CPU")


@needs_tiles
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("n", [40, 1003])  # a partial 32-column block, and a partial 16-column tile
@pytest.mark.parametrize("bias", [False, True])
def test_tile_matmul_matches_float32_reference_and_is_batch_invariant(k, n, bias):
    torch.manual_seed(k + n)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = pack_weight_for_tiles(w)
    x = torch.randn(300, k).bfloat16()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    singles = torch.cat([kernels.amx_linear(x[i:i + 1], packed, n, b) for i in range(x.shape[0])])
    torch.testing.assert_close(singles.float(), ref, rtol=2**-7, atol=1e-3 * k**0.5)
    # every row count the blocking treats differently (1 or 2 row tiles, 64-row blocks, 256-row passes,
    # zero-padded tails) gives each row exactly what it gets alone
    for m in (2, 16, 17, 32, 33, 63, 64, 65, 97, 128, 257, 300):
        assert torch.equal(kernels.amx_linear(x[:m], packed, n, b), singles[:m]), m


@needs_tiles
def test_tile_matmul_reads_strided_rows_and_refuses_bad_inputs():
    torch.manual_seed(2)
    w = torch.randn(64, 96).bfloat16()
    packed = pack_weight_for_tiles(w)
    wide = torch.randn(7, 200).bfloat16()
    x = wide[:, 10:106]  # rows 200 apart
    assert torch.equal(kernels.amx_linear(x, packed, 64, None), kernels.amx_linear(x.contiguous(), packed, 64, None))
    assert kernels.amx_linear(x[:0], packed, 64, None).shape == (0, 64)
    with pytest.raises(RuntimeError):
        kernels.amx_linear(x, packed[:-1], 64, None)  # not a packed 64 x 96 weight
    with pytest.raises(RuntimeError):
        kernels.amx_linear(x.float(), packed, 64, None)
    with pytest.raises(RuntimeError):
        kernels.amx_linear(torch.randn(3, 40).bfloat16(), packed, 64, None)  # K not a multiple of 32
    assert not kernels.amx_linear_supported(40)


@needs_tiles
def test_linear_takes_tiles_for_every_row_count_and_keeps_one_weight_copy():
    """One kernel whatever the rows: oneDNN's sums change with the row count, which made a token's bits
    depend on its prefill chunk and its batch."""
    torch.manual_seed(3)
    w, b = torch.randn(300, 256).bfloat16(), torch.randn(300).bfloat16()
    lin = Linear(w, b)
    assert lin.kernel.name == "amx" and lin.weight is None and lin.kernel.tensors() == [lin.kernel.tiled]
    x = torch.randn(300, 256).bfloat16()
    for m in (1, 64, 65, 300):
        assert torch.equal(lin(x[:m]), kernels.amx_linear(x[:m], lin.kernel.tiled, 300, b)), m
    assert torch.equal(lin(x)[-7:], lin(x[-7:]))
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(lin(x).float(), ref, rtol=2**-7, atol=2e-2)


@pytest.mark.skipif(kernels is None or not kernels.avx512_linear_supported(64), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("inter", [16, 48, 1536])
def test_gate_up_fuses_silu_mul_into_the_decode_kernel_with_identical_results(inter, dot):
    """On the kernel this CPU's decode steps use: the AMX tile matmul, or the AVX512-BF16 kernel."""
    tiles = kernels.amx_linear_supported(64)
    plain, fused_kernel = ((kernels.amx_linear, kernels.amx_linear_silu_mul) if tiles
                           else (kernels.avx512_linear, kernels.avx512_linear_silu_mul))
    torch.manual_seed(inter)
    k = 576 if inter == 1536 else 96
    gate, up = torch.randn(inter, k).bfloat16(), torch.randn(inter, k).bfloat16()
    mlp_in = GateUpLinear(gate, up)
    assert mlp_in.kernel.name == ("amx" if tiles else "avx512") and mlp_in.linear is None  # no row-major copy
    fused = fused_kernels(torch.bfloat16)
    unfused = pack_weight_for_tiles(torch.cat([gate, up]))
    x = torch.randn(300, k).bfloat16()
    # the kernels take any number of rows (row groups, 1-2 row tiles, 64-row blocks, 256-row passes, tails)
    for m in (0, 1, 2, 4, 5, 16, 17, 33, 64, 65, 257, 300):
        want = silu_mul(plain(x[:m], unfused, 2 * inter, None), fused)
        assert torch.equal(fused_kernel(x[:m], mlp_in.kernel.tiled, 2 * inter), want), m
    # the layer uses it for every input: decode steps and prefill chunks alike
    for m in (1, 64, 65, 300):
        assert torch.equal(mlp_in(x[:m], fused), fused_kernel(x[:m], mlp_in.kernel.tiled, 2 * inter)), m
    ref = F.silu(F.linear(x.float(), gate.float())) * F.linear(x.float(), up.float())
    torch.testing.assert_close(mlp_in(x, fused).float(), ref, rtol=2e-2, atol=5e-2 * k**0.5)
    with pytest.raises(RuntimeError):  # the fused store needs whole 16-column gate and up groups
        fused_kernel(x, pack_weight_for_tiles(torch.randn(48, k).bfloat16()), 48)


@needs_tiles
def test_gate_up_of_odd_width_falls_back_to_projection_then_silu_mul():
    torch.manual_seed(5)
    gate, up = torch.randn(40, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    mlp_in = GateUpLinear(gate, up)
    assert mlp_in.kernel is None and mlp_in.linear is not None
    fused = fused_kernels(torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(mlp_in(x, fused), silu_mul(Linear(torch.cat([gate, up]))(x), fused))


def test_float32_linear_takes_the_fixed_order_dense_kernel():
    w, x = torch.randn(8, 64), torch.randn(5, 64)
    lin = Linear(w)
    assert lin.kernel.name == "dense" and lin.kernel.fixed_order and lin.weight is None
    assert lin.kernel.tensors() == [lin.kernel.panels] and lin.kernel.panels.shape == (2, 64, 16)  # 8 outputs padded to one block of 32
    torch.testing.assert_close(lin(x), x @ w.T)
    assert torch.equal(lin(x[2:3]), lin(x)[2:3])  # a row alone or among others: the same bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (96, 77), (32, 1)])  # N padded to a block of 32; any K
def test_dense_kernel_matches_a_float64_reference_and_every_row_is_batch_invariant(dtype, n, k):
    """csrc/dense_linear.cpp: x @ w.T + b summed input after input, each row the same bits whatever the rows
    beside it (1 to 200 rows, so both the 6-row micro-kernel and its tails, and several 64-row passes)."""
    torch.manual_seed(n + k)
    w, b, x = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype), torch.randn(200, k).to(dtype)
    panels = pack_dense_weight(w)
    y = kernels.dense_linear(x, panels, n, b)
    want = x.double() @ w.double().T + b.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and y.shape == (200, n)
    torch.testing.assert_close(y.double(), want, atol=tol * (k ** 0.5), rtol=tol)
    for m in (1, 2, 5, 6, 7, 63, 64, 65, 199):
        assert torch.equal(kernels.dense_linear(x[:m], panels, n, b), y[:m]), m
        assert torch.equal(kernels.dense_linear(x[m:m + 1], panels, n, b), y[m:m + 1]), m
    assert torch.equal(kernels.dense_linear(x[:, :k][::3], panels, n, b), y[::3])  # a strided input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_kernel_fused_silu_mul_rounds_as_the_op_chain(dtype):
    torch.manual_seed(1)
    gate, up, x = torch.randn(48, 64).to(dtype), torch.randn(48, 64).to(dtype), torch.randn(9, 64).to(dtype)
    got = kernels.dense_linear(x, pack_dense_weight(torch.cat([gate, up]), gate_up=True), 96, silu_mul=True)
    g = kernels.dense_linear(x, pack_dense_weight(gate), 48)
    u = kernels.dense_linear(x, pack_dense_weight(up), 48)
    act = (g.float() / (1 + torch.exp(-g.float()))).to(dtype)  # SiLU as the kernel computes it, then rounded
    torch.testing.assert_close(got, (act.float() * u.float()).to(dtype))  # up to torch's exp against libm's
    torch.testing.assert_close(got.float(), (F.silu(g.float()) * u.float()), atol=1e-2, rtol=1e-2)


def test_dense_kernel_refuses_bad_input():
    panels = pack_dense_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="not a weight packed for 32 x 128"):
        kernels.dense_linear(torch.zeros(1, 128), panels, 32)
    with pytest.raises(RuntimeError, match="packed weight of its dtype"):
        kernels.dense_linear(torch.zeros(1, 64, dtype=torch.bfloat16), panels, 32)
    with pytest.raises(RuntimeError, match="silu_mul needs N % 32 == 0"):
        kernels.dense_linear(torch.zeros(1, 64), panels, 32, torch.zeros(32), silu_mul=True)
