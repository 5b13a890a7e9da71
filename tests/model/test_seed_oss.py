"""Seed-OSS: the Llama layer with q/k/v biases and an output-projection bias of its own (`attention_out_bias`).
Tiny random-weight models match transformers' greedy outputs token for token (bfloat16: up to rounding at near
ties), alone and batched with prefix caching and chunked prefill; MLP biases, which it can have, are refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, save_tiny, seed_oss_config  # noqa: E402

from servelm import LLM  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seed_oss_matches_transformers(tmp_path, tokenizer_dir, dtype):
    folder = save_tiny(seed_oss_config(), tmp_path / "seed", tokenizer_dir)
    llm = check_parity(folder, dtype)
    layer = llm.engine.core.model.layers[0]
    assert layer.qkv.bias is not None and layer.o_proj.bias is not None


def test_mlp_biases_are_refused(tmp_path, tokenizer_dir):
    folder = save_tiny(seed_oss_config(mlp_bias=True), tmp_path / "seed-mlp", tokenizer_dir)
    with pytest.raises(ValueError, match="mlp_bias"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)
