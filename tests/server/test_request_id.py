"""Request ids as vLLM names them: a response's id is its object's prefix and the request's id, which is the
client's x-request-id, else the body's `request_id`, else one the server makes up; the x-request-id header
carries the same id. In-process, with a stub engine that records the ids it is given."""

from __future__ import annotations

import json

import pytest
from fakes import RecordingEngine

from servelm.config.settings import load

BODIES = {"/v1/completions": ({"prompt": [1, 2, 3]}, "cmpl-"),
          "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}]}, "chatcmpl-")}


@pytest.fixture
def client(tokenizer):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    engine = RecordingEngine()
    config = load({"embedding_model": "none", "log_requests": False}, env={})
    with TestClient(build_app(build_state(config, tokenizer, engine, "tiny"))) as c:
        c.engine = engine
        yield c


def post(client, path: str, headers: dict | None = None, **body):
    base, _ = BODIES[path]
    return client.post(path, json={"model": "tiny", "max_tokens": 1, **base, **body}, headers=headers or {})


@pytest.mark.parametrize("path", list(BODIES))
def test_the_body_names_the_request(client, path):
    prefix = BODIES[path][1]
    r = post(client, path, request_id="job-42.a:1")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{prefix}job-42.a:1" and r.headers["x-request-id"] == "job-42.a:1"
    # a client's ids need not be unique: the engine's id is made unique from it
    post(client, path, request_id="job-42.a:1")
    first, second = client.engine.engine_ids
    assert first != second and first.startswith(f"{prefix}job-42.a:1-") and second.startswith(f"{prefix}job-42.a:1-")


@pytest.mark.parametrize("path", list(BODIES))
def test_the_header_wins_and_a_made_up_id_is_shared(client, path):
    prefix = BODIES[path][1]
    r = post(client, path, headers={"x-request-id": "from-header"}, request_id="from-body")
    assert r.json()["id"] == f"{prefix}from-header" and r.headers["x-request-id"] == "from-header"
    r = post(client, path)
    made_up = r.headers["x-request-id"]
    assert len(made_up) >= 16 and r.json()["id"] == f"{prefix}{made_up}"
    assert client.engine.engine_ids[-1].startswith(f"{prefix}{made_up}")


@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_carries_the_id_on_every_chunk(client, path):
    prefix = BODIES[path][1]
    r = post(client, path, stream=True, request_id="streamed-7")
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {f"{prefix}streamed-7"}


@pytest.mark.parametrize("bad", ["has space", "", "x" * 129, "new\nline", 7])
def test_an_id_headers_cannot_carry_is_refused(client, bad):
    r = post(client, "/v1/chat/completions", request_id=bad)
    assert r.status_code == 400 and "request_id" in json.dumps(r.json()["error"])
    assert client.engine.engine_ids == []
