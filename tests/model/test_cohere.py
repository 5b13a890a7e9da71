"""Cohere's Command R and Command R7B / A layouts: a parallel attention and MLP over one LayerNorm (no bias),
interleaved RoPE, logits times logit_scale, Command R+'s per-head q/k LayerNorms, and (Cohere2) sliding-window
layers with RoPE beside global layers without. Tiny random-weight models match transformers' greedy outputs token
for token (bfloat16: up to rounding at near ties), alone and batched with prefix caching and chunked prefill."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import assert_first_logprobs_match, check_parity, cohere_config, save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def cohere(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("cohere")
    return {"r": save_tiny(cohere_config(1), root / "r", tokenizer_dir),
            "r-plus": save_tiny(cohere_config(1, use_qk_norm=True), root / "r-plus", tokenizer_dir),
            "r7b": save_tiny(cohere_config(2), root / "r7b", tokenizer_dir)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["r", "r-plus", "r7b"])
def test_cohere_matches_transformers(cohere, name, dtype):
    llm = check_parity(cohere[name], dtype)
    model = llm.engine.core.model
    spec = model.spec
    assert spec.layer_norm and spec.parallel_residual and spec.interleaved_rope and spec.logits_scale == 0.5
    assert all(lw.post_norm is None for lw in model.layers)  # one norm per layer
    if name == "r-plus":  # a weight per head
        assert tuple(model.layers[0].q_norm.shape) == (spec.num_heads, spec.head_dim)
    if name == "r7b":
        assert spec.sliding_windows == [24, 24, 24, None] and spec.rope_layers == [True, True, True, False]


def test_logprobs_are_of_the_scaled_logits(cohere):
    """Scaling the logits never changes an argmax, so greedy parity cannot see logit_scale: the logprobs do."""
    assert_first_logprobs_match(cohere["r"])
