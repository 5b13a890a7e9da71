"""GLM-4 and ERNIE 4.5: interleaved RoPE (GPT-J's pairs) run as half-split RoPE over q/k rows reordered at load;
GLM-4's sandwich norms under its own names, RoPE on half of each head, biases and fused gate/up. Tiny
random-weight models match transformers' greedy outputs token for token (bfloat16: up to rounding at near ties),
alone and batched with prefix caching and chunked prefill; so do weight updates and LoRA adapters (against PEFT),
which bring q/k rows in the checkpoint's order."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import family_parity as fp  # noqa: E402
from family_parity import check_parity, mixed_prompts, references  # noqa: E402
from tiny_models import hf_greedy, run  # noqa: E402

from servelm import LLM, LoRARequest, SamplingParams  # noqa: E402
from servelm.model.kernels import cpu as cpu_kernels  # noqa: E402
from servelm.model.layers.blocks import apply_rotary  # noqa: E402
from servelm.model.layers.rope_layout import to_half_split  # noqa: E402


@pytest.fixture(scope="module")
def glm(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("glm")
    return {"glm4": fp.save_tiny(fp.glm4_config(), root / "glm4", tokenizer_dir),
            "glm4-b": fp.save_tiny(fp.glm4_config(), root / "glm4-b", tokenizer_dir, seed=3),
            "ernie": fp.save_tiny(fp.ernie_config(), root / "ernie", tokenizer_dir)}


@pytest.mark.parametrize("rot", [16, 8])
def test_reordered_rows_rotate_as_interleaved_pairs(rot):
    """The identity the loader rests on: rotating neighbouring pairs of the first `rot` dims equals rotating the
    reordered head half-split, and query-key dot products are the same either way."""
    g = torch.Generator().manual_seed(0)
    heads, d, t = 3, 16, 5
    q, k = torch.randn(t, heads, d, generator=g), torch.randn(t, heads, d, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(t).float() * 7, inv)  # [t, rot/2]

    def interleaved(x):
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        c, s = freqs.cos()[:, None], freqs.sin()[:, None]
        out = x.clone()
        out[..., 0:rot:2], out[..., 1:rot:2] = x1 * c - x2 * s, x2 * c + x1 * s
        return out

    def half_split(x):
        rows = to_half_split(x.permute(1, 2, 0).reshape(heads * d, t), d, rot).reshape(heads, d, t).permute(2, 0, 1)
        emb = torch.cat([freqs, freqs], dim=-1)
        rotated = apply_rotary(rows[..., :rot], emb.cos(), emb.sin())
        return torch.cat([rotated, rows[..., rot:]], dim=-1)

    want = (interleaved(q) * interleaved(k)).sum(-1)
    got = (half_split(q) * half_split(k)).sum(-1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_glm4_matches_transformers(glm, dtype):
    llm = check_parity(glm["glm4"], dtype)
    spec = llm.engine.core.model.spec
    assert spec.architecture == "Glm4ForCausalLM" and spec.interleaved_rope and spec.rotary_dim == 8
    assert spec.sandwich_norms and spec.sandwich_norm_names[1] == "post_attention_layernorm"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ernie_matches_transformers(glm, dtype):
    llm = check_parity(glm["ernie"], dtype)
    model = llm.engine.core.model
    assert model.spec.architecture == "Ernie4_5ForCausalLM" and model.spec.interleaved_rope
    kernels = cpu_kernels.load()
    if dtype == "bfloat16" and kernels is not None and kernels.avx512_linear_supported(64):
        assert model.tapes.active  # reordered at load, its layer is the Llama layer: decode steps replay tapes


def test_weight_updates_bring_rows_in_the_checkpoints_order(glm):
    """A trainer's state dict (transformers' names and layout) gives transformers' tokens on it."""
    prompts = mixed_prompts()
    llm = LLM(str(glm["glm4"]), dtype="float32", num_kv_blocks=64)
    before = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    llm.load_weights(fp.hf_state_dict(glm["glm4-b"]).items())
    after = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert after == references(glm["glm4-b"], "float32", prompts) and after != before


def test_lora_on_q_and_k_matches_peft_merged(glm, tmp_path):
    pytest.importorskip("peft")
    from random_weights import make_adapter

    merged = make_adapter(glm["ernie"], tmp_path / "qk", 8, 16, False, ["q_proj", "k_proj", "v_proj"], seed=4)
    prompts = mixed_prompts()
    llm = LLM(str(glm["ernie"]), dtype="float32", num_kv_blocks=64, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=LoRARequest("qk", 1, str(tmp_path / "qk")), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(merged, p, 8) for p in prompts]
    assert got != references(glm["ernie"], "float32", prompts)  # the adapter changed the answers
