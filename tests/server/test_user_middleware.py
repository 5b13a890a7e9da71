"""vLLM's --middleware: the operator's ASGI middleware classes and HTTP middleware functions, by import path,
run on every request inside the gateway (after its key checks), the first given outermost; one that cannot be
used stops the start before anything loads."""

from __future__ import annotations

import pytest
from fakes import IdleEngine

from servelm.config.engine import ConfigError
from servelm.config.settings import load

CLASS, FUNCTION = "user_middleware.Trail", "user_middleware.stamp"


def _client(tokenizer, *middleware: str, **cli):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False, "middleware": list(middleware), **cli}, env={})
    return TestClient(build_app(build_state(config, tokenizer, IdleEngine(), "tiny")))


def test_middleware_runs_on_every_route_in_the_order_given(tokenizer):
    with _client(tokenizer, CLASS, FUNCTION) as client:
        for r in (client.get("/v1/models"), client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}),
                  client.get("/no/such/route")):
            assert r.headers["x-trail"] == "function,class"  # the function inside, the class around it
    with _client(tokenizer, FUNCTION, CLASS) as client:
        assert client.get("/v1/models").headers["x-trail"] == "class,function"
    with _client(tokenizer) as client:
        assert "x-trail" not in client.get("/v1/models").headers


def test_middleware_runs_after_the_gateways_key_check(tokenizer):
    with _client(tokenizer, CLASS, api_key="sk-right") as client:
        refused = client.get("/v1/models")
        assert refused.status_code == 401 and "x-trail" not in refused.headers
        ok = client.get("/v1/models", headers={"Authorization": "Bearer sk-right"})
        assert ok.status_code == 200 and ok.headers["x-trail"] == "class"


@pytest.mark.parametrize(("path", "says"), [
    ("no_such_module_here.Thing", "cannot import"), ("user_middleware.Missing", "has no 'Missing'"),
    ("user_middleware.NOT_MIDDLEWARE", "neither a class")])
def test_middleware_that_cannot_be_used_stops_the_start_before_anything_loads(llama_dir, capsys, path, says):
    from servelm.entrypoints.cli import build_parser
    from servelm.server.serve import cmd_serve

    args = build_parser().parse_args(["serve", str(llama_dir), "--embedding-model", "none", "--middleware", path])
    assert cmd_serve(args, engine_factory=_no_engine) == 2
    assert says in capsys.readouterr().err


def _no_engine(*a, **kw):
    raise AssertionError("no engine may start")


def test_a_middleware_value_that_is_no_import_path_is_refused():
    for bad in ("Trail", "user_middleware.", "a b.c"):
        with pytest.raises(ConfigError, match="middleware"):
            load({"middleware": [bad]}, env={})
