"""The API process's event loop is never held by text work: tokenization and chat templates run in a worker
thread, and a step's detokenization is done in slices with the loop served in between. Checked by the order
of events, not by timing (the 30 s waits only bound a failure; they are not thresholds)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx

from servelm.engine.step_outputs import EngineStats, SeqOutput
from servelm.outputs import CompletionOutput, RequestOutput
from servelm.sampling_params import OutputKind, SamplingParams
from servelm.worker import messages as m


class _BlockingTokenizer:
    """The real tokenizer, whose encode waits until the test lets it go."""

    def __init__(self, tok, events: list[str]) -> None:
        self._tok, self.events = tok, events
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, text, **kw):
        self.started.set()
        self.release.wait(30)
        self.events.append("tokenized")
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


class _FakeEngine:
    ready, stats, info, max_model_len = True, None, SimpleNamespace(vocab_size=49152), 1 << 20
    on_ready = on_down = on_step = None

    def num_queued(self) -> int:
        return 0

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, salt=None):
        yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, " x", [5], finish_reason="length")], True)


def test_health_is_served_while_a_prompt_is_being_tokenized(tokenizer):
    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    events: list[str] = []
    tok = _BlockingTokenizer(tokenizer, events)
    app = build_app(build_state(load({"embedding_model": "none", "log_requests": False}, env={}), tok,
                                _FakeEngine(), "tiny"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            post = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a long prompt " * 500}))
            # a safety valve only: were tokenization on the loop, nothing below could run until it ends
            valve = threading.Timer(30, tok.release.set)
            valve.daemon = True
            valve.start()
            await asyncio.get_running_loop().run_in_executor(None, tok.started.wait, 30)
            assert (await client.get("/health")).status_code == 200
            events.append("health")
            tok.release.set()
            r = await post
            valve.cancel()
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " x"

    asyncio.run(main())
    assert events == ["health", "tokenized"]  # the loop answered while the tokenizer was busy


def _stats() -> EngineStats:
    return EngineStats(0, 0, 0, 0.0, 1, 1, 0, 0, 0.0, 0, 0, 0, 0, 0, 0)


def test_a_large_step_is_detokenized_in_slices_and_stop_strings_reach_the_engine(tokenizer):
    import zmq

    from servelm.config.engine import EngineConfig
    from servelm.worker.client import DETOKENIZE_SLICE, AsyncEngine, _Stream

    n = 3 * DETOKENIZE_SLICE
    ids = tokenizer(" hello stop", add_special_tokens=False).input_ids

    async def main():
        eng = AsyncEngine(EngineConfig(), tokenizer)
        pull = eng._ctx.socket(zmq.PULL)
        pull.connect(eng._in_addr)
        try:
            for i in range(n):
                eng.streams[f"r{i}"] = _Stream(asyncio.Queue())
                stop = ["stop"] if i == 0 else []
                eng.output_processor.add_request(f"r{i}", None, [1], SamplingParams(
                    max_tokens=len(ids), stop=stop, output_kind=OutputKind.DELTA))
            outs = [SeqOutput(f"r{i}", 0, ids, finish_reason=None if i == 0 else "length") for i in range(n)]
            streams = dict(eng.streams)
            seen: list[int] = []

            async def watch():  # what other coroutines see of the step's progress while it is processed
                while not seen or seen[-1] < n:
                    seen.append(sum(1 for s in streams.values() if s.queue.qsize()))
                    await asyncio.sleep(0)

            watcher = asyncio.create_task(watch())
            await eng._on_step(m.StepOutputs(outs, [], _stats()))
            await asyncio.wait_for(watcher, 30)
            assert all(streams[f"r{i}"].queue.qsize() == 1 for i in range(n))
            assert any(0 < v < n for v in seen), seen  # others ran between slices of the same step
            msg = m.input_decoder.decode(await asyncio.wait_for(pull.recv(), 30))
            assert isinstance(msg, m.FinishSample) and (msg.request_id, msg.stop) == ("r0", "stop")
        finally:
            pull.close(linger=0)
            await eng.shutdown()

    asyncio.run(main())
