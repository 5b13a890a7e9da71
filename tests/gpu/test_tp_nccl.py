"""Tensor parallelism on CUDA: two ranks on two GPUs, all-reducing over NCCL (inside the captured decode graphs
too), give the same greedy tokens as one rank on one GPU. Needs two GPUs: a one-GPU machine can run world size 1
only, and skips this module with that reason."""

from __future__ import annotations

import gc

import pytest
import torch
from tiny_models import random_prompts, run

from servelm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 CUDA devices for world size 2 over NCCL "
                                       f"({torch.cuda.device_count()} visible)")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_world_size_2_on_two_gpus_matches_world_size_1(eager, model_dirs):
    """float32, so that the split's different summation order cannot flip a greedy pick between near ties;
    a swap-preempting pool of 14 blocks and 16-token steps, so that block swaps and prefill chunks run on both
    GPUs, and pure-decode batches of up to 4 sequences for the graphs."""
    prompts = random_prompts(4, 6, 40, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", enforce_eager=eager, num_kv_blocks=14, block_size=8,
              max_num_batched_tokens=16, preemption_mode="swap", swap_space_gb=0.01)
    ref = run(LLM(str(model_dirs["qwen2"]), **kw), prompts, params)
    llm = LLM(str(model_dirs["qwen2"]), tensor_parallel_size=2, **kw)
    try:
        core = llm.engine.core
        assert core.model.tp.backend == "nccl" and core.model.embed.device == torch.device("cuda:0")
        assert run(llm, prompts, params) == ref
        assert (core.runner.num_graph_steps > 0) == (not eager)
        assert core.runner.graphs is None or bool(core.runner.graphs.graphs) != eager  # really captured
        assert llm.engine.get_stats().num_swaps > 0
    finally:
        llm.engine.close()


def test_each_rank_sizes_its_kv_cache_from_its_own_gpu(model_dirs):
    """No block count given: every rank profiles its own GPU and all take the fewest blocks any can hold; the
    tokens are those of one rank with as many blocks given by hand (run after, so the two never share a GPU)."""
    gc.collect()  # earlier engines' caches off the GPUs: they would count as other processes' memory
    torch.cuda.empty_cache()
    prompts = random_prompts(3, 6, 30, seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", max_model_len=256)
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, gpu_memory_utilization=0.3, **kw)
    try:
        plan = llm.engine.core.kv_plan
        assert plan.budget > 0  # planned from device memory, not given
        got = run(llm, prompts, params)
    finally:
        llm.engine.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert got == run(LLM(str(model_dirs["llama"]), num_kv_blocks=plan.num_blocks, **kw), prompts, params)
