"""OLMo 2 and OLMo 3: norms after each sublayer and none before it, q/k norms over the whole projections, and
(OLMo 3) sliding-window layers with a RoPE of their own. Tiny random-weight models match transformers' greedy
outputs token for token (bfloat16: up to rounding at near ties), alone and batched with prefix caching and
chunked prefill."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, mixed_prompts, olmo_config, references, save_tiny  # noqa: E402

from servelm.model.layers.parallel import check_shardable  # noqa: E402


@pytest.fixture(scope="module")
def olmo(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("olmo")
    return {"olmo2": save_tiny(olmo_config(2, attention_bias=True), root / "olmo2", tokenizer_dir),
            "olmo3": save_tiny(olmo_config(3), root / "olmo3", tokenizer_dir)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_olmo2_matches_transformers(olmo, dtype):
    llm = check_parity(olmo["olmo2"], dtype)
    model = llm.engine.core.model
    assert model.spec.architecture == "Olmo2ForCausalLM" and model.spec.post_norms_only
    assert all(lw.input_norm is None and lw.post_norm is None for lw in model.layers)
    assert model.layers[0].q_norm.numel() == model.spec.num_heads * model.spec.head_dim  # all heads at once
    assert model.tapes is None or not model.tapes.active  # PyTorch norms: the Python loop runs them
    with pytest.raises(ValueError, match="q/k norms span every head"):
        check_shardable(model.spec, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_olmo3_matches_transformers(olmo, dtype):
    """Its 40-token prompt passes the local layers' window; the global layer's YaRN and base differ from theirs."""
    llm = check_parity(olmo["olmo3"], dtype)
    spec = llm.engine.core.model.spec
    assert spec.architecture == "Olmo3ForCausalLM" and spec.sliding_windows == [24, 24, 24, None]
    assert spec.local_inv_freq is not None and spec.rope_attention_factor != 1.0


def test_each_kind_of_layer_keeps_its_rope(olmo, tmp_path, tokenizer_dir):
    """The oracle above holds only if each kind of layer gets its own RoPE: the same weights with one RoPE
    everywhere answer otherwise (and transformers agrees)."""
    ropes = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("full_attention", "sliding_attention")}
    same = save_tiny(olmo_config(3, rope_parameters=ropes), tmp_path / "one-rope", tokenizer_dir)
    check_parity(same, "float32")
    prompts = mixed_prompts()
    assert references(same, "float32", prompts) != references(olmo["olmo3"], "float32", prompts)
