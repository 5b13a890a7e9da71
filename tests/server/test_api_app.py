"""The HTTP app in-process, with no engine behind it: what a browser or a client sees before any generation
(the API docs, offline; the error for a body that is not JSON)."""

from __future__ import annotations

import re

import pytest


class _NoEngine:
    """What build_state and build_app touch of an AsyncEngine, with no engine process."""

    ready = False
    stats = None
    info = None
    max_model_len = 0
    on_ready = on_down = on_step = None

    def num_queued(self) -> int:
        return 0


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    state = build_state(load({}, env={}), None, _NoEngine(), "tiny")
    with TestClient(build_app(state)) as c:
        yield c


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_need_no_internet(client, path):
    """Swagger UI and ReDoc load their scripts and styles from this server, never from a CDN."""
    r = client.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://", r.text), "the page refers to another host"
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert any(a.endswith(".js") for a in assets)
    for a in assets:
        got = client.get(a)
        assert got.status_code == 200 and len(got.content) > 1000, a
    assert client.get("/openapi.json").json()["paths"]["/v1/chat/completions"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.parametrize("body", [b'{"messages": [}', b'{\n  "model": "tiny",\n  "prompt": "x",\n}', b"not json"])
def test_malformed_json_is_400_saying_what_and_where(client, path, body):
    import json

    try:
        json.loads(body)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] is None
    assert "not valid JSON" in err["message"] and where in err["message"], err["message"]
