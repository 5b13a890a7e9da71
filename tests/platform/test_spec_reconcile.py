"""Deployment specs reconciled, in-process: the real app, registry, deployment manager, control plane, traffic
service and reconciler, with stand-in workers (tests/fakes.py: StubEngine). A spec applied over the admin API
is deployed, scaled and routed to, and its conditions turn Ready; changing it converges again; a canary in it
rolls back or promotes through the canary runner and is written back into the spec; operators' imperative
verbs land in the spec; a fresh control plane over the same database is driven to the stored spec; invalid
specs are 4xx naming the field.

Each test drives passes itself (`converge`): a pass is awaited, never slept for."""

from __future__ import annotations

import pytest
from fakes import stub_deployment_workers
from services import both_databases, new_database

from servelm.config.engine import EngineConfig
from servelm.control.types import State
from servelm.worker.handle import HealthSettings

ADMIN = {"x-api-key": "sk-admin-spec"}
BASE = EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256)
PATH = (State.VALIDATING, State.VALIDATED, State.STAGING, State.STAGING_TESTED)
PROMPT = [1, 50, 60]


@pytest.fixture
def database_url(request, tmp_path) -> str:
    return new_database(request, tmp_path, getattr(request, "param", "sqlite"))


class Platform:
    """One server's control side over `database_url`: m:1 PRODUCTION, m:2 STAGING_TESTED failing every request
    (fault label), m:3 STAGING_TESTED; nothing deployed."""

    def __init__(self, tokenizer, llama_dir, tmp_path, database_url, registered: bool = True) -> None:
        from starlette.testclient import TestClient
        from test_model_directory import FakeEngine

        from servelm.config.settings import load
        from servelm.control.budget import MemoryBudget
        from servelm.control.deployments import DeploymentManager
        from servelm.control.plane import ControlPlane
        from servelm.control.reconciler import Reconciler
        from servelm.control.registry import Registry
        from servelm.control.traffic_service import FAULT_LABEL
        from servelm.server.api import build_app
        from servelm.server.serve import build_state
        from servelm.server.traffic import TrafficService

        config = load({"embedding_model": "none", "log_requests": False, "data_dir": str(tmp_path / "data"),
                       "admin_key": ADMIN["x-api-key"], "canary_interval_s": 0.01}, env={})
        self.reg = reg = Registry(database_url, tmp_path / "data")
        if registered:
            for v, labels, extra in ((1, None, (State.CANARY, State.PRODUCTION)), (2, {FAULT_LABEL: "error"}, ()),
                                     (3, None, ())):
                reg.register("m", str(llama_dir), labels=labels, actor="t")
                for s in (*PATH, *extra):
                    reg.transition("m", v, s, "t")
        self.state = state = build_state(config, tokenizer, FakeEngine("A"), "alpha")
        self.dm = dm = DeploymentManager(BASE, MemoryBudget(2**40), health=HealthSettings(interval_s=3600.0),
                                         reap_every_s=3600)
        state.control = cp = ControlPlane(reg, dm, BASE)
        dm.on_change, dm.production_of = cp._on_change, cp._production_of
        state.models.deployments = dm
        state.traffic = TrafficService(cp, config.server, state.metrics.registry, state.models)
        # passes are driven by the tests (converge); an hour between the loop's own
        state.reconciler = self.rec = Reconciler(cp, state.traffic, interval_s=3600.0)
        self.client = TestClient(build_app(state))
        self.client.__enter__()

        async def start() -> None:
            state.traffic.resume()
            self.rec.start()
        self.client.portal.call(start)

    def close(self) -> None:
        self.client.portal.call(self.rec.close)
        self.client.portal.call(self.state.traffic.close)
        self.client.portal.call(self.dm.shutdown)
        self.client.__exit__(None, None, None)
        self.reg.close()

    def call(self, method: str, path: str, body: dict | None = None, status: int = 200) -> dict:
        r = self.client.request(method, path, json=body, headers=ADMIN)
        assert r.status_code == status, r.text
        return r.json() if r.content else {}

    def converge(self, name: str = "m", passes: int = 10, until: str = "Converged") -> dict:
        """Reconcile pass after pass until the spec is observed and Progressing's reason is `until` (nothing
        left to do, or a canary running); its status."""
        for _ in range(passes):
            self.client.portal.call(self.rec.reconcile_all)
            s = self.call("GET", f"/admin/specs/{name}/status")
            if s["observed_generation"] == s["generation"] and cond(s, "Progressing")["reason"] == until:
                return s
        raise AssertionError(f"{name} did not converge: {s}")

    def deployed(self) -> dict[int, int]:
        """version -> workers of m's deployments."""
        return {d.version.version: d.num_workers for d in self.dm.list() if d.version.name == "m"}

    def served_by(self, n: int = 100, **headers) -> set[str]:
        """The versions n requests went to. A 3:1 split draws at random per request: 100 requests all miss the
        1-in-4 arm once in 3e12 (20 did once in 300)."""
        out = set()
        for i in range(n):
            r = self.client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1,
                                                          "user": f"u{i}"}, headers=headers)
            out.add(r.headers["x-servelm-model-version"])
        return out


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


@pytest.fixture
def platform(tokenizer, llama_dir, tmp_path, monkeypatch, database_url):
    from servelm.control import deployment

    stub_deployment_workers(monkeypatch)
    monkeypatch.setattr(deployment, "load_tokenizer", lambda version, config: tokenizer)
    monkeypatch.setenv("SERVELM_ALLOW_FAULTS", "1")
    p = Platform(tokenizer, llama_dir, tmp_path, database_url)
    yield p
    p.close()


@both_databases
def test_apply_converges_then_changes_converge(platform):
    p = platform
    put = p.call("PUT", "/admin/specs/m", {"versions": [{"version": 1, "weight": 1}], "workers": 2,
                                          "prediction_log": "metadata"})
    assert (put["generation"], put["spec"]["workers"]) == (1, 2)
    s = p.converge()
    assert p.deployed() == {1: 2}
    assert (cond(s, "Ready")["status"], cond(s, "Degraded")["status"], s["observed_generation"]) == \
        ("True", "False", 1)
    assert [a["version"] for a in s["traffic"]["arms"]] == [1]
    assert p.state.traffic.log.mode("m") == "metadata"
    ready_since = cond(s, "Ready")["last_transition_time"]
    # the same spec again: nothing changes, the generation stays, Ready keeps its transition time
    assert p.call("PUT", "/admin/specs/m", put["spec"])["generation"] == 1
    assert cond(p.converge(), "Ready")["last_transition_time"] == ready_since

    # a split and one worker each: v3 deployed, traffic split between both
    p.call("PUT", "/admin/specs/m", {"versions": [{"version": 1, "weight": 50}, {"version": 3, "weight": 50}],
                                     "workers": 1, "sticky": True})
    s = p.converge()
    assert p.deployed() == {1: 1, 3: 1} and s["observed_generation"] == 2
    assert {(a["version"], a["weight"]) for a in s["traffic"]["arms"]} == {(1, 50.0), (3, 50.0)}
    assert p.served_by() == {"m:1", "m:3"}
    # all traffic to v3: v1 is unloaded once traffic has left it
    p.call("PUT", "/admin/specs/m", {"versions": [3], "workers": 1})
    s = p.converge()
    assert p.deployed() == {3: 1} and cond(s, "Ready")["status"] == "True"
    assert p.served_by() == {"m:3"}
    audit = p.call("GET", "/admin/audit", None)["entries"]
    assert {"reconciler"} == {e["actor"] for e in audit if e["action"] in ("deploy", "scale", "unload")}


def test_a_canary_in_the_spec_rolls_back_then_another_promotes(platform):
    p = platform
    canary = {"steps": [50, 100], "min_requests": 10**6, "min_seconds": 0, "thresholds": {"min_samples": 5}}
    p.call("PUT", "/admin/specs/m", {"versions": [1], "canary": {"version": 2, **canary}})
    s = p.converge(until="CanaryRunning")
    assert p.deployed() == {1: 1, 2: 1}
    assert (s["canary"]["version"], s["canary"]["status"], cond(s, "Ready")["status"]) == (2, "running", "True")
    run = p.state.traffic.canaries["m"]
    for _ in range(400):  # requests until the runner (every 10 ms) has seen the canary fail every one it got
        if run.controller.status != "running":
            break
        p.served_by(5)
    assert run.controller.status == "rolled_back"
    s = p.converge()
    stored = p.call("GET", "/admin/specs/m")
    assert stored["spec"]["canary"] is None and stored["updated_by"] == "reconciler"
    assert (cond(s, "Degraded")["status"], cond(s, "Degraded")["reason"]) == ("True", "CanaryRolledBack")
    assert cond(s, "Ready")["status"] == "True"
    assert p.deployed() == {1: 1} and p.reg.get("m", 2).state == State.ROLLBACK
    assert p.served_by() == {"m:1"}

    # a clean canary of v3 with a short hold promotes: the spec is rewritten to v3 alone and v1 leaves
    p.call("PUT", "/admin/specs/m", {"versions": [1], "canary": {"version": 3, "steps": [50, 100],
                                                                 "min_requests": 3, "min_seconds": 0}})
    s = p.converge(until="CanaryRunning")
    assert cond(s, "Degraded")["status"] == "False"  # a new generation: the old outcome no longer counts
    run = p.state.traffic.canaries["m"]
    for _ in range(400):  # requests until the runner has held the steps and applied the promotion
        if run.controller.status not in ("running", "promoting"):
            break
        p.served_by(5)
    assert run.controller.status == "promoted"
    s = p.converge()
    assert p.call("GET", "/admin/specs/m")["spec"]["versions"] == [{"version": 3, "weight": 1.0}]
    assert p.deployed() == {3: 1} and p.reg.production("m").version == 3
    assert cond(s, "Ready")["status"] == "True" and p.served_by() == {"m:3"}


def test_a_version_that_cannot_deploy_is_degraded_and_the_rest_keeps_serving(platform, llama_dir):
    p = platform
    p.call("PUT", "/admin/specs/m", {"versions": [1]})
    p.converge()
    p.reg.register("m", str(llama_dir), actor="t")  # m:4, REGISTERED: not deployable
    p.call("PUT", "/admin/specs/m", {"versions": [4]})
    s = p.converge(until="ReconcileFailed")
    assert (cond(s, "Ready")["status"], cond(s, "Degraded")["status"]) == ("False", "True")
    assert "cannot deploy m:4: m:4 is REGISTERED" in cond(s, "Degraded")["message"]
    assert p.deployed() == {1: 1} and p.served_by() == {"m:1"}  # nothing was taken away
    p.call("PUT", "/admin/specs/m", {"versions": [1]})
    s = p.converge()
    assert (cond(s, "Ready")["status"], cond(s, "Degraded")["status"]) == ("True", "False")


def test_imperative_verbs_are_written_into_the_spec(platform):
    p = platform
    p.call("PUT", "/admin/specs/m", {"versions": [1]})
    p.converge()
    p.call("PATCH", "/admin/deployments/m-v1", {"workers": 3})
    spec = p.call("GET", "/admin/specs/m")
    assert (spec["spec"]["workers"], spec["spec"]["max_workers"], spec["generation"], spec["updated_by"]) == \
        (3, 3, 2, "admin")
    p.call("POST", "/admin/deployments", {"model": "m:3"}, 201)
    p.call("PUT", "/admin/models/m/traffic", {"arms": [{"version": 1, "weight": 80}, {"version": 3, "weight": 20}]})
    p.call("PUT", "/admin/models/m/prediction-log", {"mode": "full"})
    spec = p.call("GET", "/admin/specs/m")["spec"]
    assert spec["versions"] == [{"version": 1, "weight": 80.0}, {"version": 3, "weight": 20.0}]
    assert spec["prediction_log"] == "full"
    s = p.converge()  # the reconciler keeps what the operators did: no change
    assert p.deployed() == {1: 3, 3: 3} and cond(s, "Ready")["status"] == "True"
    assert [(a["version"], a["weight"]) for a in s["traffic"]["arms"]] == [(1, 80.0), (3, 20.0)]
    p.call("DELETE", "/admin/deployments/m-v3", status=204)
    assert p.call("GET", "/admin/specs/m")["spec"]["versions"] == [{"version": 1, "weight": 80.0}]
    p.converge()
    assert p.deployed() == {1: 3}
    # deleting the spec leaves what it deployed serving
    p.call("DELETE", "/admin/specs/m", status=204)
    p.call("GET", "/admin/specs/m", status=404)
    p.client.portal.call(p.rec.reconcile_all)
    assert p.deployed() == {1: 3}


def test_a_fresh_control_plane_is_driven_to_the_stored_spec(platform, tokenizer, llama_dir, tmp_path,
                                                            database_url):
    p = platform
    p.call("PUT", "/admin/specs/m", {"versions": [{"version": 1, "weight": 3}, {"version": 3, "weight": 1}],
                                     "workers": 2})
    p.converge()
    p.close()
    # the next process: nothing deployed (no restore), the same database
    q = Platform(tokenizer, llama_dir, tmp_path, database_url, registered=False)
    try:
        assert q.deployed() == {}
        s = q.converge()
        assert q.deployed() == {1: 2, 3: 2} and cond(s, "Ready")["status"] == "True"
        assert q.served_by() == {"m:1", "m:3"}
    finally:
        q.close()
    p.close = lambda: None  # closed above


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"versions": []}, 400, "versions"),
    ({"versions": [{"version": 1, "weight": -1}]}, 400, "versions[0].weight"),
    ({"versions": [1], "workers": 5, "max_workers": 2}, 400, "workers"),
    ({"versions": [1], "strategy": "random"}, 400, "strategy"),
    ({"versions": [1], "canary": {"version": 3, "steps": [50, 10]}}, 400, "canary.steps"),
    ({"versions": [1, 3], "canary": {"version": 2}}, 400, "versions"),
    ({"versions": [1], "replicas": 2}, 400, "replicas"),
    ({"versions": [1], "prediction_log": "everything"}, 400, "prediction_log"),
    ({"name": "other", "versions": [1]}, 400, "name"),
    ({"versions": [9]}, 404, None),
])
def test_an_invalid_spec_is_refused_naming_the_field(platform, body, status, param):
    r = platform.client.put("/admin/specs/m", json=body, headers=ADMIN)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if param is not None:
        assert (err["param"], err["code"]) == (param, "invalid_spec")
    platform.call("GET", "/admin/specs/m", status=404)
    assert platform.client.put("/admin/specs/m", json={"versions": [1]}).status_code == 401  # admin key needed


def _stats(running: int, waiting: int):
    import dataclasses

    from servelm.engine.step_outputs import EngineStats

    zero = {f.name: 0 for f in dataclasses.fields(EngineStats)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return EngineStats(**{**zero, "num_running": running, "num_waiting": waiting, "kv_usage": 0.0})


def test_autoscaling_follows_the_workers_figures_within_the_bounds(platform):
    p = platform
    p.call("PUT", "/admin/specs/m", {"versions": [1], "min_workers": 1, "max_workers": 3, "autoscaling": {
        "target_ongoing_requests": 2, "upscale_delay_s": 0, "downscale_delay_s": 0}})
    p.converge()
    assert p.deployed() == {1: 1}
    for w in p.dm.get("m-v1").workers:  # 5 requests in the worker: 3 workers at 2 each
        w.engine.stats = _stats(3, 2)
    p.converge()
    assert p.deployed() == {1: 3}
    for w in p.dm.get("m-v1").workers:  # 100 requests: still the maximum
        w.engine.stats = _stats(60, 40)
    p.converge()
    assert p.deployed() == {1: 3}
    for w in p.dm.get("m-v1").workers:  # idle: back to the minimum
        w.engine.stats = _stats(0, 0)
    s = p.converge()
    assert p.deployed() == {1: 1} and cond(s, "Ready")["status"] == "True"
    assert p.call("GET", "/admin/specs/m")["generation"] == 1  # autoscaling changes workers, not the spec
