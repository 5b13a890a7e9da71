"""Pausing a served model (vLLM's POST /pause, POST /resume, GET /is_paused; admin key) on a real server whose
HOLD request runs for minutes: "keep" holds it (a weight update then goes through, which an engine with a
request running refuses) and it goes on after the resume; "abort" ends it with finish reason "abort"; "wait"
answers only once it has ended. Requests made while paused wait, and are answered after the resume."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from serving import HOLD, HOLD_BLOCKS, HOLD_CONTEXT, _wait, start_server, stop_server

ADMIN_KEY = "pause-admin-key-123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def server(long_llama_dir):
    proc, url = start_server(long_llama_dir, "--admin-key", ADMIN_KEY, "--num-kv-blocks", str(HOLD_BLOCKS + 64),
                             "--max-model-len", str(HOLD_CONTEXT), "--max-num-seqs", "4",
                             "--embedding-model", "none")
    yield url, long_llama_dir
    assert stop_server(proc) == 0


class Streamed:
    """A streamed completion read in a thread: its chunks, an event at the first one, and its end."""

    def __init__(self, url: str, body: dict) -> None:
        self.chunks: list[dict] = []
        self.first = threading.Event()
        self.stop = threading.Event()  # set: the client leaves at its next chunk
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.first.set()
                    if self.stop.is_set():
                        return

    def tokens(self) -> int:
        return sum(len(c["choices"][0]["text"]) > 0 for c in self.chunks if c["choices"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(120)


def _call(url: str, method: str, path: str, **params) -> httpx.Response:
    return httpx.request(method, url + path, params=params, headers=ADMIN, timeout=600)


def _short(url: str, out: list) -> threading.Thread:
    def run():
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        out.append(r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.status_code)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _load(url: str) -> int:
    return httpx.get(url + "/load").json()["server_load"]


def test_keep_holds_a_request_through_a_weight_update(server):
    url, folder = server
    _wait(lambda: _load(url) == 0, 60, "earlier requests to end")
    assert httpx.post(url + "/pause").status_code == 401
    held = Streamed(url, {"model": "tiny", **HOLD})
    try:
        assert held.first.wait(120)
        update = {"model_path": str(folder)}
        r = httpx.post(url + "/update_weights_from_disk", json=update, headers=ADMIN, timeout=120)
        assert r.status_code == 409  # a request runs
        r = _call(url, "POST", "/pause", mode="keep")
        assert r.status_code == 200 and r.json()["status"] == "paused", r.text
        assert _call(url, "GET", "/is_paused").json() == {"is_paused": True, "mode": "keep"}
        r = httpx.post(url + "/update_weights_from_disk", json=update, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text  # the request is held: no step runs while the weights change
        answer: list = []
        waiting = _short(url, answer)
        _wait(lambda: _load(url) == 2, 60, "the new request to arrive")
        assert answer == []  # it waits at the door while paused
        before = held.tokens()
        assert _call(url, "POST", "/resume").json()["status"] == "resumed"
        waiting.join(120)
        assert answer == ["length"]
        _wait(lambda: held.tokens() > before, 120, "the held request to go on")
        assert _call(url, "GET", "/is_paused").json() == {"is_paused": False, "mode": None}
    finally:
        held.close()


def test_abort_ends_the_requests_in_flight(server):
    url, folder = server
    _wait(lambda: _load(url) == 0, 60, "earlier requests to end")
    held = Streamed(url, {"model": "tiny", **HOLD})
    try:
        assert held.first.wait(120)
        r = _call(url, "POST", "/pause")  # abort, vLLM's default
        assert r.status_code == 200, r.text
        held.thread.join(120)
        assert not held.thread.is_alive()
        assert held.chunks[-1]["choices"][0]["finish_reason"] == "abort"
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(folder)}, headers=ADMIN,
                       timeout=120)
        assert r.status_code == 200, r.text
    finally:
        _call(url, "POST", "/resume")
        held.close()


def test_wait_answers_once_the_requests_in_flight_have_ended(server):
    url, _ = server
    _wait(lambda: _load(url) == 0, 60, "earlier requests to end")
    held = Streamed(url, {"model": "tiny", **HOLD})
    assert held.first.wait(120)
    paused: list = []
    pausing = threading.Thread(target=lambda: paused.append(_call(url, "POST", "/pause", mode="wait")))
    pausing.start()
    _wait(lambda: _call(url, "GET", "/is_paused").json()["is_paused"], 60, "the pause to begin")
    assert paused == []  # HOLD runs for minutes: the pause waits for it
    held.close()  # its client leaves, which ends it
    pausing.join(120)
    assert paused[0].status_code == 200, paused[0].text
    assert held.chunks[-1]["choices"][0]["finish_reason"] is None  # it was never aborted by the pause
    r = _call(url, "POST", "/pause", mode="sideways")
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert _call(url, "POST", "/resume").status_code == 200


def test_async_llm_abort_ends_every_sample_and_resume_lets_requests_in(long_llama_dir):
    """AsyncLLM.pause_generation("abort"): a request of n=3 that would run for minutes ends, each sample with
    finish reason "abort" and the tokens it had; after resume_generation new requests run."""
    import asyncio

    from servelm import AsyncLLM, SamplingParams

    async def scenario():
        llm = AsyncLLM(str(long_llama_dir), dtype="float32", max_model_len=HOLD_CONTEXT,
                       num_kv_blocks=3 * HOLD_BLOCKS)
        try:
            params = SamplingParams(n=3, max_tokens=HOLD["max_tokens"], temperature=1.0, ignore_eos=True)
            outs = []
            first = asyncio.Event()

            async def run():
                async for o in llm.generate(HOLD["prompt"], params):
                    outs.append(o)
                    first.set()

            task = asyncio.create_task(run())
            await first.wait()
            await llm.pause_generation("abort")
            paused = await llm.is_paused()
            await task
            await llm.resume_generation()
            after = [o async for o in llm.generate([5, 6, 7], SamplingParams(max_tokens=4))][-1]
            return outs[-1], paused, await llm.is_paused(), after
        finally:
            await llm.shutdown()

    last, paused, still, after = asyncio.run(scenario())
    assert last.finished and [(c.index, c.finish_reason) for c in last.outputs] == [(i, "abort") for i in range(3)]
    assert all(len(c.token_ids) < HOLD["max_tokens"] for c in last.outputs)  # cut short
    assert paused is True and still is False and after.outputs[0].finish_reason == "length"
