"""EXAONE 4: norms after each sublayer and none before it, per-head q/k norms, and with a sliding window, local
layers with RoPE beside global layers without. Tiny random-weight models match transformers' greedy outputs
token for token (bfloat16: up to rounding at near ties), alone and batched with prefix caching and chunked
prefill."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, exaone4_config, mixed_prompts, references, save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def exaone4(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("exaone4")
    return {"window": save_tiny(exaone4_config(), root / "window", tokenizer_dir),
            # no window: every layer global, and every layer rotated
            "global": save_tiny(exaone4_config(sliding_window=None, layer_types=["full_attention"] * 4),
                                root / "global", tokenizer_dir)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exaone4_matches_transformers(exaone4, dtype):
    """Its 40-token prompt passes the local layers' window."""
    llm = check_parity(exaone4["window"], dtype)
    spec = llm.engine.core.model.spec
    assert spec.architecture == "Exaone4ForCausalLM" and spec.post_norms_only and not spec.whole_qk_norm
    assert spec.sliding_windows == [24, 24, 24, None] and spec.rope_layers == [True, True, True, False]


def test_without_a_window_every_layer_is_rotated(exaone4):
    """The same weights without a window answer otherwise, and transformers agrees: the parity above holds only if
    the global layer's missing RoPE and the window are both honoured."""
    llm = check_parity(exaone4["global"], "float32")
    assert llm.engine.core.model.spec.rope_layers is None
    prompts = mixed_prompts()
    assert references(exaone4["window"], "float32", prompts) != references(exaone4["global"], "float32", prompts)
