"""Prompt logprobs (SamplingParams.prompt_logprobs, what `echo` + `logprobs` needs) against transformers."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import random_prompts, reference

from servelm import LLM, SamplingParams

K = 3
TIE = 1e-5  # logprobs closer than this may order either way: the engine's sums are not transformers'


@pytest.fixture(scope="module")
def llm(llama_dir):
    # a 16-token step budget: a 45-token prompt runs in three chunks, beside other requests' decodes
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16)


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check(entries, ids: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(ids) and entries[0] is None  # the first token has nothing before it
    for j in range(1, len(ids)):
        row = ref[j - 1]
        entry = entries[j]
        assert entry[ids[j]].logprob == pytest.approx(float(row[ids[j]]), abs=1e-4)
        # its rank: 1 + the tokens above it, where a token within float32 noise of it may fall either side
        v = row[ids[j]]
        assert int((row > v + TIE).sum()) + 1 <= entry[ids[j]].rank <= int((row > v - TIE).sum()) + 1
        top = row.topk(K)
        by_rank = sorted((v.rank, t) for t, v in entry.items() if v.rank <= K)
        assert [t for _, t in by_rank] == top.indices.tolist()
        for t in top.indices.tolist():
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4)


def test_prompt_logprobs_match_transformers_under_chunked_prefill(llm, hf_models):
    prompt = random_prompts(1, 45, 45, seed=60)[0]
    others = random_prompts(3, 5, 30, seed=61)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)] + [greedy] * 3
    outs = llm.generate([prompt, *others], params, use_tqdm=False)
    check(outs[0].prompt_logprobs, prompt, hf_prompt_logprobs(hf_models["llama"], prompt))
    # the batch around it is unchanged, and pays nothing: no prompt logprobs where none were asked for
    assert [o.outputs[0].token_ids for o in outs] == reference(hf_models, "llama", [prompt, *others], 6)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(llm, hf_models):
    prompt = random_prompts(1, 40, 40, seed=62)[0]
    plain = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)  # its full blocks are now in the prefix cache
    again = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # others do hit the cache
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=K),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # this one recomputed its prompt for the logits
    check(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf_models["llama"], prompt))


def test_prompt_logprobs_survive_preemption_by_recompute(llama_dir, hf_models):
    """A pool too small for the batch: sequences are preempted and recomputed; each prompt's logprobs are
    still reported once, whole and right."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=12, max_num_batched_tokens=16)
    prompts = random_prompts(4, 30, 40, seed=63)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        ref = hf_prompt_logprobs(hf_models["llama"], p)
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        got = [o.prompt_logprobs[j][p[j]].logprob for j in range(1, len(p))]
        assert got == pytest.approx([float(ref[j - 1, p[j]]) for j in range(1, len(p))], abs=1e-4)


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_max_logprobs_caps_what_a_request_may_ask_for(llama_dir):
    """vLLM's max_logprobs: 20 by default, a request asking for more logprobs or prompt_logprobs is refused
    before it runs; a higher cap gives that many, -1 the whole vocabulary (a distribution that sums to 1)."""
    prompt = [[5, 17, 42, 9]]
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=16)
    for kw in ({"logprobs": 21}, {"prompt_logprobs": 21}):
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate(prompt, SamplingParams(max_tokens=1, **kw), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=20, prompt_logprobs=20),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == 20 and len(out.prompt_logprobs[1]) >= 20
    del llm
    wide = LLM(str(llama_dir), dtype="float32", num_kv_blocks=16, max_logprobs=-1)
    vocab = wide.engine.core.model.spec.vocab_size
    out = wide.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=vocab, prompt_logprobs=40),
                        use_tqdm=False)[0]
    top = out.outputs[0].logprobs[0]
    assert len(top) == vocab and sum(math.exp(lp.logprob) for lp in top.values()) == pytest.approx(1, abs=1e-3)
    assert sorted(lp.rank for lp in top.values()) == list(range(1, vocab + 1))
    assert len(out.prompt_logprobs[2]) >= 40
