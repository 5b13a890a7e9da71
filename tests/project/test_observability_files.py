"""The Grafana dashboard and Prometheus rules in deploy/observability parse, and every metric they name is one the
server exports (so a renamed metric cannot silently break a dashboard or an alert)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from servelm.server.observability.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "observability"
METRIC = re.compile(r"servelm:[A-Za-z0-9_:]+")


def exported_names() -> set[str]:
    names = set()
    for fam in Metrics("m").registry.collect():
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(fam.name)
    return names


def _balanced(expr: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in re.sub(r'"[^"]*"', "", expr):
        if ch in depth:
            depth[ch] += 1
        elif ch in pairs:
            depth[pairs[ch]] -= 1
            if depth[pairs[ch]] < 0:
                return False
    return not any(depth.values())


def test_alert_rules_parse_and_use_exported_metrics():
    doc = yaml.safe_load((ROOT / "prometheus-alerts.yaml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert {"ServelmErrorBudgetFastBurn", "ServelmHighErrorRate", "ServelmTTFTP99High",
            "ServelmQueueDepthHigh"} <= set(alerts)
    assert "0.001" in alerts["ServelmErrorBudgetFastBurn"]["expr"]  # 99.9% SLO
    known = exported_names() | recorded
    for r in rules:
        assert _balanced(r["expr"]), r
        assert ("alert" in r) != ("record" in r)
        used = set(METRIC.findall(r["expr"]))
        assert used, r
        assert used <= known, f"{r.get('alert') or r.get('record')}: unknown {used - known}"
        if "alert" in r:
            assert r["labels"]["severity"] in ("page", "ticket") and r["annotations"]["summary"]


def test_dashboard_parses_and_uses_exported_metrics():
    dash = json.loads((ROOT / "grafana-dashboard.json").read_text())
    exported = exported_names()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 15 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    used = set()
    for e in exprs:
        assert _balanced(e), e
        used |= set(METRIC.findall(e))
    assert used <= exported, used - exported
    # the dashboard covers the main signals
    for name in ("servelm:time_to_first_token_seconds_bucket", "servelm:requests_total",
                 "servelm:num_requests_waiting_by_priority", "servelm:kv_cache_usage_perc"):
        assert name in used
