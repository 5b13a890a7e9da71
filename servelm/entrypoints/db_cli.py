"""`servelm db upgrade` and `servelm db current`: the control-plane database's schema migrations.

The database is the one `servelm serve` would use, found the same way: --database-url, else
SERVELM_DATABASE_URL, else the config file's storage.database_url (precedence CLI > env > file), else SQLite in
the data directory.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_args(sub) -> None:
    db = sub.add_parser("db", help="the control-plane database's schema: upgrade it, or show its revision",
                        description="Schema migrations of the control-plane database (model registry, audit "
                        "trail, traffic policies, canary and experiment state, prediction log). A server "
                        "migrates it at start unless started with --no-database-auto-upgrade; with several "
                        "servers on one PostgreSQL database, run `servelm db upgrade` once before rolling them "
                        "out.")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="migrate the database to this servelm's newest revision (idempotent; "
                           "a database made before migrations keeps everything)")
    cur = db_sub.add_parser("current", help="print the database's revision and whether it needs an upgrade "
                            "(exit 1 when it does)")
    cur.add_argument("--json", action="store_true", help="print JSON")
    for p in (up, cur):
        p.add_argument("--database-url", default=argparse.SUPPRESS,
                       help="SQLAlchemy URL, e.g. postgresql+psycopg://USER:PASSWORD@HOST/DB (default: "
                       "$SERVELM_DATABASE_URL, the config file's, else SQLite in the data directory)")
        p.add_argument("--data-dir", default=argparse.SUPPRESS,
                       help="the server's data directory, whose registry.db is the database when no URL is given")
        p.add_argument("--config", default=None, metavar="FILE", help="the server's config file (also "
                       "SERVELM_CONFIG)")
    up.set_defaults(func=cmd_upgrade)
    cur.set_defaults(func=cmd_current)


def _target(args) -> tuple[str, bool]:
    """(SQLAlchemy URL, whether it is the data directory's SQLite file)."""
    from servelm.config.settings import load
    from servelm.control import db

    cli = {k: getattr(args, k) for k in ("database_url", "data_dir") if hasattr(args, k)}
    srv = load(cli, file=args.config).server
    url = srv.database()
    if url is not None:
        return url, False
    return db.default_url(srv.data_path()), True


def _open(url: str):
    from servelm.control import db

    try:
        return db.open_engine(url)
    except ImportError as e:  # a PostgreSQL URL without the postgres extra
        raise ValueError(f"cannot open {url.split('://')[0]}:// databases: {e} (pip install 'servelm[postgres]')") \
            from None


def _shown(url: str) -> str:
    from servelm.config.settings import redact_url

    return redact_url(url)


def cmd_upgrade(args: argparse.Namespace) -> int:
    from pathlib import Path

    from servelm.control import schema

    url, local = _target(args)
    if local:
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = _open(url)
    try:
        before, after = schema.upgrade(engine)
    except schema.SchemaError as e:
        print(f"servelm db upgrade: {e}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    if before == after:
        print(f"{_shown(url)}: already at revision {after} (the newest)")
    else:
        print(f"{_shown(url)}: upgraded from {before or 'no revision'} to {after}")
    return 0


def cmd_current(args: argparse.Namespace) -> int:
    from pathlib import Path

    from servelm.control import schema

    url, local = _target(args)
    if local and not Path(url.removeprefix("sqlite:///")).is_file():  # looking creates nothing
        st = {"revision": None, "head": schema.HEAD, "state": "missing"}
    else:
        engine = _open(url)
        try:
            st = schema.status(engine)
        finally:
            engine.dispose()
    if args.json:
        print(json.dumps({"url": _shown(url), **st}))
    else:
        what = {"current": "up to date",
                "behind": "behind: run `servelm db upgrade`",
                "ahead": "newer than this servelm (migrated by a newer version): run that version",
                "unversioned": "made before schema migrations: run `servelm db upgrade` (nothing is lost)",
                "empty": "empty: `servelm db upgrade` or a server's start creates the tables",
                "missing": "no database yet: `servelm db upgrade` or a server's start creates it"}[st["state"]]
        print(f"{_shown(url)}: revision {st['revision'] or 'none'} (this servelm's newest: {st['head']}); {what}")
    return 0 if st["state"] == "current" else 1
