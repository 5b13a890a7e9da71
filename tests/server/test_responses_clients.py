"""The Responses API as clients that keep no server-side state use it (Codex and others: store false, the whole
conversation sent each turn with the earlier reasoning items quoted back, include reasoning.encrypted_content):
the request runs, and the earlier reasoning stays out of the prompt, as chat templates take none. In-process,
with a stub engine that records each prompt."""

from __future__ import annotations

import pytest
from fakes import RecordingEngine
from test_reasoning_effort import EFFORT_TEMPLATE
from transformers import AutoTokenizer

from servelm.config.settings import load


@pytest.fixture(scope="module")
def app(tokenizer_dir):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = EFFORT_TEMPLATE
    engine = RecordingEngine()
    config = load({"embedding_model": "none", "log_requests": False}, env={})
    with TestClient(build_app(build_state(config, tok, engine, "tiny"))) as client:
        yield client, lambda: tok.decode(engine.prompts[-1])


def test_a_stateless_turn_with_earlier_reasoning_quoted_back(app):
    client, prompt = app
    body = {"model": "tiny", "store": False, "stream": False, "max_output_tokens": 1,
            "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low", "summary": "auto"},
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [],
                       "content": [{"type": "reasoning_text", "text": "SECRET THOUGHT"}],
                       "encrypted_content": "gAAAA..."},
                      {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "hello"}]},
                      {"type": "message", "role": "user", "content": "again"}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert prompt() == "Reasoning: low\nuser: hi\nassistant: hello\nuser: again\nassistant:"
    bad = client.post("/v1/responses", json={**body, "include": ["message.output_text.logprobs"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("include")
