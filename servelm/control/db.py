"""The registry's database: an SQLAlchemy engine (SQLite by default, any SQLAlchemy URL) and transactions.

Every registry operation is one transaction. On SQLite a writing transaction starts with BEGIN IMMEDIATE, so
concurrent writers (threads, processes, servers sharing the file) queue on the database lock instead of
reading a state another writer is about to change; elsewhere (PostgreSQL) unique constraints catch the race
and the operation is retried (`retrying`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Connection, Engine, MetaData, Table, create_engine, event, inspect
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

T = TypeVar("T")
RETRIES = 5


def default_url(data_dir: Path) -> str:
    """SQLite in the data directory: no set-up."""
    return f"sqlite:///{Path(data_dir) / 'registry.db'}"


def open_engine(url: str) -> Engine:
    """An engine for `url`; for SQLite, one where BEGIN is ours (pysqlite's own handling is off), in WAL mode
    (readers never wait for the writer) and with a busy timeout (writers wait for each other)."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # no implicit BEGIN from the driver: the listener below starts them
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 60000")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("servelm_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


@contextlib.contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """One writing transaction: committed on success, rolled back on any error."""
    with engine.connect() as conn:
        conn.execution_options(servelm_write=True)
        with conn.begin():
            yield conn


@contextlib.contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """One reading transaction (a consistent snapshot)."""
    with engine.connect() as conn, conn.begin():
        yield conn


def create_tables(engine: Engine, metadata: MetaData) -> None:
    """Create what is missing, under the write lock: servers starting together on one new database do not
    both create the same table (elsewhere than SQLite, the loser of that race looks again)."""
    for attempt in range(2):
        try:
            with write(engine) as conn:
                metadata.create_all(conn)
            return
        except (OperationalError, ProgrammingError, IntegrityError):
            if attempt:
                raise


def add_missing_columns(engine: Engine, table: Table) -> list[str]:
    """Add the nullable columns of `table` that a database created by an older servelm lacks (create_all makes
    missing tables only), so an existing registry opens as it is; its rows read NULL there. Returns the columns
    added. A concurrent server adding the same column first is fine: it is looked for again."""
    added = []
    for attempt in range(2):
        have = {c["name"] for c in inspect(engine).get_columns(table.name)}
        missing = [c for c in table.columns if c.name not in have]
        if not missing:
            return added
        for col in missing:
            if not col.nullable or col.primary_key:
                raise RuntimeError(f"the {table.name} table lacks column {col.name}, which cannot be added to "
                                   "existing rows")
        try:
            with write(engine) as conn:
                for col in missing:
                    kind = col.type.compile(dialect=engine.dialect)
                    conn.exec_driver_sql(f'ALTER TABLE {table.name} ADD COLUMN {col.name} {kind}')
                    added.append(col.name)
        except (OperationalError, ProgrammingError):
            added.clear()
            if attempt:
                raise
    return added


def retrying(op: Callable[[], T]) -> T:
    """Run `op` (which opens its own transaction) again when a concurrent writer took the same unique key
    first (a version number, the audit chain's tip); the last failure is raised."""
    for attempt in range(RETRIES):
        try:
            return op()
        except IntegrityError:
            if attempt == RETRIES - 1:
                raise
    raise AssertionError("unreachable")
