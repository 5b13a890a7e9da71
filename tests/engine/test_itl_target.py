"""The latency target for decoding streams (`itl_target_ms`): the step cost model's fit, prompt chunks cut
to what fits beside the decodes, the whole budget when nothing decodes or nothing is predicted yet, and
greedy outputs unchanged by the chunking it causes."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts, reference, run

from servelm.config.engine import ConfigError, EngineConfig
from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.scheduler import MIN_PREFILL_CHUNK, Scheduler
from servelm.engine.sequence import Request, Sequence
from servelm.engine.step_cost import StepCostModel
from servelm.engine.step_outputs import RunnerOutput
from servelm.sampling_params import SamplingParams


def _trained(base: float, per_token: float) -> StepCostModel:
    m = StepCostModel()
    for tokens in (4, 300, 17, 900, 64, 2048, 8):
        m.observe(tokens, base + per_token * tokens)
    return m


def test_fit_recovers_a_linear_step_cost():
    base, per = _trained(0.012, 0.0007).fit()
    assert base == pytest.approx(0.012, rel=1e-6) and per == pytest.approx(0.0007, rel=1e-6)
    assert _trained(0.012, 0.0007).tokens_within(0.05) == int((0.05 - 0.012) / 0.0007)
    assert _trained(0.012, 0.0007).tokens_within(0.005) == 0  # below the fixed part: nothing fits


def test_no_prediction_until_step_sizes_differ():
    m = StepCostModel()
    assert m.tokens_within(0.05) is None
    for _ in range(50):  # decodes only: every step about the same size
        m.observe(8, 0.02)
    assert m.fit() is None and m.tokens_within(0.05) is None


def test_forgetting_follows_a_change_of_machine_speed():
    m = _trained(0.01, 0.001)
    for _ in range(100):  # the machine gets twice as slow
        for tokens in (10, 500):
            m.observe(tokens, 2 * (0.01 + 0.001 * tokens))
    assert m.fit()[1] == pytest.approx(0.002, rel=0.05)


def _scheduler(target_s: float, cost: StepCostModel, ttft_s: float = 0.0) -> Scheduler:
    kv = KVCacheManager(400, 16, enable_prefix_caching=False, num_cpu_blocks=0)
    return Scheduler(kv, 64, 2048, True, "recompute", "fcfs", itl_target_s=target_s, step_cost=cost,
                     ttft_target_s=ttft_s)


def _add(sch: Scheduler, rid: str, prompt_len: int) -> Sequence:
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=50), arrival_time=0.0)
    req.seqs = [Sequence(req, 0, list(req.prompt_token_ids))]
    sch.add(req.seqs[0])
    return req.seqs[0]


def _run_prompts_to_decoding(sch: Scheduler, n: int) -> list[Sequence]:
    seqs = [_add(sch, f"d{i}", 20) for i in range(n)]
    out = sch.schedule()  # the prompts computed; each now has one more token and decodes
    sch.update_from_output(out, RunnerOutput([7] * int(out.sampled.sum())))
    return seqs


def _prompt_chunk(sch: Scheduler, rid: str) -> int:
    out = sch.schedule()
    return sum(s.num_tokens for s in out.scheduled if s.seq.request.request_id == rid)


def test_prompt_chunk_is_cut_to_fit_beside_decodes():
    cost = _trained(0.010, 0.0005)  # 80 tokens fit in 50 ms
    sch = _scheduler(0.050, cost)
    _run_prompts_to_decoding(sch, 6)
    _add(sch, "long", 1500)
    assert _prompt_chunk(sch, "long") == cost.tokens_within(0.050) - 6


def test_off_or_unpredicted_or_nothing_decoding_fills_the_budget():
    cost = _trained(0.010, 0.0005)
    sch = _scheduler(0.0, cost)  # target off
    _run_prompts_to_decoding(sch, 6)
    _add(sch, "long", 1500)
    assert _prompt_chunk(sch, "long") == 1500
    sch = _scheduler(0.050, StepCostModel())  # nothing learnt yet
    _run_prompts_to_decoding(sch, 6)
    _add(sch, "long", 1500)
    assert _prompt_chunk(sch, "long") == 1500
    sch = _scheduler(0.050, cost)  # nobody decoding: nothing to protect
    _add(sch, "long", 1500)
    assert _prompt_chunk(sch, "long") == 1500


def test_prompts_progress_when_decodes_fill_the_target():
    sch = _scheduler(0.020, _trained(0.018, 0.001))  # 2 tokens fit, and 6 decode
    _run_prompts_to_decoding(sch, 6)
    _add(sch, "long", 1500)
    assert _prompt_chunk(sch, "long") == MIN_PREFILL_CHUNK


def test_the_cut_never_starves_the_prompt_backlog():
    """With a TTFT target the prompts waiting get at least their share of its steps: 1,500 + 900 tokens over
    500 ms / 50 ms = 10 steps is 240 a step, more than the 70 that fit beside the decodes."""
    cost = _trained(0.010, 0.0005)
    sch = _scheduler(0.050, cost, ttft_s=0.5)
    _run_prompts_to_decoding(sch, 6)
    _add(sch, "long", 1500)
    _add(sch, "next", 900)
    out = sch.schedule()
    assert [(s.seq.request.request_id, s.num_tokens) for s in out.scheduled if s.num_tokens > 1] == [("long", 240)]
    sch = _scheduler(0.050, cost, ttft_s=0.5)  # a small backlog: the target's cut stands
    _run_prompts_to_decoding(sch, 6)
    _add(sch, "short", 300)
    assert _prompt_chunk(sch, "short") == cost.tokens_within(0.050) - 6


def test_a_running_prompt_and_new_ones_share_the_prefill_budget():
    cost = _trained(0.010, 0.0005)
    sch = _scheduler(0.050, cost)
    _run_prompts_to_decoding(sch, 4)
    first = _add(sch, "a", 1000)
    _add(sch, "b", 1000)
    out = sch.schedule()
    chunks = {s.seq.request.request_id: s.num_tokens for s in out.scheduled if s.num_tokens > 1}
    assert chunks == {"a": cost.tokens_within(0.050) - 4}  # "b" waits: the budget went to "a"
    sch.update_from_output(out, RunnerOutput([7] * int(out.sampled.sum())))
    assert first.num_computed_tokens == chunks["a"]
    out = sch.schedule()  # "a" is running now and comes first again
    chunks = {s.seq.request.request_id: s.num_tokens for s in out.scheduled if s.num_tokens > 1}
    assert chunks == {"a": cost.tokens_within(0.050) - 4}


def test_config_rejects_a_target_without_chunked_prefill():
    with pytest.raises(ConfigError, match="itl_target_ms"):
        EngineConfig(itl_target_ms=50, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="itl_target_ms"):
        EngineConfig(itl_target_ms=-1)
    with pytest.raises(ConfigError, match="ttft_target_ms"):
        EngineConfig(itl_target_ms=50, ttft_target_ms=-1)


def test_greedy_outputs_match_transformers_under_the_target(model_dirs, hf_models):
    from servelm import LLM

    prompts = random_prompts(6, 40, 200, seed=11)
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=256,
              itl_target_ms=0.001)
    sch = llm.engine.core.scheduler
    # a target no step meets, with a fit from the start: prompts beside decodes go in MIN_PREFILL_CHUNK chunks
    sch.step_cost = _trained(0.010, 0.0005)
    chunks: list[int] = []
    schedule = sch.schedule
    sch.schedule = lambda: _record(schedule(), chunks)
    assert run(llm, prompts) == reference(hf_models, "llama", prompts)
    assert MIN_PREFILL_CHUNK in chunks  # the target did cut prompts


def _record(out, chunks: list[int]):
    chunks += [s.num_tokens for s in out.scheduled if s.num_tokens > 1]
    return out
