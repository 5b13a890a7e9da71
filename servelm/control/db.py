"""The control-plane database: an SQLAlchemy engine (SQLite by default; PostgreSQL to share one between
servers; any SQLAlchemy URL) and transactions. Its schema is kept by migrations (schema.py).

Every registry operation is one transaction. On SQLite a writing transaction starts with BEGIN IMMEDIATE, so
concurrent writers (threads, processes, servers sharing the file) queue on the database lock instead of
reading a state another writer is about to change. On PostgreSQL a writing transaction first takes one
transaction-level advisory lock, the same serialization across every server sharing the database: control
writes are few (admin operations, state checkpoints), and every one of them reads before it writes (the next
version number, the audit chain's tip), which READ COMMITTED alone would let two servers do at once. The
prediction log's appends, which only insert, skip that lock (`write(..., exclusive=False)`). Unique
constraints still catch any race, and the operation is retried (`retrying`), as it is after a deadlock or a
serialization failure.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

T = TypeVar("T")
RETRIES = 5
BUSY_TIMEOUT_S = 60  # SQLite: how long a writer waits for another's lock before its statement fails
CONNECT_TIMEOUT_S = 5  # PostgreSQL: a database that does not answer is an error after this long, not a hang
WRITE_LOCK = 0x5E7E1B  # PostgreSQL: the advisory lock key of a control write (any constant no other code uses)
# SQLSTATEs after which the whole transaction may simply run again: serialization failure, deadlock
_RETRY_STATES = frozenset({"40001", "40P01"})


def default_url(data_dir: Path) -> str:
    """SQLite in the data directory: no set-up."""
    return f"sqlite:///{Path(data_dir) / 'registry.db'}"


def engine_url(url: str) -> str:
    """`url` with a driver SQLAlchemy can load from the postgres extra: a bare postgresql:// (SQLAlchemy's
    default driver for it is psycopg2, which servelm does not install) means psycopg 3."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def open_engine(url: str) -> Engine:
    """An engine for `url`; for SQLite, one where BEGIN is ours (pysqlite's own handling is off), in WAL mode
    (readers never wait for the writer) and with a busy timeout (writers wait for each other). Elsewhere
    pooled connections are checked before use, so a database that restarted is reconnected to, not an error."""
    url = engine_url(url)
    if url.startswith("postgresql"):
        engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})

        @event.listens_for(engine, "begin")
        def _pg_begin(conn: Connection) -> None:
            if conn.get_execution_options().get("servelm_write", False) is True:
                # held until this transaction ends: PostgreSQL's counterpart of BEGIN IMMEDIATE
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITE_LOCK})")

        return engine
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # no implicit BEGIN from the driver: the listener below starts them
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
        _wal(cur)
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("servelm_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _wal(cur) -> None:
    """Puts an SQLite database in WAL mode, which the file keeps: once is enough. The switch needs the database
    to itself, and SQLite answers a connection that asks while another one holds it with "database is locked"
    at once, without the busy wait (seen when several servers or threads create the database together), so the
    loser looks again until the winner's switch shows, within the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@contextlib.contextmanager
def write(engine: Engine, exclusive: bool = True) -> Iterator[Connection]:
    """One writing transaction: committed on success, rolled back on any error. `exclusive`: serialized with
    every other exclusive write (see above); False for a transaction that only inserts or deletes rows whose
    keys decide any conflict (on SQLite every write is exclusive)."""
    with engine.connect() as conn:
        conn.execution_options(servelm_write=True if exclusive else "append")
        with conn.begin():
            yield conn


@contextlib.contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """One reading transaction (a consistent snapshot: SQLite's is, PostgreSQL's needs REPEATABLE READ, which a
    transaction that only reads never has to retry)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            yield conn


def retrying(op: Callable[[], T]) -> T:
    """Run `op` (which opens its own transaction) again when a concurrent writer took the same unique key
    first (a version number, the audit chain's tip), or the database chose this transaction as a deadlock's
    or serialization conflict's victim; the last failure is raised."""
    for attempt in range(RETRIES):
        try:
            return op()
        except (IntegrityError, OperationalError) as e:
            if attempt == RETRIES - 1 or not (isinstance(e, IntegrityError) or _sqlstate(e) in _RETRY_STATES):
                raise
    raise AssertionError("unreachable")


def _sqlstate(e: DBAPIError) -> str | None:
    return getattr(e.orig, "sqlstate", None) or getattr(e.orig, "pgcode", None)


def unavailable(e: BaseException) -> bool:
    """Whether `e` says the database cannot be reached (down, restarting, refusing connections) rather than
    that a statement was wrong: what a server answers with 503 instead of 500."""
    if not isinstance(e, DBAPIError):
        return False
    if e.connection_invalidated:
        return True
    state = _sqlstate(e) or ""
    # 08: connection exception; 57P01-57P03: the server is shutting down or starting up
    return isinstance(e, OperationalError) and (state.startswith("08") or state.startswith("57P") or not state)
