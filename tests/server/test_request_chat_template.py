"""A chat request's own chat_template (vLLM's field): rendered only by a server started with
--trust-request-chat-template, a 400 otherwise; and chat_template_kwargs cannot set it (or the other arguments the
server and the request's fields set). In-process, with a stub engine that records each prompt."""

from __future__ import annotations

import pytest
from fakes import RecordingEngine
from transformers import AutoTokenizer

from servelm.config.settings import load

OWN = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
MSGS = [{"role": "user", "content": "hi there"}]


def _client(tok, **cli):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    engine = RecordingEngine()
    config = load({"embedding_model": "none", "log_requests": False, **cli}, env={})
    client = TestClient(build_app(build_state(config, tok, engine, "tiny")))
    client.engine = engine
    client.prompt = lambda: tok.decode(engine.prompts[-1])
    return client


@pytest.fixture
def trusted(tokenizer):
    with _client(tokenizer, trust_request_chat_template=True) as c:
        yield c


@pytest.fixture
def untrusted(tokenizer):
    with _client(tokenizer) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 1, **body})


def test_a_trusting_server_renders_the_requests_template(trusted, tokenizer):
    r = chat(trusted, chat_template=OWN)
    assert r.status_code == 200, r.text
    assert trusted.prompt() == "<<user|hi there>>A:"
    r = chat(trusted, chat_template=OWN, add_generation_prompt=False)
    assert r.status_code == 200 and trusted.prompt() == "<<user|hi there>>"
    chat(trusted)  # without one: the model's own
    assert trusted.prompt() == tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)


def test_a_model_without_a_template_takes_the_requests(tokenizer_dir):
    bare = AutoTokenizer.from_pretrained(tokenizer_dir)
    bare.chat_template = None
    with _client(bare, trust_request_chat_template=True) as c:
        assert chat(c).status_code == 400
        assert chat(c, chat_template=OWN).status_code == 200 and c.prompt() == "<<user|hi there>>A:"


def test_an_untrusting_server_refuses_it_and_runs_nothing(untrusted):
    r = chat(untrusted, chat_template=OWN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert untrusted.engine.prompts == []


@pytest.mark.parametrize("kwargs", [{"chat_template": OWN}, {"add_generation_prompt": False},
                                    {"continue_final_message": True}, {"tokenize": True}])
def test_chat_template_kwargs_cannot_set_what_the_server_sets(trusted, untrusted, kwargs):
    """Not even on a trusting server: the template comes from the chat_template field, and the rest from the
    request's fields or the server."""
    for client in (trusted, untrusted):
        r = chat(client, chat_template_kwargs=kwargs)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert client.engine.prompts == []


def test_documents_and_other_variables_still_reach_the_template(trusted):
    """A RAG template's documents come through chat_template_kwargs, as before."""
    rag = "{% for d in documents %}[{{ d['text'] }}]{% endfor %}" + OWN
    r = chat(trusted, chat_template=rag, chat_template_kwargs={"documents": [{"text": "doc one"}]})
    assert r.status_code == 200 and trusted.prompt() == "[doc one]<<user|hi there>>A:"


def test_the_documents_field_reaches_the_template(trusted):
    """vLLM's top-level documents (a RAG template's), as the template's `documents`; a document that is not a
    mapping of strings is a 400."""
    rag = "{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}" + OWN
    r = chat(trusted, chat_template=rag, documents=[{"title": "a", "text": "one"}, {"title": "b", "text": "two"}])
    assert r.status_code == 200 and trusted.prompt() == "[a: one][b: two]<<user|hi there>>A:"
    assert chat(trusted, chat_template=rag, documents=[{"text": 1}]).status_code == 400


def test_reasoning_effort_is_judged_by_the_template_that_renders(trusted):
    """The model's template does not read reasoning_effort (a 400); a request's template that does takes it."""
    assert chat(trusted, reasoning_effort="high").status_code == 400
    reads = "{% if reasoning_effort is defined %}R={{ reasoning_effort }};{% endif %}" + OWN
    r = chat(trusted, chat_template=reads, reasoning_effort="high")
    assert r.status_code == 200 and trusted.prompt() == "R=high;<<user|hi there>>A:"
