"""The `batch_invariant` mode: a request gives the same token ids and logprob bits whatever the prefix cache
held, the step's token budget, preemption (recompute or swap) or the other requests in its batch, in float32
and bfloat16, with grouped queries and with a sliding window, on whichever kernel variant this CPU runs; and
the mode refuses, at start-up, what the C++ kernels do not run (kernels off, int8/int4, MoE) instead of
serving with a path that promises nothing."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, random_prompts

from servelm import LLM, SamplingParams
from servelm.config.engine import ConfigError, EngineConfig
from servelm.model.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the mode needs the C++ kernels (not built here)")

# Widths as in test_invariance (an MLP input of 1024 is wide enough for the default matmuls to change their
# sums with the row count); a small initializer keeps the logits flat, so a last-bit difference anywhere
# shows in the logprobs.
BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=2,
            head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            tie_word_embeddings=False, initializer_range=0.05)
# (dtype, model): a Llama with grouped queries (two query heads per KV head), and a Mistral with one KV head
# per query head and a 24-token window
VARIANTS = {
    "float32": ("float32", "llama"),
    "float32-window": ("float32", "mistral"),
    "bfloat16": ("bfloat16", "llama"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    configs = {"llama": LlamaConfig(**BASE, num_key_value_heads=1),
               "mistral": MistralConfig(**BASE, num_key_value_heads=2, sliding_window=24)}
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(f"batch_invariant_{name}")
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
        for f in tokenizer_dir.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        out[name] = str(d)
    return out


@pytest.fixture(params=list(VARIANTS))
def variant(request, model_dirs):
    """(make an LLM with the variant's model and dtype, the variant's name)."""
    dtype, model = VARIANTS[request.param]

    def make(**kw) -> LLM:
        kw = {"batch_invariant": True, "num_kv_blocks": 256, **kw}
        return LLM(model_dirs[model], dtype=dtype, **kw)

    return make, request.param


def outputs(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    """Per request: its token ids and the logprob bits of every position's top tokens."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs or []])
            for c in (o.outputs[0] for o in outs)]


_alone: dict = {}


def alone(variant, prompts, params=GREEDY) -> list[tuple]:
    """The reference: each request by itself, nothing cached, its prompt in one chunk (computed once)."""
    make, name = variant
    ps = params if isinstance(params, list) else [params] * len(prompts)
    todo = [(p, s) for p, s in zip(prompts, ps, strict=True) if (name, tuple(p), repr(s)) not in _alone]
    if todo:
        llm = make(enable_prefix_caching=False)
        for p, s in todo:
            _alone[name, tuple(p), repr(s)] = outputs(llm, [p], s)[0]
    return [_alone[name, tuple(p), repr(s)] for p, s in zip(prompts, ps, strict=True)]


# 16k + 1 tokens: a full prefix-cache hit (or a 16-token budget) leaves exactly one prompt token to compute
PROMPTS = [p[:16 * k + 1] for p, k in zip(random_prompts(4, 60, 60, seed=40), (2, 3, 1, 3), strict=True)]
LONGER = random_prompts(2, 70, 100, seed=41)  # last chunks of several tokens; longer than the window


def test_prefix_cache_hits_of_none_one_or_all_blocks_keep_bits(variant):
    ref = alone(variant, PROMPTS)
    make, _ = variant
    llm = make()
    assert outputs(llm, PROMPTS) == ref  # nothing cached
    hits = llm.engine.get_stats().prefix_cache_hits
    assert outputs(llm, PROMPTS) == ref  # every full block cached: one token left to compute
    assert llm.engine.get_stats().prefix_cache_hits - hits == sum(len(p) - 1 for p in PROMPTS)
    fresh = make()
    outputs(fresh, [p[:16] + [7] * 20 for p in PROMPTS])  # only each prompt's first block
    assert outputs(fresh, PROMPTS) == ref


def test_token_budget_of_1_16_or_2048_keeps_bits(variant):
    prompts = PROMPTS + LONGER
    ref = alone(variant, prompts)
    make, _ = variant
    for budget in (1, 16, 2048):  # one token a step: the 16k + 1 prompts only (a step per token is slow)
        batch = PROMPTS if budget == 1 else prompts
        got = outputs(make(max_num_batched_tokens=budget, enable_prefix_caching=False), batch)
        assert got == ref[:len(batch)], budget


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_bits(variant, mode):
    prompts = PROMPTS + random_prompts(4, 30, 45, seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = alone(variant, prompts, params)
    make, _ = variant
    # a loaded server's step budget: prompt chunks of a few tokens, some of one, and preemption (and swapping
    # back in) between them
    llm = make(num_kv_blocks=20, block_size=8, preemption_mode=mode, swap_space_gb=0.01,
               enable_prefix_caching=False, max_num_batched_tokens=16)
    assert outputs(llm, prompts, params) == ref
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (mode == "swap")


def test_the_same_bits_alone_or_among_31_others(variant):
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True, logprobs=2) for s in (1, 2)]
    requests = PROMPTS[:2] + PROMPTS[:2]
    params = [GREEDY, GREEDY] + seeded
    ref = alone(variant, requests, params)
    others = random_prompts(31, 5, 80, seed=44)  # long and short neighbours: prompt chunks beside decodes
    noise = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True)
    make, _ = variant
    llm = make(num_kv_blocks=512)
    assert outputs(llm, others + requests, [noise] * len(others) + params)[-4:] == ref  # among 31 others
    for i, (p, s) in enumerate(zip(requests, params, strict=True)):  # again, all but one token cached
        mixed = others[: 5 * i + 2] + [p]  # a different batch (size and neighbours) for each request
        assert outputs(llm, mixed, [noise] * (len(mixed) - 1) + [s])[-1] == ref[i], i


def test_the_mode_computes_what_the_default_path_computes(model_dirs):
    """The mode checks and changes nothing: the same bits as the default path, which is invariant already."""
    prompts = PROMPTS + LONGER
    for model in ("llama", "mistral"):
        on, off = (outputs(LLM(model_dirs[model], dtype="float32", num_kv_blocks=256, batch_invariant=b), prompts)
                   for b in (True, False))
        assert on == off


def test_the_mode_refuses_what_the_kernels_do_not_run(model_dirs, monkeypatch):
    with pytest.raises(ValueError, match="batch_invariant: .* linear layers run in PyTorch's kernels"):
        LLM(model_dirs["llama"], dtype="float16", num_kv_blocks=64, batch_invariant=True)  # F.linear in float16
    with pytest.raises(ConfigError, match="quantization must be auto, none or gguf with batch_invariant"):
        EngineConfig(quantization="int4", batch_invariant=True)
    monkeypatch.setenv("SERVELM_CPU_KERNELS", "0")  # read on every load: the PyTorch paths from here on
    with pytest.raises(ValueError, match="batch_invariant needs servelm's C\\+\\+ CPU kernels"):
        LLM(model_dirs["llama"], dtype="float32", num_kv_blocks=64, batch_invariant=True)
    LLM(model_dirs["llama"], dtype="float32", num_kv_blocks=64)  # without the mode the same setting serves


def test_the_mode_is_cpu_only():
    with pytest.raises(ConfigError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, device="cuda")
