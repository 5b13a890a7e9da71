"""Usage in streams: stream_options.include_usage (a last chunk with the usage), vLLM's continuous_usage_stats
(the usage so far on every chunk) and its --enable-force-include-usage (the last chunk for every stream), on
completions and chat. In-process, with a stub engine that answers three tokens one at a time."""

from __future__ import annotations

import json

import pytest
from fakes import IdleEngine

from servelm.config.settings import load
from servelm.outputs import CompletionOutput, RequestOutput


class ThreeTokens(IdleEngine):
    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, *,
                       lora=None):
        for k, (tok, text) in enumerate(((5, "a"), (6, "b"), (7, "c"))):
            last = k == 2
            yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(
                0, text, [tok], finish_reason="length" if last else None)], last)


def _chunks(tokenizer, path: str, body: dict, **cli) -> list[dict]:
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False, **cli}, env={})
    with TestClient(build_app(build_state(config, tokenizer, ThreeTokens(), "tiny"))) as client:
        r = client.post(path, json={"model": "tiny", "stream": True, "max_tokens": 3, **body})
        assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


BODIES = {"/v1/completions": {"prompt": [1, 2, 3]}, "/v1/chat/completions": {"messages": [
    {"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("path", list(BODIES))
def test_usage_on_every_chunk_with_continuous_usage_stats(tokenizer, path):
    chunks = _chunks(tokenizer, path, {**BODIES[path], "stream_options": {"include_usage": True,
                                                                          "continuous_usage_stats": True}})
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-2] == 3
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}


@pytest.mark.parametrize("path", list(BODIES))
def test_force_include_usage_ends_every_stream_with_it(tokenizer, path):
    plain = _chunks(tokenizer, path, BODIES[path])
    assert all("usage" not in c for c in plain)
    forced = _chunks(tokenizer, path, BODIES[path], enable_force_include_usage=True)
    assert forced[-1]["choices"] == [] and forced[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in forced[:-1])  # only the last, unless continuous_usage_stats asks
