"""Model governance over HTTP, in-process (the `platform` app of test_traffic_api: real registry, control plane
and traffic service, fake engines): API key groups in segment rules, concept and embedding drift, the
webhook, the OTLP prediction-log sink, and traffic state that survives a restart."""

from __future__ import annotations

import pytest
import test_traffic_api
from test_traffic_api import ADMIN, _wait_canary, complete, put_policy

from servelm.control.types import State

platform = test_traffic_api.platform  # the fixture: the in-process app with model m (v1..v4)


def test_a_segment_rule_on_a_key_group_pins_that_groups_keys(platform, tmp_path):
    """Keys file entries carry `groups`; a rule on a group sends that group's keys to its version, every other
    key follows the split (key-group rules never matched before: no key had a group)."""
    from servelm.server.middleware.auth import KeyStore

    client, state, _ = platform
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n"
                    "  - {name: a1, key: sk-group-a1-key, groups: [beta, eu]}\n"
                    "  - {name: a2, key: sk-group-a2-key, groups: [beta]}\n"
                    "  - {name: b1, key: sk-group-b1-key, groups: [us]}\n"
                    "  - {name: c1, key: sk-group-c1-key}\n")
    state.keys = KeyStore.from_config(None, str(keys), ADMIN["x-api-key"])
    put_policy(client, {"arms": [{"version": 1}], "segments": [{"version": 3, "name": "beta",
                                                                "key_groups": ["beta"]}]})
    for name, want in (("a1", "m:3"), ("a2", "m:3"), ("b1", "m:1"), ("c1", "m:1")):
        for _ in range(3):
            r = complete(client, headers={"Authorization": f"Bearer sk-group-{name}-key"})
            assert r.status_code == 200, r.text
            assert r.headers["x-servelm-model-version"] == want, name
        assert r.headers["x-servelm-arm"] == ("segment:beta" if want == "m:3" else "v1")


@pytest.mark.parametrize("groups", ["beta", [1], ["ok", ""]])
def test_a_malformed_key_group_list_is_refused(tmp_path, groups):
    import json

    from servelm.server.middleware.auth import load_keys_file

    f = tmp_path / "keys.json"
    f.write_text(json.dumps([{"name": "k", "key": "sk-12345678", "groups": groups}]))
    with pytest.raises(ValueError, match="groups must be a list of non-empty group names"):
        load_keys_file(str(f))


class FakeEmbedder:
    """Embeds a text as a fixed random unit vector of its own (the same text, the same vector); records the
    thread nothing but the event loop may call it from."""

    def __init__(self) -> None:
        self.calls = 0

    async def embed(self, texts):
        import zlib

        import numpy as np

        self.calls += 1
        out = []
        for t in texts:
            v = np.random.default_rng(zlib.crc32(t.encode())).normal(size=8) + (5.0 if t[0].isdigit() else 0.0)
            out.append(v / np.linalg.norm(v))
        return out, len(texts)


def _speaking(dep, text: str, finish: str):
    """Make a fake deployment answer `text` with `finish`."""
    from servelm.outputs import CompletionOutput, RequestOutput

    async def generate(rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None,
                       generation=None):
        yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, text, [5], finish_reason=finish)], True)
    dep.generate = generate


def test_concept_and_embedding_drift_over_http(platform):
    """Per version: refusals, the finish-reason mix and lower feedback in the live window alert (the output is
    classified even with a metadata-only log); prompt embeddings, sampled and embedded off the request path,
    alert on a shifted prompt distribution by MMD computed in a worker thread, never in a /metrics scrape."""
    import threading

    from servelm.control import drift

    client, state, deps = platform
    svc = state.traffic
    svc.log.set_mode("m", "metadata")  # no output text kept: concept drift reads the output's first characters
    svc.watch.embedder, svc.watch.sample, svc.watch.max_inflight = FakeEmbedder(), 1.0, 10**6
    english = ["the quick brown fox jumps over the lazy dog", "hello there how are you today my friend",
               "a third sentence about the weather", "what time does the shop open"]

    def serve(n: int, prompt, score: float, tag: str) -> None:
        for j in range(n):
            r = complete(client, prompt=prompt(j), headers={"x-request-id": f"{tag}{j}"})
            assert r.status_code == 200, r.text
            fb = {"request_id": f"{tag}{j}", "score": score + 0.2 * (j % 2)}  # varied: Welch needs a spread
            assert client.post("/v1/feedback", json=fb).status_code == 200
        client.portal.call(svc.watch.drain)

    _speaking(deps[1], "Paris is the capital of France.", "stop")
    serve(25, lambda j: english[j % 4], 0.8, "ref")
    assert client.post("/admin/drift/m/reference", headers=ADMIN).json()["reference_requests"] == 25
    serve(25, lambda j: english[(j + 1) % 4], 0.8, "same")
    same = client.get("/admin/drift/m", headers=ADMIN).json()
    assert same["features"]["embedding"]["evaluated"] and not same["features"]["embedding"]["alert"]
    assert same["concept"]["v1"]["signals"]["refusal_rate"]["live_rate"] == 0.0
    assert not same["alert"] and not same["concept_alert"]

    loop_thread = client.portal.call(threading.get_ident)
    threads: list[int] = []
    real = drift.DriftMonitor.embedding_report

    def spy(self):
        threads.append(threading.get_ident())
        return real(self)

    drift.DriftMonitor.embedding_report = spy
    try:
        _speaking(deps[1], "I'm sorry, I can't help with that.", "length")
        serve(25, lambda j: f"{j}0123 ++== 98765 4321 ?? !! {j}", 0.0, "shift")
        metrics = client.get("/metrics").text  # the scrape reads the last MMD result: it computes none
        assert threads == []
        shifted = client.get("/admin/drift/m", headers=ADMIN).json()
    finally:
        drift.DriftMonitor.embedding_report = real
    assert threads and loop_thread not in threads
    assert shifted["features"]["embedding"]["alert"] and shifted["features"]["embedding"]["mmd_p"] < 0.01
    signals = shifted["concept"]["v1"]["signals"]
    assert {k for k, f in signals.items() if f["alert"]} == {"refusal_rate", "feedback", "finish_reasons"}
    assert shifted["concept_alert"] and shifted["alert"]
    metrics = client.get("/metrics").text
    for line in ('servelm:concept_drift_alert{model_name="m",model_version="1",signal="refusal_rate"} 1.0',
                 'servelm:concept_drift_alert{model_name="m",model_version="1",signal="empty_rate"} 0.0',
                 'servelm:concept_drift_live{model_name="m",model_version="1",signal="refusal_rate"} 0.625',  # 25 of the last 40
                 'servelm:concept_drift_alerts_total{model_name="m",model_version="1",signal="feedback"} 1.0',
                 'servelm:drift_alert{feature="embedding",model_name="m"} 1.0',
                 'servelm:drift_embeddings_total{model_name="m",outcome="embedded"} 75.0'):
        assert line in metrics, line
    assert 'servelm:drift_mmd2{model_name="m"}' in metrics
    svc.watch.max_inflight = 0  # the embedder is busy with drift samples: more are skipped, never queued
    calls = svc.watch.embedder.calls
    assert complete(client, prompt="one more").status_code == 200
    assert svc.watch.embedder.calls == calls and not svc.watch._inflight
    assert 'servelm:drift_embeddings_total{model_name="m",outcome="skipped"} 1.0' in client.get("/metrics").text


class Receiver:
    """A real HTTP server on 127.0.0.1 (a thread) that records the JSON bodies POSTed to it. It answers 500
    to the first `fail` requests; while `hold` is clear it keeps each request waiting."""

    def __init__(self, fail: int = 0) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list = []
        self.fail, self.hold, self.attempts = fail, threading.Event(), 0
        self.hold.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["content-length"]))
                outer.hold.wait(30)
                outer.attempts += 1
                failing = outer.attempts <= outer.fail
                if not failing:
                    outer.bodies.append((self.path, self.headers.get("content-type"), data if outer.raw
                                         else json.loads(data)))
                self.send_response(500 if failing else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.raw = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


def test_the_webhook_gets_rollbacks_failed_promotions_and_drift_alerts_without_blocking(platform):
    """A real receiver on 127.0.0.1: its first answer is a 500 (retried), and it holds the first rollback's
    delivery while the abort has already answered (the canary path never waits on the webhook). A failed
    promotion and a drift alert follow; a receiver that is gone counts a failure, nothing else."""
    from servelm.config.settings import load
    from servelm.server.observability.webhook import Webhook

    client, state, _ = platform
    svc = state.traffic
    rx = Receiver(fail=1)
    try:
        cfg = load({"webhook_url": rx.url + "/hook", "webhook_retries": 1}, env={}).server
        svc.webhook = Webhook(cfg.rollout_config.webhook_url, svc.metrics, timeout_s=cfg.rollout_config.webhook_timeout_s,
                              retries=cfg.rollout_config.webhook_retries, backoff_s=0.0)
        client.portal.call(svc.webhook.start)
        rx.hold.clear()
        r = client.post("/admin/models/m/canary", headers=ADMIN, json={"version": 3, "steps": [50, 100],
                                                                      "min_requests": 10**6, "min_seconds": 0})
        assert r.status_code == 201, r.text
        r = client.post("/admin/models/m/canary/abort", headers=ADMIN, json={"reason": "drill"})
        assert r.status_code == 200 and r.json()["status"] == "rolled_back"  # answered while the receiver holds
        assert rx.bodies == []
        rx.hold.set()
        client.portal.call(svc.webhook.flush)
        assert rx.attempts == 2  # a 500, then the retry
        (path, ctype, event), = rx.bodies
        assert (path, ctype) == ("/hook", "application/json")
        assert {k: event[k] for k in ("event", "model", "version", "production", "reason", "kind")} == {
            "event": "canary.rollback", "model": "m", "version": 3, "production": 1, "reason": "drill",
            "kind": "aborted"}

        async def refuse(*args, **kw):
            raise RuntimeError("registry unavailable")

        state.control.registry.transition("m", 4, State.STAGING, "t")
        state.control.registry.transition("m", 4, State.STAGING_TESTED, "t")
        state.control.transition = refuse
        assert client.post("/admin/models/m/canary", headers=ADMIN, json={
            "version": 4, "steps": [50, 100], "min_requests": 1, "min_seconds": 0}).status_code == 201
        i = iter(range(10**6))
        _wait_canary(client, lambda: complete(client, user=f"u{next(i)}"), "failed", limit=300)
        for _ in range(20):
            complete(client, prompt="hello there")
        client.post("/admin/drift/m/reference", headers=ADMIN)
        for _ in range(20):
            complete(client, prompt="0123456789 ++== 98765")
        client.portal.call(svc.watch.check)  # what the background check does every drift_check_interval_s
        client.portal.call(svc.webhook.flush)
        events = [b[2] for b in rx.bodies]
        assert [e["event"] for e in events[:2]] == ["canary.rollback", "canary.promotion_failed"]
        assert "registry unavailable" in events[1]["reason"] and events[1]["version"] == 4
        drift = [e for e in events[2:] if e["event"] == "drift.alert"]
        assert drift and all(e["model"] == "m" and e["kind"] == "data" for e in drift)
        assert {"char_classes", "prompt_len"} <= {e["feature"] for e in drift}
        assert len(events) == 2 + len(drift)
        n = len(events)
        client.portal.call(svc.watch.check)  # still alerting: nothing new starts
        client.portal.call(svc.webhook.flush)
        assert len(rx.bodies) == n
    finally:
        rx.close()
    svc.notify({"event": "drift.alert", "model": "m"})  # the receiver is gone: a failure, counted
    client.portal.call(svc.webhook.flush)
    metrics = client.get("/metrics").text
    assert 'servelm:webhook_failures_total{event="drift.alert"} 1.0' in metrics
    assert 'servelm:webhook_deliveries_total{event="canary.rollback"} 1.0' in metrics

    # what a server builds from its settings: the webhook and the prediction log's OTLP sink
    from prometheus_client import CollectorRegistry

    from servelm.server.traffic import TrafficService

    cfg = load({"webhook_url": "http://127.0.0.1:9/hook", "prediction_log_otlp_endpoint": "http://127.0.0.1:9/v1/logs",
                "data_dir": svc.cfg.storage_config.data_dir}, env={}).server
    other = TrafficService(state.control, cfg, CollectorRegistry(), state.models)
    assert (other.webhook.url, other.webhook.retries, other.log.otlp.endpoint) == \
        ("http://127.0.0.1:9/hook", 2, "http://127.0.0.1:9/v1/logs")
    client.portal.call(other.close)


def test_webhook_settings_come_from_the_config_tree():
    from servelm.config.engine import ConfigError
    from servelm.config.settings import load

    cfg = load({"webhook_timeout_s": 0.5}, env={"SERVELM_WEBHOOK_URL": "http://127.0.0.1:9/x"})
    assert (cfg.server.rollout_config.webhook_url, cfg.server.rollout_config.webhook_timeout_s, cfg.sources["rollout.webhook_url"]) == \
        ("http://127.0.0.1:9/x", 0.5, "env")
    with pytest.raises(ConfigError, match="webhook_url"):
        load({"webhook_url": "ftp://x"}, env={})


def test_prediction_log_entries_leave_as_otlp_log_records(tmp_path):
    """The OTLP sink with opentelemetry-sdk's real OTLP/HTTP exporter, against a receiver on 127.0.0.1 that
    decodes the protobuf ExportLogsServiceRequest: one record per entry, with the entry's fields."""
    import asyncio

    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    from servelm.config.settings import load
    from servelm.control.prediction_otlp import OtlpSink
    from servelm.control.predictions import Prediction, PredictionLog

    rx = Receiver()
    rx.raw = True
    try:
        cfg = load({"prediction_log_otlp_endpoint": rx.url + "/v1/logs"}, env={}).server
        log = PredictionLog(None, sink=tmp_path / "p.jsonl", modes={"m": "full"}, default_mode="metadata",
                            otlp=OtlpSink(cfg.observability_config.prediction_log_otlp_endpoint, "svc-test"))
        asyncio.run(log.log(Prediction("r1", "m", version=2, arm="v2", key_name="k", user="alice",
                                       prompt="mail a@example.com", output="ok", prompt_tokens=3,
                                       completion_tokens=1, latency_s=0.5, finish_reason="stop", at=1700000000.25)))
        log.write(Prediction("r2", "other", error="boom", at=1700000001.0))
        assert log.otlp.flush()
        log.close()
    finally:
        rx.close()
    records = {}
    for path, ctype, data in rx.bodies:
        assert (path, ctype) == ("/v1/logs", "application/x-protobuf")
        req = ExportLogsServiceRequest.FromString(data)
        for rl in req.resource_logs:
            res = {a.key: a.value.string_value for a in rl.resource.attributes}
            assert res["service.name"] == "svc-test"
            for sl in rl.scope_logs:
                for lr in sl.log_records:
                    attrs = {}
                    for a in lr.attributes:
                        v = a.value
                        attrs[a.key] = getattr(v, v.WhichOneof("value"))
                    body = {kv.key: kv.value.string_value for kv in lr.body.kvlist_value.values}
                    records[attrs["servelm.request_id"]] = (lr.time_unix_nano, lr.event_name, attrs, body)
    assert set(records) == {"r1", "r2"}
    t, name, attrs, body = records["r1"]
    assert (t, name) == (1700000000250000000, "servelm.prediction")
    assert attrs == {"servelm.request_id": "r1", "servelm.model": "m", "servelm.model_version": 2,
                     "servelm.arm": "v2", "servelm.key": "k", "enduser.id": "alice", "servelm.prompt_tokens": 3,
                     "servelm.completion_tokens": 1, "servelm.latency_s": 0.5, "servelm.finish_reason": "stop"}
    assert body == {"prompt": "mail [EMAIL]", "output": "ok"}  # redacted, as in the log
    t, _, attrs, body = records["r2"]
    assert attrs["servelm.error"] == "boom" and attrs["servelm.model"] == "other" and body == {}  # metadata mode


def test_canary_experiment_bandit_and_log_mode_state_survive_a_restart(platform):
    """After the periodic checkpoint, a new TrafficService over the same registry (what a restarted server
    builds) has: the running canary's step windows, the bandit's learned posterior, the experiment's arm
    statistics, and the prediction-log mode set over the admin API. (Before, all of these started again.)"""
    client, state, _ = platform
    old = state.traffic

    def restart():
        assert client.portal.call(old.checkpoint)  # what the periodic task does; then the process is gone
        return client.portal.call(_restart, state, old)

    assert client.put("/admin/models/m/prediction-log", headers=ADMIN, json={"mode": "off"}).status_code == 200
    r = client.post("/admin/models/m/canary", headers=ADMIN, json={"version": 3, "steps": [50, 100],
                                                                  "min_requests": 10**6, "min_seconds": 0})
    assert r.status_code == 201, r.text
    for j in range(30):
        assert complete(client, user=f"u{j}").status_code == 200
    windows = {v: w.to_dict() for v, w in old.canaries["m"].controller.windows.items()}
    assert sum(w["requests"] for w in windows.values()) == 30
    new = restart()
    assert new.canaries["m"].controller.step == 0
    assert {v: w.to_dict() for v, w in new.canaries["m"].controller.windows.items()} == windows
    assert new.log.mode("m") == "off" and new.log.mode("other") == "full"
    client.portal.call(new.canaries["m"].stop)
    client.portal.call(new.close)

    client.portal.call(old.canaries["m"].abort, "t", "next part")
    client.portal.call(old.clear_policy, "m", "t")
    assert client.put("/admin/models/m/bandit", headers=ADMIN, json={"versions": [1, 3]}).status_code == 200
    for j in range(20):
        complete(client, headers={"x-request-id": f"bd{j}"})
        client.post("/v1/feedback", json={"request_id": f"bd{j}", "score": 1.0 if j % 3 else 0.0})
    posterior = old.policies["m"].bandit.to_dict()
    assert sum(posterior["alpha"].values()) > 2  # learned since it was set (the stored policy has the prior)
    new = restart()
    assert new.policies["m"].bandit.to_dict() == posterior
    client.portal.call(new.close)

    client.portal.call(old.clear_policy, "m", "t")
    assert client.post("/admin/experiments", headers=ADMIN, json={
        "name": "e1", "model": "m", "arms": [{"version": 1, "name": "a"}, {"version": 4, "name": "b"}]}
    ).status_code == 201
    for j in range(10):
        assert complete(client, headers={"x-request-id": f"ex{j}"}).status_code == 200
        client.post("/v1/feedback", json={"request_id": f"ex{j}", "score": j / 10})
    arms = {k: a.to_dict() for k, a in old.experiments["e1"].arms.items()}
    assert sum(a["requests"] for a in arms.values()) == 10
    new = restart()
    assert {k: a.to_dict() for k, a in new.experiments["e1"].arms.items()} == arms
    assert not client.portal.call(old.checkpoint)  # nothing changed since: nothing written
    client.portal.call(new.close)


async def _restart(state, old):
    from prometheus_client import CollectorRegistry

    from servelm.server.traffic import TrafficService

    svc = TrafficService(state.control, old.cfg, CollectorRegistry(), state.models)
    svc.resume()
    state.control.deployments.policy_of = old.policies.get  # the app in this test keeps routing with `old`
    return svc
