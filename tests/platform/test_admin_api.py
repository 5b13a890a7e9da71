"""The model platform's admin API and CLI on a real server: refusals (401/403/404/409/400) in the error shape;
register -> validate -> promote -> deploy -> serve by name and name:version -> promote a second version (the
deployment swaps) -> roll back, all in the audit trail with the admin key's name; `servelm models` over it;
and a restarted server restores its deployments from the registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from serving import start_server, stop_server

pytest.importorskip("servelm.control.registry")  # the registry and deployments pieces of issue 29
pytest.importorskip("servelm.control.deployments")
pytestmark = pytest.mark.server

ADMIN_KEY = "sk-admin-platform-1"
ADMIN = {"x-api-key": ADMIN_KEY}
USER_KEY = "sk-user-platform-1"


def _keys_file(tmp_path) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(f"- {{name: ops-alice, key: {ADMIN_KEY}, admin: true}}\n- {{name: user, key: {USER_KEY}}}\n")
    return str(path)


def _start(llama_dir, data_dir, keys: str):
    return start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "256", "--embedding-model", "none",
                        "--data-dir", str(data_dir), "--api-keys-file", keys)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("platform")
    proc, url = _start(llama_dir, tmp / "data", _keys_file(tmp))
    yield url
    assert stop_server(proc) == 0


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    """`servelm models ARGS` against the server, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "models", "--url", url, *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SERVELM_ADMIN_KEY": ADMIN_KEY})


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def complete(url: str, model: str) -> httpx.Response:
    # the timeout only ends a hang: an on-demand load starts an engine first
    return httpx.post(url + "/v1/completions", headers={"x-api-key": USER_KEY}, timeout=300,
                      json={"model": model, "prompt": [1, 500, 600, 700], "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True})


def test_admin_refusals(server, model_dirs):
    error(httpx.get(server + "/admin/models"), 401)
    error(httpx.get(server + "/admin/models", headers={"x-api-key": USER_KEY}), 403)  # a key, not an admin one
    err = error(httpx.get(server + "/admin/models/nothing/versions/1", headers=ADMIN), 404)
    assert "nothing:1" in err["message"]
    missing = str(model_dirs["llama"].parent / "no-such-dir")  # inside the served model's folder: a root
    err = error(httpx.post(server + "/admin/models", headers=ADMIN, json={"name": "x", "path": missing}), 400)
    assert err["param"] == "path"
    err = error(httpx.post(server + "/admin/models", headers=ADMIN, json={"name": "x", "path": "/no/such/dir"}), 403)
    assert err["param"] == "path" and err["code"] == "path_not_allowed"  # outside: refused before it is looked at
    error(httpx.post(server + "/admin/models", headers=ADMIN, json={"name": "x", "path": "/m", "colour": 1}), 400)
    r = httpx.post(server + "/admin/models", headers=ADMIN, json={"name": "refused", "path": str(model_dirs["llama"])})
    assert r.status_code == 201 and r.json()["state"] == "REGISTERED"
    err = error(httpx.post(server + "/admin/models/refused/versions/1/transition", headers=ADMIN,
                           json={"state": "PRODUCTION"}), 409)
    assert "REGISTERED" in err["message"] and "VALIDATING" in err["message"]  # names where it is and may go
    err = error(httpx.post(server + "/admin/deployments", headers=ADMIN, json={"model": "refused:1"}), 409)
    assert "REGISTERED" in err["message"]
    error(httpx.patch(server + "/admin/deployments/none", headers=ADMIN, json={"workers": 2}), 404)
    error(httpx.post(server + "/admin/models/refused/rollback", headers=ADMIN), 409)
    bad = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "models", "--url", server, "list"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "SERVELM_ADMIN_KEY": USER_KEY})
    assert bad.returncode == 1 and "may not use admin routes (HTTP 403)" in bad.stderr
    doc = httpx.get(server + "/openapi.json", headers={"x-api-key": USER_KEY}, timeout=60).json()  # built on first use
    patch = doc["paths"]["/admin/deployments/{deployment_id}"]["patch"]
    assert patch["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ScaleBody")
    assert {"409", "507"} <= set(patch["responses"])


def test_register_promote_deploy_swap_rollback_audit(server, model_dirs):
    # v1 through the CLI: register + validate, promote all the way, deploy
    r = cli(server, "--json", "register", "m", str(model_dirs["llama"]), "--validate", "--label", "team=a")
    assert r.returncode == 0, r.stderr
    v1 = json.loads(r.stdout)
    assert (v1["ref"], v1["state"], v1["labels"]) == ("m:1", "VALIDATED", {"team": "a"})
    assert len(v1["golden_outputs"]) == 3  # the default smoke prompts ran
    r = cli(server, "promote", "m:1")
    assert r.returncode == 0, r.stderr
    assert [line.split(" -> ")[1].split()[0] for line in r.stdout.splitlines()] == \
        ["STAGING", "STAGING_TESTED", "CANARY", "PRODUCTION"]
    r = cli(server, "deploy", "m", "--workers", "1")
    assert r.returncode == 0 and "m-v1" in r.stdout and "m:1" in r.stdout, r.stderr
    first = complete(server, "m")
    assert first.status_code == 200, first.text
    assert first.headers["x-servelm-model-version"] == "m:1" and first.json()["model"] == "m:1"
    assert complete(server, "m:1").json()["choices"] == first.json()["choices"]
    cards = httpx.get(server + "/v1/models", headers={"x-api-key": USER_KEY}).json()["data"]
    assert {"m", "m:1"} <= {c["id"] for c in cards}

    # v2 (other weights) through HTTP: promoting it swaps the deployment
    v2 = httpx.post(server + "/admin/models", headers=ADMIN, timeout=300,
                    json={"name": "m", "path": str(model_dirs["qwen3"]), "validate": True}).json()
    assert (v2["ref"], v2["state"]) == ("m:2", "VALIDATED")
    for state in ("STAGING", "STAGING_TESTED", "CANARY", "PRODUCTION"):
        r = httpx.post(server + "/admin/models/m/versions/2/transition", headers=ADMIN, timeout=300,
                       json={"state": state})
        assert r.status_code == 200, r.text
    second = complete(server, "m")
    assert second.headers["x-servelm-model-version"] == "m:2" and second.json()["model"] == "m:2"
    assert second.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]
    error(complete(server, "m:1"), 404)  # no deployment serves v1 any more
    listed = json.loads(cli(server, "--json", "list").stdout)
    assert [(m["name"], m["production"]) for m in listed if m["name"] == "m"] == [("m", "m:2")]

    # rollback: v1 is PRODUCTION and served again
    r = cli(server, "rollback", "m", "--reason", "v2 regressed")
    assert r.returncode == 0 and "m:1" in r.stdout, r.stderr
    back = complete(server, "m")
    assert back.headers["x-servelm-model-version"] == "m:1" and back.json()["choices"] == first.json()["choices"]

    # scale through PATCH, then the audit trail
    r = httpx.patch(server + "/admin/deployments/m-v1", headers=ADMIN, json={"workers": 2}, timeout=300)
    assert r.status_code == 200 and r.json()["workers"] == 2, r.text
    audit = httpx.get(server + "/admin/audit", headers=ADMIN).json()
    assert audit["ok"] is True and audit["first_bad_id"] is None
    actions = [(e["action"], e["target"]) for e in audit["entries"] if e["actor"] == "ops-alice"]
    for want in [("register", "m:1"), ("deploy", "m-v1"), ("swap", "m-v1"), ("transition", "m:2"),
                 ("rollback", "m"), ("scale", "m-v1")]:
        assert want in actions
    r = cli(server, "audit", "--target", "m-v1")
    assert r.returncode == 0 and "chain verified" in r.stdout and "scale" in r.stdout


def test_restart_restores_deployments(llama_dir, model_dirs, tmp_path):
    keys = _keys_file(tmp_path)
    proc, url = _start(llama_dir, tmp_path / "data", keys)
    try:
        httpx.post(url + "/admin/models", headers=ADMIN, timeout=300,
                   json={"name": "r", "path": str(model_dirs["qwen3"]), "validate": True}).raise_for_status()
        r = httpx.post(url + "/admin/deployments", headers=ADMIN, timeout=300,
                       json={"model": "r:1", "workers": 2, "strategy": "round_robin", "id": "r-main"})
        assert r.status_code == 201, r.text
        before = complete(url, "r:1").json()["choices"]
    finally:
        assert stop_server(proc) == 0
    proc, url = _start(llama_dir, tmp_path / "data", keys)
    try:
        deps = httpx.get(url + "/admin/deployments", headers=ADMIN).json()
        assert [(d["id"], d["ref"], d["workers"], d["strategy"]) for d in deps] == [("r-main", "r:1", 2, "round_robin")]
        again = complete(url, "r:1")
        assert again.headers["x-servelm-model-version"] == "r:1" and again.json()["choices"] == before
        restored = [e for e in httpx.get(url + "/admin/audit", headers=ADMIN).json()["entries"]
                    if e["action"] == "restore"]
        assert restored and restored[-1]["after"] == {"restored": ["r-main"]}
    finally:
        assert stop_server(proc) == 0


def test_on_demand_load_and_embedding_versions(server, model_dirs):
    # a registered PRODUCTION version nobody deployed loads on its first request, and says how long it waited
    r = httpx.post(server + "/admin/models", headers=ADMIN, timeout=300,
                   json={"name": "od", "path": str(model_dirs["qwen2"]), "validate": True})
    assert r.status_code == 201 and r.json()["state"] == "VALIDATED", r.text
    error(complete(server, "od:2"), 404)  # no such version: nothing to load
    # only the PRODUCTION version loads on demand; any other needs an admin deploy
    assert "PRODUCTION" in error(complete(server, "od:1"), 409)["message"]
    for st in ("STAGING", "STAGING_TESTED", "CANARY", "PRODUCTION"):
        t = httpx.post(server + "/admin/models/od/versions/1/transition", headers=ADMIN, json={"state": st})
        assert t.status_code == 200, t.text
    first = complete(server, "od:1")
    assert first.status_code == 200, first.text
    assert first.headers["x-servelm-model-version"] == "od:1" and float(first.headers["x-servelm-load-wait-s"]) > 0
    again = complete(server, "od:1")
    assert "x-servelm-load-wait-s" not in again.headers and again.json()["choices"] == first.json()["choices"]
    deps = {d["id"]: d for d in httpx.get(server + "/admin/deployments", headers=ADMIN).json()}
    assert deps["od-v1"]["keep_alive_s"] == 300
    assert any(e["action"] == "load_on_demand" and e["target"] == "od-v1"
               for e in httpx.get(server + "/admin/audit", headers=ADMIN).json()["entries"])

    # Ollama's keep_alive sets how long a model loaded on demand stays loaded once idle
    user = {"x-api-key": USER_KEY}
    r = httpx.post(server + "/api/generate", headers=user, timeout=300, json={
        "model": "od:1", "prompt": "hi", "stream": False, "options": {"num_predict": 2}, "keep_alive": "1h"})
    assert r.status_code == 200 and r.json()["done"], r.text
    deps = {d["id"]: d for d in httpx.get(server + "/admin/deployments", headers=ADMIN).json()}
    assert deps["od-v1"]["keep_alive_s"] == 3600
    from datetime import datetime, timezone

    ps = {m["name"]: m for m in httpx.get(server + "/api/ps", headers=user).json()["models"]}
    left = datetime.fromisoformat(ps["od:1"]["expires_at"]) - datetime.now(timezone.utc)
    assert 3000 < left.total_seconds() <= 3600
    assert ps["tiny"]["expires_at"].startswith("0001-")  # the server's own model does not expire
    err = httpx.post(server + "/api/generate", headers=user, json={"model": "od:1", "keep_alive": "soon"})
    assert err.status_code == 400 and "keep_alive" in err.text
    # the server's own model stays loaded whatever a client says: answered "load"
    kept = httpx.post(server + "/api/generate", headers=user, json={"model": "tiny", "keep_alive": 0}).json()
    assert kept["done_reason"] == "load"
    # `ollama stop`: no prompt and keep_alive 0; the model is unloaded once idle (by the keep-alive reaper)
    stop = httpx.post(server + "/api/generate", headers=user, json={"model": "od:1", "keep_alive": 0}).json()
    assert stop["done_reason"] == "unload"
    def expired() -> bool:  # the unload's audit entry, written once its workers have stopped
        return any(e["action"] == "expire" and e["target"] == "od-v1"
                   for e in httpx.get(server + "/admin/audit", headers=ADMIN).json()["entries"])

    for _ in range(600):  # waits for the unload (the reaper looks every 5 s), not for a time
        if expired():
            break
        time.sleep(0.2)
    else:
        raise AssertionError("od-v1 was not unloaded")
    assert "od-v1" not in {d["id"] for d in httpx.get(server + "/admin/deployments", headers=ADMIN).json()}

    # an embedding version: deployed, listed and served by name like the generation ones
    from servelm.runtimes.embedder import default_embedding_path

    path = default_embedding_path()
    if path is None:
        pytest.skip("the packaged embedding model is not installed")
    v = httpx.post(server + "/admin/models", headers=ADMIN, timeout=300,
                   json={"name": "emb", "path": str(path), "validate": True}).json()
    assert (v["kind"], v["state"]) == ("embed", "VALIDATED")
    r = httpx.post(server + "/admin/deployments", headers=ADMIN, timeout=300, json={"model": "emb:1"})
    assert r.status_code == 201, r.text
    user = {"x-api-key": USER_KEY}
    ids = {c["id"] for c in httpx.get(server + "/v1/models", headers=user).json()["data"]}
    assert {"emb", "emb:1"} <= ids
    # the timeout only ends a hang: a new embedding worker's first batch can take seconds on a loaded machine
    got = httpx.post(server + "/v1/embeddings", headers=user, json={"model": "emb", "input": ["a cat", "a dog"]},
                     timeout=120)
    assert got.status_code == 200 and got.json()["model"] == "emb:1", got.text
    assert got.headers["x-servelm-model-version"] == "emb:1" and len(got.json()["data"]) == 2
    native = httpx.post(server + "/embeddings", headers=user, json={"model": "emb:1", "input": "a cat"},
                        timeout=120).json()
    assert native["embeddings"][0] == pytest.approx(got.json()["data"][0]["embedding"], abs=1e-5)
    err = error(httpx.post(server + "/v1/embeddings", headers=user, json={"model": "m", "input": "x"}), 404)
    assert "'emb'" in err["message"]  # a generation model is not an embedding model; the message lists those
