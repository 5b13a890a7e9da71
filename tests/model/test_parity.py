"""Greedy outputs match transformers token for token under every scheduling feature."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, random_prompts, reference, run

from servelm import LLM, SamplingParams


@pytest.mark.parametrize("arch", ARCHS)
def test_single_request_matches_transformers(arch, model_dirs, hf_models):
    prompts = random_prompts(1, 30, 30, seed=1)
    llm = LLM(str(model_dirs[arch]), dtype="float32", num_kv_blocks=64)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batch_of_32_mixed_lengths(arch, model_dirs, hf_models):
    prompts = random_prompts(32, 3, 90, seed=2)
    llm = LLM(str(model_dirs[arch]), dtype="float32", num_kv_blocks=512)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    # Really batched: every prompt is admitted at once (2048-token steps of prefill chunks), then all 32
    # decode together, so 16 tokens each take the prefill steps plus 15 decode steps. One by one would take
    # 32 x 16 = 512 steps; even two at a time 256.
    prefill_steps = -(-sum(len(p) for p in prompts) // llm.engine.config.scheduler_config.max_num_batched_tokens)
    assert llm.engine.get_stats().num_steps <= prefill_steps + 15


def test_prefix_caching_shares_blocks_and_keeps_outputs(model_dirs, hf_models):
    shared = random_prompts(1, 48, 48, seed=3)[0]
    prompts = [shared + own for own in random_prompts(8, 5, 20, seed=4)]
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=256)
    first = run(llm, prompts[:1])
    rest = run(llm, prompts[1:])
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= 7 * 48  # every later prompt found the 3 shared blocks
    assert 0 < stats.prefix_cache_hit_rate < 1
    assert first + rest == reference(hf_models, "llama", prompts)


def test_prefix_cache_disabled_has_no_hits(model_dirs):
    shared = random_prompts(1, 48, 48, seed=3)[0]
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    run(llm, [shared + [5, 6]])
    run(llm, [shared + [7, 8]])
    assert llm.engine.get_stats().prefix_cache_hits == 0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_with_tiny_budget(arch, model_dirs, hf_models):
    prompts = random_prompts(6, 20, 70, seed=5)
    llm = LLM(str(model_dirs[arch]), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=8)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_kv_pool_is_too_small(mode, model_dirs, hf_models):
    prompts = random_prompts(8, 30, 45, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=14, block_size=8,
              preemption_mode=mode, swap_space_gb=0.01)
    assert run(llm, prompts, params) == reference(hf_models, "llama", prompts, 24)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swaps > 0) == (mode == "swap")
    assert stats.num_free_blocks == stats.num_kv_blocks  # nothing leaked


def test_n2_shares_prompt_blocks_with_copy_on_write(model_dirs, hf_models):
    prompts = random_prompts(3, 21, 29, seed=7)  # prompt ends mid-block: the last block is shared then copied
    llm = LLM(str(model_dirs["qwen3"]), dtype="float32", num_kv_blocks=128, block_size=16)
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    refs = reference(hf_models, "qwen3", prompts)
    for o, ref in zip(outs, refs, strict=True):
        assert [c.index for c in o.outputs] == [0, 1]
        assert [c.token_ids for c in o.outputs] == [ref, ref]
    assert llm.engine.core.kv.num_cow_copies >= len(prompts)
    assert llm.engine.get_stats().num_free_blocks == 128


def test_logprobs_match_transformers_log_softmax(model_dirs, hf_models):
    prompt = random_prompts(1, 25, 25, seed=8)[0]
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["llama"](torch.tensor([ids])).logits[0].float(), dim=-1)
    total = 0.0
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert lp[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert lp[tok].rank == 1  # greedy picks the top token
        top = row.topk(3)
        assert sorted(lp) == sorted(set(top.indices.tolist()) | {tok})
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert lp[t].logprob == pytest.approx(v, abs=1e-4)
        total += lp[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
