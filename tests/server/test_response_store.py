"""Stored responses of /v1/responses: in this process's memory (bounded by count and age), or in a real Redis
shared by replicas, so that a response made through one server is read, continued and deleted through another;
each visible only to the API key that made it."""

from __future__ import annotations

import asyncio

import pytest
from fakes import IdleEngine

from servelm.config.settings import load
from servelm.outputs import CompletionOutput, RequestOutput
from servelm.server.openai.protocol import APIError
from servelm.server.openai.response_store import MemoryResponseStore, RedisResponseStore, Stored


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        return MemoryResponseStore(2, 0)
    server = request.getfixturevalue("redis_server")
    return RedisResponseStore(server.url, ttl_s=60, timeout_s=2)


def test_a_response_is_its_keys_alone(store):
    async def go():
        await store.put("r1", Stored("alice", {"id": "r1"}, [{"role": "user", "content": "hi"}]))
        got = await store.get("r1", "alice")
        assert got.response == {"id": "r1"} and got.conversation == [{"role": "user", "content": "hi"}]
        for rid, owner in (("r1", "bob"), ("nope", "alice")):  # another key's is as absent as a missing one
            with pytest.raises(APIError) as e:
                await store.get(rid, owner, "previous_response_id")
            assert (e.value.status, e.value.code, e.value.param) == (404, "response_not_found", "previous_response_id")
        with pytest.raises(APIError):
            await store.delete("r1", "bob")
        await store.delete("r1", "alice")
        with pytest.raises(APIError):
            await store.get("r1", "alice")
    _run(go())


def test_memory_keeps_the_newest_within_its_count_and_age():
    now = [0.0]
    store = MemoryResponseStore(2, ttl_s=10, clock=lambda: now[0])

    async def go():
        for i in range(3):
            await store.put(f"r{i}", Stored("alice", {"id": f"r{i}"}, []))
        with pytest.raises(APIError):
            await store.get("r0", "alice")  # the oldest went for room
        assert (await store.get("r2", "alice")).response == {"id": "r2"}
        now[0] = 11.0
        with pytest.raises(APIError):
            await store.get("r2", "alice")  # past its age
    _run(go())


def test_redis_entries_expire_after_the_ttl(redis_server):
    import redis

    store = RedisResponseStore(redis_server.url, ttl_s=3600, timeout_s=2)
    _run(store.put("r1", Stored("alice", {"id": "r1"}, [])))
    assert 0 < redis.Redis.from_url(redis_server.url).ttl("servelm:resp:r1") <= 3600


class EchoEngine(IdleEngine):
    """Answers every request with "ok" and records the prompt ids it was given."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, *,
                       lora=None):
        self.prompts.append(list(ids))
        yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(0, "ok", [5], finish_reason="stop")], True)


def _replica(tokenizer, redis_url: str):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    engine = EchoEngine()
    config = load({"embedding_model": "none", "log_requests": False, "redis_url": redis_url}, env={})
    return TestClient(build_app(build_state(config, tokenizer, engine, "tiny"))), engine


def test_replicas_continue_each_others_responses(tokenizer, redis_server):
    a, _ = _replica(tokenizer, redis_server.url)
    b, b_engine = _replica(tokenizer, redis_server.url)
    with a, b:
        first = a.post("/v1/responses", json={"model": "tiny", "input": "Name a colour"})
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        assert b.get(f"/v1/responses/{rid}").json() == first.json()
        second = b.post("/v1/responses", json={"model": "tiny", "input": "Another", "previous_response_id": rid})
        assert second.status_code == 200, second.text
        # B's prompt holds A's conversation: the chat template over both turns
        want = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour"},
                                              {"role": "assistant", "content": "ok"},
                                              {"role": "user", "content": "Another"}],
                                             add_generation_prompt=True, tokenize=False)
        assert b_engine.prompts[-1] == tokenizer(want, add_special_tokens=False).input_ids
        assert b.delete(f"/v1/responses/{rid}").status_code == 200
        assert a.get(f"/v1/responses/{rid}").status_code == 404


def test_an_unreachable_redis_is_a_503_on_read_and_a_logged_miss_on_write(caplog):
    import logging
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = RedisResponseStore(f"redis://127.0.0.1:{port}/0", ttl_s=60, timeout_s=0.5)

    async def go():
        with caplog.at_level(logging.ERROR, logger="servelm.server.openai.response_store"):
            await store.put("r1", Stored("alice", {"id": "r1"}, []))  # the answer still goes out
        assert "response r1 not stored" in caplog.text
        with pytest.raises(APIError) as e:
            await store.get("r1", "alice")
        assert (e.value.status, e.value.code) == (503, "response_store_unavailable")
    _run(go())
