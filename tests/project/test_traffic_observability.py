"""deploy/observability/traffic-{alerts.yaml,dashboard.json} parse and name only metrics the traffic service
exports (a renamed metric cannot silently break a panel or an alert)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import yaml
from prometheus_client import CollectorRegistry
from test_observability_files import METRIC, ROOT, _balanced

from servelm.server.observability.traffic_metrics import TrafficMetrics


def exported() -> set[str]:
    reg = CollectorRegistry()
    TrafficMetrics(reg, SimpleNamespace(canaries={}, mirrors={}, drift={}))
    names = set()
    for fam in reg.collect():
        names |= ({fam.name + "_total"} if fam.type == "counter" else
                  {fam.name + s for s in ("_bucket", "_sum", "_count")} if fam.type == "histogram" else {fam.name})
    return names


def test_traffic_alerts_use_exported_metrics():
    rules = [r for g in yaml.safe_load((ROOT / "traffic-alerts.yaml").read_text())["groups"] for r in g["rules"]]
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert {"ServelmCanaryRolledBack", "ServelmDriftDetected", "ServelmShadowDisagreement",
            "ServelmArmErrorBudgetFastBurn", "ServelmArmErrorBudgetSlowBurn", "ServelmConceptDrift",
            "ServelmEmbeddingDrift", "ServelmDriftEmbeddingsFailing"} <= alerts
    known = exported() | {r["record"] for r in rules if "record" in r}
    for r in rules:
        assert _balanced(r["expr"]), r
        used = set(METRIC.findall(r["expr"]))
        assert used and used <= known, f"{r.get('alert') or r.get('record')}: unknown {used - known}"


def test_traffic_dashboard_uses_exported_metrics():
    dash = json.loads((ROOT / "traffic-dashboard.json").read_text())
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            assert _balanced(t["expr"]), t
            used |= set(METRIC.findall(t["expr"]))
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 10
    assert used <= exported(), used - exported()
    for name in ("servelm:arm_requests_total", "servelm:canary_traffic_percent", "servelm:drift_psi",
                 "servelm:shadow_dropped_total", "servelm:concept_drift_live", "servelm:drift_mmd2"):
        assert name in used
