"""Deployment specs end to end on a real server (engine-core workers of a tiny random model): `servelm apply -f`
a YAML file, `servelm get deployments` and `servelm describe` once the reconciler reports Ready; then a
restart with --deployment-spec (JSON, two workers) resumes from the stored spec and converges to the new one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from serving import _wait, start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]
ADMIN_KEY = "sk-admin-spec-srv"
ADMIN = {"x-api-key": ADMIN_KEY}


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", *args, "--url", url],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "SERVELM_ADMIN_KEY": ADMIN_KEY})


def status(url: str, name: str = "m") -> dict:
    return httpx.get(f"{url}/admin/specs/{name}/status", headers=ADMIN, timeout=30).json()


def ready(url: str, generation: int) -> dict | None:
    """The status once generation `generation` is observed, Ready and no longer progressing; else None."""
    s = status(url)
    conds = {c["type"]: c for c in s["conditions"]}
    done = s["observed_generation"] == generation and conds["Ready"]["status"] == "True" and \
        conds["Progressing"]["status"] == "False"
    return s if done else None


def test_apply_get_describe_and_a_restart_with_a_spec_file(llama_dir, tmp_path):
    args = ("--num-kv-blocks", "64", "--max-model-len", "256", "--embedding-model", "none", "--data-dir",
            str(tmp_path / "data"), "--admin-key", ADMIN_KEY, "--reconcile-interval-s", "0.5")
    from servelm.control.registry import Registry
    from servelm.control.types import State

    reg = Registry(None, tmp_path / "data")  # m:1 VALIDATED before the server starts (its validation is tested
    reg.register("m", str(llama_dir), actor="t")  # elsewhere; here it would only add a worker's start)
    for st in (State.VALIDATING, State.VALIDATED):
        reg.transition("m", 1, st, "t")
    reg.close()
    proc, url = start_server(llama_dir, *args)
    try:
        bad = tmp_path / "bad.yaml"
        bad.write_text("name: m\nversions: [1]\nworkers: 0\n")
        out = cli(url, "apply", "-f", str(bad))
        assert out.returncode == 2 and "workers must be an integer from 1 to 64" in out.stderr, out.stderr
        spec = tmp_path / "model.yaml"
        spec.write_text("# the model's desired state\nname: m\nversions:\n  - version: 1\n    weight: 100\n"
                        "workers: 1\nstrategy: round_robin\nprediction_log: metadata\n")
        out = cli(url, "apply", "-f", str(spec))
        assert out.returncode == 0 and out.stdout.strip() == "m created (generation 1)", out.stderr
        s = _wait(lambda: ready(url, 1), 120, "the spec to be Ready")
        assert [(d["id"], d["workers"], d["ready"]) for d in s["deployments"]] == [("m-v1", 1, True)]
        assert cli(url, "apply", "-f", str(spec)).stdout.strip() == "m unchanged (generation 1)"
        table = cli(url, "get", "deployments").stdout.splitlines()
        assert table[0].split()[:6] == ["NAME", "GENERATION", "OBSERVED", "READY", "PROGRESSING", "DEGRADED"]
        assert table[1].split()[:7] == ["m", "1", "1", "True", "False", "False", "v1=100"]
        described = cli(url, "describe", "m")
        assert described.returncode == 0
        assert "strategy: round_robin" in described.stdout and "Serving" in described.stdout
        assert "m-v1" in described.stdout
        missing = cli(url, "describe", "nope")
        assert missing.returncode == 1 and "no deployment spec for 'nope'; specs: m (HTTP 404)" in missing.stderr
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-servelm-model-version"] == "m:1"
    finally:
        assert stop_server(proc) == 0

    # the next start applies the file from the chart's values (here: two workers), over the stored spec
    spec_file = tmp_path / "specs.json"
    spec_file.write_text(json.dumps({"deployments": [{"name": "m", "versions": [{"version": 1, "weight": 100}],
                                                      "workers": 2, "strategy": "round_robin",
                                                      "prediction_log": "metadata"}]}))
    proc, url = start_server(llama_dir, *args, "--deployment-spec", str(spec_file))
    try:
        s = _wait(lambda: ready(url, 2), 120, "the restarted server to converge to generation 2")
        assert [(d["id"], d["workers"], d["ready"]) for d in s["deployments"]] == [("m-v1", 2, True)]
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-servelm-model-version"] == "m:1"
        entries = httpx.get(url + "/admin/audit?target=spec:m", headers=ADMIN, timeout=30).json()["entries"]
        assert [(e["actor"], e["action"]) for e in entries] == [("admin", "spec.apply"), ("startup", "spec.apply")]
    finally:
        assert stop_server(proc) == 0


def test_a_spec_file_that_cannot_be_applied_stops_the_start_before_any_model_loads(llama_dir, tmp_path):
    bad = tmp_path / "specs.yaml"
    bad.write_text("name: m\nversions: [1]\nworkers: 99\n")
    serve = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", str(llama_dir), "--port", "0"]
    r = subprocess.run([*serve, "--data-dir", str(tmp_path / "data"), "--deployment-spec", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "spec 1: workers must be an integer from 1 to 64, not 99" in r.stderr, r.stderr
    r = subprocess.run([*serve, "--deployment-spec", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "deployment specs need the model registry" in r.stderr, r.stderr
