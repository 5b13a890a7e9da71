"""Mixture-of-experts families: tiny random-weight Qwen3-MoE (q/k norms, norm_topk_prob), Qwen2-MoE (a shared
expert behind a sigmoid gate, q/k/v biases, a dense layer from mlp_only_layers) and Mixtral (float32 routing
weights, a sliding window) match transformers' greedy outputs token for token in float32 (in bfloat16: up to
rounding at near ties), alone and batched with prefix caching and chunked prefill, from the per-expert
checkpoint layout and transformers 5's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import (  # noqa: E402
    GREEDY8,
    MOE_ARCHS,
    check_parity,
    mixed_prompts,
    moe_config,
    references,
    save_tiny,
)
from tiny_models import run  # noqa: E402

from servelm import LLM  # noqa: E402
from servelm.model.layers.invariant import check_batch_invariant  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("moe")
    return {a: save_tiny(moe_config(a), root / a, tokenizer_dir) for a in MOE_ARCHS}


# bfloat16 (the CPU kernels' path) once, on Mixtral: the others' bf16 differs only in where the routing weights
# are rounded, which a check up to rounding cannot see (suite time)
@pytest.mark.parametrize(("arch", "dtype"), [(a, "float32") for a in MOE_ARCHS] + [("mixtral", "bfloat16")])
def test_moe_matches_transformers(moe, arch, dtype):
    llm = check_parity(moe[arch], dtype)
    model = llm.engine.core.model
    assert model.tapes is None or not model.tapes.active  # the Python layer loop (README: Models)
    sparse = [lw.moe is not None for lw in model.layers]
    assert sparse == ([False, True] if arch == "qwen2_moe" else [True, True])
    if dtype == "float32":
        with pytest.raises(ValueError, match="batch_invariant"):
            check_batch_invariant(model)


def test_moe_transformers5_layout(moe, tmp_path, tokenizer_dir):
    """save_pretrained(save_original_format=False) keeps transformers 5's fused experts.gate_up_proj /
    experts.down_proj tensors: the same model, the same tokens."""
    folder = save_tiny(moe_config("qwen3_moe"), tmp_path / "fused", tokenizer_dir, save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    prompts = mixed_prompts()[:1]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16)
    assert run(llm, prompts, GREEDY8) == references(moe["qwen3_moe"], "float32", prompts)
