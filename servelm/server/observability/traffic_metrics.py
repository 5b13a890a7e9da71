"""Prometheus metrics of traffic management (`servelm:` names, labels model_name / model_version / arm).

Counters are incremented where things happen; the state-like figures (a canary's share, shadow agreement,
drift statistics) are read from the live objects at scrape time by a collector.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ARM = ("model_name", "model_version", "arm")


class TrafficMetrics:
    """The counters and histograms, and a collector over `service` (a TrafficService) for the gauges."""

    def __init__(self, registry: Any, service: Any) -> None:
        r = registry
        self.requests = Counter("servelm:arm_requests", "Generation requests by model version and traffic arm "
                                "(outcome ok or error).", [*_ARM, "outcome"], registry=r)
        self.latency = Histogram("servelm:arm_e2e_request_latency_seconds", "Request latency by model version "
                                 "and traffic arm.", list(_ARM), buckets=_LATENCY, registry=r)
        self.ttft = Histogram("servelm:arm_time_to_first_token_seconds", "Time to first token by model version "
                              "and traffic arm.", list(_ARM), buckets=_LATENCY, registry=r)
        self.feedback = Counter("servelm:feedback", "Feedback received (POST /v1/feedback).", list(_ARM), registry=r)
        self.rollbacks = Counter("servelm:canary_rollbacks", "Canaries rolled back automatically or aborted.",
                                 ["model_name", "model_version", "reason"], registry=r)
        self.promotions = Counter("servelm:canary_promotions", "Canaries promoted to PRODUCTION.",
                                  ["model_name", "model_version"], registry=r)
        self.canary_failures = Counter("servelm:canary_promotion_failures", "Canary promotions that could not "
                                       "be applied (status failed; alert on it).", ["model_name", "model_version"],
                                       registry=r)
        self.shadow_requests = Counter("servelm:shadow_requests", "Mirrored requests run on a shadow version.",
                                       ["model_name", "model_version"], registry=r)
        self.shadow_dropped = Counter("servelm:shadow_dropped", "Mirrored requests dropped because the shadow "
                                      "queue was full.", ["model_name", "model_version"], registry=r)
        self.drift_alerts = Counter("servelm:drift_alerts", "Drift reports that raised an alert (per feature).",
                                    ["model_name", "feature"], registry=r)
        self.concept_alerts = Counter("servelm:concept_drift_alerts", "Concept-drift signals of a version that "
                                      "started alerting (feedback, refusal_rate, empty_rate, finish_reasons).",
                                      ["model_name", "model_version", "signal"], registry=r)
        self.drift_embeddings = Counter("servelm:drift_embeddings", "Prompts sampled for embedding drift, by "
                                        "outcome (embedded, skipped: too many in flight, failed).",
                                        ["model_name", "outcome"], registry=r)
        self.webhook_deliveries = Counter("servelm:webhook_deliveries", "Events delivered to the webhook.",
                                          ["event"], registry=r)
        self.webhook_failures = Counter("servelm:webhook_failures", "Webhook events not delivered (every attempt "
                                        "failed, or the queue was full).", ["event"], registry=r)
        registry.register(_Collector(service))

    def request(self, name: str, version: int | None, arm: str, error: bool, latency: float,
                ttft: float | None) -> None:
        v = str(version) if version is not None else ""
        self.requests.labels(name, v, arm, "error" if error else "ok").inc()
        if not error:
            self.latency.labels(name, v, arm).observe(latency)
            if ttft is not None:
                self.ttft.labels(name, v, arm).observe(ttft)


class _Collector:
    """Gauges read from the service when scraped."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self):
        s = self.service
        pct = GaugeMetricFamily("servelm:canary_traffic_percent", "A running canary's share of its model's "
                                "traffic (0 after a rollback, 100 after promotion).", labels=["model_name",
                                                                                              "model_version"])
        for name, run in s.canaries.items():
            pct.add_metric([name, str(run.controller.config.canary)], run.controller.percent)
        yield pct
        agree = GaugeMetricFamily("servelm:shadow_exact_agreement", "Share of mirrored requests whose shadow "
                                  "output equals the primary's.", labels=["model_name"])
        sim = GaugeMetricFamily("servelm:shadow_similarity", "Mean token-level similarity of shadow and primary "
                                "outputs.", labels=["model_name"])
        for name, m in s.mirrors.items():
            summ = m.stats.summary()
            if summ["exact_agreement"] is not None:
                agree.add_metric([name], summ["exact_agreement"])
                sim.add_metric([name], summ["similarity_mean"])
        yield agree
        yield sim
        psi = GaugeMetricFamily("servelm:drift_psi", "Population stability index, live against reference "
                                "window.", labels=["model_name", "feature"])
        alert = GaugeMetricFamily("servelm:drift_alert", "1 while a feature's drift is over its threshold.",
                                  labels=["model_name", "feature"])
        mmd = GaugeMetricFamily("servelm:drift_mmd2", "MMD^2 between the reference and live windows of prompt "
                                "embeddings (the last computed; a scrape never computes it).", labels=["model_name"])
        c_alert = GaugeMetricFamily("servelm:concept_drift_alert", "1 while a version's concept-drift signal "
                                    "(feedback, refusal_rate, empty_rate, finish_reasons) is over its threshold.",
                                    labels=["model_name", "model_version", "signal"])
        c_live = GaugeMetricFamily("servelm:concept_drift_live", "A version's live-window value of a concept "
                                   "signal: the refusal or empty-output rate, the feedback mean.",
                                   labels=["model_name", "model_version", "signal"])
        watch = getattr(s, "watch", None)
        for name in sorted(set(s.drift) | set(getattr(watch, "concept", {}))):
            # a copy: a scrape may run off the loop that feeds the windows; fresh=False: no MMD here (the loop)
            rep = s.drift_report(name, watch.snapshot(name), fresh=False)
            for feature, f in rep["features"].items():
                if "psi" in f:
                    psi.add_metric([name, feature], f["psi"])
                if f.get("evaluated"):
                    alert.add_metric([name, feature], 1.0 if f["alert"] else 0.0)
            if "mmd2" in rep["features"]["embedding"]:
                mmd.add_metric([name], rep["features"]["embedding"]["mmd2"])
            for ver, c in rep.get("concept", {}).items():
                for signal, f in c["signals"].items():
                    live = f.get("live_rate", f.get("live_mean"))
                    if live is not None:
                        c_live.add_metric([name, ver.lstrip("v"), signal], live)
                    if "p" in f or "live_mix" in f:
                        c_alert.add_metric([name, ver.lstrip("v"), signal], 1.0 if f["alert"] else 0.0)
        yield psi
        yield alert
        yield mmd
        yield c_alert
        yield c_live
