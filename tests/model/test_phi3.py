"""Phi-3: tiny random-weight models (fused qkv_proj and gate_up_proj in the checkpoint) match transformers'
greedy outputs token for token (bfloat16: up to rounding at near ties), alone and batched with prefix caching
and chunked prefill: one with a sliding window and full-head RoPE (float32 and bfloat16), one with LongRoPE and
partial RoPE (Phi-4-mini's)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, phi3_config, save_tiny  # noqa: E402

from servelm import LLM  # noqa: E402
from servelm.model.kernels import cpu as cpu_kernels  # noqa: E402


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("phi3")
    return {"window": save_tiny(phi3_config(longrope=False), root / "window", tokenizer_dir),
            "longrope": save_tiny(phi3_config(longrope=True), root / "longrope", tokenizer_dir)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phi3_matches_transformers(phi3, dtype):
    llm = check_parity(phi3["window"], dtype)
    model = llm.engine.core.model
    assert model.spec.fused_checkpoint and model.spec.sliding_windows == [24, 24]
    kernels = cpu_kernels.load()
    if dtype == "bfloat16" and kernels is not None and kernels.avx512_linear_supported(64):
        assert model.tapes.active  # a Phi-3 layer is the Llama layer: its decode steps replay kernel tapes


def test_phi3_longrope_with_partial_rotary(phi3):
    llm = check_parity(phi3["longrope"], "float32")
    core = llm.engine.core
    assert core.model.spec.rotary_dim == 12 and (core.model.tapes is None or not core.model.tapes.active)
    # the short factors hold up to original_max_position_embeddings: the context stops there
    assert core.max_model_len == 64
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        LLM(str(phi3["longrope"]), dtype="float32", num_kv_blocks=16, max_model_len=128)
