"""The tool-call formats beyond Hermes, end to end through the API: a server started with --tool-call-parser
qwen3_coder (or pythonic, or granite) returns the calls a reply writes in that format as OpenAI's tool_calls, whole and
streamed, and as Ollama's, with qwen3_coder's raw values typed by the request's own tool schemas. In-process,
with a stub engine that replies the given text a few characters at a time."""

from __future__ import annotations

import json

import pytest
from fakes import IdleEngine

from servelm.config.settings import load
from servelm.outputs import CompletionOutput, RequestOutput

TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "room": {"type": "string"}, "nights": {"type": "integer"}, "breakfast": {"type": "boolean"}}}}}]
REPLIES = {
    "qwen3_coder": "I will book it.\n<tool_call>\n<function=book>\n<parameter=room>\n101\n</parameter>\n"
                   "<parameter=nights>\n3\n</parameter>\n<parameter=breakfast>\ntrue\n</parameter>\n</function>\n"
                   "</tool_call>",
    "pythonic": '[book(room="101", nights=3, breakfast=True)]',
    "granite": '<tool_call>[{"name": "book", "arguments": {"room": "101", "nights": 3, "breakfast": true}}]',
}
WANT = {"room": "101", "nights": 3, "breakfast": True}  # "101" stays text: the schema says string


class Replies(IdleEngine):
    text = ""

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, *,
                       lora=None):
        pieces = [self.text[i:i + 5] for i in range(0, len(self.text), 5)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(
                0, piece, [k + 1], finish_reason="stop" if last else None)], last)


@pytest.fixture(params=list(REPLIES))
def app(request, tokenizer):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    engine = Replies()
    engine.text = REPLIES[request.param]
    config = load({"embedding_model": "none", "log_requests": False, "tool_call_parser": request.param}, env={})
    with TestClient(build_app(build_state(config, tokenizer, engine, "tiny"))) as client:
        yield client, request.param


def test_chat_returns_the_calls_typed_by_the_requests_schema(app):
    client, parser = app
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Book room 101"}], "tools": TOOLS}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    [call] = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "book" and json.loads(call["function"]["arguments"]) == WANT
    assert whole["message"]["content"] == ("I will book it." if parser == "qwen3_coder" else None)
    stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    args = "".join(t["function"].get("arguments", "") for c in chunks for t in c["choices"][0]["delta"].get(
        "tool_calls", []))
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert json.loads(args) == WANT and content.strip() == (whole["message"]["content"] or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_ollama_chat_returns_the_calls(app):
    client, _ = app
    r = client.post("/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "Book room 101"}],
                                       "tools": TOOLS, "stream": False}).json()
    [call] = r["message"]["tool_calls"]
    assert call["function"]["name"] == "book" and call["function"]["arguments"] == WANT
