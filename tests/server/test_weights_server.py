"""Weight updates through the engine process: POST /update_weights_from_disk (SGLang's route, admin key) on a
real server, and AsyncLLM.update_weights_from_disk. The served model answers as transformers does on the new
checkpoint, its prefix cache emptied; a checkpoint that does not fit is a 400 and changes nothing; a busy
engine is a 409."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from family_parity import async_greedy, mixed_prompts, references, save_tiny
from serving import HOLD, HOLD_BLOCKS, HOLD_CONTEXT, start_server, stop_server
from tiny_models import COMMON

from servelm import AsyncLLM, SamplingParams

ADMIN_KEY = "weights-admin-key-123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("weights")

    def llama(**kw):
        return LlamaConfig(**{**COMMON, **kw})

    return {"a": save_tiny(llama(), root / "a", tokenizer_dir, seed=0),
            "b": save_tiny(llama(), root / "b", tokenizer_dir, seed=1),
            "wider": save_tiny(llama(intermediate_size=2 * COMMON["intermediate_size"]), root / "wider",
                               tokenizer_dir, seed=2)}


def _greedy(url: str, prompts) -> tuple[list[list[int]], list[int]]:
    """Each prompt's 8 greedy token ids and how many of its tokens the prefix cache served."""
    toks, cached = [], []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        toks.append(r.json()["choices"][0]["token_ids"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return toks, cached


def test_a_served_model_takes_a_checkpoint_from_disk(checkpoints, tmp_path):
    prompts = mixed_prompts()
    damaged = tmp_path / "damaged"  # a's config beside weights that are not a safetensors file
    damaged.mkdir()
    (damaged / "config.json").write_bytes((checkpoints["a"] / "config.json").read_bytes())
    (damaged / "model.safetensors").write_bytes(b"not a safetensors file")
    proc, url = start_server(checkpoints["a"], "--embedding-model", "none", "--admin-key", ADMIN_KEY)
    try:
        assert _greedy(url, prompts)[0] == references(checkpoints["a"], "float32", prompts)
        body = {"model_path": str(checkpoints["b"])}
        assert httpx.post(url + "/update_weights_from_disk", json=body).status_code == 401
        r = httpx.post(url + "/update_weights_from_disk", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["success"] is True and r.json()["model"] == "tiny" and r.json()["num_bytes"] > 0
        toks, cached = _greedy(url, prompts)
        assert toks == references(checkpoints["b"], "float32", prompts)
        assert cached[2] == 0  # computed anew: what the cache held was the old weights'
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(checkpoints["wider"])},
                       headers=ADMIN, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(damaged)}, headers=ADMIN,
                       timeout=120)
        assert r.status_code == 400 and "cannot be read" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/update_weights_from_disk", json={**body, "model": "other"}, headers=ADMIN)
        assert r.status_code == 404
        assert _greedy(url, prompts)[0] == references(checkpoints["b"], "float32", prompts)  # unchanged
    finally:
        assert stop_server(proc) == 0


def test_async_llm_updates_its_engine(checkpoints):
    prompts = mixed_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario():
        llm = AsyncLLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=256)
        try:
            before = await async_greedy(llm, prompts, greedy)
            done = await llm.update_weights_from_disk(checkpoints["b"])
            return before, done, await async_greedy(llm, prompts, greedy)
        finally:
            await llm.shutdown()

    before, done, after = asyncio.run(scenario())
    assert before == references(checkpoints["a"], "float32", prompts)
    assert done is True and after == references(checkpoints["b"], "float32", prompts)


def test_async_llm_refuses_an_update_while_a_request_runs(long_llama_dir):
    """A request that runs for minutes (the long-context model's HOLD) is in flight: the update is False; once
    it is aborted, the same update goes through."""
    hold = SamplingParams(temperature=0.0, max_tokens=HOLD["max_tokens"], ignore_eos=True)

    async def scenario():
        llm = AsyncLLM(str(long_llama_dir), dtype="float32", max_model_len=HOLD_CONTEXT, num_kv_blocks=HOLD_BLOCKS)
        try:
            held = llm.generate(HOLD["prompt"], hold, request_id="held")
            await anext(held)
            busy = await llm.update_weights_from_disk(long_llama_dir)
            await held.aclose()
            return busy, await llm.update_weights_from_disk(long_llama_dir)
        finally:
            await llm.shutdown()

    assert asyncio.run(scenario()) == (False, True)


def test_a_busy_engine_is_a_409(tokenizer):
    """In-process, with a stub engine that has requests in flight."""
    from fakes import IdleEngine
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    class Busy(IdleEngine):
        async def kv_cache(self, action, path=None): ...

        async def update_weights_from_disk(self, path):
            return None  # requests in flight

    config = load({"embedding_model": "none", "log_requests": False, "admin_key": ADMIN_KEY}, env={})
    with TestClient(build_app(build_state(config, tokenizer, Busy(), "tiny"))) as client:
        r = client.post("/update_weights_from_disk", json={"model_path": "/x"}, headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "engine_busy"
