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


def test_root_path_serves_the_api_under_a_proxys_prefix():
    """vLLM's --root-path: a proxy serves the server under /llm and strips the prefix, and uvicorn puts it back in
    front of each path (the client here sends it as uvicorn would). Every route answers where it is, the admin
    routes still need the admin key, Ollama's routes keep their error shape, and the web page and /docs link
    through the prefix."""
    from starlette.testclient import TestClient

    from servelm.config.engine import ConfigError
    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    admin = {"Authorization": "Bearer admin-key-123"}
    state = build_state(load({"root_path": "/llm/", "admin_key": "admin-key-123"}, env={}), None, _NoEngine(), "tiny")
    with TestClient(build_app(state), root_path="/llm") as c:
        assert [m["id"] for m in c.get("/llm/v1/models").json()["data"]] == ["tiny"]
        assert c.get("/llm/admin/config").status_code == 401
        assert c.get("/llm/admin/config", headers=admin).json()["config"]["api"]["root_path"]["value"] == "/llm"
        r = c.post("/llm/api/chat", content=b"not json")
        assert r.status_code == 400 and isinstance(r.json()["error"], str)  # Ollama's shape, not OpenAI's
        page = c.get("/llm/").text
        assert '"/llm/ui/app.js"' in page and '"/ui/' not in page
        for asset in re.findall(r'(?:src|href)="([^"]+)"', page):
            assert c.get(asset).status_code == 200, asset
        docs = c.get("/llm/docs").text
        assert "/llm/openapi.json" in docs
        for asset in re.findall(r'(?:src|href)="([^"]+)"', docs):
            assert asset.startswith("/llm/") and c.get(asset).status_code == 200, asset
    for bad in ("llm", "/a b", '/x"y'):
        with pytest.raises(ConfigError, match="root_path"):
            load({"root_path": bad}, env={})
