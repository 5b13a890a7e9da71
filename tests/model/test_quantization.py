"""Quantized weights (model/quant/weight_only.py): the setting, the kernels against dequantize-then-matmul, the GGUF
block formats kept as int4, and greedy parity of a quantized model against its dequantized twin."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest
import torch
from tiny_models import random_prompts, run

from servelm import LLM, SamplingParams
from servelm.config.args import add_engine_args, engine_config_from_args
from servelm.config.engine import ConfigError, EngineConfig
from servelm.config.settings import load
from servelm.model.layers.blocks import Linear
from servelm.model.loading.gguf_loader import int4_blocks
from servelm.model.quant.weight_only import (
    QuantMatmul,
    QuantWeight,
    is_linear_weight,
    quantize_int4,
    quantize_int8,
)

PROMPTS = random_prompts(2, 5, 20, seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_setting_is_validated_and_flows_from_cli_env_and_file(tmp_path):
    with pytest.raises(ConfigError, match="quantization must be auto, none, gguf, int8, int4 or fp8, got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ConfigError, match="quantization_group_size must be 32, 64, 128 or 256, got 48"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ConfigError, match="quantization must be none, int8, int4 or fp8 on a GPU"):
        EngineConfig(quantization="gguf", device="cuda")
    assert EngineConfig(quantization="int8", device="cuda").model_config.quantization == "int8"  # Triton kernels there
    with pytest.raises(ConfigError, match="quantization must be auto, none or gguf with batch_invariant"):
        EngineConfig(quantization="int8", batch_invariant=True)
    assert EngineConfig(quantization="gguf", batch_invariant=True).load_quantization() == "gguf"
    with pytest.raises(ConfigError, match=r"model.quantization .*\(set by env SERVELM_QUANTIZATION\)"):
        load(env={"SERVELM_QUANTIZATION": "fp4"})
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"engine": {"quantization": "int4", "quantization_group_size": 64}}))
    c = load(file=str(f), env={})
    assert (c.engine.model_config.quantization, c.engine.model_config.quantization_group_size) == ("int4", 64)
    assert c.sources["model.quantization"] == "file"
    assert load(cli={"quantization": "int8"}, env={"SERVELM_QUANTIZATION": "int4"}).engine.model_config.quantization == "int8"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--quantization", "int4", "--quantization-group-size", "128"])
    assert engine_config_from_args(args).model_config.quantization_group_size == 128


def test_gguf_quantization_needs_a_gguf_file(llama_dir):
    with pytest.raises(ValueError, match="is not a GGUF file: use int8 or int4"):
        LLM(str(llama_dir), quantization="gguf", num_kv_blocks=16)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantize_then_matmul(kind, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    q = quantize_int8(w, dtype) if kind == "int8" else quantize_int4(w, 32, dtype)
    assert q.codes.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    dense = q.dequantize(torch.float32)
    assert (dense - w).abs().max() <= (w.abs().max() / 127 if kind == "int8" else 0.2 * w.abs().max())
    lin = Linear(q, bias=torch.randn(48, generator=g).to(dtype))
    assert lin.quant is not None and lin.weight is None  # kept quantized: no float copy
    x = torch.randn(5, 128, generator=g).to(dtype)
    want = (x.float() @ dense.T + lin.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lin(x).float(), want, rtol=tol, atol=tol * want.abs().max().item())


def _gguf_blocks(name: str, rows: int, cols: int) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(3)
    if name != "Q4_K":
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    # no numpy quantizer for Q4_K: random blocks with sane float16 d and dmin decode just as well
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = rng.uniform(0.01, 0.1, (len(blocks), 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_kept_as_int4_decode_exactly(name):
    """The kernel's weight, read back through an identity matmul: in float32 gguf's dequantized tensor bit for
    bit; in bfloat16 (the kernels' one dtype for scales and activations) that of the scales so rounded."""
    import gguf

    raw = _gguf_blocks(name, 32, 512)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]))
    codes, scales, zeros = (torch.from_numpy(np.ascontiguousarray(a)) for a in int4_blocks(raw, name))
    exact = QuantWeight("int4", codes, scales, zeros, 32, torch.float32, name)
    assert torch.equal(QuantMatmul(exact)(torch.eye(512)).T, want) and torch.equal(exact.dequantize(), want)
    bf16 = QuantWeight("int4", codes, scales, zeros, 32, torch.bfloat16, name)
    seen = QuantMatmul(bf16)(torch.eye(512, dtype=torch.bfloat16)).T
    assert torch.equal(seen, bf16.dequantize())
    torch.testing.assert_close(seen.float(), want, rtol=0.02, atol=0.02 * want.abs().max().item())


@pytest.fixture(scope="module")
def reference_dirs(llama_dir, tmp_path_factory):
    """{kind: a copy of the tiny Llama whose linears are the int8/int4 weights dequantized to float32}."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(llama_dir / "model.safetensors"))
    out = {}
    for kind in ("int8", "int4"):
        d = tmp_path_factory.mktemp(f"ref_{kind}")
        for f in llama_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
        q = {n: (quantize_int8(t, torch.float32) if kind == "int8" else quantize_int4(t, 32, torch.float32))
             .dequantize(torch.float32) if is_linear_weight(n) else t for n, t in weights.items()}
        save_file(q, str(d / "model.safetensors"))
        out[kind] = d
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_greedy_matches_its_dequantized_twin(kind, llama_dir, reference_dirs):
    llm = LLM(str(llama_dir), dtype="float32", quantization=kind, num_kv_blocks=32)
    model = llm.engine.core.model
    lins = [lin for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.down, lw.gate_up.linear)]
    assert all(lin.quant is not None and lin.quant.kind == kind and lin.weight is None for lin in lins)
    got = run(llm, PROMPTS, GREEDY)
    assert model.tapes is None or not model.tapes.active
    want = run(LLM(str(reference_dirs[kind]), dtype="float32", num_kv_blocks=32), PROMPTS, GREEDY)
    assert got == want
