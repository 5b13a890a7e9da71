"""AsyncLLM, vLLM's asyncio engine: one engine process serving the requests of an event loop. Its greedy outputs
are the offline LLM's (the oracle that matches transformers), cumulative, delta or final only; each of many
concurrent requests gets its own outputs; leaving a stream or abort() frees the request; bad requests raise
ValueError and leave the engine serving; LoRA adapters load on first use; shutdown ends the process.

One AsyncLLM for the module, on an event loop of its own thread (the engine's sockets belong to that loop)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest

from servelm import LLM, AsyncLLM, OutputKind, SamplingParams
from servelm.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["Once upon a time", [1, 500, 600, 700, 800], {"prompt": "The capital of France"},
           {"prompt_token_ids": [1, 42, 43, 44]}]


class LoopThread:
    """An event loop running in a thread: run(coro) waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def served(llama_dir):
    loop = LoopThread()
    llm = AsyncLLM(str(llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True)
    loop.run(llm.start())
    yield llm, loop
    loop.run(llm.shutdown())
    loop.close()


async def _all(llm: AsyncLLM, prompt, params=GREEDY, **kw) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, **kw)]


def test_greedy_outputs_are_the_offline_apis_cumulative_as_vllms(served, oracle):
    llm, loop = served
    want = oracle.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, expected in zip(PROMPTS, want, strict=True):
        outs = loop.run(_all(llm, prompt))
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.prompt_token_ids == expected.prompt_token_ids
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert final.outputs[0].text == expected.outputs[0].text
        texts = [o.outputs[0].text for o in outs]  # cumulative: each output holds all so far
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)) and len(outs) > 1


def test_delta_and_final_only_outputs(served, oracle):
    llm, loop = served
    [want] = oracle.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    deltas = loop.run(_all(llm, PROMPTS[0], dataclasses.replace(GREEDY, output_kind=OutputKind.DELTA)))
    assert "".join(o.outputs[0].text for o in deltas) == want.outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == want.outputs[0].token_ids
    final = loop.run(_all(llm, PROMPTS[0], dataclasses.replace(GREEDY, output_kind=OutputKind.FINAL_ONLY)))
    assert len(final) == 1 and final[0].outputs[0].text == want.outputs[0].text


def test_concurrent_requests_each_get_their_own_outputs(served):
    llm, loop = served
    prompts = [[1, 100 + 7 * k, 200 + k] for k in range(12)]

    async def many():
        return await asyncio.gather(*(_all(llm, p, request_id=f"r{k}") for k, p in enumerate(prompts)))
    results = loop.run(many())
    tok = llm.tokenizer
    for k, outs in enumerate(results):
        assert {o.request_id for o in outs} == {f"r{k}"}
        final = outs[-1]
        assert final.prompt_token_ids == prompts[k] and len(final.outputs[0].token_ids) == GREEDY.max_tokens
        assert final.outputs[0].text == tok.decode(final.outputs[0].token_ids, skip_special_tokens=True)
    assert llm._engine.num_in_flight() == 0


def test_leaving_a_stream_or_abort_frees_the_request(served):
    llm, loop = served
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def leave_early():
        async with contextlib.aclosing(llm.generate(PROMPTS[1], long, request_id="closed")) as stream:
            async for out in stream:
                assert not out.finished
                break
        closed = llm._engine.num_in_flight()  # aclosing: aborted as the block ends
        async for _ in llm.generate(PROMPTS[1], long, request_id="left"):
            break
        for _ in range(500):  # a plain break: aborted once the loop has collected the generator
            if llm._engine.num_in_flight() == 0:
                break
            await asyncio.sleep(0.01)
        return closed, llm._engine.num_in_flight()
    assert loop.run(leave_early()) == (0, 0)

    async def aborted():
        seen = []
        async def consume():
            async for out in llm.generate(PROMPTS[1], long, request_id="stopped"):
                seen.append(out)
                if len(seen) == 1:
                    first.set()
        first = asyncio.Event()
        task = asyncio.create_task(consume())
        await first.wait()
        await llm.abort("stopped")
        await task  # the stream ends after what it already held
        return seen
    seen = loop.run(aborted())
    assert seen and not seen[-1].finished and llm._engine.num_in_flight() == 0
    assert loop.run(_all(llm, PROMPTS[0]))[-1].finished  # and the engine serves on


def test_bad_requests_raise_value_error_and_the_engine_serves_on(served):
    llm, loop = served
    vocab = llm._engine.info.vocab_size
    with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, {vocab}\)"):
        loop.run(_all(llm, [1, vocab + 5]))
    with pytest.raises(ValueError, match="at least one token"):
        loop.run(_all(llm, {"prompt_token_ids": []}))
    with pytest.raises(ValueError, match="priority"):
        loop.run(_all(llm, PROMPTS[0], priority=7))
    with pytest.raises(ValueError, match="exactly one"):
        loop.run(_all(llm, {"text": "hi"}))

    async def twice():
        first = llm.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="same")
        await anext(first)
        try:
            await _all(llm, PROMPTS[0], request_id="same")
        finally:
            await first.aclose()
    with pytest.raises(ValueError, match="already in use"):
        loop.run(twice())
    assert llm._engine.num_in_flight() == 0 and loop.run(_all(llm, PROMPTS[0]))[-1].finished


def test_default_sampling_params_are_the_models(served, oracle):
    llm, _ = served
    assert llm.get_default_sampling_params() == oracle.get_default_sampling_params()
    assert llm.max_model_len == oracle.engine.max_model_len


def test_a_lora_request_loads_its_adapter_on_first_use(served, llama_dir, model_dirs, tmp_path_factory):
    pytest.importorskip("peft")
    from random_weights import make_adapter

    from servelm import LoRARequest

    path = tmp_path_factory.mktemp("async-lora") / "a"
    make_adapter(model_dirs["llama"], path, 8, 16, False, ["q_proj", "v_proj"], seed=41)
    lora = LoRARequest("a", 1, str(path))
    want = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, enable_lora=True).generate(
        [PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    llm, loop = served
    assert loop.run(_all(llm, PROMPTS[1], lora_request=lora))[-1].outputs[0].token_ids == want
    assert loop.run(_all(llm, PROMPTS[1], lora_request=LoRARequest("a", 1)))[-1].outputs[0].token_ids == want
    base = loop.run(_all(llm, PROMPTS[1]))[-1].outputs[0].token_ids
    assert base != want
    with pytest.raises(ValueError, match="loaded from"):
        loop.run(_all(llm, PROMPTS[1], lora_request=LoRARequest("a", 1, str(path) + "-other")))


def test_shutdown_ends_the_engine_process_and_start_makes_a_new_one(llama_dir):
    async def lifecycle():
        async with AsyncLLM(str(llama_dir), dtype="float32", num_kv_blocks=16) as llm:
            proc = llm._engine._proc
            assert llm.is_running and proc.is_alive()
            await llm.check_health()
            assert (await _all(llm, PROMPTS[0]))[-1].finished
        assert not llm.is_running and not proc.is_alive()
        with pytest.raises(RuntimeError, match="not running"):
            await llm.check_health()
        out = await _all(llm, PROMPTS[0])  # generate starts it again
        await llm.shutdown()
        return out
    assert asyncio.run(lifecycle())[-1].finished


def test_a_script_without_a_main_guard_fails_its_start_once_saying_why(llama_dir, tmp_path):
    """The engine process is spawned and imports the script's module: a script that starts the engine at its
    top level starts it again in there, which dies. That first engine's death stops the start with the reason,
    where it used to restart, dying the same way, until the start timeout."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import asyncio\nfrom servelm import AsyncLLM\n"
                      f"asyncio.run(AsyncLLM({str(llama_dir)!r}, dtype='float32', num_kv_blocks=16).start())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "EngineStartError" in done.stderr and 'if __name__ == "__main__":' in done.stderr
    assert done.stderr.count("in-flight requests") == 1 and "restarting" not in done.stderr  # one death


def test_reset_prefix_cache_as_vllms(served, oracle):
    """LLM.reset_prefix_cache and AsyncLLM.reset_prefix_cache: the next run of a prompt computes it anew; while
    a request is in flight the reset is refused (False) and changes nothing."""
    prompt = list(range(1, 50))
    params = SamplingParams(temperature=0, max_tokens=2)
    oracle.generate([prompt], params, use_tqdm=False)
    assert oracle.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens >= 32
    oracle.engine.add_request("busy", prompt, params)
    assert oracle.reset_prefix_cache() is False
    oracle.engine.abort_request("busy")
    assert oracle.reset_prefix_cache() is True
    assert oracle.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0

    llm, loop = served
    loop.run(_all(llm, prompt, params))
    assert loop.run(_all(llm, prompt, params))[-1].num_cached_tokens >= 32
    assert loop.run(llm.reset_prefix_cache()) is True
    assert loop.run(_all(llm, prompt, params))[-1].num_cached_tokens == 0
