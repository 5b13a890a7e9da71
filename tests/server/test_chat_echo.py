"""vLLM's echo on chat completions: a reply that continues the last message carries that message's text first.
In-process, with a stub engine that answers three tokens one at a time."""

from __future__ import annotations

import json

from test_stream_usage import ThreeTokens

from servelm.config.settings import load


def test_chat_echo_begins_a_continued_message_with_its_text(tokenizer):
    """vLLM's echo on chat: a reply that continues the last (assistant) message carries its text first, whole
    and streamed; a reply to a user message echoes nothing."""
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False}, env={})
    go_on = {"model": "tiny", "max_tokens": 3, "echo": True, "add_generation_prompt": False,
             "continue_final_message": True,
             "messages": [{"role": "user", "content": "Spell it"}, {"role": "assistant", "content": "It is "}]}
    with TestClient(build_app(build_state(config, tokenizer, ThreeTokens(), "tiny"))) as client:
        whole = client.post("/v1/chat/completions", json=go_on).json()["choices"][0]["message"]
        assert (whole["role"], whole["content"]) == ("assistant", "It is abc")
        stream = client.post("/v1/chat/completions", json={**go_on, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "It is abc"
        fresh = {**go_on, "add_generation_prompt": True, "continue_final_message": False,
                 "messages": go_on["messages"][:1]}
        assert client.post("/v1/chat/completions", json=fresh).json()["choices"][0]["message"]["content"] == "abc"
