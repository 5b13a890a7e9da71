"""SageMaker's hosting contract: /ping is the readiness check, and /invocations answers exactly as the route its
body is shaped for (chat, completions, embeddings, scores, rerank), with that route's keys, errors and streams."""

from __future__ import annotations

import json

import pytest
from fakes import IdleEngine

from servelm.outputs import CompletionOutput, RequestOutput
from servelm.runtimes.embedder import default_embedding_path

KEY = "sk-sagemaker-0001"


class CountingEngine(IdleEngine):
    """Answers each request with the number of its prompt tokens, so that a route's prompt shows in its answer."""

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, *,
                       lora=None):
        yield RequestOutput(rid, prompt, list(ids),
                            [CompletionOutput(0, f"{len(ids)} tokens", [7, 8], finish_reason="length")], True)


@pytest.fixture(scope="module")
def app(tokenizer, tmp_path_factory):
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.runtimes.embedder import DEFAULT_EMBED_NAME, Embedder
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    path = default_embedding_path()
    if path is None:
        pytest.skip("the packaged all-MiniLM-L6-v2 is not installed")
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: app, key: {KEY}}}\n")
    engine, embedder = CountingEngine(), Embedder(path)
    state = build_state(load({"api_keys_file": str(keys)}), tokenizer, engine, "tiny", embedder=embedder,
                        embed_name=DEFAULT_EMBED_NAME)
    client = TestClient(build_app(state), headers={"Authorization": f"Bearer {KEY}"})
    with client:
        yield client, engine
    embedder.close()


def _same(a: dict, b: dict) -> None:
    """Two answers equal but for what differs between any two calls (ids, times)."""
    drop = {"id", "created", "created_at"}
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 2, "model": "tiny"}),
    ("/v1/embeddings", {"input": ["a cat on a mat", "stock markets fell"]}),
    ("/score", {"text_1": "a cat", "text_2": ["a kitten", "a car"]}),
    ("/score", {"queries": ["a cat"], "documents": ["a kitten"]}),
    ("/rerank", {"query": "a cat", "documents": ["a car", "a kitten"], "top_n": 1}),
])
def test_invocations_answer_as_the_route_the_body_is_shaped_for(app, path, body):
    client, _ = app
    direct, invoked = client.post(path, json=body), client.post("/invocations", json=body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    _same(direct.json(), invoked.json())


def test_invocations_stream_and_errors_are_the_routes(app):
    client, _ = app
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with client.stream("POST", "/invocations", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
    # the route's own validation and error shape
    bad = {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
    direct, invoked = client.post("/v1/chat/completions", json=bad), client.post("/invocations", json=bad)
    assert invoked.status_code == direct.status_code == 400 and invoked.json() == direct.json()
    # a body that names no API, and one that is not JSON
    r = client.post("/invocations", json={"text": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_invocation"
    assert "messages" in r.json()["error"]["message"]
    r = client.post("/invocations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert client.get("/invocations").status_code == 405


def test_the_adapter_header_names_the_model(app):
    client, _ = app
    body = {"prompt": "hi", "max_tokens": 2}
    r = client.post("/invocations", json=body, headers={"X-Amzn-SageMaker-Adapter-Identifier": "tiny"})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    r = client.post("/invocations", json=body, headers={"X-Amzn-SageMaker-Adapter-Identifier": "no-such-adapter"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_ping_is_readiness_and_needs_no_key_while_invocations_do(app):
    client, engine = app
    for method in ("GET", "POST"):
        assert client.request(method, "/ping", headers={"Authorization": ""}).status_code == 200
    r = client.post("/invocations", json={"prompt": "hi"}, headers={"Authorization": ""})
    assert r.status_code == 401
    engine.check_engine = lambda: False  # the engine process is down: not ready
    try:
        r = client.get("/ping")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        del engine.check_engine


def test_an_input_body_goes_to_classify_when_the_model_it_names_is_a_classifier():
    """Which of /v1/embeddings and /classify an `input` body runs follows the model it names: the server's
    embedding model, or a deployed one of the registry."""
    from types import SimpleNamespace

    from servelm.server.sagemaker import _task_of, invocation_path

    state = SimpleNamespace(embed_model_name="minilm", embedder=SimpleNamespace(task="embed"), models=SimpleNamespace(
        deployed=lambda kind: [SimpleNamespace(name="reranker", served_name="reranker:2", task="classify")]))
    for model, path in ((None, "/v1/embeddings"), ("minilm", "/v1/embeddings"), ("reranker", "/classify"),
                        ("reranker:2", "/classify"), ("unknown", "/v1/embeddings")):
        assert invocation_path({"input": "x", "model": model}, _task_of(state, model) == "classify") == path


def test_invocations_are_logged_under_the_route_they_ran(app):
    """The request's record (its log line, trace, and traffic management's view of it) names the route it ran."""
    import logging

    client, _ = app
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, log = Keep(), logging.getLogger("servelm.requests")
    log.addHandler(handler)
    try:
        assert client.post("/invocations", json={"prompt": "counted", "max_tokens": 1}).status_code == 200
    finally:
        log.removeHandler(handler)
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert [e["path"] for e in events if e.get("event") == "request"] == ["/v1/completions"]
