"""vLLM's add_special_tokens: on completions (default true) a text prompt gets the tokenizer's special tokens (a
BOS), on chat (default false) only what the chat template writes unless the request asks for them too.
In-process, with a tokenizer that adds a BOS and a stub engine that records each prompt."""

from __future__ import annotations

import pytest
from fakes import RecordingEngine
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from servelm.config.settings import load

BOS = "<|im_start|>"


@pytest.fixture
def client(tokenizer_dir):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    bos = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    assert tok("hi").input_ids[0] == bos  # the tokenizer adds a BOS of its own
    engine = RecordingEngine()
    config = load({"embedding_model": "none", "log_requests": False}, env={})
    with TestClient(build_app(build_state(config, tok, engine, "tiny"))) as c:
        c.engine, c.tok, c.bos = engine, tok, bos
        yield c


def test_completions_add_them_unless_told_not_to(client):
    plain = client.tok("Hello there", add_special_tokens=False).input_ids
    for body, want in (({}, [client.bos, *plain]), ({"add_special_tokens": False}, plain)):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 1, **body})
        assert r.status_code == 200 and client.engine.prompts[-1] == want
    client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})
    assert client.engine.prompts[-1] == [5, 6, 7]  # token ids are taken as they are


def test_chat_adds_them_only_when_asked(client):
    msgs = [{"role": "user", "content": "hi"}]
    rendered = client.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    plain = client.tok(rendered, add_special_tokens=False).input_ids
    for body, want in (({}, plain), ({"add_special_tokens": True}, [client.bos, *plain])):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 1, **body})
        assert r.status_code == 200 and client.engine.prompts[-1] == want
