"""Stored traffic-management records: each model's traffic policy, canary rollout and experiments, in the
registry's database, every change audited in the same transaction (so a change and its audit entry commit
together or not at all).

Records are the dict forms of `TrafficPolicy`, `CanaryController` and experiment definitions, keyed by
(kind, key): kind "policy", "canary" and "logmode" (a prediction-log mode set at run time) use the model name
as key, "experiment" the experiment's name.

Kind "state" holds what running things learned (canary and experiment windows, bandit posteriors), saved
every few seconds and at shutdown so a restart carries on from it: `save_state`/`load_state`, not audited
(it is statistics, not a change anyone made).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable

from sqlalchemy import JSON, Column, Engine, Float, MetaData, String, Table, select

from servelm.control import db, schema
from servelm.control.audit import Audit
from servelm.control.errors import InvalidRequest, NotFound
from servelm.control.traffic import TrafficPolicy

KINDS = ("policy", "canary", "experiment", "logmode")
metadata = MetaData()
records_table = Table(
    "traffic_records", metadata,
    Column("kind", String(32), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("record", JSON, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("updated_by", String(200), nullable=False),
)


class PolicyStore:
    """Traffic records in `engine` (the registry's), audited through `audit` (the registry's trail)."""

    def __init__(self, engine: Engine, audit: Audit) -> None:
        self.engine, self.audit = engine, audit
        # told of every audited change once it is committed, on the thread that made it: (kind, key, record or
        # None when removed, actor, action); the reconciler folds operators' changes into the model's spec
        self.on_change: Callable[[str, str, dict | None, str, str], None] | None = None
        schema.ensure(engine)

    def get(self, kind: str, key: str) -> dict | None:
        _check(kind)
        with db.read(self.engine) as conn:
            row = conn.execute(select(records_table.c.record).where(records_table.c.kind == kind,
                                                                    records_table.c.key == key)).first()
        return row.record if row else None

    def all(self, kind: str) -> dict[str, dict]:
        _check(kind)
        with db.read(self.engine) as conn:
            rows = conn.execute(select(records_table.c.key, records_table.c.record)
                                .where(records_table.c.kind == kind).order_by(records_table.c.key))
            return {r.key: r.record for r in rows}

    def put(self, kind: str, key: str, record: dict, actor: str, action: str | None = None) -> dict | None:
        """Create or replace a record; the audit entry holds before and after. Returns the previous one."""
        _check(kind)

        def op() -> dict | None:
            with db.write(self.engine) as conn:
                where = (records_table.c.kind == kind) & (records_table.c.key == key)
                row = conn.execute(select(records_table.c.record).where(where)).first()
                before = row.record if row else None
                values = {"record": record, "updated_at": time.time(), "updated_by": actor}
                if row:
                    conn.execute(records_table.update().where(where).values(**values))
                else:
                    conn.execute(records_table.insert().values(kind=kind, key=key, **values))
                self.audit.append(conn, actor, action or f"{kind}.set", f"{kind}:{key}", before, record)
                return before
        before = db.retrying(op)
        if self.on_change is not None:
            self.on_change(kind, key, record, actor, action or f"{kind}.set")
        return before

    def pseudonym(self, value: str) -> str:
        """sha256 of this registry's erasure secret + `value`: names a subject (an erased user) in the permanent
        audit trail without writing down who it was. The secret is made on first use, kept in this table
        (kind "secret", never audited, never served) and shared by every server on the registry, so the same
        user always maps to the same pseudonym; without the secret the id cannot be guessed back from it."""
        def op() -> str:
            with db.write(self.engine) as conn:
                where = (records_table.c.kind == "secret") & (records_table.c.key == "erasure")
                row = conn.execute(select(records_table.c.record).where(where)).first()
                if row is not None:
                    return row.record["secret"]
                made = secrets.token_hex(32)
                conn.execute(records_table.insert().values(kind="secret", key="erasure", record={"secret": made},
                                                           updated_at=time.time(), updated_by="system"))
                return made
        secret = db.retrying(op)
        return "sha256:" + hashlib.sha256((secret + "\0" + value).encode()).hexdigest()

    def save_state(self, records: dict[str, dict | None]) -> None:
        """Write (or, for None, remove) state records in one transaction, unaudited."""
        def op() -> None:
            with db.write(self.engine) as conn:
                for key, record in records.items():
                    where = (records_table.c.kind == "state") & (records_table.c.key == key)
                    conn.execute(records_table.delete().where(where))
                    if record is not None:
                        conn.execute(records_table.insert().values(kind="state", key=key, record=record,
                                                                   updated_at=time.time(), updated_by="system"))
        if records:
            db.retrying(op)

    def load_state(self) -> dict[str, dict]:
        """Every state record, by key."""
        with db.read(self.engine) as conn:
            rows = conn.execute(select(records_table.c.key, records_table.c.record)
                                .where(records_table.c.kind == "state"))
            return {r.key: r.record for r in rows}

    def delete(self, kind: str, key: str, actor: str) -> dict:
        """Remove a record (404 when absent); audited. Returns what was removed."""
        _check(kind)

        def op() -> dict:
            with db.write(self.engine) as conn:
                where = (records_table.c.kind == kind) & (records_table.c.key == key)
                row = conn.execute(select(records_table.c.record).where(where)).first()
                if row is None:
                    raise NotFound(f"no {kind} for {key!r}", code="not_found")
                conn.execute(records_table.delete().where(where))
                self.audit.append(conn, actor, f"{kind}.delete", f"{kind}:{key}", row.record, None)
                return row.record
        removed = db.retrying(op)
        if self.on_change is not None:
            self.on_change(kind, key, None, actor, f"{kind}.delete")
        return removed

    def set_policy(self, policy: TrafficPolicy, actor: str) -> None:
        """Store a model's traffic policy (validated by construction)."""
        self.put("policy", policy.model, policy.to_dict(), actor)

    def policy(self, model: str) -> TrafficPolicy | None:
        d = self.get("policy", model)
        return TrafficPolicy.from_dict(d) if d else None


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise InvalidRequest(f"unknown record kind {kind!r}; known: {', '.join(KINDS)}", code="invalid_kind")
