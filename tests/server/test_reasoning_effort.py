"""Reasoning effort: OpenAI's reasoning_effort (chat) and reasoning.effort (Responses), and Ollama's think levels,
reach the chat template as its reasoning_effort variable, as vLLM passes it to GPT-OSS's template. A model whose
template does not read the variable refuses them (400), since they would change nothing. In-process, with a stub
engine that records each prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fakes import RecordingEngine
from transformers import AutoTokenizer

from servelm.config.settings import load

# a template that reads reasoning_effort, as GPT-OSS's does (its "Reasoning: high" system line)
EFFORT_TEMPLATE = ("{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                   "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def effort_tokenizer(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = EFFORT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def app(effort_tokenizer, tokenizer):
    """A client of a server whose model reads reasoning_effort ("tiny") and one of a model whose template does
    not ("plain"), each with its engine's recorded prompts as text."""
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    def client(tok):
        engine = RecordingEngine()
        config = load({"embedding_model": "none", "log_requests": False, "reasoning_parser": "qwen3"}, env={})
        test_client = TestClient(build_app(build_state(config, tok, engine, "tiny")))
        return test_client, lambda: tok.decode(engine.prompts[-1])

    (effort, effort_prompt), (plain, _) = client(effort_tokenizer), client(tokenizer)
    with effort, plain:
        yield SimpleNamespace(effort=effort, prompt=effort_prompt, plain=plain)


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 1, **body})


def test_chat_reasoning_effort_is_the_templates_variable(app):
    assert _chat(app.effort, reasoning_effort="high").status_code == 200
    assert app.prompt() == "Reasoning: high\nuser: hi\nassistant:"
    assert _chat(app.effort).status_code == 200
    assert app.prompt() == "user: hi\nassistant:"
    # the field wins over the same name in chat_template_kwargs
    assert _chat(app.effort, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}
                 ).status_code == 200
    assert app.prompt().startswith("Reasoning: low\n")
    bad = _chat(app.effort, reasoning_effort="extreme")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_a_template_that_does_not_read_it_refuses_the_effort(app):
    r = _chat(app.plain, reasoning_effort="high")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "reasoning_effort" and r.json()["error"]["code"] == "unsupported_parameter"
    r = app.plain.post("/v1/responses", json={"model": "tiny", "input": "hi", "reasoning": {"effort": "low"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"
    r = app.plain.post("/api/chat", json={"model": "tiny", "messages": MSGS, "stream": False, "think": "high"})
    assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]
    r = app.effort.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "reasoning_effort": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"  # no template to read it


def test_responses_reasoning_effort_is_the_templates_variable_and_echoed(app):
    r = app.effort.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1,
                                               "reasoning": {"effort": "medium", "summary": "auto"}})
    assert r.status_code == 200, r.text
    assert app.prompt() == "Reasoning: medium\nuser: hi\nassistant:"
    assert r.json()["reasoning"] == {"effort": "medium", "summary": "auto"}
    r = app.effort.post("/v1/responses", json={"model": "tiny", "input": "hi", "reasoning": {"summary": "detailed"}})
    assert r.status_code == 400  # no summary but auto's (none): the reasoning comes back whole


@pytest.mark.parametrize("level", ["low", "medium", "high"])
def test_ollama_think_levels_are_the_templates_effort(app, level):
    r = app.effort.post("/api/chat", json={"model": "tiny", "messages": MSGS, "stream": False, "think": level,
                                           "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    assert app.prompt() == f"Reasoning: {level}\nuser: hi\nassistant:"


def test_ollama_think_refuses_what_is_no_level(app):
    r = app.effort.post("/api/chat", json={"model": "tiny", "messages": MSGS, "stream": False, "think": "max"})
    assert r.status_code == 400 and "think" in r.json()["error"]
