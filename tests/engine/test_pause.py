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
