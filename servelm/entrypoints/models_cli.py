"""`servelm models ...`: the model platform's admin API from a terminal (register, promote, deploy, scale,
roll back, read the audit trail). It talks HTTP to a running server: --url (or $SERVELM_URL) and the admin key
(--admin-key-file, or $SERVELM_ADMIN_KEY). Tables for people, --json for scripts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from servelm.config import env
from servelm.entrypoints import traffic_cli

PROMOTION_PATH = ("VALIDATED", "STAGING", "STAGING_TESTED", "CANARY", "PRODUCTION")


class CliError(Exception):
    """The server refused, or could not be reached: printed as one line, exit 1."""


def _add_shared(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The options of every `servelm models` command. They go on `models` itself with their defaults, and on
    each subcommand with none (SUPPRESS), so `models --url X list` and `models list --url X` both work: a value
    given after the subcommand wins, and one left out there does not overwrite the one given before it."""
    def default(value):
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--url", default=default(env.server_url()),
                   help="the server's base URL (default: $SERVELM_URL or http://127.0.0.1:8000)")
    p.add_argument("--admin-key-file", default=default(None),
                   help="file holding the admin key (else $SERVELM_ADMIN_KEY)")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print the server's JSON instead of a table")
    p.add_argument("--timeout", type=float, default=default(600.0),
                   help="seconds to wait for one call (loading is slow)")


def add_args(p: argparse.ArgumentParser) -> None:
    _add_shared(p, defaults=True)
    sub = p.add_subparsers(dest="models_command", required=True)

    reg = sub.add_parser("register", help="import a model folder or .gguf file as the next version of NAME")
    reg.add_argument("name")
    reg.add_argument("path")
    reg.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="a label (repeatable)")
    reg.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                     help="an engine setting for this version's workers, e.g. max_num_seqs=64 (repeatable)")
    reg.add_argument("--golden", action="append", default=None, metavar="PROMPT",
                     help="a golden prompt run by validation (repeatable; default: a smoke set)")
    reg.add_argument("--validate", action="store_true", help="validate it right away")
    reg.add_argument("--base", default=None, metavar="BASE:VERSION",
                     help="PATH is a PEFT LoRA adapter of this generation model version: registered as a version "
                          "of kind lora, deployed into its base's workers")

    sub.add_parser("list", help="every model, its PRODUCTION version and its versions")
    show = sub.add_parser("show", help="a model's versions, or one version (NAME:VERSION) in full")
    show.add_argument("model")
    val = sub.add_parser("validate", help="run validation: REGISTERED -> VALIDATED or FAILED")
    val.add_argument("model", metavar="NAME:VERSION")
    tr = sub.add_parser("transition", help="move a version to one lifecycle state")
    tr.add_argument("model", metavar="NAME:VERSION")
    tr.add_argument("state")
    tr.add_argument("--reason", default=None)
    pr = sub.add_parser("promote", help="walk a version up VALIDATED -> STAGING -> STAGING_TESTED -> CANARY -> "
                        "PRODUCTION to --to (default PRODUCTION); into PRODUCTION its deployment swaps to it")
    pr.add_argument("model", metavar="NAME:VERSION")
    pr.add_argument("--to", default="PRODUCTION", choices=PROMOTION_PATH[1:])
    pr.add_argument("--reason", default=None)
    rb = sub.add_parser("rollback", help="put NAME's previous PRODUCTION version back (zero-downtime swap)")
    rb.add_argument("name")
    rb.add_argument("--reason", default=None)
    de = sub.add_parser("delete", help="delete a version that is neither active nor deployed")
    de.add_argument("model", metavar="NAME:VERSION")

    dep = sub.add_parser("deploy", help="serve a version with N workers")
    dep.add_argument("model", metavar="NAME[:VERSION]")
    dep.add_argument("--workers", type=int, default=1)
    dep.add_argument("--strategy", default="least_loaded",
                     choices=["round_robin", "least_loaded", "memory_aware", "prefix_aware"])
    dep.add_argument("--keep-alive", type=float, default=None, help="unload after this many idle seconds")
    dep.add_argument("--id", default=None, help="the deployment's id (default: NAME-vVERSION)")
    dep.add_argument("--enable-lora", action="store_true",
                     help="its workers take LoRA adapters: adapter versions of this version deploy into them")
    sub.add_parser("deployments", help="every deployment and its workers")
    sc = sub.add_parser("scale", help="change a deployment's number of workers (scaling down drains)")
    sc.add_argument("id")
    sc.add_argument("workers", type=int)
    sw = sub.add_parser("swap", help="serve another version on a deployment (zero downtime)")
    sw.add_argument("id")
    sw.add_argument("version", help="a version number, or NAME:VERSION")
    un = sub.add_parser("unload", help="drain a deployment and stop its workers")
    un.add_argument("id")

    au = sub.add_parser("audit", help="the audit trail, with its hash chain verified (exit 1 if broken)")
    au.add_argument("--target", default=None, help="only entries about this model version or deployment")
    au.add_argument("--limit", type=int, default=50, help="the last N entries (default 50)")
    gc = sub.add_parser("gc", help="delete old versions beyond the newest N per model (kept: active, deployed)")
    gc.add_argument("--keep-last", type=int, required=True)
    traffic_cli.add_args(sub)
    for command in sub.choices.values():
        _add_shared(command, defaults=False)
    p.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.models_command](_Client(args), args)
    except CliError as e:
        print(f"servelm: error: {e}", file=sys.stderr)
        return 1


class _Client:
    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        key = Path(args.admin_key_file).read_text().strip() if args.admin_key_file else \
            env.admin_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout)
        self.json = args.json

    def call(self, method: str, path: str, body: dict | None = None, params: dict | None = None):
        import httpx

        try:
            r = self.http.request(method, path, json=body, params=params)
        except httpx.HTTPError as e:
            raise CliError(f"cannot reach {self.http.base_url}: {e}") from e
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500] or r.reason_phrase
            raise CliError(f"{message} (HTTP {r.status_code})")
        return r.json() if r.content else None

    def out(self, data, table) -> None:
        print(json.dumps(data, indent=2) if self.json else table(data))


def _ref(model: str) -> tuple[str, int]:
    name, sep, ver = model.rpartition(":")
    if not sep or not ver.isdigit():
        raise CliError(f"{model!r}: give NAME:VERSION, e.g. smol:2")
    return name, int(ver)


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise CliError(f"{what} {item!r}: give KEY=VALUE")
        try:
            out[k] = json.loads(v) if what == "--engine" else v
        except ValueError:
            out[k] = v  # a plain string setting
    return out


def table(rows: list[dict], cols: list[str]) -> str:
    """Columns padded to their widest cell."""
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


_VERSION_COLS = ["ref", "state", "kind", "base", "architecture", "dtype", "size_bytes", "created_by", "failure"]
_DEPLOY_COLS = ["id", "ref", "workers", "strategy", "ready", "in_flight", "base_deployment"]


def _version_table(v: dict) -> str:
    return "\n".join(f"{k:15} {json.dumps(v[k]) if isinstance(v[k], (dict, list)) else v[k]}" for k in v)


def _register(c: _Client, a) -> int:
    body = {"name": a.name, "path": str(Path(a.path).expanduser().resolve()), "labels": _pairs(a.label, "--label"),
            "engine": _pairs(a.engine, "--engine"), "golden_prompts": a.golden, "validate": a.validate}
    if a.base is not None:
        body["base"] = a.base
    c.out(c.call("POST", "/admin/models", body), _version_table)
    return 0


def _list(c: _Client, a) -> int:
    models = c.call("GET", "/admin/models")
    c.out(models, lambda ms: table([{"name": m["name"], "production": m["production"], "versions": len(m["versions"]),
                                     "latest": m["versions"][-1]["ref"] if m["versions"] else None,
                                     "latest_state": m["versions"][-1]["state"] if m["versions"] else None}
                                    for m in ms], ["name", "production", "versions", "latest", "latest_state"]))
    return 0


def _show(c: _Client, a) -> int:
    name, sep, ver = a.model.rpartition(":")
    if sep and ver.isdigit():
        c.out(c.call("GET", f"/admin/models/{name}/versions/{ver}"), _version_table)
    else:
        c.out(c.call("GET", f"/admin/models/{a.model}"), lambda m: table(m["versions"], _VERSION_COLS))
    return 0


def _validate(c: _Client, a) -> int:
    name, ver = _ref(a.model)
    v = c.call("POST", f"/admin/models/{name}/versions/{ver}/validate")
    c.out(v, _version_table)
    return 0 if v["state"] == "VALIDATED" else 1


def _transition(c: _Client, a) -> int:
    name, ver = _ref(a.model)
    body = {"state": a.state.upper(), "reason": a.reason}
    c.out(c.call("POST", f"/admin/models/{name}/versions/{ver}/transition", body), _version_table)
    return 0


def _promote(c: _Client, a) -> int:
    name, ver = _ref(a.model)
    v = c.call("GET", f"/admin/models/{name}/versions/{ver}")
    steps = list(PROMOTION_PATH[PROMOTION_PATH.index(v["state"]) + 1:PROMOTION_PATH.index(a.to) + 1]) \
        if v["state"] in PROMOTION_PATH[:PROMOTION_PATH.index(a.to)] else [a.to]
    for state in steps:  # each step is its own audited transition; the server refuses an illegal one (409)
        t0 = time.monotonic()
        v = c.call("POST", f"/admin/models/{name}/versions/{ver}/transition", {"state": state, "reason": a.reason})
        if not c.json:
            print(f"{v['ref']} -> {state} ({time.monotonic() - t0:.1f}s)")
    if c.json:
        c.out(v, _version_table)
    return 0


def _rollback(c: _Client, a) -> int:
    v = c.call("POST", f"/admin/models/{a.name}/rollback", {"reason": a.reason})
    c.out(v, lambda v: f"{a.name} rolled back: {v['ref']} is PRODUCTION again")
    return 0


def _delete(c: _Client, a) -> int:
    name, ver = _ref(a.model)
    c.call("DELETE", f"/admin/models/{name}/versions/{ver}")
    c.out({"deleted": f"{name}:{ver}"}, lambda d: f"deleted {d['deleted']}")
    return 0


def _deploy(c: _Client, a) -> int:
    body = {"model": a.model, "workers": a.workers, "strategy": a.strategy, "keep_alive_s": a.keep_alive, "id": a.id}
    if a.enable_lora:
        body["enable_lora"] = True
    c.out(c.call("POST", "/admin/deployments", body), lambda d: table([d], _DEPLOY_COLS))
    return 0


def _deployments(c: _Client, a) -> int:
    c.out(c.call("GET", "/admin/deployments"), lambda ds: table(ds, _DEPLOY_COLS))
    return 0


def _scale(c: _Client, a) -> int:
    c.out(c.call("PATCH", f"/admin/deployments/{a.id}", {"workers": a.workers}), lambda d: table([d], _DEPLOY_COLS))
    return 0


def _swap(c: _Client, a) -> int:
    c.out(c.call("POST", f"/admin/deployments/{a.id}/swap", {"version": a.version}),
          lambda d: table([d], _DEPLOY_COLS))
    return 0


def _unload(c: _Client, a) -> int:
    c.call("DELETE", f"/admin/deployments/{a.id}")
    c.out({"unloaded": a.id}, lambda d: f"unloaded {d['unloaded']}")
    return 0


def _audit(c: _Client, a) -> int:
    data = c.call("GET", "/admin/audit", params={k: v for k, v in {"target": a.target, "limit": a.limit}.items()
                                                 if v is not None})

    def show(d: dict) -> str:
        rows = [{**e, "at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at"])),
                 "after": json.dumps(e["after"])[:60] if e["after"] is not None else None} for e in d["entries"]]
        chain = "chain verified" if d["ok"] else f"CHAIN BROKEN at entry {d['first_bad_id']}"
        return table(rows, ["id", "at", "actor", "action", "target", "after"]) + f"\n{chain}"
    c.out(data, show)
    return 0 if data["ok"] else 1


def _gc(c: _Client, a) -> int:
    c.out(c.call("POST", "/admin/gc", {"keep_last": a.keep_last}),
          lambda d: "removed: " + (", ".join(d["removed"]) or "nothing"))
    return 0


_COMMANDS = {"register": _register, "list": _list, "show": _show, "validate": _validate, "transition": _transition,
             "promote": _promote, "rollback": _rollback, "delete": _delete, "deploy": _deploy,
             "deployments": _deployments, "scale": _scale, "swap": _swap, "unload": _unload, "audit": _audit,
             "gc": _gc, "traffic": lambda c, a: traffic_cli.traffic(c, a, CliError),
             "canary": lambda c, a: traffic_cli.canary(c, a, CliError)}
