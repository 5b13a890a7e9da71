"""The KV cache sized as vLLM sizes it on a GPU: gpu_memory_utilization of the device, less the peak of a
profile run at the largest step and the memory that is not the engine's tensors. The device's counters are a
stand-in here (CI has no GPU); the profile run itself is the real one, on the CPU."""

from __future__ import annotations

import pytest

from servelm import LLM, SamplingParams
from servelm.config.engine import EngineConfig
from servelm.engine import core as core_mod
from servelm.engine.kv_sizing import KVPlan, check_model_len, plan_kv_blocks

GiB = 2**30


class FakeMemory:
    """A device of `total` bytes on which `other` bytes are not this process's tensors; the profile run's peak
    is `peak`. Records the order of calls."""

    def __init__(self, total: int, peak: int, other: int) -> None:
        self._total, self._peak, self._other = total, peak, other
        self.graphs = 0  # what CUDA graphs hold while they exist
        self.events: list[str] = []

    def total(self) -> int:
        return self._total

    def used(self) -> int:
        return self._other + self.reserved() + self.graphs

    def reserved(self) -> int:
        return self._peak + 12345  # the allocator holds a little more than its peak: not "other" memory

    def reset_peak(self) -> None:
        self.events.append("reset")

    def peak_allocated(self) -> int:
        self.events.append("peak")
        return self._peak


def test_blocks_are_what_utilization_leaves_after_the_profiled_peak_and_other_memory():
    mem = FakeMemory(total=80 * GiB, peak=20 * GiB, other=2 * GiB)
    cfg = EngineConfig(gpu_memory_utilization=0.5)
    plan = plan_kv_blocks(cfg, 2**20, mem, lambda: mem.events.append("profile"))
    assert mem.events == ["reset", "profile", "peak"]
    assert plan.num_blocks == (40 * GiB - 20 * GiB - 2 * GiB) // 2**20
    # the default share is vLLM's 0.9
    assert plan_kv_blocks(EngineConfig(), 2**20, mem, lambda: None).num_blocks == int(
        0.9 * 80 * GiB - 22 * GiB) // 2**20
    assert "40.00 GiB for this engine" in plan.describe() and "20.00 GiB of weights" in plan.describe()


class FakeGraphs:
    """What a capture of the largest CUDA graphs returns: while it lives, the device has `size` bytes fewer."""

    def __init__(self, mem: FakeMemory, size: int) -> None:
        self.mem = mem
        mem.graphs = size
        mem.events.append("graphs")

    def __del__(self) -> None:
        self.mem.graphs = 0
        self.mem.events.append("freed")


def test_the_cuda_graphs_measured_before_the_cache_exists_come_out_of_it():
    mem = FakeMemory(total=80 * GiB, peak=20 * GiB, other=2 * GiB)
    cfg = EngineConfig(gpu_memory_utilization=0.5)
    plan = plan_kv_blocks(cfg, 2**20, mem, lambda: mem.events.append("profile"),
                          graphs=lambda: FakeGraphs(mem, 3 * GiB))
    # measured after the profile's memory left the device, and released before the cache is allocated
    assert mem.events == ["reset", "profile", "peak", "reset", "graphs", "reset", "freed", "reset"] and mem.graphs == 0
    assert plan.graphs == 3 * GiB
    assert plan.num_blocks == (40 * GiB - 20 * GiB - 2 * GiB - 3 * GiB) // 2**20
    assert "3.00 GiB of CUDA graphs" in plan.describe()
    with pytest.raises(ValueError, match="CUDA graphs 3.00 GiB"):
        plan_kv_blocks(EngineConfig(gpu_memory_utilization=0.3), 2**20, mem, lambda: None,
                       graphs=lambda: FakeGraphs(mem, 3 * GiB))


def test_a_size_given_by_hand_wins_and_runs_no_profile():
    mem = FakeMemory(total=80 * GiB, peak=20 * GiB, other=0)
    ran = []
    assert plan_kv_blocks(EngineConfig(num_kv_blocks=7), 2**20, mem, lambda: ran.append(1)).num_blocks == 7
    assert plan_kv_blocks(EngineConfig(kv_cache_memory_gb=2), 2**20, mem, lambda: ran.append(1)).num_blocks == 2048
    assert plan_kv_blocks(EngineConfig(), 2**20, None, lambda: ran.append(1)).num_blocks == 1024  # the CPU: 1 GiB
    assert plan_kv_blocks(EngineConfig(num_kv_blocks=7), 2**20, mem, lambda: ran.append(1),
                          graphs=lambda: ran.append(2)).num_blocks == 7
    assert ran == [] and mem.events == []


def test_no_memory_left_is_an_error_naming_the_numbers():
    mem = FakeMemory(total=16 * GiB, peak=15 * GiB, other=GiB)
    with pytest.raises(ValueError) as e:
        plan_kv_blocks(EngineConfig(max_num_batched_tokens=8192), 2**20, mem, lambda: None)
    msg = str(e.value)
    assert "0.9 of 16.00 GiB is 14.40 GiB" in msg and "15.00 GiB at their peak" in msg and "8192 tokens" in msg
    assert "--gpu-memory-utilization" in msg


def test_a_context_that_does_not_fit_a_planned_cache_is_an_error_a_fixed_one_lowers_it(caplog):
    planned = KVPlan(num_blocks=100, block_bytes=2**20, budget=10 * GiB, peak=GiB, other=0)
    with pytest.raises(ValueError, match=r"context length 4096 does not fit.*--max-model-len 1600"):
        check_model_len(planned, 16, None, 4096)
    assert check_model_len(planned, 16, 1600, 4096) == 1600
    with pytest.raises(ValueError, match="max_model_len=2000 does not fit.*raise --gpu-memory-utilization"):
        check_model_len(planned, 16, 2000, 4096)
    fixed = KVPlan(num_blocks=100, block_bytes=2**20)
    assert check_model_len(fixed, 16, None, 4096) == 1600
    assert "lowered from 4096 to the KV cache capacity 1600" in caplog.text
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        check_model_len(fixed, 16, 8192, 4096)


def test_the_engine_profiles_its_largest_step_then_serves_the_same_tokens(llama_dir, monkeypatch):
    """An engine given device counters runs the real profile step (a 96-token chunk, 8 rows of logits and
    sampling) between resetting and reading the peak, sizes its cache from them, and then generates exactly
    what an engine with the same number of blocks given by hand generates."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads, head_dim 16, float32
    mem = FakeMemory(total=10**6, peak=2 * 10**5, other=10**5)
    want_blocks = (int(0.5 * 10**6) - 3 * 10**5) // block_bytes
    profiled = []
    real_profile = core_mod.profile_largest_step

    def profile(model, block_size, tokens, rows, *rest):
        mem.events.append("profile")
        profiled.append((block_size, tokens, rows))
        real_profile(model, block_size, tokens, rows, *rest)

    monkeypatch.setattr(core_mod, "profile_largest_step", profile)
    init = core_mod.EngineCore.__init__
    monkeypatch.setattr(core_mod.EngineCore, "__init__", lambda self, config, model, tokenizer_loader=None,
                        memory=None: init(self, config, model, tokenizer_loader, mem))
    kw = dict(dtype="float32", max_num_batched_tokens=96, max_num_seqs=8, max_model_len=256, seed=0)
    llm = LLM(str(llama_dir), gpu_memory_utilization=0.5, **kw)
    assert mem.events == ["reset", "profile", "peak"] and profiled == [(16, 96, 8)]
    assert llm.engine.core.kv_plan.block_bytes == block_bytes
    assert llm.engine.core.kv_plan.num_blocks == want_blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 200, 31], list(range(3, 120))]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.undo()
    ref = LLM(str(llama_dir), num_kv_blocks=want_blocks, **kw)
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
