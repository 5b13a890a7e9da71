"""A request's output does not depend on how the scheduler ran it: in bfloat16 (the CPU kernels' paths) and
float32, the same request gives the same tokens and the same logprob bits whatever the prefix cache held,
the step's token budget, preemption (recompute or swap) or the other requests in its batch."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompts

from servelm import LLM, SamplingParams
from servelm.model import cpu_kernels

_kernels = cpu_kernels.load()
# the guarantee is the C++ kernels' (bf16 on CPUs with AMX or AVX512-BF16); PyTorch's paths do not give it
pytestmark = pytest.mark.skipif(_kernels is None or not _kernels.avx512_linear_supported(64),
                                reason="needs the CPU kernels on a CPU with AVX512-BF16")

# Head size 64 and widths that are multiples of 32 take the kernels a real model takes on this CPU (AMX or
# AVX512-BF16 linears, the bf16 decode and prefill attention kernels); an MLP input of 1024 is wide enough
# for oneDNN's bf16 matmul to change its sums with the row count (at 512 it did not); a small initializer
# keeps the logits flat, so a rounding difference anywhere shows up in the chosen tokens too.
CONFIG = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              pad_token_id=2, tie_word_embeddings=False, initializer_range=0.05)
DTYPES = ["bfloat16"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("invariance_model")
    AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return str(out)


def outputs(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    """Per request: its token ids and the logprob bits of every position's top tokens."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs or []])
            for c in (o.outputs[0] for o in outs)]


_alone: dict = {}


def alone(model_dir, dtype, prompts, params=GREEDY) -> list[tuple]:
    """The reference: each request by itself, nothing cached, its prompt in one chunk (computed once)."""
    ps = params if isinstance(params, list) else [params] * len(prompts)
    todo = [(p, s) for p, s in zip(prompts, ps, strict=True) if (dtype, tuple(p), repr(s)) not in _alone]
    if todo:
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks=128, enable_prefix_caching=False)
        for p, s in todo:
            _alone[dtype, tuple(p), repr(s)] = outputs(llm, [p], s)[0]
    return [_alone[dtype, tuple(p), repr(s)] for p, s in zip(prompts, ps, strict=True)]


# 16k + 1 tokens: a full prefix-cache hit (or a 16-token budget) leaves exactly one prompt token to compute
PROMPTS = [p[:16 * k + 1] for p, k in zip(random_prompts(4, 60, 60, seed=40), (2, 3, 1, 3), strict=True)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hits_of_none_one_or_all_blocks_keep_outputs(model_dir, dtype):
    ref = alone(model_dir, dtype, PROMPTS)
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256)
    assert outputs(llm, PROMPTS) == ref  # nothing cached
    hits = llm.engine.get_stats().prefix_cache_hits
    assert outputs(llm, PROMPTS) == ref  # every full block cached: one token left to compute
    assert llm.engine.get_stats().prefix_cache_hits - hits == sum(len(p) - 1 for p in PROMPTS)
    fresh = LLM(model_dir, dtype=dtype, num_kv_blocks=256)
    outputs(fresh, [p[:16] + [7] * 20 for p in PROMPTS])  # only each prompt's first block
    assert outputs(fresh, PROMPTS) == ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_budget_of_1_16_or_2048_keeps_outputs(model_dir, dtype):
    prompts = PROMPTS + random_prompts(2, 70, 100, seed=41)  # and two whose last chunks are longer
    ref = alone(model_dir, dtype, prompts)
    for budget in (1, 16, 2048):
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        assert outputs(llm, prompts) == ref, budget


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(model_dir, dtype, mode):
    prompts = PROMPTS + random_prompts(4, 30, 45, seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = alone(model_dir, dtype, prompts, params)
    # a loaded server's step budget: prompts arrive in chunks, some of a single token, and a sequence may be
    # preempted (and swapped back in) between its chunks
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=20, block_size=8, preemption_mode=mode, swap_space_gb=0.01,
              enable_prefix_caching=False, max_num_batched_tokens=16)
    assert outputs(llm, prompts, params) == ref
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (mode == "swap")


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_sampling_is_the_same_in_any_batch(model_dir, dtype):
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True, logprobs=2) for s in (1, 2, 3, 4)]
    ref = alone(model_dir, dtype, PROMPTS, seeded)
    others = random_prompts(31, 5, 80, seed=44)  # long and short neighbours: prompt chunks beside decodes
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=512)
    noise = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True)
    assert outputs(llm, others + PROMPTS, [noise] * len(others) + seeded)[-4:] == ref  # among 31 others
    for i, (p, s) in enumerate(zip(PROMPTS, seeded, strict=True)):  # again, all but one token cached
        mixed = others[: 5 * i + 2] + [p]  # a different batch (size and neighbours) for each request
        assert outputs(llm, mixed, [noise] * (len(mixed) - 1) + [s])[-1] == ref[i], i


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_that_repeats_a_reply_computes_it_as_prompt(model_dir, dtype):
    """Multi-turn chat: the next prompt holds the last reply, whose cached keys and values came from the
    decode path; it must get what it gets with nothing cached, so those blocks are not reused as prompt."""
    first = PROMPTS[1]  # 49 tokens
    reply = outputs(LLM(model_dir, dtype=dtype, num_kv_blocks=64), [first],
                    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0][0]
    follow_up = first + reply + [5, 6, 7]  # 92 tokens: the reply fills whole blocks
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=64)
    outputs(llm, [first], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    hits = llm.engine.get_stats().prefix_cache_hits
    assert outputs(llm, [follow_up]) == alone(model_dir, dtype, [follow_up])
    assert llm.engine.get_stats().prefix_cache_hits - hits == 48  # the prompt's 3 blocks, none of the reply's
