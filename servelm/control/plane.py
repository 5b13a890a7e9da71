"""The server's control plane: the model registry (versions, lifecycle, audit) and the deployments that serve
them, kept in step. The admin routes call this; it calls `servelm.control` only.

What it adds over its two parts: a promotion to PRODUCTION (or a rollback) swaps the model's deployment to
that version with zero downtime before the registry records it, so a version that fails to start leaves the
old one serving and the registry unchanged; every deploy, scale, swap and unload is persisted (a restarted
server restores its deployments with `restore()`) and written to the audit trail with the admin key's name.
Every registry write from here runs on the registry's writer thread (`registry.io`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from servelm.config.engine import EngineConfig
from servelm.control.errors import Conflict, ControlError, InvalidRequest, NotFound
from servelm.control.model_roots import allowed_roots, check_path
from servelm.control.types import MAX_VERSION, Kind, ModelVersion, State

logger = logging.getLogger("servelm.control")
SYSTEM = "system"  # the actor of what the server does by itself (restore, eviction)
DEPLOYABLE = frozenset({State.VALIDATED, State.STAGING, State.STAGING_TESTED, State.CANARY, State.PRODUCTION})


def parse_ref(model: str) -> tuple[str, int | None]:
    """'name:3' -> ('name', 3); 'name' -> ('name', None). A number above MAX_VERSION is no version (the whole
    string is then a name that does not exist: a 404, never an integer overflow in the registry's database)."""
    name, sep, ver = model.rpartition(":")
    return (name, int(ver)) if sep and ver.isdigit() and 0 < int(ver) <= MAX_VERSION else (model, None)


class ControlPlane:
    """Registry + DeploymentManager behind one object, with the server's engine settings as the base."""

    def __init__(self, registry: Any, deployments: Any, engine_base: EngineConfig, start_timeout: float = 600.0,
                 model_roots: list[Path] | None = None):
        self.registry = registry
        self.deployments = deployments
        self.engine_base = engine_base
        self.start_timeout = start_timeout
        self.model_roots = model_roots  # where register may import from (control/model_roots.py); None: anywhere
        self._audits: set[asyncio.Task] = set()  # replaced workers' audit entries being written
        self._closed = False
        self._follow: asyncio.Task | None = None
        # awaited after each audited deploy, scale, swap and unload: (actor, action, before, after) as audited;
        # the reconciler folds operators' changes into the model's spec (control/spec_adopt.py)
        self.on_verb: Callable[[str, str, dict | None, dict | None], Awaitable[None]] | None = None

    @classmethod
    def open(cls, config) -> ControlPlane:
        """The registry in the server's data dir (or at database_url) and an empty deployment manager."""
        from servelm.control.deployments import DeploymentManager
        from servelm.control.registry import Registry

        srv = config.server
        registry = Registry(srv.database(), srv.data_path(), migrate=srv.storage_config.database_auto_upgrade)
        plane = cls(registry, None, config.engine, srv.lifecycle_config.engine_start_timeout_s, allowed_roots(config))
        plane.refresh_s = srv.storage_config.registry_refresh_s
        plane.deployments = DeploymentManager(engine_base=config.engine, on_change=plane._on_change,
                                              production_of=plane._production_of,
                                              start_timeout=srv.lifecycle_config.engine_start_timeout_s,
                                              drain_timeout_s=srv.lifecycle_config.swap_drain_timeout_s,
                                              on_replaced=plane.worker_replaced)
        return plane

    refresh_s = 0.0  # see follow()

    def follow(self) -> None:
        """In the running event loop: re-read the PRODUCTION versions every `refresh_s` seconds, so promotions
        and rollbacks made by other servers sharing the database are followed (0: only this server's own)."""
        if self.refresh_s > 0 and self._follow is None:
            self._follow = asyncio.get_running_loop().create_task(self._follow_every(self.refresh_s))

    async def _follow_every(self, seconds: float) -> None:
        failing = False
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.registry.io(self.registry.refresh)
                if failing:
                    logger.info("the registry is readable again: PRODUCTION versions are followed again")
                failing = False
            except Exception as e:  # the database down: keep the versions known, say so once
                if not failing:
                    logger.warning("cannot re-read the PRODUCTION versions (%s: %s); serving the ones known",
                                   type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                failing = True

    async def close(self) -> None:
        self._closed = True
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        await self.deployments.shutdown()
        await asyncio.gather(*self._audits, return_exceptions=True)  # replacements still being written
        self.registry.close()

    def worker_replaced(self, target: str, before: dict, after: dict) -> None:
        """Audit a replaced worker: its engine process died (or was killed as hung), was restarted, and
        the new one is ready. `target` is the deployment's id or the fixed model's name; before and after are
        AsyncEngine.on_replaced's. Called on the event loop; the write runs on the registry's writer thread."""
        if self._closed:  # a fixed model's engine outlives the registry at shutdown
            logger.warning("%s: worker replaced after the registry closed, not audited: %s -> %s", target, before,
                           after)
            return
        task = asyncio.get_running_loop().create_task(
            self._audit(SYSTEM, "replace_worker", target, before, after))
        self._audits.add(task)
        task.add_done_callback(self._audited)

    def _audited(self, task: asyncio.Task) -> None:
        self._audits.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("could not audit a replaced worker: %s", task.exception())

    # -- versions ----------------------------------------------------------------------------------
    async def register(self, name: str, path: str, *, labels: dict | None, engine: dict | None,
                       golden_prompts: list[str] | None, actor: str, validate: bool = False,
                       base: str | None = None) -> ModelVersion:
        """Import a model folder or .gguf file as the next version of `name` (copying it may take a while, so
        it runs off the event loop); with `validate`, validate it at once. With `base` (NAME:VERSION), `path` is
        a PEFT LoRA adapter of that version (Registry.register)."""
        def register() -> ModelVersion:
            if self.model_roots is not None:
                check_path(path, self.model_roots)  # 403 before anything is read or copied
            return self.registry.register(name, path, labels=labels, engine=engine, golden_prompts=golden_prompts,
                                          actor=actor, base=base)
        mv = await asyncio.to_thread(register)
        if validate:
            mv = await self.validate(name, mv.version, actor)
        return mv

    async def validate(self, name: str, version: int, actor: str) -> ModelVersion:
        """REGISTERED -> VALIDATING -> VALIDATED | FAILED (with the reason); returns the version as it ends.
        Its worker counts in the memory budget while it runs (507 before anything changes if it does not fit,
        after unloading idle deployments as a deploy would)."""
        from servelm.control.validation import validate

        mv = await self.registry.io(self.registry.get, name, version)
        sized, config = mv, mv.engine_config(self.engine_base) if mv.kind == Kind.GENERATE else None
        if mv.kind == Kind.LORA:  # its validation worker is one of its base, with the adapter loaded
            sized = await self.registry.io(self.registry.get, *mv.base_ref)
            config = sized.engine_config(self.engine_base)
        async with self.deployments.reserving(sized, config, f"validating {mv.ref}"):
            return await validate(self.registry, name, version, self.engine_base, actor,
                                  start_timeout=self.start_timeout)

    def version(self, name: str, version: int | None = None) -> ModelVersion:
        """A version; without a number, the PRODUCTION one, else the newest (404 when there is none)."""
        if version is not None:
            return self.registry.get(name, version)
        found = self.registry.production(name) or next(iter(reversed(self.registry.versions(name))), None)
        if found is None:
            raise NotFound(f"no model {name!r}; models: {', '.join(self.registry.models()) or 'none'}",
                           code="model_not_found", param="model")
        return found

    async def transition(self, name: str, version: int, to: str, actor: str, reason: str | None = None
                         ) -> ModelVersion:
        """Move a version through its lifecycle (409 for a transition the state machine forbids). Into
        PRODUCTION: the deployment serving the model's current PRODUCTION version (or its only one) is swapped
        to this version first; if that fails, nothing changes and the error says why."""
        from servelm.control import lifecycle

        try:
            target = State(to)
        except ValueError:
            raise InvalidRequest(f"unknown state {to!r}; states: {', '.join(s.value for s in State)}",
                                 code="invalid_state", param="state") from None
        mv = await self.registry.io(self.registry.get, name, version)
        lifecycle.check(mv.state, target, mv.ref)
        if target == State.PRODUCTION:
            await self._swap_model_to(mv, actor)
        if target == State.VALIDATING:  # validation runs the whole way, as POST .../validate
            return await self.validate(name, version, actor)
        return await self.registry.io(self.registry.transition, name, version, target, actor, reason)

    async def rollback(self, name: str, actor: str, reason: str | None = None) -> ModelVersion:
        """Put the previous PRODUCTION version back, swapping the model's deployment to it first."""
        prev = await self.registry.io(self.registry.previous_production, name)
        if prev is None:
            cur = self.registry.production(name)
            raise Conflict(f"{cur.ref if cur else name} has no previous PRODUCTION version to roll back to",
                           code="nothing_to_roll_back")
        await self._swap_model_to(prev, actor)
        return await self.registry.io(self.registry.rollback, name, actor, reason)

    async def delete(self, name: str, version: int, actor: str) -> None:
        await self.registry.io(self.registry.delete, name, version, actor)

    async def gc(self, keep_last: int, actor: str) -> list[str]:
        """Delete old unused versions and unreferenced artifacts (Registry.gc), off the event loop."""
        return await self.registry.io(self.registry.gc, keep_last, actor)

    async def _audit(self, actor: str, action: str, target: str, before: dict | None, after: dict | None) -> None:
        await self.registry.io(self.registry.audit.record, actor, action, target, before, after)
        if self.on_verb is not None and action in ("deploy", "scale", "swap", "unload"):
            await self.on_verb(actor, action, before, after)

    # -- deployments -------------------------------------------------------------------------------
    async def deploy(self, model: str, *, workers: int, strategy: str, actor: str, keep_alive_s: float | None = None,
                     deployment_id: str | None = None, enable_lora: bool = False) -> dict:
        """Serve a version (`name:version`, or `name` for its PRODUCTION/newest one) with N workers; with
        `enable_lora`, workers that LoRA adapter versions of it can deploy into. A LoRA adapter version starts
        no worker: it is loaded into the workers of its base version's deployment (DeploymentManager.create)."""
        name, number = parse_ref(model)
        mv = self.version(name, number)
        _check_deployable(mv)
        d = await self.deployments.create(mv, workers, strategy, keep_alive_s=keep_alive_s,
                                          deployment_id=deployment_id, enable_lora=enable_lora)
        rec = d.describe()
        await self._audit(actor, "deploy", d.id, None, _brief(rec))
        return rec

    async def scale(self, deployment_id: str, workers: int, actor: str) -> dict:
        before = _brief(self.deployments.get(deployment_id).describe())
        d = await self.deployments.scale(deployment_id, workers)
        rec = d.describe()
        await self._audit(actor, "scale", deployment_id, before, _brief(rec))
        return rec

    async def swap(self, deployment_id: str, model: str, actor: str) -> dict:
        """Serve another version on a deployment (zero downtime); `model` is a version number or name:version."""
        d = self.deployments.get(deployment_id)
        name, number = parse_ref(model) if not model.isdigit() else (d.version.name, int(model))
        mv = self.version(name, number)
        _check_deployable(mv)
        return await self._swap(d, mv, actor)

    async def unload(self, deployment_id: str, actor: str) -> None:
        before = _brief(self.deployments.get(deployment_id).describe())
        await self.deployments.unload(deployment_id)
        await self._audit(actor, "unload", deployment_id, before, None)

    def describe(self, deployment_id: str) -> dict:
        return self.deployments.get(deployment_id).describe()

    def list_deployments(self) -> list[dict]:
        return [d.describe() for d in self.deployments.list()]

    async def restore(self) -> list[str]:
        """Bring back every persisted deployment (after a restart), whatever its version's state now; one that
        cannot start is logged and audited, and the rest still come back. Returns the ids restored."""
        records = await self.registry.io(self.registry.deployments)
        started = await self.deployments.restore(records, self.registry.get)
        restored = [d.id for d in started]
        for rec in records:
            if rec.get("id") not in restored:
                await self._audit(SYSTEM, "restore_failed", str(rec.get("id")), None,
                                  {"reason": "it could not start (see the server log)"})
        if restored:
            await self._audit(SYSTEM, "restore", "deployments", None, {"restored": restored})
        return restored

    def find_version(self, model: str, kind: Kind | None = None) -> ModelVersion | None:
        """What an on-demand load of `model` serves: `name` or `name:N` -> its PRODUCTION version (N must be
        that version); None when there is none (of `kind`, if given). Any other version loads only through an
        admin deploy (409): a request must not bring up a version that has not been promoted."""
        name, number = parse_ref(model)
        try:
            mv = self.registry.get(name, number) if number is not None else self.registry.production(name)
        except ControlError:
            return None
        if mv is None or mv.state not in DEPLOYABLE or (kind is not None and mv.kind.serves != kind):
            return None
        if mv.state != State.PRODUCTION:
            raise Conflict(f"{mv.ref} is {mv.state.value}, not PRODUCTION: only a PRODUCTION version loads "
                           "on demand; deploy it through the admin API (POST /admin/deployments)",
                           code="not_deployed", param="model")
        return mv

    async def load_on_demand(self, model: str, kind: Kind, keep_alive_s: float | None) -> tuple[Any, float]:
        """A request's lease (control/lease.py) on the deployment serving `model`, loaded now if it is
        registered but not deployed (audited). The lease is taken before anything else is awaited, so the
        deployment cannot be evicted or expire before the request uses it; the caller releases it."""
        lease, waited = await self.deployments.ensure(model, lambda m: self.find_version(m, kind),
                                                      keep_alive_s=keep_alive_s, pin=True)
        if waited > 0:
            try:
                await self._audit(SYSTEM, "load_on_demand", lease.id, None,
                                  {**_brief(lease.describe()), "wait_s": round(waited, 3)})
            except BaseException:
                lease.release()
                raise
        return lease, waited

    # -- internals ---------------------------------------------------------------------------------
    async def _swap_model_to(self, mv: ModelVersion, actor: str) -> None:
        """Swap the deployment that serves `mv`'s model by name to `mv` (none deployed: nothing to do)."""
        mine = [d for d in self.deployments.list() if d.version.name == mv.name]
        if not mine or any(d.version.version == mv.version for d in mine):
            return
        prod = self.registry.production(mv.name)
        target = next((d for d in mine if prod is not None and d.version.version == prod.version), None)
        if target is None and len(mine) == 1:
            target = mine[0]
        if target is not None:
            _check_deployable(mv, promoting=True)
            await self._swap(target, mv, actor)

    async def _swap(self, d, mv: ModelVersion, actor: str) -> dict:
        before = _brief(d.describe())
        try:
            await self.deployments.swap(d.id, mv)
        except ControlError as e:
            await self._audit(actor, "swap_failed", d.id, before, {"to": mv.ref, "reason": e.message})
            raise
        rec = d.describe()
        await self._audit(actor, "swap", d.id, before, _brief(rec))
        return rec

    def _production_of(self, name: str) -> int | None:
        mv = self.registry.production(name)
        return mv.version if mv is not None else None

    async def _on_change(self, action: str, rec: dict) -> None:
        """Persist the manager's changes (on the registry's writer thread, in the order they happened)."""
        await self.registry.io(self._persist, action, rec)

    def _persist(self, action: str, rec: dict) -> None:
        """A deployment that exists is saved (a restart brings it back), one that is gone is forgotten; what
        the manager did by itself (evict, expire) is audited here."""
        if action in ("unload", "evict", "expire"):
            self.registry.delete_deployment(rec["id"])
        else:
            self.registry.save_deployment(_persisted(rec))
        if action in ("evict", "expire"):
            self.registry.audit.record(SYSTEM, action, rec["id"], _brief(rec), None)


def _check_deployable(mv: ModelVersion, promoting: bool = False) -> None:
    if mv.state not in DEPLOYABLE and not promoting:
        raise Conflict(f"{mv.ref} is {mv.state.value}; deploy a version that is one of "
                       f"{', '.join(s.value for s in sorted(DEPLOYABLE, key=list(State).index))}",
                       code="not_deployable")


# an adapter deployment's record names the deployment it runs on; a base's, whether its workers take adapters
_KEEP = ("id", "name", "version", "ref", "workers", "strategy", "keep_alive_s", "enable_lora", "base_deployment")


def _persisted(rec: dict) -> dict:
    """What restoring a deployment needs of its record."""
    return {k: rec.get(k) for k in _KEEP}


def _brief(rec: dict | None) -> dict | None:
    """A deployment record as the audit trail keeps it (no per-worker state)."""
    return None if rec is None else {k: rec.get(k) for k in _KEEP}

