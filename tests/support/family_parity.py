"""Shared by the per-family parity tests (tests/model/test_phi3.py, tests/model/test_moe.py): build a tiny random-weight model
from a transformers config, and check servelm's greedy tokens against transformers' on a scheduling mix."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import COMMON, hf_greedy, random_prompts, run

from servelm import LLM, SamplingParams

GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

# Phi-4-mini's RoPE in small: head_dim 16, partial_rotary_factor 0.75 rotates 12 of it (6 frequencies), the
# short factors apply up to 64 positions
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.3, 1.9, 2.6, 3.4, 4.0], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            "original_max_position_embeddings": 64}
MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


def phi3_config(longrope: bool):
    """A sliding window of 24 and full-head RoPE, or LongRoPE with partial RoPE (no window)."""
    from transformers import Phi3Config

    if longrope:
        return Phi3Config(**COMMON, original_max_position_embeddings=64, rope_parameters=dict(LONGROPE))
    return Phi3Config(**COMMON, sliding_window=24)


def moe_config(arch: str, window: int | None = 24, dense_layers: tuple[int, ...] = (0,)):
    """Qwen3-MoE (q/k norms, norm_topk_prob), Qwen2-MoE (shared expert, q/k/v biases, `dense_layers` dense) or
    Mixtral (4 experts, with `window`); top-2 routing."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(COMMON, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**moe, head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**moe, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                              norm_topk_prob=False, mlp_only_layers=list(dense_layers))
    return MixtralConfig(**{**moe, "intermediate_size": 32}, num_local_experts=4, sliding_window=window)


def smollm3_config(**kw):
    """SmolLM3 in small: four layers, the fourth without RoPE (its default no_rope_layers)."""
    from transformers import SmolLM3Config

    return SmolLM3Config(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True, **kw})


def olmo_config(version: int, **kw):
    """OLMo 2, or OLMo 3 in small: four layers, the fourth global and the rest in a 24-token window, the global
    layer with YaRN on another base than the local ones (so each kind's own RoPE is checked)."""
    from transformers import Olmo2Config, Olmo3Config

    if version == 2:
        return Olmo2Config(**{**COMMON, **kw})
    ropes = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                "rope_theta": 500000.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return Olmo3Config(**{**COMMON, "num_hidden_layers": 4, "sliding_window": 24, "rope_parameters": ropes, **kw})


def glm4_config(**kw):
    """GLM-4 in small: interleaved RoPE on half of each 16-wide head, q/k/v biases, sandwich norms."""
    from transformers import Glm4Config

    return Glm4Config(**{**COMMON, "head_dim": 16, "attention_bias": True, **kw})


def ernie_config(**kw):
    """ERNIE 4.5 in small: the Llama layer with interleaved RoPE over whole heads, tied embeddings."""
    from transformers import Ernie4_5Config

    return Ernie4_5Config(**{**COMMON, "tie_word_embeddings": True, **kw})


def exaone4_config(**kw):
    """EXAONE 4 in small: four layers, three local (24-token window, with RoPE) and a global one without RoPE."""
    from transformers import Exaone4Config

    return Exaone4Config(**{**COMMON, "num_hidden_layers": 4, "sliding_window": 24, "sliding_window_pattern": 4,
                            "layer_types": ["sliding_attention"] * 3 + ["full_attention"], **kw})


def cohere_config(version: int, **kw):
    """Command R in small (q/k norms per head with use_qk_norm), or Command R7B's layout: four layers, three local
    (24-token window) and a global one without RoPE; tied embeddings, as Cohere's models have."""
    from transformers import Cohere2Config, CohereConfig

    if version == 1:
        return CohereConfig(**{**COMMON, "tie_word_embeddings": True, "logit_scale": 0.5, **kw})
    return Cohere2Config(**{**COMMON, "tie_word_embeddings": True, "num_hidden_layers": 4, "logit_scale": 0.5,
                            "sliding_window": 24, "rotary_pct": 1.0,  # (which llama.cpp's converter reads)
                            "layer_types": ["sliding_attention"] * 3 + ["full_attention"], **kw})


def ministral3_config(**kw):
    """Ministral 3 in small: YaRN and Llama 4's query scaling past an original context of 16 (so the mixed
    prompts' later positions are scaled)."""
    from transformers import Ministral3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
    return Ministral3Config(**{**COMMON, "head_dim": 16, "sliding_window": None, "rope_parameters": rope, **kw})


def ministral_config(**kw):
    """Ministral (8B-2410's layout) in small: a 24-token window on three of four layers."""
    from transformers import MinistralConfig

    return MinistralConfig(**{**COMMON, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 24,
                              "layer_types": ["sliding_attention"] * 3 + ["full_attention"], **kw})


def glm4_moe_config(**kw):
    """GLM-4.5 in small: the first layer dense, then 8 routed experts in 4 groups (the best 2 groups, top 2 within)
    and a shared expert, q/k norms, half of each head rotated, a next-token prediction layer in the checkpoint."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 3, "head_dim": 16, "n_routed_experts": 8,
                            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                            "moe_intermediate_size": 32, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                            "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True, **kw})


def seed_oss_config(**kw):
    from transformers import SeedOssConfig

    return SeedOssConfig(**{**COMMON, "attention_bias": True, "attention_out_bias": True, **kw})


# Granite's four scalars, far from neutral
GRANITE_SCALARS = dict(embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.4,
                       logits_scaling=3.0)


def granite_config(**kw):
    from transformers import GraniteConfig

    return GraniteConfig(**{**COMMON, "tie_word_embeddings": True, **GRANITE_SCALARS, **kw})


def save_tiny(config, out: Path, tokenizer_dir: Path, seed: int = 0, **save_kwargs) -> Path:
    """A random-weight model of `config` saved with the SmolLM2 tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, **save_kwargs)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def mixed_prompts() -> list[list[int]]:
    """A 32-token shared prefix with two short tails, then a 40-token prompt (past a 24-token window)."""
    shared = random_prompts(1, 32, 32, seed=21)[0]
    return [shared + p[1:] for p in random_prompts(2, 5, 12, seed=22)] + random_prompts(1, 40, 40, seed=23)


_refs: dict = {}


def references(folder: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy 8 tokens for each prompt, its model loaded in `dtype` (computed once per folder)."""
    key = (str(folder), dtype, tuple(map(tuple, prompts)))
    if key not in _refs:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        _refs[key] = [hf_greedy(hf, p, 8) for p in prompts]
    return _refs[key]


def assert_greedy_within_rounding(folder: Path, prompts: list[list[int]], outs: list[list[int]]) -> None:
    """bfloat16: every generated token is transformers' argmax (its bfloat16 model, fed the same prefix), or
    within 3 bf16 ulps of it. Exact ties to the bit cannot be asked of two sets of kernels: transformers' own
    cached generate and its uncached forward pick different tokens where the top two logits are 0.06 apart."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            rows = hf(torch.tensor([p + out])).logits[0, len(p) - 1:len(p) - 1 + len(out)].float()
        for step, (tok, row) in enumerate(zip(out, rows, strict=True)):
            top = row.max()
            ulp = 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)
            assert row[tok] >= top - 3 * ulp, (p, step, tok, int(row.argmax()), float(top - row[tok]))


def assert_greedy_matches(folder: Path, dtype: str, prompts: list[list[int]], outs: list[list[int]]) -> None:
    """In float32 every token as transformers' greedy generate; in bfloat16 transformers' choice up to rounding."""
    if dtype == "float32":
        assert outs == references(folder, dtype, prompts)
    else:
        assert_greedy_within_rounding(folder, prompts, outs)


def hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's float32 weights under transformers' names, as a trainer's model holds them."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


async def async_greedy(llm, prompts: list[list[int]], params: SamplingParams = GREEDY8) -> list[list[int]]:
    """An AsyncLLM's token ids for each prompt, one request after another."""
    out = []
    for p in prompts:
        final = [o async for o in llm.generate(p, params)][-1]
        out.append(final.outputs[0].token_ids)
    return out


def assert_first_logprobs_match(folder: Path) -> None:
    """The first sampled token's top logprobs are log_softmax of transformers' logits (float32): what greedy parity
    cannot see of a scale on the logits, which never moves an argmax."""
    from transformers import AutoModelForCausalLM

    prompt = mixed_prompts()[2]
    out = LLM(str(folder), dtype="float32", num_kv_blocks=16).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
    [step] = out.logprobs
    for tok, lp in step.items():
        assert abs(lp.logprob - float(want[tok])) <= 1e-4, (tok, lp.logprob, float(want[tok]))


def check_parity(folder: Path, dtype: str, **llm_kwargs) -> LLM:
    """The first prompt alone, then the rest batched (the shared prefix from the cache) in 16-token prefill
    chunks: in float32 every token as transformers' greedy generate; in bfloat16 every token transformers'
    choice up to rounding (`assert_greedy_within_rounding`). Returns the LLM for further checks."""
    prompts = mixed_prompts()
    llm = LLM(str(folder), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=16, **llm_kwargs)
    outs = run(llm, prompts[:1], GREEDY8) + run(llm, prompts[1:], GREEDY8)  # alone, then batched and chunked
    assert llm.engine.get_stats().prefix_cache_hits >= 32  # the shared prefix came from the cache
    assert_greedy_matches(folder, dtype, prompts, outs)
    return llm


def multimodal_model(kind: str, seed: int = 0, **text_kw):
    """A tiny random-weight multimodal model (its vision part one small layer) of `kind`: gemma3, mistral3,
    ministral3 (Mistral3 with a Ministral 3 language model), llava, qwen2_5_vl or qwen3_vl; its language model from
    COMMON with `text_kw`."""
    import transformers as tf

    text = {k: v for k, v in COMMON.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    clip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14)
    if kind == "gemma3":  # its global layers' RoPE linearly scaled, as Gemma 3 4B and up have it
        ropes = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        config = tf.Gemma3Config(text_config={**text, "head_dim": 16, "sliding_window": 24, "rope_parameters": ropes,
                                              **ids, **text_kw},
                                 vision_config=clip,
                                 mm_tokens_per_image=4, tie_word_embeddings=True, **ids)
        cls = tf.Gemma3ForConditionalGeneration
    elif kind in ("mistral3", "ministral3"):
        lm = dict(text, model_type="mistral", head_dim=16, sliding_window=None, **ids)
        if kind == "ministral3":
            lm = {**ministral3_config().to_dict(), **lm, "model_type": "ministral3"}
        lm.update(text_kw)
        config = tf.Mistral3Config(text_config=lm, vision_config=dict(clip, head_dim=16), tie_word_embeddings=False,
                                   **ids)
        cls = tf.Mistral3ForConditionalGeneration
    elif kind == "llava":
        config = tf.LlavaConfig(text_config=dict(text, model_type="llama", **ids, **text_kw),
                                vision_config=dict(clip, model_type="clip_vision_model"), **ids)
        cls = tf.LlavaForConditionalGeneration
    elif kind == "qwen2_5_vl":
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        config = tf.Qwen2_5_VLConfig(text_config=dict(text, rope_parameters=rope, **ids, **text_kw),
                                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                        out_hidden_size=text["hidden_size"]), **ids)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    else:
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 10000.0}
        config = tf.Qwen3VLConfig(text_config=dict(text, head_dim=16, rope_parameters=rope, **ids, **text_kw),
                                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     out_hidden_size=text["hidden_size"], deepstack_visual_indexes=[]),
                                  **ids)
        cls = tf.Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    return cls(config).float().eval()
