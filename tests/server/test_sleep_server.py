"""Sleep mode through the engine process: vLLM's POST /sleep, POST /wake_up and GET /is_sleeping (admin key) on a
real server, and AsyncLLM.sleep / wake_up / is_sleeping. A trainer's cycle (sleep at level 2, wake the weights,
load new ones, wake the KV cache) serves the new checkpoint; a request made while the engine sleeps waits and is
answered once it is woken; a server without --enable-sleep-mode refuses."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from family_parity import async_greedy, mixed_prompts, references, save_tiny
from serving import _wait, start_server, stop_server
from tiny_models import COMMON

from servelm import AsyncLLM, SamplingParams

ADMIN_KEY = "sleep-admin-key-123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("sleep")
    return {"a": save_tiny(LlamaConfig(**COMMON), root / "a", tokenizer_dir, seed=0),
            "b": save_tiny(LlamaConfig(**COMMON), root / "b", tokenizer_dir, seed=1)}


def _greedy(url: str, prompt) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _post(url: str, path: str, **params) -> httpx.Response:
    return httpx.post(url + path, params=params, headers=ADMIN, timeout=120)


def _asleep(url: str) -> list[str]:
    r = httpx.get(url + "/is_sleeping", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["is_sleeping"] == bool(r.json()["asleep"])
    return r.json()["asleep"]


def _sleep_state(url: str) -> str:
    """The state vLLM's engine_sleep_state gauge marks (1) for the model."""
    from prometheus_client.parser import text_string_to_metric_families

    marked = [s.labels["sleep_state"] for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
              if f.name == "servelm:engine_sleep_state" for s in f.samples
              if s.labels["model_name"] == "tiny" and s.value == 1]
    assert len(marked) == 1
    return marked[0]


def test_a_trainers_cycle_over_http(checkpoints):
    prompts = mixed_prompts()
    refs = {k: references(checkpoints[k], "float32", prompts) for k in ("a", "b")}
    proc, url = start_server(checkpoints["a"], "--embedding-model", "none", "--admin-key", ADMIN_KEY,
                             "--enable-sleep-mode")
    try:
        assert [_greedy(url, p) for p in prompts] == refs["a"]
        assert httpx.post(url + "/sleep").status_code == 401
        assert httpx.get(url + "/is_sleeping").status_code == 401
        assert _asleep(url) == []
        r = _post(url, "/sleep", level=2)
        assert r.status_code == 200 and r.json()["level"] == 2 and r.json()["num_bytes"] > 0, r.text
        assert _asleep(url) == ["weights", "kv_cache"]
        assert _sleep_state(url) == "discard_all"
        r = httpx.post(url + "/admin/kv/load", json={"path": "/nonexistent"}, headers=ADMIN)
        assert r.status_code == 400 and "asleep" in r.json()["error"]["message"], r.text  # no cache to fill
        r = _post(url, "/wake_up", tags="weights")
        assert r.status_code == 200 and r.json()["asleep"] == ["kv_cache"], r.text
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(checkpoints["b"])},
                       headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        assert _post(url, "/wake_up", tags="kv_cache").json()["asleep"] == []
        assert _sleep_state(url) == "awake"
        assert [_greedy(url, p) for p in prompts] == refs["b"]

        # a request made while the engine sleeps waits, holding off another sleep, and is answered once woken
        assert _post(url, "/sleep", level=1).status_code == 200
        answer: list = []
        waiting = threading.Thread(target=lambda: answer.append(_greedy(url, prompts[0])))
        waiting.start()
        _wait(lambda: httpx.get(url + "/load").json()["server_load"] == 1, 60, "the request to arrive")
        assert answer == [] and _asleep(url) == ["weights", "kv_cache"]
        r = _post(url, "/sleep", level=1)
        assert r.status_code == 409 and r.json()["error"]["code"] == "engine_busy", r.text
        assert _post(url, "/wake_up").status_code == 200
        waiting.join(120)
        assert answer == [refs["b"][0]]

        for path, params, field in (("/sleep", {"level": 3}, "level"), ("/wake_up", {"tags": "everything"}, "tags")):
            r = _post(url, path, **params)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert _post(url, "/sleep", model="other").status_code == 404
        assert [_greedy(url, p) for p in prompts] == refs["b"]
    finally:
        assert stop_server(proc) == 0


def test_async_llm_sleeps_and_wakes(checkpoints):
    prompts = mixed_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario(**kw):
        llm = AsyncLLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=256, **kw)
        try:
            if not kw:
                with pytest.raises(ValueError, match="enable_sleep_mode"):
                    await llm.sleep()
                return None
            before = await async_greedy(llm, prompts, greedy)
            await llm.sleep(level=2)
            asleep = await llm.is_sleeping()
            await llm.wake_up()  # no new weights: the checkpoint is read again
            return before, asleep, await llm.is_sleeping(), await async_greedy(llm, prompts, greedy)
        finally:
            await llm.shutdown()

    before, asleep, still, after = asyncio.run(scenario(enable_sleep_mode=True))
    assert before == after == references(checkpoints["a"], "float32", prompts)
    assert asleep is True and still is False
    assert asyncio.run(scenario()) is None
