"""The role a chat completion's reply carries: --response-role for a new turn (vLLM's flag, "assistant" by
default), and the last message's own role when the reply continues it (add_generation_prompt false). In-process,
with a stub engine that answers three tokens."""

from __future__ import annotations

import json

import pytest
from test_stream_usage import ThreeTokens

from servelm.config.engine import ConfigError
from servelm.config.settings import load


def _roles(tokenizer, body: dict, **cli) -> tuple[str, str]:
    """The role of the whole reply and of the stream's first chunk."""
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False, **cli}, env={})
    body = {"model": "tiny", "max_tokens": 3, **body}
    with TestClient(build_app(build_state(config, tokenizer, ThreeTokens(), "tiny"))) as client:
        whole = client.post("/v1/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert stream.status_code == 200, stream.text
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])  # only the first chunk names it
    return whole.json()["choices"][0]["message"]["role"], chunks[0]["choices"][0]["delta"]["role"]


USER = [{"role": "user", "content": "hi"}]


def test_a_new_turn_takes_the_response_role(tokenizer):
    assert _roles(tokenizer, {"messages": USER}) == ("assistant", "assistant")
    assert _roles(tokenizer, {"messages": USER}, response_role="narrator") == ("narrator", "narrator")


def test_a_continued_message_keeps_its_role(tokenizer):
    said = USER + [{"role": "assistant", "content": "Once upon a"}]
    body = {"messages": said, "add_generation_prompt": False, "continue_final_message": True}
    assert _roles(tokenizer, body, response_role="narrator") == ("assistant", "assistant")
    assert _roles(tokenizer, {"messages": USER, "add_generation_prompt": False},
                  response_role="narrator") == ("user", "user")


@pytest.mark.parametrize("role", ["", " assistant", "a\nb"])
def test_a_response_role_that_is_no_name_is_refused_at_start(role):
    with pytest.raises(ConfigError, match="response_role"):
        load({"response_role": role}, env={})
