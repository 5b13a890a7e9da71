"""Mixture-of-experts families: tiny random-weight Qwen3-MoE (q/k norms, norm_topk_prob), Qwen2-MoE (a shared
expert behind a sigmoid gate, q/k/v biases, a dense layer from mlp_only_layers) and Mixtral (float32 routing
weights, a sliding window) match transformers' greedy outputs token for token in float32 and bfloat16, alone and
batched with prefix caching and chunked prefill, from the per-expert checkpoint layout and transformers 5's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import COMMON, run  # noqa: E402
from family_parity import GREEDY8, check_parity, mixed_prompts, references, save_tiny  # noqa: E402

from servelm import LLM  # noqa: E402
from servelm.model.invariant import make_batch_invariant  # noqa: E402

MOE = dict(COMMON, num_experts_per_tok=2)


def _config(arch: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**MOE, head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                              norm_topk_prob=False, mlp_only_layers=[0])
    return MixtralConfig(**{**MOE, "intermediate_size": 32}, num_local_experts=4, sliding_window=24)


ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("moe")
    return {a: save_tiny(_config(a), root / a, tokenizer_dir) for a in ARCHS}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_matches_transformers(moe, arch, dtype):
    llm = check_parity(moe[arch], dtype)
    model = llm.engine.core.model
    assert model.cpp_decode is None  # the Python layer loop (README: Models)
    sparse = [lw.moe is not None for lw in model.layers]
    assert sparse == ([False, True] if arch == "qwen2_moe" else [True, True])
    if dtype == "float32":
        with pytest.raises(ValueError, match="batch_invariant"):
            make_batch_invariant(model)


def test_moe_transformers5_layout(moe, tmp_path, tokenizer_dir):
    """save_pretrained(save_original_format=False) keeps transformers 5's fused experts.gate_up_proj /
    experts.down_proj tensors: the same model, the same tokens."""
    folder = save_tiny(_config("qwen3_moe"), tmp_path / "fused", tokenizer_dir, save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    prompts = mixed_prompts()[:1]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16)
    assert run(llm, prompts, GREEDY8) == references(moe["qwen3_moe"], "float32", prompts)
