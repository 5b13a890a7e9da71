"""The model registry: models, their versions and artifacts, lifecycle and audit, in one SQLAlchemy database.

Every operation is one transaction that also writes its audit entry, so a change and its record commit
together or not at all. SQLite in the data directory by default; any SQLAlchemy URL (e.g. PostgreSQL, for
several servers sharing one registry). Artifacts live in the content-addressed store beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Connection,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    select,
)

from servelm.config.engine import ENGINE_FIELDS, ConfigError, EngineConfig
from servelm.control import checkpoint, db, lifecycle, schema
from servelm.control.audit import Audit
from servelm.control.errors import Conflict, InvalidRequest, NotFound
from servelm.control.store import ArtifactStore, size_bytes
from servelm.control.types import MAX_VERSION, Kind, ModelVersion, State

T = TypeVar("T")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # no ':' (name:version pins a version)

metadata = MetaData()
models_table = Table(
    "models", metadata,
    Column("name", String(128), primary_key=True),
    Column("next_version", Integer, nullable=False),  # never reused, even after a delete
    Column("created_at", Float, nullable=False),
)
versions_table = Table(
    "versions", metadata,
    Column("name", String(128), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("state", String(32), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("artifact", Text, nullable=False),
    Column("sha256", String(64), nullable=False, index=True),
    Column("source", Text, nullable=False),
    Column("architecture", String(200)),
    Column("dtype", String(64)),
    Column("size_bytes", BigInteger, nullable=False),
    Column("num_params", BigInteger),
    Column("created_by", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("labels", JSON, nullable=False),
    Column("engine", JSON, nullable=False),
    Column("golden_prompts", JSON, nullable=False),
    Column("golden_outputs", JSON, nullable=False),
    Column("failure", Text),
    Column("replaces", Integer),  # the PRODUCTION version this one replaced when promoted (rollback target)
    Column("state_since", Float, nullable=False),
    # a LoRA adapter's base version (name:version); migration 0002 adds it to older databases, their rows NULL
    Column("base", String(300)),
)
deployments_table = Table(
    "deployments", metadata,
    Column("id", String(200), primary_key=True),
    Column("name", String(128)),
    Column("version", Integer),
    Column("record", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
)
_FIELDS = [f.name for f in dataclasses.fields(ModelVersion)]


def _to_version(row) -> ModelVersion:
    d = {k: row._mapping[k] for k in _FIELDS}
    d["state"], d["kind"] = State(d["state"]), Kind(d["kind"])
    return ModelVersion(**d)


def _row(mv: ModelVersion) -> dict:
    d = dataclasses.asdict(mv)
    d["state"], d["kind"] = mv.state.value, mv.kind.value
    return d


def _check_inputs(name: str, labels: dict | None, engine: dict | None) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequest(f"invalid model name {name!r}: use letters, digits, '.', '_' or '-' (at most 128, "
                             "no ':')", code="invalid_name", param="name")
    if labels is not None and not (isinstance(labels, dict)
                                   and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
        raise InvalidRequest("labels must map strings to strings", code="invalid_labels", param="labels")
    if engine:
        fields = set(ENGINE_FIELDS) - {"model", "gguf_file"}
        unknown = sorted(set(engine) - fields)
        if unknown:
            raise InvalidRequest(f"unknown engine settings {unknown}; known: {', '.join(sorted(fields))}",
                                 code="invalid_engine", param="engine")
        try:
            EngineConfig().replace(**engine)
        except (ConfigError, TypeError) as e:
            raise InvalidRequest(f"invalid engine settings: {e}", code="invalid_engine", param="engine") from e


class Registry:
    """Models, versions, lifecycle, deployment records and the audit trail (`self.audit`).

    Its methods block on the database (and the artifact store): async code runs them with `await
    registry.io(fn, ...)`, on the registry's one writer thread, so they never stall the event loop and
    changes are applied in the order they were asked for. `production(name)` is answered from memory: every
    lifecycle write made through this object refreshes it (a server resolves requests without a query).
    """

    def __init__(self, url: str | None, data_dir: Path, *, migrate: bool = True) -> None:
        self.data_dir = Path(data_dir).expanduser()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.url = url or db.default_url(self.data_dir)
        self.engine = db.open_engine(self.url)
        try:
            schema.ensure(self.engine, migrate=migrate)  # SchemaError when it is not current and may not migrate
        except BaseException:
            self.engine.dispose()
            raise
        self.audit = Audit(self.engine)
        self.store = ArtifactStore(self.data_dir / "artifacts")
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="servelm-registry")
        self._prod_lock = threading.Lock()  # guards _prod (held for a dict access only)
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._prod: dict[str, ModelVersion] = {}  # name -> its PRODUCTION version (absent: none)
        self._refresh_production()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.engine.dispose()

    async def io(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` (a registry or audit method) on the registry's writer thread, in call order."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _refresh_production(self, names: list[str] | None = None) -> None:
        """Re-read the PRODUCTION versions of `names` (None: every model) after a write that committed. One
        refresh at a time, so of two the later one (which read after both commits) is what stays; readers wait
        only for the dict update, never for the query."""
        with self._refresh_lock:
            query = select(versions_table).where(versions_table.c.state == State.PRODUCTION.value)
            if names is not None:
                query = query.where(versions_table.c.name.in_(names))
            with db.read(self.engine) as conn:
                found = {mv.name: mv for mv in map(_to_version, conn.execute(query))}
            self._install(found, names)

    def refresh(self) -> None:
        """Re-read every model's PRODUCTION version: what other servers sharing the database promoted or rolled
        back (the server calls it every registry_refresh_s)."""
        self._refresh_production(None)

    def _install(self, found: dict[str, ModelVersion], names: list[str] | None) -> None:
        with self._prod_lock:
            if names is None:
                self._prod = found
            else:
                for n in names:
                    if n in found:
                        self._prod[n] = found[n]
                    else:
                        self._prod.pop(n, None)

    def _write(self, op: Callable[[Connection], T]) -> T:
        """Run `op` in one writing transaction, again if a concurrent writer took a unique key first."""
        def attempt() -> T:
            with db.write(self.engine) as conn:
                return op(conn)
        return db.retrying(attempt)

    def _changing_states(self, op: Callable[[Connection], T], names: list[str] | None) -> T:
        """A lifecycle write: `op` in one transaction, then the cached PRODUCTION versions of `names` (None:
        all) refreshed, whether it succeeded or not (a failed commit may still have been applied elsewhere)."""
        try:
            return self._write(op)
        finally:
            self._refresh_production(names)

    # -- reading ----------------------------------------------------------------------------------
    def _find(self, conn: Connection, name: str, version: int) -> ModelVersion | None:
        if not 0 < version <= MAX_VERSION:  # no such version; SQLite would overflow on a huge one
            return None
        row = conn.execute(select(versions_table).where(versions_table.c.name == name,
                                                        versions_table.c.version == version)).first()
        return _to_version(row) if row else None

    def _get(self, conn: Connection, name: str, version: int) -> ModelVersion:
        mv = self._find(conn, name, version)
        if mv is None:
            have = conn.execute(select(versions_table.c.version).where(versions_table.c.name == name)
                                .order_by(versions_table.c.version)).scalars().all()
            known = f"its versions: {', '.join(map(str, have))}" if have else "no such model"
            raise NotFound(f"model version {name}:{version} not found ({known})", code="model_not_found",
                           param="model")
        return mv

    def get(self, name: str, version: int) -> ModelVersion:
        """One version; NotFound naming the versions that exist."""
        with db.read(self.engine) as conn:
            return self._get(conn, name, version)

    def versions(self, name: str) -> list[ModelVersion]:
        """A model's versions, oldest first (empty for an unknown model)."""
        with db.read(self.engine) as conn:
            rows = conn.execute(select(versions_table).where(versions_table.c.name == name)
                                .order_by(versions_table.c.version))
            return [_to_version(r) for r in rows]

    def models(self) -> list[str]:
        """Names with at least one version."""
        with db.read(self.engine) as conn:
            return list(conn.execute(select(versions_table.c.name).distinct().order_by(versions_table.c.name))
                        .scalars())

    def _production(self, conn: Connection, name: str) -> ModelVersion | None:
        row = conn.execute(select(versions_table).where(versions_table.c.name == name,
                                                        versions_table.c.state == State.PRODUCTION.value)).first()
        return _to_version(row) if row else None

    def production(self, name: str) -> ModelVersion | None:
        """The version `name` resolves to, if one is in PRODUCTION: from memory, no query (this registry's
        writes keep it current; another server's writes to a shared database show at the next `refresh`)."""
        with self._prod_lock:
            mv = self._prod.get(name)
        return dataclasses.replace(mv) if mv is not None else None  # a copy: callers cannot edit the cache

    def _previous(self, conn: Connection, cur: ModelVersion | None) -> ModelVersion | None:
        if cur is None:
            return None
        prev_no = conn.execute(select(versions_table.c.replaces).where(
            versions_table.c.name == cur.name, versions_table.c.version == cur.version)).scalar()
        prev = self._find(conn, cur.name, prev_no) if prev_no is not None else None
        return prev if prev is not None and prev.state == State.DEPRECATED else None

    def previous_production(self, name: str) -> ModelVersion | None:
        """The version the current PRODUCTION one replaced, if it is still there to go back to (DEPRECATED,
        not archived or deleted): what `rollback` restores."""
        with db.read(self.engine) as conn:
            return self._previous(conn, self._production(conn, name))

    # -- changing -----------------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, *, labels: dict[str, str] | None = None,
                 engine: dict | None = None, golden_prompts: list[str] | None = None,
                 actor: str, base: str | None = None) -> ModelVersion:
        """Import a model folder or .gguf file as the next version of `name` (REGISTERED). With `base`
        (`name:version` of a GENERATE version that is not ARCHIVED), `path` is a PEFT LoRA adapter folder and the
        version is of kind `lora`, recorded with its base; an adapter folder without `base` is refused."""
        _check_inputs(name, labels, engine)
        if golden_prompts is not None and not (isinstance(golden_prompts, list)
                                               and all(isinstance(p, str) and p for p in golden_prompts)):
            raise InvalidRequest("golden_prompts must be a list of non-empty strings", code="invalid_prompts",
                                 param="golden_prompts")
        src = Path(path).expanduser()
        if not src.exists():
            raise InvalidRequest(f"path {str(path)!r} does not exist", code="invalid_path", param="path")
        if base is None and (src / "adapter_config.json").is_file():
            raise InvalidRequest(f"{str(path)!r} is a LoRA adapter: register it with its base version "
                                 "(base: NAME:VERSION of the generation model it adapts)", code="invalid_base",
                                 param="base")
        if base is not None:
            if engine:  # its requests run in the base's workers, with the base's settings
                raise InvalidRequest("a LoRA adapter runs in its base version's workers: give engine settings "
                                     "to the base, not the adapter", code="invalid_engine", param="engine")
            self._check_base(base)  # a clear refusal before anything is copied (checked again when written)
            info = checkpoint.describe_adapter(src)
        else:
            info = checkpoint.describe(src)  # refuse what cannot be served before copying anything
        sha, stored = self.store.put(src)

        def op() -> ModelVersion:
            nonlocal stored
            now = time.time()
            with db.write(self.engine) as conn:
                if not stored.exists():  # a delete or gc removed the shared copy meanwhile: import it again
                    _, stored = self.store.put(src)
                if base is not None:  # in the transaction: a base deleted or archived meanwhile is not recorded
                    self._base(conn, base)
                row = conn.execute(select(models_table.c.next_version).where(models_table.c.name == name)).first()
                number = row.next_version if row else 1
                if row:
                    conn.execute(models_table.update().where(models_table.c.name == name)
                                 .values(next_version=number + 1))
                else:
                    conn.execute(models_table.insert().values(name=name, next_version=2, created_at=now))
                mv = ModelVersion(name, number, State.REGISTERED, info.kind, str(stored), sha, str(src.resolve()),
                                  info.architecture, info.dtype, size_bytes(stored), info.num_params, actor, now,
                                  dict(labels or {}), dict(engine or {}), list(golden_prompts or []), base=base)
                conn.execute(versions_table.insert().values(**_row(mv), replaces=None, state_since=now))
                self.audit.append(conn, actor, "register", mv.ref, None, mv.to_dict())
                return mv
        return db.retrying(op)

    def _check_base(self, base: str) -> ModelVersion:
        with db.read(self.engine) as conn:
            return self._base(conn, base)

    def _base(self, conn: Connection, base: str) -> ModelVersion:
        """The GENERATE version an adapter names as its base; 400 for a malformed ref or another kind, 404 when
        it does not exist, 409 when it is ARCHIVED."""
        name, sep, number = base.rpartition(":") if isinstance(base, str) else ("", "", "")
        if not (sep and NAME_RE.match(name) and number.isdigit() and 0 < int(number) <= MAX_VERSION):
            raise InvalidRequest(f"base must be NAME:VERSION of a registered generation model, got {base!r}",
                                 code="invalid_base", param="base")
        mv = self._find(conn, name, int(number))
        if mv is None:
            raise NotFound(f"the base version {base} is not registered", code="model_not_found",
                           param="base")
        if mv.kind != Kind.GENERATE:
            raise InvalidRequest(f"the base {base} is a {mv.kind.value} model; a LoRA adapter adapts a generation "
                                 "model", code="invalid_base", param="base")
        if mv.state == State.ARCHIVED:
            raise Conflict(f"the base {base} is ARCHIVED", code="invalid_base", param="base")
        return mv

    def _adapters_of(self, conn: Connection, ref: str) -> list[ModelVersion]:
        """The adapter versions that name `ref` as their base."""
        rows = conn.execute(select(versions_table).where(versions_table.c.kind == Kind.LORA.value,
                                                         versions_table.c.base == ref)
                            .order_by(versions_table.c.name, versions_table.c.version))
        return [_to_version(r) for r in rows]

    def _needed_by(self, conn: Connection, mv: ModelVersion, deployed_only: bool) -> list[str]:
        """The adapters of `mv` (only deployed ones, with `deployed_only`), each as "ref (deployed as id)" or
        "ref (STATE)": what a refusal to archive or delete the base names."""
        out = []
        for a in self._adapters_of(conn, mv.ref):
            ids = self._deployed(conn, a.name, a.version)
            if ids:
                out.append(f"{a.ref} (deployed as {', '.join(ids)})")
            elif not deployed_only:
                out.append(f"{a.ref} ({a.state.value})")
        return out

    def _set_state(self, conn: Connection, mv: ModelVersion, to: State, **changes) -> ModelVersion:
        """Compare-and-set the state (a concurrent writer that moved it first makes this a 409)."""
        res = conn.execute(versions_table.update().where(
            versions_table.c.name == mv.name, versions_table.c.version == mv.version,
            versions_table.c.state == mv.state.value).values(state=to.value, state_since=time.time(), **changes))
        if res.rowcount != 1:
            raise Conflict(f"{mv.ref} changed state concurrently; retry", code="conflict")
        return self._get(conn, mv.name, mv.version)

    def transition(self, name: str, version: int, to: State | str, actor: str, reason: str | None = None, *,
                   outputs: list[str] | None = None) -> ModelVersion:
        """Move a version to `to` if the lifecycle allows it (else 409 naming the current and allowed states).
        Entering PRODUCTION demotes the current PRODUCTION version to DEPRECATED in the same transaction and
        remembers it as the rollback target. ARCHIVED is refused (409 naming the adapter) while a deployed
        adapter runs on the version. FAILED records `reason` as the failure; VALIDATED records
        `outputs` (the golden prompts' outputs)."""
        try:
            to = State(to)
        except ValueError:
            raise InvalidRequest(f"unknown state {to!r}; states: {', '.join(s.value for s in State)}",
                                 code="invalid_state", param="state") from None
        def op(conn: Connection) -> ModelVersion:
            mv = self._get(conn, name, version)
            lifecycle.check(mv.state, to, mv.ref)
            if to == State.ARCHIVED and (needed := self._needed_by(conn, mv, deployed_only=True)):
                raise Conflict(f"cannot archive {mv.ref}: adapter {'; '.join(needed)} runs on it; unload "
                               "the adapter's deployment first", code="base_in_use")
            changes: dict = {}
            if to == State.VALIDATING:
                changes.update(failure=None, golden_outputs=[])
            elif to == State.FAILED:
                changes["failure"] = reason or "failed"
            elif to == State.VALIDATED and outputs is not None:
                changes["golden_outputs"] = list(outputs)
            elif to == State.PRODUCTION:
                cur = self._production(conn, name)
                if cur is not None:
                    self._set_state(conn, cur, State.DEPRECATED)
                    self.audit.append(conn, actor, "transition", cur.ref, {"state": cur.state.value},
                                      {"state": State.DEPRECATED.value, "reason": f"replaced by {mv.ref}"})
                changes["replaces"] = cur.version if cur else None
            new = self._set_state(conn, mv, to, **changes)
            after = {"state": to.value, "reason": reason}
            if outputs is not None:
                after["outputs"] = list(outputs)
            self.audit.append(conn, actor, "transition", mv.ref, {"state": mv.state.value}, after)
            return new
        return self._changing_states(op, [name])

    def rollback(self, name: str, actor: str, reason: str | None = None) -> ModelVersion:
        """Put the previous PRODUCTION version back: the current one goes to DEPRECATED and the one it replaced
        returns to PRODUCTION. This is the one way out of DEPRECATED other than ARCHIVED, and only for the
        version the current one replaced. Returns the restored version; the caller swaps its deployment."""
        def op(conn: Connection) -> ModelVersion:
            cur = self._production(conn, name)
            if cur is None:
                raise Conflict(f"{name} has no PRODUCTION version to roll back", code="nothing_to_roll_back")
            prev = self._previous(conn, cur)
            if prev is None:
                raise Conflict(f"{cur.ref} replaced no version that is still DEPRECATED; nothing to roll "
                               "back to", code="nothing_to_roll_back")
            self._set_state(conn, cur, State.DEPRECATED)
            restored = self._set_state(conn, prev, State.PRODUCTION)
            self.audit.append(conn, actor, "rollback", name, {"production": cur.ref},
                              {"production": prev.ref, "reason": reason})
            return restored
        return self._changing_states(op, [name])

    def _deployed(self, conn: Connection, name: str, version: int) -> list[str]:
        return list(conn.execute(select(deployments_table.c.id).where(
            deployments_table.c.name == name, deployments_table.c.version == version)).scalars())

    def _drop(self, conn: Connection, mv: ModelVersion) -> None:
        """Delete a version's row. Its artifact goes with the gc sweep at the end of the same transaction
        (`_sweep`), once no version references it: inside the transaction, so a concurrent register of the
        same content cannot lose it."""
        conn.execute(versions_table.delete().where(versions_table.c.name == mv.name,
                                                   versions_table.c.version == mv.version))

    def _sweep(self, conn: Connection, shas: set[str] | None = None) -> list[str]:
        """Remove the artifacts (of `shas`, or all) that no version references; last in a transaction, after
        its audit entry, so a retried transaction never finds its files already gone."""
        kept = set(conn.execute(select(versions_table.c.sha256).distinct()).scalars())
        if shas is None:
            return self.store.gc(kept)
        return [sha for sha in sorted(shas - kept) if self.store.remove(sha)]

    def delete(self, name: str, version: int, actor: str) -> None:
        """Remove a version (and its artifact, if no other version shares it). 409 while it is active
        (VALIDATING, STAGING, STAGING_TESTED, CANARY, PRODUCTION), deployed, or the base of an adapter version."""
        def op(conn: Connection) -> None:
            mv = self._get(conn, name, version)
            if mv.state in lifecycle.ACTIVE:
                raise Conflict(f"cannot delete {mv.ref}: it is {mv.state.value}", code="version_in_use")
            deployed = self._deployed(conn, name, version)
            if deployed:
                raise Conflict(f"cannot delete {mv.ref}: deployed as {', '.join(deployed)}",
                               code="version_in_use")
            # an adapter cannot run without its base: it goes first (the base may be archived meanwhile)
            needed = self._needed_by(conn, mv, deployed_only=False)
            if needed:
                raise Conflict(f"cannot delete {mv.ref}: it is the base of adapter {', '.join(needed)}; "
                               "delete those first", code="base_in_use")
            self._drop(conn, mv)
            self.audit.append(conn, actor, "delete", mv.ref, mv.to_dict(), None)
            self._sweep(conn, {mv.sha256})
        self._changing_states(op, [name])

    def gc(self, keep_last: int, actor: str) -> list[str]:
        """Per model, keep the newest `keep_last` versions, and any older one that is active, deployed, the
        rollback target or an adapter's base; delete the rest and every artifact no kept version references. Returns the refs
        removed."""
        if not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidRequest(f"keep_last must be an integer >= 1, got {keep_last!r}", code="invalid_keep",
                                 param="keep_last")
        def op(conn: Connection) -> list[str]:
            removed: list[str] = []
            names = conn.execute(select(versions_table.c.name).distinct()).scalars().all()
            bases = set(conn.execute(select(versions_table.c.base).where(versions_table.c.base.is_not(None)))
                        .scalars())  # what an adapter needs is kept as long as the adapter is
            for name in names:
                rows = conn.execute(select(versions_table).where(versions_table.c.name == name)
                                    .order_by(versions_table.c.version.desc())).all()
                prev = self._previous(conn, self._production(conn, name))
                for r in rows[keep_last:]:
                    mv = _to_version(r)
                    if (mv.state in lifecycle.ACTIVE or self._deployed(conn, name, mv.version)
                            or (prev is not None and prev.version == mv.version) or mv.ref in bases):
                        continue
                    self._drop(conn, mv)
                    removed.append(mv.ref)
            kept = set(conn.execute(select(versions_table.c.sha256).distinct()).scalars())
            unused = sorted(self.store.digests() - kept)
            self.audit.append(conn, actor, "gc", "registry", None,
                              {"keep_last": keep_last, "removed": removed, "artifacts_removed": unused})
            self._sweep(conn)
            return removed
        return self._changing_states(op, None)

    # -- deployment records -------------------------------------------------------------------------
    def save_deployment(self, rec: dict) -> None:
        """Insert or replace a deployment record (JSON-serialisable; `id` required; `name` and `version` name
        the version it serves, which then cannot be deleted). Not audited here: the caller records deploy,
        scale and unload with `audit.record`."""
        if "id" not in rec:
            raise ValueError("a deployment record needs an 'id'")
        def op(conn: Connection) -> None:
            old = conn.execute(select(deployments_table.c.created_at)
                               .where(deployments_table.c.id == str(rec["id"]))).scalar()
            conn.execute(deployments_table.delete().where(deployments_table.c.id == str(rec["id"])))
            conn.execute(deployments_table.insert().values(
                id=str(rec["id"]), name=rec.get("name"), version=rec.get("version"), record=dict(rec),
                created_at=old if old is not None else time.time()))
        self._write(op)

    def deployments(self) -> list[dict]:
        """Every deployment record, oldest first (what a restarted server brings back)."""
        with db.read(self.engine) as conn:
            return [r.record for r in conn.execute(select(deployments_table.c.record)
                                                   .order_by(deployments_table.c.created_at))]

    def delete_deployment(self, id: str) -> bool:
        """Forget a deployment record; False if there was none."""
        with db.write(self.engine) as conn:
            return conn.execute(deployments_table.delete().where(deployments_table.c.id == str(id))).rowcount > 0
