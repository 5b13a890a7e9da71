"""Tensor parallelism's device side, checked on the CPU: the backend chosen from the device (gloo for the CPU,
NCCL for CUDA), each rank's device, the GPU count the config demands, and the decode-graph step protocol (the
worker rank pads and runs the driver's unpadded decode inputs, as on a GPU it replays its captured graphs)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts, run

from servelm import LLM, SamplingParams
from servelm.config.engine import ConfigError, EngineConfig
from servelm.model.layers.parallel import TensorParallel, backend_for, rank_device


@pytest.fixture(scope="module", autouse=True)
def _keep_threads():
    """A TP=2 engine gives this process (rank 0) half the CPUs' threads: restored for the other modules."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), (torch.device("cpu"), "gloo"), ("cuda", "nccl"),
                                             ("cuda:3", "nccl"), (torch.device("cuda", 1), "nccl")])
def test_backend_is_chosen_from_the_device(device, backend):
    assert backend_for(device) == backend


def test_each_rank_takes_its_own_gpu_from_the_base_index():
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [rank_device("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert [rank_device("cpu", r) for r in range(2)] == ["cpu", "cpu"]
    assert TensorParallel(1, 2, "cuda:1").backend == "nccl"  # (chosen without touching CUDA)
    assert TensorParallel(0, 2).backend == "gloo"


@pytest.mark.parametrize("device, visible, ok, why", [
    ("cuda", 2, True, ""),
    ("cuda", 1, False, r"at most 1 on cuda: 2 ranks need GPUs cuda:0\.\.cuda:1, and 1 is visible"),
    ("cuda:1", 2, False, r"at most 1 on cuda:1: 2 ranks need GPUs cuda:1\.\.cuda:2, and 2 are visible"),
    ("cuda:1", 3, True, ""),
    ("cuda", 0, False, r"at most 0 on cuda: 2 ranks need GPUs cuda:0\.\.cuda:1, and 0 are visible"),
])
def test_tp_on_cuda_needs_a_gpu_per_rank(monkeypatch, device, visible, ok, why):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if ok:
        assert EngineConfig(device=device, tensor_parallel_size=2).parallel_config.tensor_parallel_size == 2
    else:
        with pytest.raises(ConfigError, match=f"tensor_parallel_size must be {why}"):
            EngineConfig(device=device, tensor_parallel_size=2)


def test_world_size_1_on_cuda_asks_for_no_second_gpu(monkeypatch):
    """One rank runs the plain path (no group, no worker process): nothing to count."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("counted GPUs for one rank"))
    EngineConfig(device="cuda", tensor_parallel_size=1)


def test_the_rest_of_tps_limits_hold_on_cuda_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1, or run with no speculative decoding"):
        EngineConfig(device="cuda", tensor_parallel_size=2, speculative_method="ngram")


def test_worker_rank_follows_the_drivers_padded_decode_steps(model_dirs):
    """The driver runs pure-decode steps through its padded static buffers (uncaptured, on the CPU); the worker
    rank gets the step's unpadded inputs, pads them to the same size and runs its shard with them: tokens as
    one rank's eager path, and resizing the buffers mid-run is followed too."""
    prompts = random_prompts(5, 3, 30, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=64, block_size=8)
    ref = run(LLM(str(model_dirs["qwen2"]), **kw), prompts, params)
    llm = LLM(str(model_dirs["qwen2"]), tensor_parallel_size=2, **kw)
    try:
        runner = llm.engine.core.runner
        runner.enable_decode_graphs([1, 2, 4, 8], capture=False)
        assert run(llm, prompts, params) == ref
        steps = runner.num_graph_steps
        assert steps > 0
        runner.enable_decode_graphs([2, 8], capture=False)
        assert run(llm, prompts, params) == ref
        assert runner.num_graph_steps > steps
    finally:
        llm.engine.close()
