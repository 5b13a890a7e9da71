"""`servelm models traffic ...` and `servelm models canary ...`: a model's traffic policy and canary rollouts
over the admin HTTP API (the client, tables and errors are models_cli's)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_args(sub: Any) -> None:
    tr = sub.add_parser("traffic", help="show or set NAME's traffic policy (split, sticky, header segments)")
    tr.add_argument("name")
    tr.add_argument("--set", action="append", default=[], metavar="VERSION=WEIGHT",
                    help="an arm of the split, e.g. --set 1=90 --set 2=10 (replaces the policy)")
    tr.add_argument("--sticky", action="store_true", help="the same user always gets the same version")
    tr.add_argument("--segment", action="append", default=[], metavar="HEADER=VALUE:VERSION",
                    help="requests with this header value go to VERSION, e.g. x-tier=beta:2 (repeatable)")
    tr.add_argument("--clear", action="store_true", help="remove the policy (back to the PRODUCTION version)")
    ca = sub.add_parser("canary", help="start, show or abort a canary rollout")
    ca.add_argument("action", choices=("start", "status", "abort"))
    ca.add_argument("model", metavar="NAME[:VERSION]", help="NAME:VERSION to start, NAME for status/abort")
    ca.add_argument("--steps", default="1,5,25,100", help="percent of traffic per step (default 1,5,25,100)")
    ca.add_argument("--min-requests", type=int, default=200, help="requests per version before a step ends")
    ca.add_argument("--min-seconds", type=float, default=300.0, help="seconds each step is held at least")
    ca.add_argument("--reason", default=None, help="why (abort)")


def _policy_text(p: dict) -> str:
    arms = ", ".join(f"v{a['version']}={a['weight']:g}" + (f" ({a['name']})" if a["name"] else "") for a in p["arms"])
    lines = [f"model   {p['model']}", f"split   {arms}{' sticky' if p['sticky'] else ''}"]
    lines += [f"segment {json.dumps({k: v for k, v in r.items() if v})}" for r in p["segments"]]
    if p.get("shadow"):
        lines.append(f"shadow  {json.dumps(p['shadow'])}")
    return "\n".join(lines)


def traffic(c: Any, a: argparse.Namespace, error: type[Exception]) -> int:
    path = f"/admin/models/{a.name}/traffic"
    if a.clear:
        c.call("DELETE", path)
        c.out({"cleared": a.name}, lambda d: f"{d['cleared']}: no traffic policy")
        return 0
    if not a.set:
        c.out(c.call("GET", path), _policy_text)
        return 0
    arms, segments = [], []
    for item in a.set:
        v, sep, w = item.partition("=")
        if not sep or not v.isdigit():
            raise error(f"--set {item!r}: give VERSION=WEIGHT, e.g. 2=10")
        arms.append({"version": int(v), "weight": float(w)})
    for item in a.segment:
        cond, sep, v = item.rpartition(":")
        h, eq, value = cond.partition("=")
        if not sep or not eq or not v.isdigit():
            raise error(f"--segment {item!r}: give HEADER=VALUE:VERSION, e.g. x-tier=beta:2")
        segments.append({"version": int(v), "name": value, "headers": {h: value}})
    body = {"arms": arms, "sticky": a.sticky, "segments": segments}
    c.out(c.call("PUT", path, body), _policy_text)
    return 0


def _canary_text(s: dict) -> str:
    cfg = s["config"]
    last = (s.get("last_decision") or {}).get("reasons") or []
    lines = [f"{s['model']}:{cfg['canary']} against {s['model']}:{cfg['production']}: {s['status']}, step "
             f"{s['step']} ({s['percent']:g}% of traffic)"]
    lines += [f"  {k}: {w['requests']} requests, {w['errors']} errors" for k, w in s["windows"].items()]
    lines += [f"  {h['action']} at step {h['step']}: {'; '.join(h['reasons'])}" for h in s["history"]]
    lines += [f"  now: {r}" for r in last]
    return "\n".join(lines)


def canary(c: Any, a: argparse.Namespace, error: type[Exception]) -> int:
    name, sep, ver = a.model.rpartition(":")
    if a.action == "start":
        if not sep or not ver.isdigit():
            raise error(f"{a.model!r}: give NAME:VERSION of the version to roll out")
        try:
            steps = [float(x) for x in a.steps.split(",")]
        except ValueError:
            raise error(f"--steps {a.steps!r}: give percents separated by commas, e.g. 1,5,25,100") from None
        body = {"version": int(ver), "steps": steps, "min_requests": a.min_requests, "min_seconds": a.min_seconds}
        c.out(c.call("POST", f"/admin/models/{name}/canary", body), _canary_text)
    elif a.action == "status":
        c.out(c.call("GET", f"/admin/models/{a.model}/canary"), _canary_text)
    else:
        c.out(c.call("POST", f"/admin/models/{a.model}/canary/abort", {"reason": a.reason}), _canary_text)
    return 0
