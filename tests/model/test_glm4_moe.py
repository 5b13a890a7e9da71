"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): DeepSeek-V3's routing (sigmoid scores, a per-expert correction bias on the
choice, group-limited top k, renormalised and scaled weights), an ungated shared expert, dense first layers, q/k
norms and half of each head rotated. A tiny random-weight model, its correction biases drawn far from zero, matches
transformers' greedy outputs token for token (bfloat16: up to rounding at near ties), alone and batched with
prefix caching and chunked prefill; the checkpoint's next-token prediction layer is left unread."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, glm4_moe_config  # noqa: E402


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory, tokenizer_dir):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(glm4_moe_config(), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[1:]:  # the correction decides which experts run: make it matter
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g))
    folder = tmp_path_factory.mktemp("glm4_moe") / "model"
    model.save_pretrained(folder)
    # a next-token prediction layer past the model's three, as GLM-4.5's checkpoints hold one
    save_file({"model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=g),
               "model.layers.3.self_attn.q_proj.weight": torch.randn(64, 64, generator=g)},
              str(folder / "mtp.safetensors"))
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_glm4_moe_matches_transformers(glm4_moe, dtype):
    llm = check_parity(glm4_moe, dtype)
    model = llm.engine.core.model
    opts = model.spec.moe
    assert model.spec.architecture == "Glm4MoeForCausalLM" and model.spec.extra_layers == 1
    assert opts.sigmoid_routing and (opts.n_group, opts.topk_group, opts.routed_scale) == (4, 2, 2.5)
    assert model.layers[0].moe is None and all(lw.moe is not None for lw in model.layers[1:])
    assert model.layers[1].moe.correction.abs().sum() > 0


def test_group_limited_choice_and_the_correction(glm4_moe):
    """The routing itself: experts only from the best two groups (each ranked by its two best scores with the
    correction), weights the chosen experts' scores without it, renormalised and scaled."""
    from servelm import LLM

    moe = LLM(str(glm4_moe), dtype="float32", num_kv_blocks=16).engine.core.model.layers[1].moe
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = moe.route(x)
    scores = torch.sigmoid(x @ moe.router_weight.T)
    choice = (scores + moe.correction).view(5, 4, 2)
    best_groups = choice.topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
    for t in range(5):
        assert set((ids[t] // 2).tolist()) <= set(best_groups[t].tolist())
        chosen = scores[t, ids[t]]
        torch.testing.assert_close(weights[t], chosen / chosen.sum() * 2.5)


def test_a_block_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(glm4_moe, tmp_path):
    """GLM-4.5-Air-FP8's form: every expert's projections (and the attention's) fp8 with 128x128 block scales,
    the router and its correction as they were."""
    from family_parity import GREEDY8, mixed_prompts, references
    from fp8_checkpoints import write_fp8_checkpoint
    from tiny_models import run

    from servelm import LLM

    out, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(glm4_moe, out, twin, "block", (128, 128))
    llm = LLM(str(out), dtype="float32", num_kv_blocks=64)
    model = llm.engine.core.model
    assert model.quantization == "fp8" and model.layers[1].moe.experts[0][1].quant.kind == "fp8"
    prompts = mixed_prompts()
    assert run(llm, prompts, GREEDY8) == references(twin, "float32", prompts)
