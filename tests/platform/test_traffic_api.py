"""Traffic management over HTTP, in-process: the real app, registry, deployment manager (route()), control
plane and traffic service, with fake engines standing in for the workers (each answers with its version's
name, so a response shows who served it). Splits, sticky users, segment rules, canary rollback and
promotion, shadow overflow, experiments with feedback, drift, the prediction log and its erasure."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
from fakes import IdleEngine
from services import both_databases, new_database

from servelm.control.types import State
from servelm.outputs import CompletionOutput, RequestOutput

ADMIN = {"x-api-key": "sk-admin-traffic-1"}


class FakeDep(IdleEngine):
    """A deployment of one registered version: the surface the routes use, no processes. `gate` (when
    set) holds every request until it is released (to fill the shadow queue deterministically)."""

    def __init__(self, version, tokenizer) -> None:
        self.version, self.tokenizer, self.id = version, tokenizer, f"{version.name}-v{version.version}"
        self.kind = version.kind
        self.gate: asyncio.Event | None = None
        self.served = 0
        self.pins = 0  # leases held now (requests, shadow copies included, that a swap would wait for)

    def pin(self):
        from servelm.control.lease import Lease

        self.pins += 1
        return Lease(self, None, on_release=lambda: setattr(self, "pins", self.pins - 1))

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None,
                       generation=None, lora=None):
        if self.gate is not None:
            await self.gate.wait()
        self.served += 1
        word = f"{self.version.name}-v{self.version.version}"
        yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, word, [5, self.version.version],
                                                                finish_reason="length")], True)


@pytest.fixture
def database_url(request, tmp_path) -> str:
    """SQLite, or each database for the tests marked both_databases (a representative set: canary rollback
    and promotion, audit, restart, prediction log, feedback)."""
    return new_database(request, tmp_path, getattr(request, "param", "sqlite"))


@pytest.fixture
def platform(tokenizer, llama_dir, tmp_path, monkeypatch, database_url):
    """An app with model `m`: v1 PRODUCTION, v2 and v3 STAGING_TESTED, v4 VALIDATED; v2 fails every request
    (fault label), all four deployed (fake)."""
    from starlette.testclient import TestClient
    from test_model_directory import FakeEngine

    from servelm.config.settings import load
    from servelm.control.deployments import DeploymentManager
    from servelm.control.plane import ControlPlane
    from servelm.control.registry import Registry
    from servelm.control.traffic_service import FAULT_LABEL
    from servelm.server.api import build_app
    from servelm.server.serve import build_state
    from servelm.server.traffic import TrafficService

    monkeypatch.setenv("SERVELM_ALLOW_FAULTS", "1")
    config = load({"embedding_model": "none", "log_requests": False, "data_dir": str(tmp_path / "data"),
                   "admin_key": ADMIN["x-api-key"], "canary_interval_s": 0.01, "prediction_log": "full",
                   "drift_min_samples": 20, "drift_window": 40, "shadow_queue": 1}, env={})
    reg = Registry(database_url, tmp_path / "data")
    path = [State.VALIDATING, State.VALIDATED, State.STAGING, State.STAGING_TESTED]
    for v, labels, to in ((1, None, [*path, State.CANARY, State.PRODUCTION]), (2, {FAULT_LABEL: "error"}, path),
                          (3, None, path), (4, None, path[:2])):
        reg.register("m", str(llama_dir), labels=labels, actor="t")
        for s in to:
            reg.transition("m", v, s, "t")
    state = build_state(config, tokenizer, FakeEngine("A"), "alpha")
    dm = DeploymentManager(production_of=lambda n: (p.version if (p := reg.production(n)) else None))
    deps = {v: FakeDep(reg.get("m", v), tokenizer) for v in (1, 2, 3, 4)}
    dm._deployments = {d.id: d for d in deps.values()}
    state.control = ControlPlane(reg, dm, config.engine)
    state.models.deployments = dm
    state.traffic = TrafficService(state.control, config.server, state.metrics.registry, state.models)
    with TestClient(build_app(state)) as client:
        yield client, state, deps
        client.portal.call(state.traffic.close)
    reg.close()


def complete(client, user: str | None = None, headers: dict | None = None, model: str = "m", prompt="hi",
             safety_identifier: str | None = None):
    body = {"model": model, "prompt": prompt, "max_tokens": 1} | ({"user": user} if user else {}) | (
        {"safety_identifier": safety_identifier} if safety_identifier else {})
    return client.post("/v1/completions", json=body, headers=headers or {})


def put_policy(client, body: dict, status: int = 200):
    r = client.put("/admin/models/m/traffic", json=body, headers=ADMIN)
    assert r.status_code == status, r.text
    return r.json()


def test_split_lands_within_a_binomial_tolerance(platform):
    client, _, _ = platform
    put_policy(client, {"arms": [{"version": 1, "weight": 90}, {"version": 3, "weight": 10}]})
    n = 2000
    served = [complete(client).headers["x-servelm-model-version"] for _ in range(n)]
    k = served.count("m:3")
    assert served.count("m:1") + k == n
    assert abs(k - 0.1 * n) < 4.5 * math.sqrt(n * 0.1 * 0.9)  # 4.5 sigma: a false alarm about 1 in 150,000


def test_sticky_users_never_switch_and_arms_are_named(platform):
    client, _, _ = platform
    put_policy(client, {"arms": [{"version": 1, "weight": 50, "name": "control"},
                                 {"version": 3, "weight": 50, "name": "treatment"}], "sticky": True})
    first: dict[str, str] = {}
    for i in range(200):
        user = f"user-{i % 40}"
        # the header, the body's user or OpenAI's newer safety_identifier: one user, one arm
        via = [{"headers": {"x-servelm-user": user}}, {"user": user}, {"safety_identifier": user}][i % 3]
        r = complete(client, **via)
        got = (r.headers["x-servelm-model-version"], r.headers["x-servelm-arm"])
        assert got in {("m:1", "control"), ("m:3", "treatment")}
        assert first.setdefault(user, got) == got, f"{user} switched"
    assert len(set(first.values())) == 2  # both arms got users


def test_a_header_segment_pins_a_version(platform):
    client, _, _ = platform
    put_policy(client, {"arms": [{"version": 1}],
                        "segments": [{"version": 3, "name": "beta", "headers": {"x-tier": "beta"}}]})
    for _ in range(20):
        r = complete(client, headers={"x-tier": "beta"})
        assert (r.headers["x-servelm-model-version"], r.headers["x-servelm-arm"]) == ("m:3", "segment:beta")
        assert complete(client).headers["x-servelm-model-version"] == "m:1"
    assert complete(client, model="m:4").headers["x-servelm-model-version"] == "m:4"  # pinned: no policy


def test_metadata_and_flag_segments(platform):
    client, _, _ = platform
    put_policy(client, {"arms": [{"version": 1}], "segments": [
        {"version": 3, "name": "eu", "metadata": {"region": "eu"}}, {"version": 4, "name": "f", "flags": ["new-ui"]}]})
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    for meta, flags, want in (({"region": "eu"}, "", "m:3"), ({"region": "us"}, "", "m:1"),
                              (None, "x, new-ui", "m:4"), ({"region": "eu"}, "new-ui", "m:3")):
        r = client.post("/v1/completions", json=body | ({"metadata": meta} if meta else {}),
                        headers={"x-servelm-flags": flags} if flags else {})
        assert r.status_code == 200 and r.headers["x-servelm-model-version"] == want, (meta, flags)
    r = client.post("/v1/completions", json=body | {"metadata": {"k": 1}})
    assert r.status_code == 400  # metadata values are strings, as OpenAI's


@both_databases
def test_policy_refusals_and_audit(platform):
    client, state, _ = platform
    assert client.get("/admin/models/m/traffic", headers=ADMIN).status_code == 404
    assert client.put("/admin/models/m/traffic", json={"arms": [{"version": 1}]}).status_code == 401
    r = client.put("/admin/models/m/traffic", json={"arms": [{"version": 9}]}, headers=ADMIN)
    assert r.status_code == 404 and "m:9" in r.json()["error"]["message"]
    r = client.put("/admin/models/m/traffic", json={"arms": [{"version": 1, "weight": 0}]}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_policy"
    put_policy(client, {"arms": [{"version": 1, "weight": 3}]})
    assert client.get("/admin/models/m/traffic", headers=ADMIN).json()["arms"][0]["weight"] == 3
    assert client.delete("/admin/models/m/traffic", headers=ADMIN).status_code == 204
    actions = [e["action"] for e in client.get("/admin/audit", headers=ADMIN).json()["entries"]]
    assert actions[-2:] == ["policy.set", "policy.delete"]
    paths = client.get("/openapi.json").json()["paths"]
    body = paths["/admin/models/{name}/traffic"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/TrafficBody") and "/v1/feedback" in paths


def _wait_canary(client, send, want: str, limit: int = 3000) -> list:
    """Send requests (`send()`) until the canary's status is `want`; the responses."""
    out = []
    for _ in range(limit):
        out.append(send())
        if client.get("/admin/models/m/canary", headers=ADMIN).json()["status"] == want:
            return out
    raise AssertionError(f"the canary never became {want}")


@both_databases
def test_a_faulty_canary_is_rolled_back_and_no_request_fails_because_of_it(platform):
    client, state, _ = platform
    r = client.post("/admin/models/m/canary", headers=ADMIN, json={
        "version": 2, "steps": [50, 100], "min_requests": 1000, "min_seconds": 0,
        "thresholds": {"min_samples": 10}})
    assert r.status_code == 201, r.text
    assert state.control.registry.get("m", 2).state == State.CANARY
    i = iter(range(10**6))
    rs = _wait_canary(client, lambda: complete(client, user=f"u{next(i)}"), "rolled_back")
    for r in rs:  # every failure is the injected fault of m:2; nothing failed otherwise
        if r.status_code != 200:
            assert r.status_code == 503 and r.json()["error"]["code"] == "injected_fault", r.text
            assert r.headers["x-servelm-model-version"] == "m:2"
    assert any(r.status_code == 503 for r in rs)
    after = [complete(client, user=f"v{j}") for j in range(50)]
    assert all(r.status_code == 200 and r.headers["x-servelm-model-version"] == "m:1" for r in after)
    assert state.control.registry.get("m", 2).state == State.ROLLBACK
    status = client.get("/admin/models/m/canary", headers=ADMIN).json()
    assert status["percent"] == 0 and "error_rate" in status["history"][-1]["reasons"][0]
    actions = [e["action"] for e in client.get("/admin/audit", headers=ADMIN).json()["entries"]]
    assert "canary.start" in actions and "canary.rollback" in actions
    metrics = client.get("/metrics").text
    assert re.search(r'servelm:canary_rollbacks_total\{model_name="m",model_version="2",reason="automatic"\} 1',
                     metrics)


@both_databases
def test_a_healthy_canary_is_promoted(platform):
    client, state, _ = platform
    r = client.post("/admin/models/m/canary", headers=ADMIN, json={
        "version": 3, "steps": [30, 60], "min_requests": 15, "min_seconds": 0})
    assert r.status_code == 201, r.text
    i = iter(range(10**6))
    rs = _wait_canary(client, lambda: complete(client, user=f"u{next(i)}"), "promoted")
    assert all(r.status_code == 200 for r in rs)
    assert state.control.registry.get("m", 3).state == State.PRODUCTION
    assert all(complete(client).headers["x-servelm-model-version"] == "m:3" for _ in range(10))
    history = client.get("/admin/models/m/canary", headers=ADMIN).json()["history"]
    assert [h["action"] for h in history] == ["advance", "promote"]
    assert client.get("/admin/models/m/traffic", headers=ADMIN).status_code == 404  # the policy went


def test_shadow_overflow_is_counted_and_never_blocks(platform):
    client, state, deps = platform
    r = client.put("/admin/models/m/shadow", headers=ADMIN, json={"version": 3, "fraction": 1.0})
    assert r.status_code == 200, r.text
    deps[3].gate = gate = client.portal.call(asyncio.Event)  # the shadow never answers until released
    for _ in range(5):  # queue of 1, one running: 3 of 5 dropped, and every caller answered
        r = complete(client)
        assert r.status_code == 200 and r.headers["x-servelm-model-version"] == "m:1"
    stats = client.get("/admin/models/m/shadow", headers=ADMIN).json()["stats"]
    assert stats["dropped"] == 3
    # the running shadow copy pins v3 as a request does (a swap of v3 waits for it); the callers' pins are gone
    assert deps[3].pins == 1 and deps[1].pins == 0
    assert 'servelm:shadow_dropped_total{model_name="m",model_version="3"} 3.0' in client.get("/metrics").text
    client.portal.call(gate.set)
    client.portal.call(state.traffic.mirrors["m"].drain)
    assert deps[3].pins == 0
    stats = client.get("/admin/models/m/shadow", headers=ADMIN).json()["stats"]
    assert stats["pairs"] == 2 and stats["exact_agreement"] == 0.0  # v3 answers other tokens than v1


def test_experiment_report_with_feedback_on_the_arm_that_served(platform):
    client, _, _ = platform
    r = client.post("/admin/experiments", headers=ADMIN, json={
        "name": "exp1", "model": "m", "arms": [{"version": 1, "name": "a"}, {"version": 3, "name": "b"}],
        "sticky": True})
    assert r.status_code == 201, r.text
    for j in range(60):
        rid = f"req-{j}"
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1, "user": f"u{j}"},
                        headers={"x-request-id": rid})
        score = 1.0 if r.headers["x-servelm-arm"] == "b" else 0.0
        f = client.post("/v1/feedback", json={"request_id": rid, "score": score})
        assert f.status_code == 200 and f.json()["arm"] == r.headers["x-servelm-arm"], f.text
    assert client.post("/v1/feedback", json={"request_id": "nope", "label": "good"}).status_code == 404
    assert client.post("/v1/feedback", json={"request_id": "req-1"}).status_code == 400
    rep = client.get("/admin/experiments/exp1", headers=ADMIN).json()
    assert rep["arms"]["a"]["requests"] + rep["arms"]["b"]["requests"] == 60
    assert rep["arms"]["a"]["feedback"]["mean"] == 0.0 and rep["arms"]["b"]["feedback"]["mean"] == 1.0
    assert "b" in rep["comparisons"]
    assert client.post("/admin/experiments/exp1/stop", headers=ADMIN).json()["stopped_at"] is not None
    assert client.get("/admin/experiments/nope", headers=ADMIN).status_code == 404


def test_drift_flags_a_shifted_prompt_distribution_only(platform):
    client, _, _ = platform
    english = ["the quick brown fox jumps over the lazy dog", "hello there how are you today my friend"]
    for j in range(40):
        complete(client, prompt=english[j % 2])
    assert client.post("/admin/drift/m/reference", headers=ADMIN).json()["reference_requests"] == 40
    for j in range(40):
        complete(client, prompt=english[(j + 1) % 2])
    same = client.get("/admin/drift/m", headers=ADMIN).json()
    assert same["features"]["char_classes"]["evaluated"] and not same["alert"]
    for _ in range(40):
        complete(client, prompt="0123456789 ++== 98765 4321 ?? !! 555 777")
    shifted = client.get("/admin/drift/m", headers=ADMIN).json()
    assert shifted["alert"] and shifted["features"]["char_classes"]["alert"]
    metrics = client.get("/metrics").text
    assert 'servelm:drift_alert{feature="char_classes",model_name="m"} 1.0' in metrics


@both_databases
def test_prediction_log_and_erasure_of_one_user(platform):
    client, state, _ = platform
    for j in range(6):
        r = complete(client, user="alice" if j % 2 else "bob", prompt=f"mail me at a{j}@example.com")
        assert r.status_code == 200
    rows = client.get("/admin/predictions", headers=ADMIN, params={"model": "m"}).json()
    assert len(rows) == 6 and {r["user"] for r in rows} == {"alice", "bob"}
    assert all("[EMAIL]" in r["prompt"] and r["output"] == "m-v1" and r["version"] == 1 for r in rows)
    r = client.delete("/admin/predictions", headers=ADMIN, params={"user": "alice"})
    assert r.json() == {"user": "alice", "removed": 3}
    left = client.get("/admin/predictions", headers=ADMIN).json()
    assert [x["user"] for x in left] == ["bob"] * 3
    entry = client.get("/admin/audit", headers=ADMIN).json()["entries"][-1]
    assert entry["action"] == "predictions.erase" and entry["after"] == {"removed": 3}
    assert "example" not in str(entry)
    # the permanent audit names the erased user by a keyed hash, the same each time, never the id itself
    assert "alice" not in str(entry) and entry["target"].startswith("user:sha256:")
    client.delete("/admin/predictions", headers=ADMIN, params={"user": "alice"})
    again = client.get("/admin/audit", headers=ADMIN).json()["entries"][-1]
    assert again["target"] == entry["target"] == "user:" + state.traffic.store.pseudonym("alice")
    assert entry["target"] != "user:" + state.traffic.store.pseudonym("bob")
    assert client.get("/admin/audit", headers=ADMIN).json()["ok"] is True


def test_cli_traffic_and_canary_commands(platform, capsys):
    """`servelm models traffic|canary` over the same admin API (its HTTP client swapped for the in-process
    one)."""
    import argparse

    from servelm.entrypoints import models_cli

    client, state, _ = platform
    parser = argparse.ArgumentParser()
    models_cli.add_args(parser)

    class Client(models_cli._Client):
        def __init__(self, args) -> None:
            self.json = args.json

        def call(self, method, path, body=None, params=None):
            r = client.request(method, path, json=body, params=params, headers=ADMIN)
            if r.status_code >= 400:
                raise models_cli.CliError(f"{r.json()['error']['message']} (HTTP {r.status_code})")
            return r.json() if r.content else None

    def run(*argv: str) -> tuple[int, str, str]:
        args = parser.parse_args(list(argv))
        orig, models_cli._Client = models_cli._Client, Client
        try:
            code = models_cli.cmd_models(args)
        finally:
            models_cli._Client = orig
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = run("traffic", "m", "--set", "1=80", "--set", "3=20", "--sticky", "--segment", "x-tier=beta:3")
    assert code == 0 and "v1=80, v3=20 sticky" in out and "x-tier" in out
    assert state.traffic.policies["m"].arms[1].weight == 20
    code, out, err = run("traffic", "m", "--set", "one=2")
    assert code == 1 and "VERSION=WEIGHT" in err
    assert run("traffic", "m", "--clear")[0] == 0 and "m" not in state.traffic.policies
    code, out, _ = run("canary", "start", "m:3", "--steps", "50,100", "--min-requests", "1000")
    assert code == 0 and "m:3 against m:1: running, step 0 (50% of traffic)" in out
    code, out, _ = run("canary", "abort", "m", "--reason", "drill")
    assert code == 0 and "rolled_back" in out and "abort at step 0: drill" in out
    assert state.control.registry.get("m", 3).state == State.ROLLBACK
    code, _, err = run("canary", "abort", "m")
    assert code == 1 and "HTTP 409" in err


@both_databases
def test_policies_canaries_and_experiments_come_back_after_a_restart(platform):
    """A new TrafficService over the same registry (what a restarted server builds) has the stored policy,
    carries on the running canary at its step, and knows the running experiment."""
    from prometheus_client import CollectorRegistry

    from servelm.control.traffic import split
    from servelm.server.traffic import TrafficService

    client, state, _ = platform
    r = client.post("/admin/models/m/canary", headers=ADMIN, json={"version": 3, "steps": [20, 100],
                                                                  "min_requests": 10**6, "min_seconds": 0})
    assert r.status_code == 201, r.text
    old = state.traffic
    client.portal.call(old.canaries["m"].stop)  # the old server is gone

    async def restart():
        svc = TrafficService(state.control, old.cfg, CollectorRegistry(), state.models)
        return svc, svc.resume()
    new, resumed = client.portal.call(restart)
    assert resumed == ["m"] and new.canaries["m"].controller.percent == 20
    assert {a.version: a.weight for a in new.policies["m"].arms} == {1: 80, 3: 20}
    client.portal.call(new.canaries["m"].abort, "t", "test")
    client.portal.call(new.clear_policy, "m", "t")
    client.portal.call(new.start_experiment, "e2", split("m", {1: 1, 4: 1}), None, "t")
    third = TrafficService(state.control, old.cfg, CollectorRegistry(), state.models)
    assert third.experiment_of == {"m": "e2"} and set(third.experiments["e2"].arms) == {"v1", "v4"}
    client.portal.call(new.close)
    client.portal.call(third.close)


def test_a_bandit_moves_traffic_to_the_version_with_better_feedback(platform):
    client, state, _ = platform
    r = client.put("/admin/models/m/bandit", headers=ADMIN, json={"versions": [1, 3], "min_share": 0.05})
    assert r.status_code == 200, r.text
    for j in range(100):
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                        headers={"x-request-id": f"b{j}"})
        good = r.headers["x-servelm-model-version"] == "m:3"
        assert client.post("/v1/feedback", json={"request_id": f"b{j}", "label": "good" if good else "bad"}
                           ).status_code == 200
    served = [complete(client).headers["x-servelm-model-version"] for _ in range(200)]
    # exploration sends 5% to each version; Thompson sampling sends the rest to m:3 (expected ~190 of 200)
    assert served.count("m:3") >= 150 and served.count("m:1") >= 1
    assert client.get("/admin/models/m/traffic", headers=ADMIN).json()["bandit"]["alpha"]["3"] > 50


@pytest.mark.parametrize("stream", [False, True])
def test_the_response_completes_only_after_its_prediction_is_logged(platform, stream):
    """Driving the ASGI app directly: while a request's log write is held, the server has not sent the last
    byte of its response (nor, streamed, its [DONE]); releasing the write completes it."""
    import json

    client, state, _ = platform
    log = state.traffic.log
    real = log.log

    async def drive():
        entered, gate, sent = asyncio.Event(), asyncio.Event(), []

        async def held(p):
            entered.set()
            await gate.wait()
            return await real(p)

        reads = []

        async def receive():  # the body once; then a client that stays connected
            if reads:
                await asyncio.Event().wait()
            reads.append(1)
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        def finished() -> bool:
            return any(m["type"] == "http.response.body" and (not m.get("more_body") or b"[DONE]" in m["body"])
                       for m in sent)

        body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1, "stream": stream}).encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
                 "server": ("testserver", 80), "client": ("127.0.0.1", 1234),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                             (b"x-request-id", f"held-{stream}".encode())]}
        log.log = held
        try:
            task = asyncio.create_task(client.app(scope, receive, send))
            await asyncio.wait_for(entered.wait(), 30)
            held_back = not finished()
            gate.set()
            await asyncio.wait_for(task, 30)
        finally:
            log.log = real
        return held_back, finished(), b"".join(m.get("body", b"") for m in sent if "body" in m)

    held_back, done, text = client.portal.call(drive)
    assert held_back, "the response completed before its prediction was logged"
    assert done and (b"[DONE]" in text) == stream
    assert [r["request_id"] for r in log.entries()][-1] == f"held-{stream}"


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_huge_version_number_is_refused_never_a_500(platform):
    """Version numbers past what the registry's database holds are a 4xx in the error shape, on the on-demand
    load path, the admin version routes and traffic bodies (SQLite raised OverflowError: a 500)."""
    client, state, _ = platform
    state.models.on_demand = lambda model, kind: state.control.load_on_demand(model, kind, None)
    huge = "99999999999999999999"
    err = _error(complete(client, model=f"m:{huge}"), 404)
    assert err["code"] == "model_not_found" and "'m'" in err["message"]
    assert _error(client.get(f"/admin/models/m/versions/{huge}", headers=ADMIN), 400)["param"]
    _error(client.put("/admin/models/m/traffic", json={"arms": [{"version": int(huge)}]}, headers=ADMIN), 400)
    assert state.control.find_version(f"m:{huge}") is None


def test_a_key_limited_to_some_models_cannot_load_or_use_others(platform):
    """A key's model list is checked on the requested name before any on-demand load, on every route that
    takes a model; and only the PRODUCTION version loads on demand (others need an admin deploy)."""
    from servelm.server.middleware.auth import ApiKey, KeyStore, digest

    client, state, _ = platform
    state.keys = KeyStore([ApiKey("a", digest("alpha-only-key-1"), models=frozenset({"alpha"})),
                           ApiKey("all", digest("all-models-key-1"))],
                          digest(ADMIN["x-api-key"]))
    loads: list[str] = []

    async def on_demand(model, kind):
        loads.append(model)
        return await state.control.load_on_demand(model, kind, None)

    state.models.on_demand = on_demand
    state.control.deployments._deployments.clear()  # nothing deployed: a request of `m` would load it
    auth = {"Authorization": "Bearer alpha-only-key-1"}
    for path, body in (("/v1/completions", {"model": "m:1", "prompt": "x", "max_tokens": 1}),
                       ("/v1/embeddings", {"model": "m", "input": "x"}),
                       ("/tokenize", {"model": "m", "prompt": "x"}),
                       ("/detokenize", {"model": "m", "tokens": [1]})):
        err = _error(client.post(path, json=body, headers=auth), 403)
        assert err["code"] == "model_not_allowed", path
    assert loads == []  # refused before anything loaded
    assert client.post("/tokenize", json={"model": "alpha", "prompt": "x"}, headers=auth).status_code == 200
    everything = {"Authorization": "Bearer all-models-key-1"}
    # only the PRODUCTION version (m:1, or m) may load on demand: m:4 (VALIDATED) and m:3 are refused
    for ref in ("m:4", "m:3"):
        assert "PRODUCTION" in _error(complete(client, model=ref, headers=everything), 409)["message"]
    assert state.control.find_version("m:1").version == 1 and state.control.find_version("m").version == 1


@both_databases
def test_feedback_is_bounded_once_per_request_and_only_from_its_key(platform):
    """A score past +-1e6 is refused (1e308 then a normal score overflowed the experiment's statistics to
    inf/NaN: its report answered 500); a request takes one feedback, and only from the key that made it."""
    from servelm.server.middleware.auth import ApiKey, KeyStore, digest

    client, state, _ = platform
    state.keys = KeyStore([ApiKey("a", digest("feedback-key-a1")), ApiKey("b", digest("feedback-key-b1"))],
                          digest(ADMIN["x-api-key"]))
    a, b = {"Authorization": "Bearer feedback-key-a1"}, {"Authorization": "Bearer feedback-key-b1"}
    assert client.post("/admin/experiments", headers=ADMIN, json={
        "name": "fb", "model": "m", "arms": [{"version": 1, "name": "a"}, {"version": 3, "name": "b"}]}
    ).status_code == 201
    for rid in ("fb-1", "fb-2"):
        assert complete(client, headers={**a, "x-request-id": rid}).status_code == 200
    _error(client.post("/v1/feedback", json={"request_id": "fb-1", "score": 1e308}, headers=a), 400)
    other = _error(client.post("/v1/feedback", json={"request_id": "fb-1", "score": 1.0}, headers=b), 404)
    unknown = _error(client.post("/v1/feedback", json={"request_id": "nope", "score": 1.0}, headers=b), 404)
    assert other["message"].replace("fb-1", "nope") == unknown["message"]  # another key's request looks unknown
    assert client.post("/v1/feedback", json={"request_id": "fb-1", "score": 1e6}, headers=a).status_code == 200
    assert _error(client.post("/v1/feedback", json={"request_id": "fb-1", "score": 0.5}, headers=a), 409)
    assert client.post("/v1/feedback", json={"request_id": "fb-2", "score": -1e6}, headers=a).status_code == 200
    rep = client.get("/admin/experiments/fb", headers=ADMIN)
    assert rep.status_code == 200, rep.text
    fed = [arm["feedback"] for arm in rep.json()["arms"].values() if arm["feedback"]["n"]]
    assert sum(f["n"] for f in fed) == 2 and all(math.isfinite(f["mean"]) for f in fed)


def test_policy_writes_run_off_the_event_loop_in_order(platform):
    """A policy change's database write (audited) runs on the registry's writer thread, never on the event
    loop that serves requests; two changes land in the order they were made, in memory and stored."""
    import threading

    client, state, _ = platform
    svc = state.traffic
    threads: list[str] = []
    put = svc.store.put

    def spy(*args, **kw):
        threads.append(threading.current_thread().name)
        return put(*args, **kw)

    svc.store.put = spy
    for weights in ([{"version": 1, "weight": 90}, {"version": 3, "weight": 10}], [{"version": 1, "weight": 50},
                                                                                   {"version": 3, "weight": 50}]):
        assert client.put("/admin/models/m/traffic", headers=ADMIN, json={"arms": weights}).status_code == 200
    assert client.put("/admin/models/m/prediction-log", headers=ADMIN, json={"mode": "off"}).status_code == 200
    assert len(threads) == 3 and all(t.startswith("servelm-registry") for t in threads), threads
    assert {a.version: a.weight for a in svc.policies["m"].arms} == {1: 50, 3: 50}
    assert svc.store.policy("m") == svc.policies["m"]


def test_feedback_for_a_request_served_before_a_restart(platform):
    """A restarted server remembers no request ids: feedback finds the request in the prediction log (its
    version and arm), and the once-per-request rule holds across restarts (the database records it)."""
    client, state, _ = platform
    assert complete(client, headers={"x-request-id": "old-1"}).status_code == 200
    state.traffic.served.clear()  # what a new process knows
    r = client.post("/v1/feedback", json={"request_id": "old-1", "score": 1.0})
    assert r.status_code == 200, r.text
    assert (r.json()["model"], r.json()["version"], r.json()["arm"]) == ("m", 1, "v1")
    state.traffic.served.clear()
    assert _error(client.post("/v1/feedback", json={"request_id": "old-1", "score": 0.0}), 409)["code"] == \
        "feedback_exists"
    assert _error(client.post("/v1/feedback", json={"request_id": "never", "score": 0.0}), 404)


@pytest.mark.parametrize("body, param", [
    ({"arms": [{"version": 1, "name": "a"}, {"version": 3, "name": "b"}], "baseline": "nope"}, "baseline"),
    ({"arms": [{"version": 1, "name": "a"}, {"version": 3, "name": "a"}]}, "arms"),
])
def test_an_invalid_experiment_is_refused_before_anything_is_stored(platform, body, param):
    """An unknown baseline (was a KeyError 500 with the experiment left running) or two arms under one label
    (their statistics merged silently) is a 400, and neither the experiment nor its policy exists after."""
    client, state, _ = platform
    err = _error(client.post("/admin/experiments", headers=ADMIN, json={"name": "bad", "model": "m", **body}), 400)
    assert err["param"] == param and err["code"] == "invalid_experiment"
    assert client.get("/admin/experiments", headers=ADMIN).json() == []
    assert client.get("/admin/models/m/traffic", headers=ADMIN).status_code == 404
    assert state.traffic.store.all("experiment") == {}


def test_a_drift_report_reads_a_copy_of_the_windows_the_loop_feeds(platform):
    """The report runs in a thread while requests keep appending to the live windows; it reads a copy taken
    on the loop (iterating the live deques there raised 'deque mutated during iteration': a 500)."""
    client, state, _ = platform
    for _ in range(3):
        complete(client)
    svc, live = state.traffic, state.traffic.drift["m"]
    report = svc.drift_report

    def racing(name, mon=None):
        live.observe(prompt="appended meanwhile", prompt_tokens=[1, 2], output_tokens=1)  # a request finishing
        assert mon is not live
        return report(name, mon)

    svc.drift_report = racing
    rep = client.get("/admin/drift/m", headers=ADMIN)
    assert rep.status_code == 200, rep.text
    assert rep.json()["features"]["prompt_len"]["n_live"] == 3 and len(live.live.prompt_len) == 4


def test_a_shadow_copy_keeps_the_primary_cache_salt_and_a_queue_timeout(platform):
    """The mirrored request runs in the primary's prefix-cache namespace (per-key isolation) and with a queue
    timeout, the primaries' or, when they have none (the default), a bounded one of its own; the comparison covers
    a bounded prefix of each output (difflib is quadratic)."""
    client, state, deps = platform
    seen: list[tuple] = []
    generate = deps[3].generate

    def spy(rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, generation=None,
            lora=None):
        seen.append((queue_timeout, cache_salt))
        return generate(rid, ids, params, prompt, priority, queue_timeout, cache_salt, generation, lora=lora)

    deps[3].generate = spy
    assert client.put("/admin/models/m/shadow", headers=ADMIN, json={"version": 3}).status_code == 200
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1, "cache_salt": "s1"})
    assert r.status_code == 200 and r.headers["x-servelm-model-version"] == "m:1"
    client.portal.call(state.traffic.mirrors["m"].drain)
    from servelm.control.traffic_service import SHADOW_QUEUE_TIMEOUT_S

    assert state.config.admission.queue_timeout_s == 0
    assert seen == [(SHADOW_QUEUE_TIMEOUT_S, "salt:s1")]
    from servelm.control.shadow import MAX_COMPARED, similarity

    same = list(range(MAX_COMPARED))
    assert similarity(same + [1] * 5000, same + [2] * 5000) == 1.0


def test_a_canary_whose_promotion_fails_says_failed_and_counts_an_alert(platform):
    """The status said 'promoted' before the promotion was applied; when applying it fails it is 'failed',
    the version is not PRODUCTION and servelm:canary_promotion_failures_total counts it."""
    client, state, _ = platform

    async def refuse(*args, **kw):
        raise RuntimeError("registry unavailable")

    r = client.post("/admin/models/m/canary", headers=ADMIN, json={
        "version": 3, "steps": [30, 60], "min_requests": 15, "min_seconds": 0})
    assert r.status_code == 201, r.text
    state.control.transition = refuse
    i = iter(range(10**6))
    _wait_canary(client, lambda: complete(client, user=f"u{next(i)}"), "failed", limit=300)
    assert state.control.registry.get("m", 3).state == State.CANARY
    status = client.get("/admin/models/m/canary", headers=ADMIN).json()
    assert status["history"][-1]["action"] == "promotion_failed"
    assert 'servelm:canary_promotion_failures_total{model_name="m",model_version="3"} 1.0' in \
        client.get("/metrics").text
