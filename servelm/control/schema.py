"""The control-plane database's schema: Alembic migrations (servelm/control/migrations), run to the newest
revision by `servelm db upgrade` or by a server at start.

Migrating holds a lock for its whole transaction (PostgreSQL: an advisory lock; SQLite: BEGIN IMMEDIATE), so
servers starting together on one database migrate it once; the others wait, then find it current. A
database made before servelm had migrations (no `alembic_version` table, some or all tables present) is
brought to the first revision by creating only what it lacks: nothing in it is lost.

`ensure()` is what every part that opens the database calls: when the database is already current it costs
one query and never imports Alembic (which a server's hot path does not need).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

from sqlalchemy import Connection, Engine, inspect, text

from servelm.control import db

# Every revision, oldest first; the last is the head this code needs. tests/control/test_schema.py checks it against
# the migrations folder, so a new revision must be listed here too.
REVISIONS = ("0001", "0002", "0003")
HEAD = REVISIONS[-1]
_PG_LOCK = 0x5E7E1A  # the advisory lock key of a migration (any constant no other code uses)
MIGRATIONS = Path(__file__).parent / "migrations"

_checked: weakref.WeakSet[Engine] = weakref.WeakSet()  # engines whose database is known to be current
_checked_lock = threading.Lock()


class SchemaError(RuntimeError):
    """The database's schema is not the one this code needs, and it may not (or cannot) be migrated here."""


def _version(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def _has_tables(conn: Connection) -> bool:
    return bool(set(inspect(conn).get_table_names()) & {"models", "versions", "audit", "traffic_records",
                                                         "predictions"})


def status(engine: Engine) -> dict:
    """Where the database stands: {"revision": its revision or None, "head": this code's, "state": one of
    current | behind | ahead | unversioned (tables made before migrations) | empty}."""
    with db.read(engine) as conn:
        rev = _version(conn)
        tables = rev is None and _has_tables(conn)
    if rev == HEAD:
        state = "current"
    elif rev in REVISIONS:
        state = "behind"
    elif rev is not None:
        state = "ahead"
    else:
        state = "unversioned" if tables else "empty"
    return {"revision": rev, "head": HEAD, "state": state}


def _alembic_config(conn: Connection):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def upgrade(engine: Engine, target: str = "head") -> tuple[str | None, str | None]:
    """Migrate to `target` (default: the newest revision) in one transaction under the migration lock; returns
    (revision before, revision after). SchemaError when the database is newer than this code."""
    from alembic import command

    with engine.connect() as conn:
        conn.execution_options(servelm_write=True)  # SQLite: BEGIN IMMEDIATE, the lock
        with conn.begin():
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK})")
            before = _version(conn)
            if before is not None and before not in REVISIONS:
                raise _ahead(engine, before)
            command.upgrade(_alembic_config(conn), target)
            after = _version(conn)
    with _checked_lock:
        if after == HEAD:
            _checked.add(engine)
    return before, after


def ensure(engine: Engine, *, migrate: bool = True) -> None:
    """Make sure the schema is current before the database is used: migrate it when `migrate`, else raise
    SchemaError naming `servelm db upgrade`. Checked once per engine."""
    with _checked_lock:
        if engine in _checked:
            return
    st = status(engine)
    if st["state"] == "ahead":
        raise _ahead(engine, st["revision"])
    if st["state"] != "current":
        if not migrate:
            where = {"behind": f"at revision {st['revision']}", "empty": "empty",
                     "unversioned": "made before schema migrations"}[st["state"]]
            raise SchemaError(f"the control database {_shown(engine)} is {where}; this servelm needs revision "
                              f"{HEAD}: run `servelm db upgrade` (with the same --database-url or --data-dir), "
                              "or start the server with --database-auto-upgrade")
        upgrade(engine)
    with _checked_lock:
        _checked.add(engine)


def _ahead(engine: Engine, rev: str) -> SchemaError:
    return SchemaError(f"the control database {_shown(engine)} is at revision {rev}, which this servelm does "
                       f"not know (its newest is {HEAD}): it was migrated by a newer servelm; run that version")


def _shown(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)
