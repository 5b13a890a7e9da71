"""Defaults that must not get in the way: the per-request token cap follows the model's context length and
max_n (a fixed 32768 refused long-context requests), and an embedding request naming an unknown model is told
which embedding model is served. In-process, with stub engines."""

from __future__ import annotations

import pytest
from fakes import IdleEngine

from servelm.config.settings import load
from servelm.outputs import CompletionOutput, RequestOutput

CHAT = [{"role": "user", "content": "hi"}]


class LongContextEngine(IdleEngine):
    """A model with a 64k context that remembers the max_tokens each request was given."""

    max_model_len = 65536

    def __init__(self) -> None:
        self.max_tokens: list[int] = []
        self.queue_timeouts: list[float | None] = []

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None):
        self.max_tokens.append(params.max_tokens)
        self.queue_timeouts.append(queue_timeout)
        yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, "x", [5], finish_reason="length")], True)


def _client(tokenizer, engine, **cli):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False, **cli}, env={})
    return TestClient(build_app(build_state(config, tokenizer, engine, "long")))


def test_no_queue_timeout_by_default_and_the_configured_one_otherwise(tokenizer):
    """A request that waits is one the server will serve (a client that gives up disconnects, which aborts it):
    by default the engine is given no queue timeout, as vLLM; --queue-timeout-s sets one, and 0 is none."""
    assert load({}, env={}).admission.queue_timeout_s == 0
    for cli, want in (({}, None), ({"queue_timeout_s": 12.5}, 12.5), ({"queue_timeout_s": 0}, None)):
        engine = LongContextEngine()
        with _client(tokenizer, engine, **cli) as client:
            assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}).status_code == 200
        assert engine.queue_timeouts == [want]
    with pytest.raises(ValueError, match="queue_timeout_s"):
        load({"queue_timeout_s": -1}, env={})


def test_the_default_token_cap_is_max_model_len_times_max_n(tokenizer):
    engine = LongContextEngine()
    with _client(tokenizer, engine) as client:
        assert load({}, env={}).admission.max_request_tokens is None  # derived, not a fixed number
        # 4 + 60000 tokens: over the former fixed 32768, well inside this model's context
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 60000})
        assert r.status_code == 200, r.text
        # n samples that each fit the context fit the cap too
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 65000, "n": 16})
        assert r.status_code == 200, r.text
        # a request of several prompts is still capped: 17 x (1 + 65000) > 65536 x 16
        r = client.post("/v1/completions", json={"prompt": [[1]] * 17, "max_tokens": 65000})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "limit_exceeded" and err["param"] == "max_tokens"
        assert "1048576" in err["message"] and "max_model_len 65536 x max_n 16" in err["message"]
        # a chat request without max_tokens: the rest of the context for each sample, as vLLM gives
        engine.max_tokens.clear()
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "n": 4})
        assert r.status_code == 200, r.text
        assert engine.max_tokens == [65536 - r.json()["usage"]["prompt_tokens"]]


def test_the_derived_cap_follows_max_n_and_a_set_cap_still_rules(tokenizer):
    engine = LongContextEngine()
    with _client(tokenizer, engine, max_n=2) as client:
        r = client.post("/v1/completions", json={"prompt": [[1]] * 3, "max_tokens": 65000})  # 3 x 65001 > 2 x 65536
        assert r.status_code == 400 and "max_n 2" in r.json()["error"]["message"], r.text
    with _client(tokenizer, engine, max_request_tokens=1000) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 1000})
        assert r.status_code == 400 and "limit of 1000 tokens" in r.json()["error"]["message"], r.text
        engine.max_tokens.clear()
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "n": 4})  # the default fits the cap
        assert r.status_code == 200, r.text
        assert engine.max_tokens == [(1000 - r.json()["usage"]["prompt_tokens"]) // 4]


def test_the_cap_can_be_set_and_unset_at_run_time():
    config = load({}, env={})
    assert config.patch({"max_request_tokens": 4096}) == {"admission.max_request_tokens": 4096}
    assert config.admission.request_token_cap(65536) == 4096
    config.patch({"max_request_tokens": None})
    assert config.admission.request_token_cap(65536) == 65536 * 16


class FakeEmbedder:
    async def embed(self, texts):
        import numpy as np

        return [np.zeros(4, dtype=np.float32) for _ in texts], len(texts)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_an_unknown_embedding_model_is_404_naming_the_served_one(tokenizer, path):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False}, env={})
    state = build_state(config, tokenizer, IdleEngine(), "long", embedder=FakeEmbedder(),
                        embed_name="all-MiniLM-L6-v2")
    with TestClient(build_app(state)) as client:
        assert client.post(path, json={"model": "all-MiniLM-L6-v2", "input": "hi"}).status_code == 200
        r = client.post(path, json={"model": "text-embedding-3-small", "input": "hi"})
        assert r.status_code == 404, r.text
        message = r.json()["error"]["message"]
        assert "embedding models: 'all-MiniLM-L6-v2'" in message and "no models yet" not in message
