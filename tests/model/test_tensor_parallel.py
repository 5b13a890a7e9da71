"""Tensor parallelism on the CPU: two ranks (this process and one worker process) give the same greedy tokens
as one rank and as transformers, under batching, prefix caching, chunked prefill, preemption (swap and
recompute) and copy-on-write; bad sizes are refused before anything starts; no rank outlives its engine."""

from __future__ import annotations

import os

import pytest
import torch
from serving import pid_alive
from tiny_models import COMMON, build_gemma, hf_greedy, random_prompts, reference, run

from servelm import LLM, SamplingParams
from servelm.config.engine import EngineConfig
from servelm.model.layers.parallel import check_shardable, kv_heads
from servelm.model.spec import ModelSpec


@pytest.fixture(scope="module", autouse=True)
def _keep_threads():
    """A TP=2 engine gives this process (rank 0) half the CPUs' threads: restored for the other modules."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me and pid_alive(int(d)):
                        out.add(int(d))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


@pytest.fixture(scope="module")
def gemma3_kv1(tmp_path_factory, tokenizer_dir):
    """A Gemma 3 of Gemma-3-270M's attention shape, four query heads over one KV head (at TP=2 both ranks keep
    that head), with its sandwich norms, q/k norms and local/global layers; norm weights randomised."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**{**COMMON, "num_key_value_heads": 1, "tie_word_embeddings": True}, head_dim=16,
                              sliding_window=24, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    return build_gemma(config, tmp_path_factory.mktemp("gemma3_kv1"), tokenizer_dir)


def test_every_scheduling_feature_matches_tp1_and_transformers(model_dirs, hf_models):
    """Qwen2 (Q/K/V biases, a sliding-window layer): swap preemption (a pool of 14 blocks for 4 requests),
    chunked prefill (16-token steps), prefix caching (a shared 24-token prefix, cached by the first request)
    and batching, all at once."""
    shared = random_prompts(1, 24, 24, seed=11)[0]
    prompts = [shared + own for own in random_prompts(4, 6, 20, seed=12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=14, block_size=8, max_num_batched_tokens=16,
              preemption_mode="swap", swap_space_gb=0.01)
    refs = reference(hf_models, "qwen2", prompts)
    tp1 = LLM(str(model_dirs["qwen2"]), **kw)
    assert run(tp1, prompts[:1], params) + run(tp1, prompts[1:], params) == refs
    llm = LLM(str(model_dirs["qwen2"]), tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.core.model.spec.num_heads == 2  # this process holds half the heads
        assert llm.engine.core.model.num_params == tp1.engine.core.model.num_params  # reports the whole model
        assert run(llm, prompts[:1], params) + run(llm, prompts[1:], params) == refs
        stats = llm.engine.get_stats()
        assert stats.prefix_cache_hits >= 3 * 24
        assert stats.num_preemptions > 0 and stats.num_swaps > 0
        assert stats.num_free_blocks == stats.num_kv_blocks
    finally:
        llm.engine.close()


def test_replicated_kv_head_recompute_and_copy_on_write(gemma3_kv1):
    """Gemma 3 with one KV head on two ranks; recompute preemption; n=2 samples share the prompt's blocks, then copy the
    last one (the copy replayed on the worker rank). Afterwards the rank exits when the driver's end of the
    connection closes without a word, as when the driver dies."""
    path, hf = gemma3_kv1
    prompts = random_prompts(4, 21, 29, seed=13)  # each ends mid-block: the shared last block is copied
    refs = [hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=12, block_size=8)
    workers = llm.engine.core.runner.tp_workers
    assert list(kv_heads(ModelSpec.from_hf_config(hf.config), 1, 2)) == [0]
    try:
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in refs]
        assert llm.engine.core.kv.num_cow_copies >= 1
        assert llm.engine.get_stats().num_preemptions > 0
    finally:
        for conn in workers.conns:
            conn.close()
        for proc in workers.procs:
            assert proc.wait(timeout=60) is not None


def _prompt_logprobs(llm, prompts) -> torch.Tensor:
    """The logprob of every prompt token after the first (teacher forced: no greedy divergence to follow)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([d[t].logprob for o, p in zip(outs, prompts, strict=True)
                         for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)])


def test_bfloat16_tp2_as_close_to_float32_as_tp1_and_close_leaves_no_process(model_dirs):
    """In bf16 the ranks' partial sums are rounded before the all-reduce adds them, so the bits differ from
    one rank's single sum (and greedy picks between near-tied logits can differ): TP=2 must add no error
    beyond bf16's own, measured against float32 on the prompt tokens' logprobs."""
    prompts = random_prompts(4, 10, 40, seed=14)
    path = str(model_dirs["qwen3"])
    exact = _prompt_logprobs(LLM(path, dtype="float32", num_kv_blocks=64), prompts)
    tp1 = (_prompt_logprobs(LLM(path, dtype="bfloat16", num_kv_blocks=64), prompts) - exact).abs()
    before = _children()
    llm = LLM(path, dtype="bfloat16", tensor_parallel_size=2, num_kv_blocks=64)
    pids = llm.engine.core.runner.tp_workers.pids
    assert len(pids) == 1 and all(pid_alive(p) for p in pids)
    tp2 = (_prompt_logprobs(llm, prompts) - exact).abs()
    llm.engine.close()
    assert not any(pid_alive(p) for p in pids)
    assert _children() <= before
    assert tp1.mean() > 0 and tp2.mean() <= 1.5 * tp1.mean() and tp2.max() <= 1.5 * tp1.max()


def _spec(**kw) -> ModelSpec:
    from transformers import LlamaConfig

    return ModelSpec.from_hf_config(LlamaConfig(**{**COMMON, **kw}))


@pytest.mark.parametrize("kw, size, why", [
    ({}, 3, "divide the model's 4 attention heads"),
    ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6}, 4, "divide the model's 6 KV heads"),
    ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, 4, "multiple of the model's 3 KV heads"),
    ({"intermediate_size": 130}, 4, "MLP intermediate size 130"),
])
def test_unshardable_sizes_are_refused(kw, size, why):
    with pytest.raises(ValueError, match=why):
        check_shardable(_spec(**kw), size)


def test_shard_math_replicates_kv_heads_as_query_heads_need_them():
    spec = _spec(num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    assert [list(kv_heads(spec, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads(spec, r, 2)) for r in range(2)] == [[0], [1]]
    check_shardable(spec, 8)  # 8 ranks, one query head each, every KV head on 4 of them


def test_bad_sizes_stop_start_up_before_any_rank_starts(model_dirs):
    before = _children()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4 attention heads"):
        LLM(str(model_dirs["llama"]), dtype="float32", tensor_parallel_size=3, num_kv_blocks=8)
    assert _children() <= before
    for kw, why in [({"speculative_method": "ngram"}, "speculative"),
                    ({"batch_invariant": True}, "batch_invariant"), ({"quantization": "gguf"}, "quantization"),
                    ({"kv_cache_persist": "/tmp/x"}, "kv_cache_persist")]:
        with pytest.raises(ValueError, match=f"tensor_parallel_size must be 1, or run with .*{why}"):
            EngineConfig(tensor_parallel_size=2, **kw)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_a_rank_that_cannot_load_fails_start_up_with_its_error(tmp_path):
    from servelm.engine.tp_workers import TPWorkers

    before = _children()
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed to start: .*no-such-model"):
        TPWorkers.start(EngineConfig(model=missing, tensor_parallel_size=2), None)
    assert _children() <= before


def test_fused_checkpoint_tensors_split_like_their_parts():
    """Phi-3 stores [q; k; v] and [gate; up] joined: each rank's slice equals its slices of the parts."""
    from servelm.model.layers.parallel import shard_tensor

    spec = _spec(num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    d, inter = spec.head_dim, spec.intermediate_size
    q, k, v = torch.randn(8 * d, 64), torch.randn(2 * d, 64), torch.randn(2 * d, 64)
    gate, up = torch.randn(inter, 64), torch.randn(inter, 64)
    p = "model.layers.0."
    for rank in range(4):
        def part(name, t, r=rank):
            return shard_tensor(p + name, t, spec, r, 4)

        assert torch.equal(part("self_attn.qkv_proj.weight", torch.cat([q, k, v])),
                           torch.cat([part("self_attn.q_proj.weight", q), part("self_attn.k_proj.weight", k),
                                      part("self_attn.v_proj.weight", v)]))
        assert torch.equal(part("mlp.gate_up_proj.weight", torch.cat([gate, up])),
                           torch.cat([part("mlp.gate_proj.weight", gate), part("mlp.up_proj.weight", up)]))
        assert torch.equal(part("self_attn.q_proj.weight", q), q[rank * 2 * d:(rank + 1) * 2 * d])
        assert torch.equal(part("self_attn.k_proj.weight", k), k[rank // 2 * d:(rank // 2 + 1) * d])
    o = torch.randn(64, 8 * d)
    assert torch.equal(torch.cat([shard_tensor(p + "self_attn.o_proj.weight", o, spec, r, 4) for r in range(4)], 1), o)
    assert shard_tensor(p + "self_attn.o_proj.bias", torch.ones(64), spec, 1, 4) is None  # added once, on rank 0
