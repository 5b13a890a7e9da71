"""servelm's GGUF block kernels (csrc/quant_linear.cpp, model/quant/gguf.py): the repacked codes against gguf's
dequantization, the int8-activation kernel (AVX512-VNNI and AVX2 builds) and the bf16 tile path against
dequantize-then-matmul references, and greedy parity of a model whose linears are GGUF blocks against the
torch reference of the same arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from random_weights import random_blocks
from tiny_models import random_prompts, run

from servelm.model.kernels import build as kernel_build
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.kernels.cpu_features import cpu_flags
from servelm.model.layers.linear_kernels import pack_weight_for_tiles
from servelm.model.quant.gguf import (
    FORMATS,
    GGUFBlocks,
    GGUFMatmul,
    ReferenceMatmul,
    pack_blocks,
    quantize_activations,
)

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")


def _int_builds() -> list:
    """Every built variant this CPU runs that has the int8-activation kernel (the AVX512 one and AVX2)."""
    found = cpu_kernels.manifest() or {}
    table = {v.name: v for v in kernel_build.variants()}
    out = []
    for name in ("amx", "avx512bf16", "avx2"):
        if name in found.get("built", []) and set(table[name].requires) <= cpu_flags():
            k = cpu_kernels.load_variant(name)
            if k.quant_linear_supported(0, 64):
                out.append(pytest.param(k, id=name))
    return out


INT_BUILDS = _int_builds()


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_packed_codes_and_scales_decode_to_gguf_values_bit_for_bit(qtype):
    import gguf

    w = random_blocks(qtype, 40, 512)  # 40 rows: the packing pads to whole 32-row blocks
    want = torch.from_numpy(gguf.quants.dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[qtype]))
    assert torch.equal(w.dequantize(torch.float32), want)
    assert torch.equal(kernels.quant_unpack(pack_blocks(w), FORMATS[qtype], 40, 512), want)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 rounding times w in float64 (what the kernel computes, up to float32 sums), and the bound on its
    distance from the unrounded product: per output, sum over blocks of (block scale / 2) * sum |w|."""
    xq = quantize_activations(x).double()
    y = xq @ w.double().T + (0 if bias is None else bias.double())
    m, k = x.shape
    half_step = (x.float().reshape(m, k // 32, 32).abs().amax(-1) / 127 / 2).double()  # [M, G]
    bound = half_step @ w.double().abs().reshape(w.shape[0], k // 32, 32).sum(-1).T  # [M, N]
    return y, bound


@pytest.mark.parametrize("kern", INT_BUILDS)
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("m", [1, 5])  # one row; a chunk of 4 and one of 1
def test_int8_activation_kernel_matches_dequantize_then_matmul(kern, qtype, m):
    """The kernel against the dequantized weight times x rounded as the kernel rounds it: float32 sums and one
    bf16 rounding apart (rtol 2^-8); and against unrounded x: within the int8 rounding's bound."""
    n, k = 72, 512  # 72 rows: a partial 32-row block
    w = random_blocks(qtype, n, k, seed=m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    dense = w.dequantize(torch.float32)
    y = kern.quant_linear(x, pack_blocks(w), FORMATS[qtype], n, bias, int_rows=64).double()
    want, bound = _reference(x, dense, bias)
    scale = (quantize_activations(x).double().abs() @ dense.double().abs().T) + 1
    assert ((y - want).abs() <= 2**-8 * want.abs() + 1e-5 * scale).all()
    exact = x.double() @ dense.double().T + bias.double()
    assert ((y - exact).abs() <= bound + 2**-8 * exact.abs() + 1e-5 * scale).all()
    assert ((want - exact).abs() > 2**-7 * exact.abs()).any()  # the int8 rounding is visible: the test can tell


@pytest.mark.parametrize("kern", INT_BUILDS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])
def test_gate_up_fused_silu_mul_in_the_int8_kernel(kern, qtype):
    n, k, m = 128, 256, 2  # gate and up 64 rows each
    w = random_blocks(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = kern.quant_linear(x, pack_blocks(w, gate_up=True), FORMATS[qtype], n, None, silu_mul=True, int_rows=64)
    proj, _ = _reference(x, w.dequantize(torch.float32), None)
    gate, up = proj.to(torch.bfloat16).chunk(2, dim=-1)
    want = (F.silu(gate.float()).bfloat16().float() * up.float())
    torch.testing.assert_close(y.float(), want, rtol=2**-6, atol=1e-2 * want.abs().max().item())


tile_path = pytest.mark.skipif(kernels is None or kernels.quant_linear_supported(0, 64) != 2,
                               reason="needs the bf16 tile kernels (AMX or AVX512-BF16)")


@tile_path
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize(("n", "k", "m"), [(96, 512, 40), (160, 256, 300)])
def test_many_rows_run_the_bf16_model_weight_bit_for_bit(qtype, n, k, m):
    """Batches and prefill-sized inputs: the weight dequantized to bf16 in tile order a block at a time as the
    bf16 tile kernel reaches it (each thread dequantizing its next block during this one's products; more
    than 256 rows in two passes over the blocks): the same bits as the bf16 model (the file dequantized at
    load, packed for that kernel)."""
    w = random_blocks(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()
    dense = pack_weight_for_tiles(w.dequantize(torch.bfloat16))
    tiles = kernels.amx_linear if kernels.amx_linear_supported(k) else kernels.avx512_linear
    y = kernels.quant_linear(x, pack_blocks(w), FORMATS[qtype], n, bias, int_rows=8)
    assert torch.equal(y, tiles(x, dense, n, bias))
    gu = kernels.quant_linear(x, pack_blocks(w, gate_up=True), FORMATS[qtype], n, None, silu_mul=True, int_rows=8)
    fused = kernels.amx_linear_silu_mul if kernels.amx_linear_supported(k) else kernels.avx512_linear_silu_mul
    assert torch.equal(gu, fused(x, pack_weight_for_tiles(w.dequantize(torch.bfloat16), gate_up=True), n))


def _avx512_build():
    """The AVX512-BF16 build (tile path on avx512_linear) where this CPU runs it, else None."""
    found = cpu_kernels.manifest() or {}
    table = {v.name: v for v in kernel_build.variants()}
    if "avx512bf16" not in found.get("built", []) or not set(table["avx512bf16"].requires) <= cpu_flags():
        return None
    return cpu_kernels.load_variant("avx512bf16")


@pytest.mark.skipif(_avx512_build() is None, reason="needs the AVX512-BF16 build and a CPU that runs it")
@pytest.mark.parametrize("mode", ["bf16", "fma"])
def test_many_rows_without_amx_run_the_bf16_model_weight_bit_for_bit(mode):
    """CPUs with AVX512-BF16 but no AMX: each block dequantized as avx512_linear reaches it, in both of its
    ways to multiply bf16 pairs: the same bits as avx512_linear over the bf16 model's packed weight."""
    k = _avx512_build()
    before = k.bf16_dot()
    k.set_bf16_dot(mode)
    try:
        for qtype in FORMATS:
            for n, kk, m in [(96, 512, 40), (160, 256, 300)]:
                w = random_blocks(qtype, n, kk)
                x = torch.randn(m, kk, generator=torch.Generator().manual_seed(1)).bfloat16()
                bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()
                y = k.quant_linear(x, pack_blocks(w), FORMATS[qtype], n, bias, int_rows=8)
                assert torch.equal(y, k.avx512_linear(x, pack_weight_for_tiles(w.dequantize(torch.bfloat16)), n, bias))
                gu = k.quant_linear(x, pack_blocks(w, gate_up=True), FORMATS[qtype], n, None, silu_mul=True, int_rows=8)
                dense = pack_weight_for_tiles(w.dequantize(torch.bfloat16), gate_up=True)
                assert torch.equal(gu, k.avx512_linear_silu_mul(x, dense, n)), (qtype, n, kk, m)
    finally:
        k.set_bf16_dot(before)


def test_bad_input_raises():
    w = random_blocks("Q4_0", 32, 64)
    packed = pack_blocks(w)
    with pytest.raises(RuntimeError, match="not a weight packed for 32 x 128"):
        kernels.quant_linear(torch.zeros(1, 128, dtype=torch.bfloat16), packed, FORMATS["Q4_0"], 32)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.quant_linear(torch.zeros(1, 64), packed, FORMATS["Q4_0"], 32)


@pytest.fixture(scope="module")
def gguf_llama(llama_dir):
    """The tiny Llama's linear weights as GGUF blocks of one type: a function of the type and the kernel choice
    that returns a loaded LLM (the loader's safetensors reader patched to quantize them with gguf)."""
    import gguf

    from servelm import LLM
    from servelm.model.loading import loader
    from servelm.model.quant.weight_only import is_linear_weight

    def load(qtype: str, env: dict) -> LLM:
        original = loader._iter_safetensors

        def quantized(path, dtype, **kw):
            for name, t in original(path, dtype, **kw):
                if is_linear_weight(name):
                    raw = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType[qtype])
                    t = GGUFBlocks(qtype, torch.from_numpy(np.ascontiguousarray(raw)), t.shape[1], dtype)
                yield name, t

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader, "_iter_safetensors", quantized)
            for key, value in env.items():
                mp.setenv(key, value)
            return LLM(str(llama_dir), dtype="bfloat16", num_kv_blocks=32)

    return load


@pytest.mark.skipif(kernels is None or kernels.quant_linear_supported(FORMATS["Q8_0"], 64) < 1,
                    reason="this kernel build has no int8 kernel (the portable one)")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])  # 8-bit symmetric, 4-bit with offsets, 5-bit
def test_greedy_parity_with_the_torch_reference_of_the_same_format(qtype, gguf_llama):
    from servelm import SamplingParams

    prompts = random_prompts(2, 5, 20, seed=7)  # prefill and decode, both on the int8 kernel
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = gguf_llama(qtype, {})
    model = llm.engine.core.model
    assert all(isinstance(lin.quant, GGUFMatmul) for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.down))
    assert all(isinstance(lw.gate_up.quant, GGUFMatmul) for lw in model.layers)  # SiLU fused into the store
    got = run(llm, prompts, greedy)
    if model.tapes is not None:  # decode steps replayed from kernel tapes, the GGUF kernel's calls in them
        assert model.tapes.active and model.tapes.replayed > 0, model.tapes.refused
    ref = gguf_llama(qtype, {"SERVELM_QUANT_KERNEL": "reference"})
    assert isinstance(ref.engine.core.model.layers[0].qkv.quant, ReferenceMatmul)
    assert got == run(ref, prompts, greedy)


def test_auto_is_gguf_for_a_gguf_file_in_bf16_where_the_kernels_run_the_formats():
    from servelm.config.engine import EngineConfig
    from servelm.model.quant.gguf import auto_quantization

    runs = kernels.quant_linear_supported(FORMATS["Q4_0"], 64) >= 1  # the int8 kernel: AVX512-VNNI or AVX2
    assert auto_quantization("gguf", "cpu", torch.bfloat16) == ("gguf" if runs else "none")
    assert auto_quantization("gguf", "cpu", torch.float32) == "none"  # the kernels take bf16 only
    assert auto_quantization("safetensors", "cpu", torch.bfloat16) == "none"
    assert auto_quantization("gguf", "cuda", torch.bfloat16) == "none"
    assert EngineConfig().model_config.quantization == "auto" and EngineConfig().load_quantization() == "auto"
    assert EngineConfig(batch_invariant=True).load_quantization() == "auto"  # the GGUF kernels are invariant


@pytest.mark.skipif(kernels is None or kernels.quant_linear_supported(FORMATS["Q4_1"], 64) < 1,
                    reason="needs the int8-activation kernel (AVX512-VNNI or AVX2)")
def test_the_default_model_loads_kept_quantized_by_default():
    from servelm.model.loading.loader import load_model
    from servelm.model.loading.source import default_model_path

    path = default_model_path()
    model = load_model(str(path.parent), path.name, dtype="bfloat16", with_tokenizer=False, quantization="auto").model
    assert model.quantization == "gguf" and all(isinstance(lin.quant, GGUFMatmul) and lin.quant.kind == "Q4_1"
                                                for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.down))
