"""The HTTP layer resolves each request's `model` through the server's model directory: several models behind
one app, versions pinned with name:version, the version on every response, a 404 that lists what exists.
In-process, with fake engines (no engine processes), so it runs in a second."""

from __future__ import annotations

import pytest
from fakes import IdleEngine

from servelm.control.errors import NotFound
from servelm.control.types import Kind, ModelVersion, State
from servelm.outputs import CompletionOutput, RequestOutput


class FakeEngine(IdleEngine):
    """The AsyncEngine surface the routes use; every completion is the engine's own word, so a response shows
    which engine served it."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.served: list[str] = []

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None):
        self.served.append(rid)
        yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, self.word, [5], finish_reason="length")], True)


class FakeDeployment(FakeEngine):
    def __init__(self, name: str, version: int, state: State, tokenizer) -> None:
        super().__init__(f"{name}-v{version}")
        self.tokenizer = tokenizer
        self.version = ModelVersion(name, version, state, Kind.GENERATE, "/store/x", "0" * 64, "/src")


class FakeManager:
    """DeploymentManager's resolve/list contract: name -> its PRODUCTION deployment, name:version pinned."""

    def __init__(self, deployments: list[FakeDeployment]) -> None:
        self.deployments = deployments

    def list(self):
        return list(self.deployments)

    def resolve(self, model: str):
        for d in self.deployments:
            if model == d.version.ref or (model == d.version.name and d.version.state == State.PRODUCTION):
                return d
        raise NotFound(f"no deployment serves {model!r}", code="model_not_found")


@pytest.fixture(scope="module")
def app(tokenizer):
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    engines = {"alpha": FakeEngine("A"), "beta": FakeEngine("B")}
    config = load({"embedding_model": "none", "log_requests": False}, env={})
    state = build_state(config, tokenizer, engines["alpha"], "alpha", more=[(engines["beta"], tokenizer, "beta")])
    deps = [FakeDeployment("gamma", 1, State.PRODUCTION, tokenizer), FakeDeployment("gamma", 2, State.STAGING,
                                                                                     tokenizer)]
    state.models.deployments = FakeManager(deps)
    with TestClient(build_app(state)) as client:
        yield client, engines, deps


def _complete(client, model: str | None):
    body = {"prompt": "hi", "max_tokens": 1} | ({"model": model} if model is not None else {})
    return client.post("/v1/completions", json=body)


@pytest.mark.parametrize(("model", "word", "served"), [
    ("alpha", "A", "alpha"), ("beta", "B", "beta"), (None, "A", "alpha"),
    ("gamma", "gamma-v1", "gamma:1"), ("gamma:1", "gamma-v1", "gamma:1"), ("gamma:2", "gamma-v2", "gamma:2")])
def test_each_request_is_served_by_the_model_it_names(app, model, word, served):
    client, _, _ = app
    r = _complete(client, model)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == word
    assert r.json()["model"] == served
    chat = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 1})
    assert chat.json()["choices"][0]["message"]["content"] == word and chat.json()["model"] == served
    native = client.post("/generate", json={"prompt": "hi", "max_tokens": 1} | ({"model": model} if model else {}))
    assert native.json()["text"] == word


def test_a_registered_version_says_so_in_a_header(app):
    client, _, _ = app
    assert _complete(client, "gamma").headers["x-servelm-model-version"] == "gamma:1"
    assert _complete(client, "gamma:2").headers["x-servelm-model-version"] == "gamma:2"
    assert "x-servelm-model-version" not in _complete(client, "alpha").headers  # not a registered version
    stream = client.post("/v1/completions", json={"model": "gamma:2", "prompt": "hi", "max_tokens": 1,
                                                  "stream": True})
    assert stream.headers["x-servelm-model-version"] == "gamma:2" and '"model":"gamma:2"' in stream.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/generate"])
def test_an_unknown_model_is_404_listing_the_available_ones(app, path):
    client, _, _ = app
    body = {"model": "nope", "max_tokens": 1} | ({"messages": [{"role": "user", "content": "x"}]}
                                                 if path == "/v1/chat/completions" else {"prompt": "hi"})
    if path == "/tokenize":
        body.pop("max_tokens")
    r = client.post(path, json=body)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    for name in ("'alpha'", "'beta'", "'gamma'", "'gamma:1'", "'gamma:2'"):
        assert name in err["message"]


def test_models_lists_every_name_and_version(app):
    client, _, _ = app
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["alpha", "beta", "gamma", "gamma:1", "gamma:2"]
    by_id = {c["id"]: c for c in cards}
    assert by_id["gamma:2"]["version"] == 2 and by_id["gamma:2"]["state"] == "STAGING"
    assert client.get("/v1/models/gamma:2").json()["root"] == "gamma:2"
    assert client.get("/v1/models/nope").status_code == 404


def test_per_model_metrics_and_stats(app):
    client, _, _ = app
    _complete(client, "beta")
    text = client.get("/metrics").text
    line = next(ln for ln in text.splitlines()
                if ln.startswith('servelm:request_success_total{finished_reason="length",model_name="beta"}'))
    assert float(line.split()[-1]) >= 1
    models = client.get("/server/stats").json()["models"]
    assert {"alpha", "beta", "gamma:1", "gamma:2"} <= set(models)


def test_a_key_limited_to_a_model_name_may_use_its_versions(tokenizer, tmp_path):
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    keys = tmp_path / "keys.yaml"
    keys.write_text("- {name: g, key: gamma-key-123, models: [gamma]}\n")
    config = load({"embedding_model": "none", "log_requests": False, "api_keys_file": str(keys)}, env={})
    state = build_state(config, tokenizer, FakeEngine("A"), "alpha")
    state.models.deployments = FakeManager([FakeDeployment("gamma", 3, State.PRODUCTION, tokenizer)])
    auth = {"Authorization": "Bearer gamma-key-123"}
    with TestClient(build_app(state)) as client:
        assert client.post("/v1/completions", json={"model": "gamma:3", "prompt": "x", "max_tokens": 1},
                           headers=auth).status_code == 200
        assert client.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 1},
                           headers=auth).status_code == 403


def test_the_version_that_served_a_request_is_the_one_reported(tokenizer):
    """A deployment tags each output with the version whose worker produced it (a swap can land between
    resolving the model and running the request): the header and the `model` field report that version."""
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    class Swapped(FakeDeployment):
        async def generate(self, rid, ids, params, *args, **kw):
            async for out in super().generate(rid, ids, params, *args, **kw):
                out.model_version = "gamma:5"  # the new version took the request
                yield out

    config = load({"embedding_model": "none", "log_requests": False}, env={})
    state = build_state(config, tokenizer, FakeEngine("A"), "alpha")
    state.models.deployments = FakeManager([Swapped("gamma", 4, State.PRODUCTION, tokenizer)])
    with TestClient(build_app(state)) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={"model": "gamma", "prompt": "x", "max_tokens": 1,
                                                     "stream": stream})
            assert r.headers["x-servelm-model-version"] == "gamma:5"
            assert '"model":"gamma:5"' in r.text.replace(" ", "")
        chat = client.post("/v1/chat/completions", json={"model": "gamma", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "x"}]})
        assert chat.json()["model"] == "gamma:5" and chat.headers["x-servelm-model-version"] == "gamma:5"


def test_a_registered_model_loads_on_its_first_request(tokenizer):
    """With on-demand loading, a model no deployment serves yet is loaded by the request that names it; the
    response says how long it waited. What is not registered either stays a 404 listing what exists."""
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False}, env={})
    state = build_state(config, tokenizer, FakeEngine("A"), "alpha")
    manager = FakeManager([])
    loads: list[str] = []

    async def on_demand(model, kind):
        if model != "delta:1":
            raise NotFound("not registered")
        loads.append(model)
        dep = FakeDeployment("delta", 1, State.VALIDATED, tokenizer)
        manager.deployments.append(dep)
        return dep, 0.25

    state.models.deployments, state.models.on_demand = manager, on_demand
    with TestClient(build_app(state)) as client:
        first = _complete(client, "delta:1")
        assert first.json()["choices"][0]["text"] == "delta-v1"
        assert first.headers["x-servelm-load-wait-s"] == "0.250" and first.headers["x-servelm-model-version"] == "delta:1"
        second = _complete(client, "delta:1")
        assert "x-servelm-load-wait-s" not in second.headers and loads == ["delta:1"]  # loaded once
        err = _complete(client, "epsilon").json()["error"]
        assert err["code"] == "model_not_found" and "'alpha'" in err["message"] and "'delta:1'" in err["message"]
