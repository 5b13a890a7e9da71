"""Pausing at the engine (EngineCore.held, abort_all; vLLM's pause_generation underneath the server's routes): a
held engine runs no step and takes a weight update with requests in flight, which then go on; abort_all ends
every sample of every request, those not yet forked included."""

from __future__ import annotations

from servelm import LLM, SamplingParams


def test_a_held_engine_runs_nothing_and_takes_new_weights_under_its_requests(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    engine, core = llm.engine, llm.engine.core
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    core.held = True
    assert core.holds_requests
    steps = core.num_steps
    assert engine.step() == [] and core.num_steps == steps
    assert llm.engine.update_weights(str(llama_dir))  # allowed: no step runs under the held request
    core.held = False
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outs] == [6]


def test_abort_all_ends_every_sample(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    engine, core = llm.engine, llm.engine.core
    engine.add_request("n3", [1, 2, 3], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1))
    engine.add_request("one", [4, 5], SamplingParams(max_tokens=6))
    outputs = core.abort_all()
    assert sorted((o.request_id, o.index, o.finish_reason) for o in outputs) == [
        ("n3", 0, "abort"), ("n3", 1, "abort"), ("n3", 2, "abort"), ("one", 0, "abort")]
    assert not engine.has_unfinished_requests() and core.kv.num_free_blocks == 64


def test_a_step_left_in_flight_by_aborts_is_collected_before_weights_change(llama_dir):
    """Async scheduling: requests aborted while a step runs behind them leave it in flight with no request;
    a weight update (or a sleep) collects it first, so that no step reads weights as they are written. A held
    engine collects its step in flight alone and launches none behind it."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, async_scheduling=True, enable_sleep_mode=True)
    engine, core = llm.engine, llm.engine.core
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], greedy, use_tqdm=False)]
    engine.add_request("r", [1, 2, 3], greedy)
    while core.inflight is None:
        engine.step()
    engine.abort_request("r")
    assert core.inflight is not None and not engine.has_unfinished_requests()
    assert llm.engine.update_weights(str(llama_dir))
    assert core.inflight is None
    engine.add_request("s", [1, 2, 3], greedy)
    while core.inflight is None:
        engine.step()
    core.held = True
    engine.step()  # the step in flight is collected, none goes behind it
    assert core.inflight is None and engine.step() == []
    core.held = False
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.sleep(level=1)  # nothing in flight to collect; the same answers after
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], greedy, use_tqdm=False)] == want
