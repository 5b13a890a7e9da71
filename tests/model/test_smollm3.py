"""SmolLM3: the Llama layer with RoPE left out of every fourth layer (NoPE, `no_rope_layers`). Tiny random-weight
models match transformers' greedy outputs token for token (bfloat16: up to rounding at near ties), alone and
batched with prefix caching and chunked prefill; a NoPE layer's keys and queries are never rotated."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, save_tiny, smollm3_config  # noqa: E402

from servelm.model.kernels import cpu as cpu_kernels  # noqa: E402


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("smollm3")
    return {"nope": save_tiny(smollm3_config(), root / "nope", tokenizer_dir),
            "all-rope": save_tiny(smollm3_config(no_rope_layers=[1, 1, 1, 1]), root / "all-rope", tokenizer_dir),
            # SmolLM3's sliding window, on its NoPE layers
            "window": save_tiny(smollm3_config(use_sliding_window=True, sliding_window=24), root / "window",
                                tokenizer_dir)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm3_matches_transformers(smollm3, dtype):
    llm = check_parity(smollm3["nope"], dtype)
    model = llm.engine.core.model
    assert model.spec.architecture == "SmolLM3ForCausalLM" and model.spec.rope_layers == [True, True, True, False]
    kernels = cpu_kernels.load()
    if dtype == "bfloat16" and kernels is not None and kernels.avx512_linear_supported(64):
        assert model.tapes.active  # a NoPE layer is the Llama layer less a kernel: decode steps replay tapes


def test_a_nope_layer_changes_the_output_and_a_window_on_the_nope_layers(smollm3):
    """The oracle holds only if the NoPE layer is honoured: the same weights with RoPE everywhere answer
    otherwise (and transformers agrees). With use_sliding_window, SmolLM3 puts its window on the NoPE layers."""
    check_parity(smollm3["all-rope"], "float32")
    from family_parity import mixed_prompts, references

    prompts = mixed_prompts()
    assert references(smollm3["nope"], "float32", prompts) != references(smollm3["all-rope"], "float32", prompts)
    llm = check_parity(smollm3["window"], "float32")  # its 40-token prompt passes the window
    assert llm.engine.core.model.spec.sliding_windows == [None, None, None, 24]
