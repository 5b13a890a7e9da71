"""The EngineClient contract (servelm/worker/engine_client.py): what the server relies on from whatever serves a
model, checked against each implementation that can be built in a test.

- AsyncEngine: one engine process on the tiny random llama.
- Deployment: a control-plane deployment with one worker on the same model, through a request's Lease.
- RayServeEngine: not built here. Its engine is a Ray Serve DeploymentHandle, which exists only on a running Ray
  cluster (tests/platform/test_ray.py starts one); its cases are skipped with that reason.
- IdleEngine (tests/support/fakes.py): answers every request at once, so it never has a request queued or running; the
  cases about those are skipped for it.

Each engine lives on one event loop for the module (an engine's sockets and tasks belong to the loop that made
them), so each case runs its coroutine on that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from fakes import IdleEngine
from serving import HOLD_BLOCKS, HOLD_CONTEXT

from servelm import SamplingParams
from servelm.config.engine import EngineConfig, RuntimeSettings
from servelm.control.types import Kind, ModelVersion, State
from servelm.sampling_params import OutputKind
from servelm.worker.client import RequestRejected
from servelm.worker.engine_client import EngineClient

pytestmark = pytest.mark.server

# the tiny llama with the long context (long_llama_dir): a request for most of it runs for minutes, so one that
# a case aborts is still running whenever the abort arrives, however fast the machine
BASE = EngineConfig(dtype="float32", num_kv_blocks=HOLD_BLOCKS, max_model_len=HOLD_CONTEXT, num_threads=1)
PROMPT = [1, 5, 9, 200]
GREEDY = dict(temperature=0.0, ignore_eos=True, output_kind=OutputKind.DELTA)  # as the server streams
STEP_S = 60.0  # the most any one output may take to come (a loaded machine runs the tiny model slowly)


@dataclass
class Impl:
    engine: EngineClient
    loop: asyncio.AbstractEventLoop
    close: Callable = None
    skip: dict[str, str] = field(default_factory=dict)  # case -> why it does not apply

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, 10 * STEP_S))

    def needs(self, case: str) -> None:
        if case in self.skip:
            pytest.skip(self.skip[case])


def _async_engine(llama_dir, tokenizer, loop) -> Impl:
    from servelm.worker.client import AsyncEngine

    engine = AsyncEngine(BASE.replace(model=str(llama_dir)), tokenizer)
    loop.run_until_complete(engine.start())
    return Impl(engine, loop, engine.shutdown)


def _deployment(llama_dir, tokenizer, loop) -> Impl:
    from servelm.control.deployment import Deployment

    version = ModelVersion(name="tiny", version=1, state=State.PRODUCTION, kind=Kind.GENERATE,
                           artifact=str(llama_dir), sha256="0" * 64, source=str(llama_dir), engine={})
    dep = Deployment(version, BASE, 1, "least_loaded")
    loop.run_until_complete(dep.start())
    return Impl(dep.pin(), loop, dep.shutdown)  # what a request holds: the deployment through its lease


def _ray(llama_dir, tokenizer, loop) -> Impl:
    pytest.skip("RayServeEngine needs a Ray Serve DeploymentHandle, which exists only on a running Ray cluster "
                "(tests/platform/test_ray.py)")


def _idle(llama_dir, tokenizer, loop) -> Impl:
    why = "IdleEngine answers every request at once: nothing is ever queued or running"
    return Impl(IdleEngine(), loop, skip={"queued": why, "abort": why, "reject_prompt": why})


@pytest.fixture(scope="module", params=[_async_engine, _deployment, _ray, _idle],
                ids=["AsyncEngine", "Deployment", "RayServeEngine", "IdleEngine"])
def impl(request, long_llama_dir, tokenizer):
    loop = asyncio.new_event_loop()
    try:
        made = request.param(long_llama_dir, tokenizer, loop)
    except BaseException:
        loop.close()
        raise
    yield made
    if made.close is not None:
        loop.run_until_complete(made.close())
    loop.close()


async def _next(stream):
    return await asyncio.wait_for(anext(stream), STEP_S)


def test_it_is_an_engine_client(impl):
    assert isinstance(impl.engine, EngineClient)
    assert impl.engine.check_engine() and impl.engine.max_model_len > 0


def test_generate_streams_outputs_ending_with_finished(impl):
    async def main():
        outs = [out async for out in impl.engine.generate("gen", PROMPT, SamplingParams(max_tokens=6, **GREEDY))]
        assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(o.request_id == "gen" for o in outs)
        if "abort" not in impl.skip:  # a real engine: every token it was asked for, then the end
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
            assert outs[-1].outputs[0].finish_reason == "length"
        assert impl.engine.num_in_flight() == 0
    impl.run(main())


def test_abort_of_a_running_request_ends_its_stream(impl):
    impl.needs("abort")

    async def main():
        want = HOLD_CONTEXT - len(PROMPT)
        stream = impl.engine.generate("long", PROMPT, SamplingParams(max_tokens=want, **GREEDY))
        first = await _next(stream)
        assert not first.finished  # running
        await impl.engine.abort("long")
        rest = [out async for out in _bounded(stream)]  # what was already on its way, then the end
        tokens = sum(len(o.outputs[0].token_ids) for o in [first, *rest])
        assert tokens < want and not any(o.finished for o in rest)
        assert impl.engine.num_in_flight() == 0
    impl.run(main())


async def _bounded(stream):
    """The stream's outputs, failing (rather than hanging) if it does not end."""
    while True:
        try:
            yield await asyncio.wait_for(anext(stream), STEP_S)
        except StopAsyncIteration:
            return


def test_num_queued_counts_a_request_without_output_and_update_config_takes_effect(impl):
    impl.needs("queued")
    engine = impl.engine
    config = engine.config

    async def main():
        # one sequence at a time: a second request stays queued while the first runs
        await engine.update_config(dataclasses.replace(RuntimeSettings.of(config), max_num_seqs=1))
        try:
            first = engine.generate("a", PROMPT, SamplingParams(max_tokens=200, **GREEDY))
            await _next(first)
            second = engine.generate("b", [2, 3], SamplingParams(max_tokens=4, **GREEDY))
            waiting = asyncio.ensure_future(anext(second))
            for _ in range(20):  # "a" goes on stepping; with room for two, "b" would have had output by now
                await _next(first)
                assert not waiting.done()
            assert engine.num_queued() == 1
            await engine.update_config(dataclasses.replace(RuntimeSettings.of(config), max_num_seqs=256))
            out = await asyncio.wait_for(waiting, STEP_S)  # room again: it runs beside "a"
            assert out.request_id == "b" and engine.num_queued() == 0
            await first.aclose()
            await second.aclose()
        finally:
            await engine.update_config(RuntimeSettings.of(BASE))
    impl.run(main())


def test_update_config_is_accepted(impl):
    async def main():
        await impl.engine.update_config(RuntimeSettings(8, "fcfs", 5.0))
        await impl.engine.update_config(RuntimeSettings.of(BASE))
    impl.run(main())


def test_an_unknown_lora_adapter_is_rejected(impl):
    async def main():
        with pytest.raises(RequestRejected):
            async for _ in impl.engine.generate("lora", PROMPT, SamplingParams(max_tokens=2), lora="no-such"):
                pass
        assert impl.engine.num_in_flight() == 0
    impl.run(main())


def test_a_prompt_over_the_context_is_rejected(impl):
    impl.needs("reject_prompt")

    async def main():
        too_long = [1] * (impl.engine.max_model_len + 1)
        with pytest.raises(RequestRejected):
            async for _ in impl.engine.generate("long-prompt", too_long, SamplingParams(max_tokens=2)):
                pass
    impl.run(main())
