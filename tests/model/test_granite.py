"""Granite (3.x): the Llama layer with four scalars, an embedding multiplier, an attention scale, a residual
multiplier on each sublayer's output and a divisor of the logits. Tiny random-weight models match transformers'
greedy outputs token for token (bfloat16: up to rounding at near ties), alone and batched with prefix caching
and chunked prefill, and each scalar is honoured."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import GRANITE_SCALARS as SCALARS  # noqa: E402
from family_parity import (  # noqa: E402
    assert_first_logprobs_match,
    check_parity,
    granite_config,
    mixed_prompts,
    references,
    save_tiny,
)


@pytest.fixture(scope="module")
def granite(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("granite")
    return {"granite": save_tiny(granite_config(), root / "granite", tokenizer_dir),
            "plain": save_tiny(granite_config(embedding_multiplier=1.0, attention_multiplier=0.25,
                                              residual_multiplier=1.0, logits_scaling=1.0), root / "plain",
                               tokenizer_dir)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_granite_matches_transformers(granite, dtype):
    llm = check_parity(granite["granite"], dtype)
    spec = llm.engine.core.model.spec
    assert spec.architecture == "GraniteForCausalLM"
    assert (spec.embed_scale, spec.attn_scale, spec.residual_scale, spec.logits_divisor) == tuple(SCALARS.values())
    tapes = llm.engine.core.model.tapes  # the residual products are PyTorch ops: the Python loop runs them
    assert tapes is None or not tapes.active


def test_the_scalars_change_the_output(granite):
    """The same weights with neutral scalars (a Llama) answer otherwise, and transformers agrees: the parity
    above holds only if every scalar is applied."""
    check_parity(granite["plain"], "float32")
    prompts = mixed_prompts()
    assert references(granite["granite"], "float32", prompts) != references(granite["plain"], "float32", prompts)


def test_logprobs_are_of_the_divided_logits(granite):
    """Dividing the logits never changes an argmax, so greedy parity cannot see logits_scaling: the logprobs do
    (transformers' GraniteForCausalLM divides its logits before any softmax)."""
    assert_first_logprobs_match(granite["granite"])
