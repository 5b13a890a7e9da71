"""Async scheduling: the next step of decodes is scheduled and launched behind the one in flight, its input
tokens taken on the device from that step's samples. Outputs must be what the steps in order give: greedy equal
to transformers, seeded sampling equal to the engine without overlap, with rows ending on tokens nobody could
foresee (stop ids), requests arriving and aborted while a step is in flight, and requests that need each step's
tokens on the host (logprobs, penalties) holding the overlap off."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, random_prompts

from servelm import LLM, SamplingParams
from servelm.config.engine import ConfigError, EngineConfig


def _llm(model_dirs, **kw) -> LLM:
    return LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=96, block_size=4, **kw)


def _until_stop(tokens: list[int], stop: int) -> list[int]:
    return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens


@pytest.mark.parametrize("buffers", ["eager", "static"])
def test_greedy_outputs_match_transformers(model_dirs, hf_models, buffers):
    """Rows end at different lengths and on stop ids taken from their own continuations (the step behind
    theirs already runs when their stop token comes): every output still equals transformers' greedy one.
    `static`: the padded buffers a GPU replays CUDA graphs from, run without capture."""
    prompts = random_prompts(6, 4, 30, seed=21)
    lengths = [20, 3, 24, 9, 24, 14]
    want = [hf_greedy(hf_models["llama"], p, n) for p, n in zip(prompts, lengths, strict=True)]
    stops = [w[k] for w, k in zip(want, [5, 0, 11, 30, 2, 40], strict=True) if k < len(w)]
    stops += [None] * (len(prompts) - len(stops))
    llm = _llm(model_dirs, async_scheduling=True)
    core = llm.engine.core
    if buffers == "static":
        core.runner.enable_decode_graphs([1, 2, 4, 8], capture=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                             stop_token_ids=[s] if s is not None else None)
              for n, s in zip(lengths, stops, strict=True)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = [_until_stop(w, s) if s is not None else w for w, s in zip(want, stops, strict=True)]
    assert got == expected
    assert core.num_overlapped_steps > 0
    if buffers == "static":
        assert core.runner.num_graph_steps > 0
    assert core.inflight is None and core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_seeded_sampling_is_the_same_with_and_without_overlap(model_dirs):
    prompts = random_prompts(5, 4, 20, seed=22)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12 + 3 * i, ignore_eos=True)
              for i in range(5)]
    runs = {}
    for overlap in (False, True):
        llm = _llm(model_dirs, async_scheduling=overlap)
        runs[overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (llm.engine.core.num_overlapped_steps > 0) == overlap
    assert runs[True] == runs[False]


def test_requests_arriving_and_aborted_while_a_step_is_in_flight(model_dirs, hf_models):
    """A request aborted while the step behind its own runs leaves its blocks to the pool; requests arriving
    meanwhile wait for the step in flight, then are admitted; every other output is transformers' greedy one."""
    prompts = random_prompts(6, 4, 24, seed=23)
    engine = _llm(model_dirs, async_scheduling=True).engine
    core = engine.core
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], greedy)
    done: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids

    while core.inflight is None:
        step()
    engine.abort_request("r1")
    engine.add_request("r4", prompts[4], greedy)
    step()
    while core.inflight is None:
        step()
    engine.add_request("r5", prompts[5], greedy)
    engine.abort_request("r2")
    while engine.has_unfinished_requests():
        step()
    assert sorted(done) == ["r0", "r3", "r4", "r5"]
    for rid in done:
        assert done[rid] == hf_greedy(hf_models["llama"], prompts[int(rid[1])], 16), rid
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks and len(core.scheduler.batch) == 0


def test_a_request_that_needs_its_tokens_holds_the_overlap_off(model_dirs, hf_models):
    """Logprobs, penalties, min_tokens and n > 1 read each step's tokens on the host: while such a
    request runs no step goes behind another, and every output is what the engine without overlap gives (a
    repetition penalty sampled before the last token is on the host would change the greedy choice)."""
    prompts = random_prompts(3, 4, 20, seed=24)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    runs = {}
    for overlap in (False, True):
        llm = _llm(model_dirs, async_scheduling=overlap, max_num_seqs=4)
        runs[overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.num_overlapped_steps == 0
    assert runs[True] == runs[False]
    assert runs[True][1] == hf_greedy(hf_models["llama"], prompts[1], 10)
    engine = llm.engine
    for i, extra in enumerate([{"logprobs": 1}, {"prompt_logprobs": 1}, {"min_tokens": 4}, {"n": 2},
                               {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {}]):
        engine.add_request(f"k{i}", prompts[0], SamplingParams(max_tokens=10, **extra))
        assert engine.core.requests[f"k{i}"].overlaps is (not extra), extra
        engine.abort_request(f"k{i}")


def test_config_refuses_what_async_scheduling_cannot_run_with():
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(model="m", async_scheduling=True, speculative_method="ngram")
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
    assert EngineConfig(model="m", async_scheduling=True).scheduler_config.async_scheduling


def test_by_default_steps_overlap_on_cuda_where_nothing_rules_it_out(monkeypatch):
    """As vLLM's default: on with a CUDA device, off where speculative decoding or tensor parallelism needs each
    step's tokens on the host first (not an error, as it is when asked for), and off on the CPU."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # tensor parallelism's check of the GPUs
    assert EngineConfig(model="m", device="cuda").async_scheduling_on()
    assert not EngineConfig(model="m", device="cuda", async_scheduling=False).async_scheduling_on()
    assert not EngineConfig(model="m", device="cuda", speculative_method="ngram").async_scheduling_on()
    assert not EngineConfig(model="m", device="cuda", tensor_parallel_size=2).async_scheduling_on()
    assert not EngineConfig(model="m").async_scheduling_on()
    assert EngineConfig(model="m", async_scheduling=True).async_scheduling_on()


def test_the_cpu_engine_goes_step_by_step_unless_asked(model_dirs):
    assert _llm(model_dirs).engine.core.async_scheduling is False
    assert _llm(model_dirs, async_scheduling=True).engine.core.async_scheduling is True


def test_a_waiting_request_of_a_better_class_is_not_kept_waiting(model_dirs):
    """With every slot taken by overlapping low-priority decodes, a high-priority request that arrives is
    admitted at once (displacing one), as without overlap: it finishes while the others still run."""
    from servelm.engine.sequence import Priority

    prompts = random_prompts(3, 4, 12, seed=25)
    engine = _llm(model_dirs, async_scheduling=True, max_num_seqs=2).engine
    core = engine.core
    for i in range(2):
        engine.add_request(f"low{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                           priority=Priority.LOW)
    while core.inflight is None:
        engine.step()
    engine.add_request("high", prompts[2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       priority=Priority.HIGH)
    finished: list[str] = []
    while "high" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high"]
    while engine.has_unfinished_requests():
        engine.step()
    assert core.num_overlapped_steps > 0 and core.kv.num_free_blocks == core.kv.pool.num_blocks
