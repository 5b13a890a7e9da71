"""The traffic service is control logic: it runs over a registry with whatever the process supplies for
metrics and operator events (here recording stand-ins, no server), and refuses with control errors."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from servelm.config.settings import load
from servelm.control.errors import Conflict, NotFound, Unavailable
from servelm.control.registry import Registry
from servelm.control.traffic_service import FAULT_LABEL, TrafficService


class Counter:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, ...], float] = {}

    def labels(self, *values: str) -> Counter:
        self._key = values
        return self

    def inc(self, amount: float = 1) -> None:
        self.counts[self._key] = self.counts.get(self._key, 0) + amount


class Metrics:
    def __init__(self) -> None:
        for name in ("feedback", "rollbacks", "promotions", "canary_failures", "shadow_requests", "shadow_dropped",
                     "drift_alerts", "concept_alerts", "drift_embeddings"):
            setattr(self, name, Counter())
        self.requests: list[tuple] = []

    def request(self, name, version, arm, error, latency, ttft) -> None:
        self.requests.append((name, version, arm, error))


class Events:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def start(self) -> None: ...

    def send(self, event: dict) -> None:
        self.sent.append(event)

    async def close(self) -> None: ...


def _record(**kw):
    base = dict(request_id="r1", model="m", model_version="m:1", status=200, error=None, arm=None, user="",
                key_name="alice", api_key=None, start=0.0, first_token=None, last_token=None, prompt_tokens=3,
                completion_tokens=2, finish_reason="stop", prompt_text='"hi"', completion_text=None,
                output_head="", prompt_ids=None, output_ids=[], params=None, cache_salt=None, decision=None,
                traffic_done=False)
    return SimpleNamespace(**{**base, **kw})


def test_requests_feedback_and_events_go_through_the_supplied_seams(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELM_ALLOW_FAULTS", "1")
    cfg = load({"embedding_model": "none", "log_requests": False, "prediction_log": "metadata"}, env={}).server
    reg = Registry(None, tmp_path / "data")
    cp = SimpleNamespace(registry=reg, deployments=SimpleNamespace())
    events = Events()
    svc = TrafficService(cp, cfg, SimpleNamespace(), lambda s: Metrics(), lambda m: events)
    assert cp.deployments.policy_of == svc.policies.get  # the deployments ask it for the policy per request

    async def main():
        await svc.complete(_record())
        assert svc.metrics.requests == [("m", 1, "v1", False)]
        out = await svc.feedback("r1", 1.0, "alice")
        assert (out["model"], out["version"], out["arm"]) == ("m", 1, "v1")
        assert svc.metrics.feedback.counts == {("m", "1", "v1"): 1}
        with pytest.raises(Conflict) as e:
            await svc.feedback("r1", 1.0, "alice")
        assert (e.value.code, e.value.param) == ("feedback_exists", "request_id")
        with pytest.raises(NotFound):
            await svc.feedback("r1", 1.0, "bob")  # another key's request is not revealed
        svc.notify({"event": "drill"})
        assert events.sent == [{"event": "drill"}]
        faulty = SimpleNamespace(version=SimpleNamespace(labels={FAULT_LABEL: "error"}, ref="m:2"))
        with pytest.raises(Unavailable, match="injected fault in m:2"):
            await svc.fault(faulty)
        await svc.close()

    asyncio.run(main())
    reg.close()
