"""Deployment specs in the registry's database: one row per model name with its spec, a generation that
counts the changes made to the spec, and the status the reconciler last reported (so `servelm describe` on any
server sharing the database shows it). Every change of a spec is audited in its own transaction ("spec.apply",
"spec.delete", target "spec:<name>"); status writes are not (they are observations, not changes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import JSON, Column, Engine, Float, Integer, MetaData, String, Table, select

from servelm.control import db, schema
from servelm.control.audit import Audit
from servelm.control.errors import NotFound
from servelm.control.spec import DeploymentSpec

metadata = MetaData()
specs_table = Table(
    "deployment_specs", metadata,
    Column("name", String(128), primary_key=True),
    Column("spec", JSON, nullable=False),
    Column("generation", Integer, nullable=False),
    Column("status", JSON, nullable=True),
    Column("updated_at", Float, nullable=False),
    Column("updated_by", String(200), nullable=False),
)


@dataclass(frozen=True)
class StoredSpec:
    spec: DeploymentSpec
    generation: int  # 1 for a new spec, one more for each change
    status: dict | None
    updated_at: float
    updated_by: str

    def to_dict(self) -> dict:
        return {"name": self.spec.name, "generation": self.generation, "spec": self.spec.to_dict(),
                "status": self.status, "updated_at": self.updated_at, "updated_by": self.updated_by}


class SpecStore:
    """The specs in `engine` (the registry's), changes audited through `audit` (the registry's trail)."""

    def __init__(self, engine: Engine, audit: Audit) -> None:
        self.engine, self.audit = engine, audit
        schema.ensure(engine)

    def get(self, name: str) -> StoredSpec | None:
        with db.read(self.engine) as conn:
            row = conn.execute(select(specs_table).where(specs_table.c.name == name)).first()
        return _stored(row) if row is not None else None

    def require(self, name: str) -> StoredSpec:
        found = self.get(name)
        if found is None:
            raise NotFound(f"no deployment spec for {name!r}; specs: {', '.join(self.names()) or 'none'}",
                           code="spec_not_found", param="name")
        return found

    def names(self) -> list[str]:
        with db.read(self.engine) as conn:
            return list(conn.execute(select(specs_table.c.name).order_by(specs_table.c.name)).scalars())

    def all(self) -> list[StoredSpec]:
        with db.read(self.engine) as conn:
            rows = conn.execute(select(specs_table).order_by(specs_table.c.name)).all()
        return [_stored(r) for r in rows]

    def put(self, spec: DeploymentSpec, actor: str, action: str = "spec.apply") -> StoredSpec:
        """Store `spec` as its model's desired state. The generation goes up only when the spec changes, so
        applying the same file again is a no-op (nothing audited)."""
        def op() -> StoredSpec:
            with db.write(self.engine) as conn:
                where = specs_table.c.name == spec.name
                row = conn.execute(select(specs_table).where(where)).first()
                new = spec.to_dict()
                if row is not None and row.spec == new:
                    return _stored(row)
                now = time.time()
                generation = 1 if row is None else row.generation + 1
                values = {"spec": new, "generation": generation, "updated_at": now, "updated_by": actor}
                if row is None:
                    conn.execute(specs_table.insert().values(name=spec.name, status=None, **values))
                else:
                    conn.execute(specs_table.update().where(where).values(**values))
                self.audit.append(conn, actor, action, f"spec:{spec.name}", row.spec if row else None,
                                  {**new, "generation": generation})
                return StoredSpec(spec, generation, row.status if row else None, now, actor)
        return db.retrying(op)

    def delete(self, name: str, actor: str) -> StoredSpec:
        """Forget a spec (404 when there is none); what it deployed stays as it is."""
        def op() -> StoredSpec:
            with db.write(self.engine) as conn:
                where = specs_table.c.name == name
                row = conn.execute(select(specs_table).where(where)).first()
                if row is None:
                    raise NotFound(f"no deployment spec for {name!r}", code="spec_not_found",
                                   param="name")
                conn.execute(specs_table.delete().where(where))
                self.audit.append(conn, actor, "spec.delete", f"spec:{name}", row.spec, None)
                return _stored(row)
        return db.retrying(op)

    def save_status(self, name: str, status: dict) -> None:
        """The reconciler's report for `name` (nothing when the spec was deleted meanwhile)."""
        def op() -> None:
            with db.write(self.engine, exclusive=False) as conn:
                conn.execute(specs_table.update().where(specs_table.c.name == name).values(status=status))
        db.retrying(op)


def _stored(row) -> StoredSpec:
    return StoredSpec(DeploymentSpec.from_dict(row.spec), row.generation, row.status, row.updated_at,
                      row.updated_by)
