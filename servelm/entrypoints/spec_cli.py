"""`servelm apply -f FILE`, `servelm get deployments`, `servelm describe NAME`: deployment specs over a running
server's admin API (the same --url, --admin-key-file, --json and client as `servelm models`). A file is checked
here first (YAML or JSON: one spec, a list, or {deployments: [...]}), so a mistake is reported before anything
is sent; then each spec is PUT, and the server's reconciler drives the deployments to it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servelm.entrypoints.models_cli import CliError, _add_shared, _Client, table


def add_args(sub) -> None:
    ap = sub.add_parser("apply", help="store deployment specs from a YAML or JSON file on a running server",
                        description="Store each deployment spec of the files on a running server (its admin API); "
                        "its reconciler then deploys, scales and routes to match. Applying the same file again "
                        "changes nothing.")
    ap.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                    help="a YAML or JSON file of specs ('-': standard input; repeatable)")
    _add_shared(ap, defaults=True)
    ap.set_defaults(func=cmd_apply)
    gp = sub.add_parser("get", help="list the deployment specs and whether each is ready")
    gp.add_argument("what", choices=("deployments",))
    _add_shared(gp, defaults=True)
    gp.set_defaults(func=cmd_get)
    dp = sub.add_parser("describe", help="a deployment spec with its status conditions and deployments")
    dp.add_argument("name")
    _add_shared(dp, defaults=True)
    dp.set_defaults(func=cmd_describe)


def _run(fn, args: argparse.Namespace) -> int:
    try:
        return fn(_Client(args), args)
    except CliError as e:
        print(f"servelm: error: {e}", file=sys.stderr)
        return 1


def cmd_apply(args: argparse.Namespace) -> int:
    from servelm.control.errors import ControlError
    from servelm.control.spec import parse_text

    specs = []
    for name in args.filename:
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text()
            specs += parse_text(text, "standard input" if name == "-" else name)
        except OSError as e:
            print(f"servelm: error: cannot read {name}: {e.strerror}", file=sys.stderr)
            return 2
        except ControlError as e:
            print(f"servelm: error: {e.message}", file=sys.stderr)
            return 2

    def apply(c: _Client, a: argparse.Namespace) -> int:
        done = []
        for spec in specs:
            before = _generation(c, spec.name)
            stored = c.call("PUT", f"/admin/specs/{spec.name}", spec.to_dict())
            outcome = "created" if before is None else "unchanged" if before == stored["generation"] else "configured"
            done.append({"name": spec.name, "generation": stored["generation"], "outcome": outcome})
        c.out(done, lambda rows: "\n".join(f"{r['name']} {r['outcome']} (generation {r['generation']})"
                                           for r in rows))
        return 0
    return _run(apply, args)


def _generation(c: _Client, name: str) -> int | None:
    try:
        return c.call("GET", f"/admin/specs/{name}")["generation"]
    except CliError as e:
        if "(HTTP 404)" in str(e):
            return None
        raise


def _condition(status: dict | None, kind: str) -> dict:
    return next((c for c in (status or {}).get("conditions") or [] if c["type"] == kind), {})


def _row(s: dict) -> dict:
    spec, status = s["spec"], s.get("status") or {}
    versions = " ".join(f"v{v['version']}={v['weight']:g}" for v in spec["versions"])
    if spec.get("canary"):
        versions += f" canary=v{spec['canary']['version']}"
    workers = f"{spec['workers']}" if spec["min_workers"] == spec["max_workers"] else \
        f"{spec['workers']} ({spec['min_workers']}-{spec['max_workers']})"
    ready = _condition(status, "Ready")
    return {"name": s["name"], "generation": s["generation"], "observed": status.get("observed_generation"),
            "ready": ready.get("status", "Unknown"), "reason": ready.get("reason"),
            "progressing": _condition(status, "Progressing").get("status", "Unknown"),
            "degraded": _condition(status, "Degraded").get("status", "Unknown"), "versions": versions,
            "workers": workers}


def cmd_get(args: argparse.Namespace) -> int:
    def get(c: _Client, a: argparse.Namespace) -> int:
        c.out(c.call("GET", "/admin/specs"), lambda rows: table([_row(s) for s in rows], [
            "name", "generation", "observed", "ready", "progressing", "degraded", "versions", "workers", "reason"]))
        return 0
    return _run(get, args)


def _describe_text(s: dict) -> str:
    import yaml

    status = s.get("status") or {}
    lines = [f"Name:         {s['name']}", f"Generation:   {s['generation']} (observed: "
             f"{status.get('observed_generation')})", f"Updated by:   {s['updated_by']}", "Spec:"]
    lines += ["  " + line for line in yaml.safe_dump(s["spec"], sort_keys=False).rstrip().splitlines()]
    lines += ["Conditions:", table(status.get("conditions") or [], ["type", "status", "reason", "message"])]
    lines += ["Deployments:", table(status.get("deployments") or [], ["id", "version", "workers", "ready"])]
    if status.get("canary"):
        c = status["canary"]
        lines.append(f"Canary:       v{c['version']} {c['status']}, step {c['step']} ({c['percent']:g}% of traffic)")
    return "\n".join(lines)


def cmd_describe(args: argparse.Namespace) -> int:
    def describe(c: _Client, a: argparse.Namespace) -> int:
        c.out(c.call("GET", f"/admin/specs/{a.name}"), _describe_text)
        return 0
    return _run(describe, args)
