"""The deployment audit trail: append-only, hash-chained entries.

Each entry is (id, at, actor, action, target, before, after, prev_hash, hash) where hash = sha256 over the
canonical JSON of the entry's fields followed by the previous entry's hash. Changing, inserting or deleting
an entry anywhere but at the tip breaks the chain, which `verify()` walks. `prev_hash` is unique, so two
writers can never both extend the same tip (one of them retries).
"""

from __future__ import annotations

import hashlib
import json
import time

from sqlalchemy import JSON, Column, Connection, Engine, Float, Integer, MetaData, String, Table, Text, select

from servelm.control import db, schema

GENESIS = "0" * 64
metadata = MetaData()
entries_table = Table(
    "audit", metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("at", Float, nullable=False),
    Column("actor", String(200), nullable=False),
    Column("action", String(100), nullable=False),
    Column("target", String(300), nullable=False),
    Column("before", JSON),
    Column("after", JSON),
    Column("prev_hash", String(64), nullable=False, unique=True),
    Column("hash", Text, nullable=False),
)
_HASHED = ("id", "at", "actor", "action", "target", "before", "after")


def canonical(obj) -> bytes:
    """Key-sorted, compact JSON: the same bytes for the same values, however they were stored."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def entry_hash(entry: dict, prev_hash: str) -> str:
    """sha256 over the entry's canonical fields, then the previous entry's hash."""
    return hashlib.sha256(canonical({k: entry[k] for k in _HASHED}) + prev_hash.encode()).hexdigest()


class Audit:
    """The audit trail in the registry's database."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        schema.ensure(engine)

    def append(self, conn: Connection, actor: str, action: str, target: str, before=None, after=None) -> dict:
        """Add an entry inside the caller's transaction (so the change and its record commit together)."""
        tip = conn.execute(select(entries_table.c.id, entries_table.c.hash)
                           .order_by(entries_table.c.id.desc()).limit(1)).first()
        entry = {"id": (tip.id + 1) if tip else 1, "at": time.time(), "actor": actor, "action": action,
                 "target": target, "before": _plain(before), "after": _plain(after)}
        entry["prev_hash"] = tip.hash if tip else GENESIS
        entry["hash"] = entry_hash(entry, entry["prev_hash"])
        conn.execute(entries_table.insert().values(**entry))
        return entry

    def record(self, actor: str, action: str, target: str, before=None, after=None) -> dict:
        """Add an entry in its own transaction: for changes made outside the registry (deploy, scale,
        unload)."""
        def op() -> dict:
            with db.write(self.engine) as conn:
                return self.append(conn, actor, action, target, before, after)
        return db.retrying(op)

    def entries(self, target: str | None = None, since_id: int = 0, limit: int | None = None) -> list[dict]:
        """Entries in order (optionally those about one target, or after an id)."""
        q = select(entries_table).where(entries_table.c.id > since_id).order_by(entries_table.c.id)
        if target is not None:
            q = q.where(entries_table.c.target == target)
        if limit is not None:
            q = q.limit(limit)
        with db.read(self.engine) as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def verify(self) -> tuple[bool, int | None]:
        """Walk the chain: (True, None) when intact, else (False, id of the first entry that does not match
        its fields or does not link to the entry before it)."""
        prev = GENESIS
        with db.read(self.engine) as conn:
            for row in conn.execute(select(entries_table).order_by(entries_table.c.id)):
                e = dict(row._mapping)
                if e["prev_hash"] != prev or entry_hash(e, prev) != e["hash"]:
                    return False, e["id"]
                prev = e["hash"]
        return True, None


def _plain(value):
    """A JSON-safe copy (so what is hashed is exactly what the database hands back)."""
    return None if value is None else json.loads(canonical(value))
