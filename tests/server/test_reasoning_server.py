"""A server with --reasoning-parser deepseek_r1, whose replies start inside their reasoning: the tiny random model
never writes </think>, so each reply is all reasoning, and every front end must say so in its own shape (chat
completions, the Responses API streamed or not, Ollama). The qwen3 parser, which needs a reply to open <think>,
is tested beside tool calls in test_tool_calling.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import start_server, stop_server

from servelm import LLM, SamplingParams

pytestmark = pytest.mark.server

MSGS = [{"role": "user", "content": "Is 9.11 more than 9.8?"}]
N = 12


@pytest.fixture(scope="module")
def server(llama_dir):
    proc, url = start_server(llama_dir, "--num-kv-blocks", "128", "--max-model-len", "512", "--embedding-model",
                             "none", "--reasoning-parser", "deepseek_r1")
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reply(llama_dir) -> str:
    """The greedy reply to MSGS, all of it reasoning under deepseek_r1."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=512)
    text = llm.chat(MSGS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert "</think>" not in text
    return text


def test_chat_reply_is_all_reasoning(client, reply):
    c = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=N, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert c.message.model_dump()["reasoning"] == reply and c.message.content is None
    # a grammar waits for the reasoning's end, which never comes: the reply is the same
    forced = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=N, temperature=0,
                                            extra_body={"ignore_eos": True, "guided_choice": ["yes"]}).choices[0]
    assert forced.message.model_dump()["reasoning"] == reply


def test_responses_api_returns_a_reasoning_item(client, reply):
    res = client.responses.create(model="tiny", input=MSGS[0]["content"], max_output_tokens=N, temperature=0)
    assert [item.type for item in res.output] == ["reasoning", "message"]
    assert res.output[0].content[0].text == reply and res.output[0].content[0].type == "reasoning_text"
    assert res.output_text == "" and res.status == "incomplete"
    events = list(client.responses.create(model="tiny", input=MSGS[0]["content"], max_output_tokens=N,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and kinds.count("response.output_item.done") == 2
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reply
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message")]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_ollama_thinking(server, reply):
    body = {"model": "tiny", "messages": MSGS, "stream": False,
            "options": {"temperature": 0, "num_predict": N}}
    r = httpx.post(server + "/api/chat", json=body).json()
    assert r["message"]["thinking"] == reply and r["message"]["content"] == ""
    lines = [json.loads(x) for x in httpx.post(server + "/api/chat", json={**body, "stream": True}).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines) == reply
    plain = httpx.post(server + "/api/chat", json={**body, "think": False}).json()
    assert plain["message"]["content"] == reply and "thinking" not in plain["message"]


def test_messages_api_returns_a_thinking_block(server, client):
    """Anthropic's Messages API: the reasoning chat completions gives, as a thinking block, whole or as
    thinking_delta events."""
    import anthropic

    claude = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=N, temperature=0).choices[0]
    reasoning = chat.message.model_dump()["reasoning"]
    r = claude.messages.create(model="tiny", messages=MSGS, max_tokens=N, temperature=0)
    assert [(b.type, b.thinking) for b in r.content] == [("thinking", reasoning)]
    events = list(claude.messages.create(model="tiny", messages=MSGS, max_tokens=N, temperature=0, stream=True))
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking"]
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta") == reasoning
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == r.stop_reason
