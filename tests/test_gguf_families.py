"""Phi-3 and the MoE families as GGUF files written by llama.cpp's own converter (tests/llama_cpp.py) run as the
folders they came from: Phi-3 with LongRoPE (rope_factors_long/short tensors, attention factor, original
context) and partial RoPE, Qwen3-MoE and Qwen2-MoE (stacked ffn_*_exps experts, the shared expert, a dense
layer) and Mixtral (a `llama` file with experts, its Q/K rows permuted)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from conftest import run  # noqa: E402
from family_parity import GREEDY8, mixed_prompts, moe_config, phi3_config, references, save_tiny  # noqa: E402
from llama_cpp import ConverterUnavailable, convert  # noqa: E402

from servelm import LLM  # noqa: E402
from servelm.model.gguf_config import read_gguf_config  # noqa: E402

NAMES = ["phi3", "qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dir):
    """{name: (HF folder, float32 GGUF)}, converted in one run of the converter."""
    root = tmp_path_factory.mktemp("families")
    configs = {"phi3": phi3_config(longrope=True), "qwen3_moe": moe_config("qwen3_moe"),
               "qwen2_moe": moe_config("qwen2_moe"),
               "mixtral": moe_config("mixtral", window=None)}  # llama.cpp's converter drops a llama-arch window
    folders = {n: save_tiny(c, root / n, tokenizer_dir, seed=1) for n, c in configs.items()}
    tc = folders["phi3"] / "tokenizer_config.json"  # the converter's Phi-3 path reads a BPE vocabulary only so
    original = tc.read_text()
    tc.write_text(json.dumps({**json.loads(original), "tokenizer_class": "GPT2Tokenizer"}))
    try:
        files = convert(folders, tmp_path_factory.mktemp("families_gguf"))
    except ConverterUnavailable as e:
        pytest.skip(str(e))
    finally:
        tc.write_text(original)
    return {n: (folders[n], files[n]) for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_converted_family_gguf_matches_its_folder(converted, name, tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELM_CACHE_DIR", str(tmp_path / "cache"))
    folder, gguf = converted[name]
    config = read_gguf_config(gguf)
    assert config.architectures == [{"phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                     "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[name]]
    prompts = mixed_prompts()
    llm = LLM(str(gguf), tokenizer=str(folder), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    assert run(llm, prompts, GREEDY8) == references(folder, "float32", prompts)
