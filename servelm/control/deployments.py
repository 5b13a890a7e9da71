"""The server's deployments: create, find by model name, scale, swap, unload, within a memory budget.

`resolve(model)` is the routing seam above the workers: `name` goes to the deployment of the name's
PRODUCTION version (or the only deployment of that name), `name:version` to that version's deployment.
Traffic policies between versions (A/B, canary, shadow) will choose here, between deployments.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable

from servelm.config.engine import EngineConfig
from servelm.control.adapter_deployment import AdapterDeployment
from servelm.control.budget import MemoryBudget, worker_footprint
from servelm.control.deployment import Deployment, load_tokenizer
from servelm.control.embed_deployment import EmbedDeployment
from servelm.control.errors import Conflict, ControlError, InvalidRequest, NotFound, Unavailable
from servelm.control.lease import Lease
from servelm.control.traffic import Decision, RequestAttrs, TrafficPolicy
from servelm.control.types import Kind, ModelVersion, State
from servelm.worker.handle import HealthSettings

__all__ = ["AdapterDeployment", "Deployment", "DeploymentManager", "EmbedDeployment", "Served", "load_tokenizer"]
logger = logging.getLogger("servelm.deployments")
# what resolve() returns: generation (AsyncEngine surface: a version's workers, or a LoRA adapter on a base
# deployment's workers) or embeddings
Served = Deployment | AdapterDeployment | EmbedDeployment


class DeploymentManager:
    """Every deployment of the server.

    `on_change(action, record)` (a function, or a coroutine function: awaited) is called after each change
    ("create", "scale", "swap", "unload", "evict", "expire") and after a failed swap ("swap_failed", the record
    with `to` and `error`), with the deployment's `describe()` record, so the caller can persist and audit
    it. `production_of(name)`
    names the PRODUCTION version of a model (the registry's view; default: the deployed versions' states);
    `policy_of(name)` its traffic policy, if any (see `route`). `on_replaced(deployment_id, before, after)` is
    called when a deployment's worker process died (or was killed as hung) and its replacement is ready (see
    AsyncEngine.on_replaced), for the audit trail.
    Deployments idle for their `keep_alive_s` are unloaded; under memory pressure idle ones are unloaded
    least recently used first.
    """

    def __init__(self, engine_base: EngineConfig | None = None, budget: MemoryBudget | None = None,
                 on_change: Callable[[str, dict], None] | None = None,
                 production_of: Callable[[str], int | None] | None = None, start_timeout: float = 600.0,
                 health: HealthSettings | None = None, reap_every_s: float = 5.0,
                 policy_of: Callable[[str], TrafficPolicy | None] | None = None,
                 drain_timeout_s: float = 600.0,
                 on_replaced: Callable[[str, dict, dict], None] | None = None) -> None:
        self.engine_base = engine_base or EngineConfig()
        self.budget = budget or MemoryBudget(device=self.engine_base.device_config.device)
        self.on_change, self.production_of, self.policy_of = on_change, production_of, policy_of
        self.on_replaced = on_replaced
        self.start_timeout, self.health = start_timeout, health
        self.reap_every_s = reap_every_s
        self.drain_timeout_s = drain_timeout_s  # how long a swap, scale-down or unload lets requests finish
        self._deployments: dict[str, Served] = {}
        self._footprints: dict[str, int] = {}  # id -> bytes per worker
        self._reserved = 0  # bytes of workers being started (not yet counted in a deployment)
        self._lock = asyncio.Lock()  # budget decisions one at a time
        self._reaper: asyncio.Task | None = None
        self._loading: dict[str, asyncio.Future] = {}  # version ref -> its on-demand load in progress
        self._creating: set[str] = set()  # deployment ids being created (claimed before the first await)

    # -- lookup ------------------------------------------------------------------------------------
    def get(self, deployment_id: str) -> Served:
        d = self._deployments.get(deployment_id)
        if d is None:
            raise NotFound(f"no deployment {deployment_id!r}; deployments: "
                           f"{', '.join(self._deployments) or 'none'}", code="deployment_not_found")
        return d

    def list(self) -> list[Served]:
        return list(self._deployments.values())

    def served(self) -> list[str]:
        """Every name a request may use: each deployed `name:version`, and each model name that resolves."""
        refs = sorted({d.version.ref for d in self._deployments.values()})
        names = sorted({d.version.name for d in self._deployments.values()})
        return [n for n in names if self._by_name(n, strict=False) is not None] + refs

    def resolve(self, model: str) -> Served:
        """The deployment that serves `model` (`name` or `name:version`); 404 naming what exists."""
        name, sep, ver = model.rpartition(":")
        if sep and ver.isdigit():
            for d in self._deployments.values():
                if d.version.name == name and d.version.version == int(ver):
                    return d
        else:
            found = self._by_name(model, strict=True)
            if found is not None:
                return found
        raise NotFound(f"the model {model!r} is not deployed; available: "
                       f"{', '.join(self.served()) or 'none'}", code="model_not_found", param="model")

    def route(self, model: str, attrs: RequestAttrs | None = None) -> tuple[Served, Decision | None]:
        """resolve(), with the model's traffic policy (`policy_of(name)`) choosing the version of a bare name:
        the deployment and the policy's decision (its arm, and a shadow version for the caller to mirror to),
        or no decision where no policy applies (a pinned `name:version`, no policy). A chosen version that is
        not deployed falls back to resolve(name), logged."""
        policy = self.policy_of(model) if self.policy_of is not None and ":" not in model else None
        if policy is None:
            return self.resolve(model), None
        decision = policy.choose(attrs or RequestAttrs())
        try:
            return self.resolve(f"{model}:{decision.version}"), decision
        except ControlError:
            logger.warning("traffic policy of %s chose version %d, which is not deployed; serving %s as resolved",
                           model, decision.version, model)
            return self.resolve(model), None

    def _by_name(self, name: str, strict: bool) -> Served | None:
        mine = [d for d in self._deployments.values() if d.version.name == name]
        if len(mine) == 1:
            return mine[0]
        if not mine:
            return None
        prod = self.production_of(name) if self.production_of else next(
            (d.version.version for d in mine if d.version.state == State.PRODUCTION), None)
        found = next((d for d in mine if d.version.version == prod), None)
        if found is None and strict:
            raise NotFound(f"the model {name!r} has several deployments "
                           f"({', '.join(d.version.ref for d in mine)}) and none of them is its PRODUCTION "
                           "version; name one as name:version", code="model_not_found", param="model")
        return found

    async def ensure(self, model: str, find: Callable[[str], ModelVersion | None], workers: int = 1,
                     strategy: str = "least_loaded", keep_alive_s: float | None = 300.0, pin: bool = False
                     ) -> tuple[Served | Lease, float]:
        """The deployment serving `model`, loading it first if there is none (on demand): `find(model)` names
        the version to load (the registry's PRODUCTION version of a name, or a pinned `name:version`; None: the
        404 stands). Returns it and the seconds this call waited for the load (0.0 if it was there); requests
        arriving during one load share it. On-demand deployments unload after `keep_alive_s` idle.
        With `pin`, returns a request's lease on it instead, taken while the manager still holds it (a load
        that finished can be evicted before its waiter resumes: then it is loaded again)."""
        t0 = time.monotonic()
        for attempt in range(3):
            try:
                d = self.resolve(model)
            except ControlError:
                version = find(model)
                if version is None:
                    raise
                task = self._loading.get(version.ref)
                if task is None:
                    task = asyncio.ensure_future(self.create(version, workers, strategy, keep_alive_s=keep_alive_s))
                    self._loading[version.ref] = task
                    task.add_done_callback(lambda _, ref=version.ref: self._loading.pop(ref, None))
                d = await asyncio.shield(task)  # a caller that leaves does not cancel the load for the others
                waited = time.monotonic() - t0
            else:
                waited = 0.0 if attempt == 0 else time.monotonic() - t0
            if not pin:
                return d, waited
            if self._holds(d):  # no await between this check and the pin: eviction cannot come between
                return d.pin(), waited
        raise Unavailable(f"{model} was unloaded again before its request could use it (memory pressure); "
                          "retry", code="engine_unavailable", param="model")

    # -- changes -----------------------------------------------------------------------------------
    async def create(self, version: ModelVersion, workers: int = 1, strategy: str = "least_loaded",
                     engine_base: EngineConfig | None = None, tokenizer=None, keep_alive_s: float | None = None,
                     deployment_id: str | None = None, enable_lora: bool = False) -> Served:
        """Deploy `version` with `workers` workers, started and warm when this returns (an embedding version:
        one embedding worker). With `enable_lora`, its workers run with LoRA enabled, so adapter versions of it
        can deploy into them. A LoRA adapter version starts no worker: it is loaded into the workers of the
        deployment serving its base version (the oldest, where several do; 409 where none does, or where that
        one runs without LoRA), and `workers` and `strategy` are the base deployment's."""
        d: Served
        if version.kind == Kind.PREDICT:
            raise InvalidRequest(f"{version.ref} is a {version.architecture} model: it is served over the Open "
                                 "Inference Protocol (/v2/models/...) without a deployment", code="not_deployable")
        if version.kind == Kind.LORA:
            d, config = AdapterDeployment(version, self._base_for(version), deployment_id, keep_alive_s,
                                          self.drain_timeout_s), None
            workers = 0  # nothing to count in the budget: it runs in its base's workers
        elif version.kind == Kind.EMBED:
            d, config = EmbedDeployment(version, deployment_id, keep_alive_s, self.drain_timeout_s), None
            workers = 1
        else:
            base = engine_base or self.engine_base
            if enable_lora and not base.lora_config.enable_lora:
                base = base.replace(enable_lora=True)
            d = Deployment(version, base, workers, strategy, tokenizer, deployment_id,
                           self.start_timeout, self.health, drain_timeout_s=self.drain_timeout_s,
                           keep_alive_s=keep_alive_s)
            config = d.config
            if self.on_replaced is not None:
                d.on_replaced = lambda before, after, i=d.id: self.on_replaced(i, before, after)
        if d.id in self._deployments or d.id in self._creating:
            raise Conflict(f"deployment {d.id!r} exists already", code="deployment_exists")
        # Claimed before the first await: a concurrent create of the same id (two admin calls, or an admin
        # deploy racing an on-demand load) is refused rather than started and then overwritten, leaking workers.
        self._creating.add(d.id)
        try:
            per_worker = 0 if workers == 0 else await asyncio.to_thread(self._footprint, version, config)
            await self._reserve(per_worker * workers, f"deploying {version.ref} with {workers} worker(s)", keep=None)
            try:
                await d.start()
            except BaseException:
                await d.shutdown()
                raise
            finally:
                self._reserved -= per_worker * workers
            self._deployments[d.id], self._footprints[d.id] = d, per_worker
        finally:
            self._creating.discard(d.id)
        self._start_reaper()
        await self._changed("create", d)
        return d

    async def restore(self, records: list[dict], version_of: Callable[[str, int], ModelVersion]) -> list[Served]:
        """Bring back deployments from their `describe()` records (what `on_change` was given; a restarted
        server's registry holds them), oldest first. One that cannot start is logged and skipped, so the rest
        still serve; returns those that started."""
        started = []
        for rec in records:
            try:
                version = version_of(rec["name"], int(rec["version"]))
                started.append(await self.create(version, int(rec.get("workers", 1)),
                                                  rec.get("strategy") or "least_loaded",
                                                  keep_alive_s=rec.get("keep_alive_s"), deployment_id=rec["id"],
                                                  enable_lora=bool(rec.get("enable_lora"))))
            except (ControlError, KeyError, ValueError, TypeError) as e:
                logger.error("could not restore deployment %s: %s", rec.get("id"), getattr(e, "message", e))
        return started

    async def scale(self, deployment_id: str, n: int) -> Served:
        d = self.get(deployment_id)
        if isinstance(d, AdapterDeployment):
            raise InvalidRequest(f"{d.id} is LoRA adapter {d.version.ref}: it runs on the workers of deployment "
                                 f"{d.base.id}; scale that one", code="not_scalable", param="workers")
        extra = max(0, n - d.num_workers) * self._footprints[d.id]
        await self._reserve(extra, f"scaling {d.id} to {n} workers", keep=d)
        try:
            await d.scale(n)
        finally:
            self._reserved -= extra
        if self._holds(d):  # unloaded meanwhile: nothing to persist
            await self._changed("scale", d)
        return d

    async def swap(self, deployment_id: str, version: ModelVersion, tokenizer=None) -> Served:
        """Serve `version` on this deployment with zero downtime (its workers run beside the old ones for a
        while, so both must fit the budget)."""
        d = self.get(deployment_id)
        if isinstance(d, AdapterDeployment):
            return await self._swap_adapter(d, version)
        config = version.engine_config(d.base) if isinstance(d, Deployment) else None
        per_worker = await asyncio.to_thread(self._footprint, version, config)
        need = per_worker * d.num_workers
        await self._reserve(need, f"swapping {d.id} to {version.ref}", keep=d)
        try:
            await d.swap(version, tokenizer)
        except ControlError as e:
            logger.error("swap of %s to %s failed: %s", d.id, version.ref, e.message)
            if self._holds(d):
                await self._changed("swap_failed", d, to=version.ref, error=e.message)
            raise
        finally:
            self._reserved -= need
        if self._holds(d):  # unloaded meanwhile: its record must not come back
            self._footprints[d.id] = per_worker
            await self._changed("swap", d)
        return d

    async def _swap_adapter(self, d: AdapterDeployment, version: ModelVersion) -> AdapterDeployment:
        """An adapter deployment to another adapter version (on the deployment of that one's base)."""
        if version.kind != Kind.LORA:
            raise InvalidRequest(f"{d.id} serves LoRA adapter {d.version.ref}; {version.ref} is not an adapter",
                                 code="wrong_kind")
        try:
            await d.swap(version, self._base_for(version))
        except ControlError as e:
            logger.error("swap of %s to %s failed: %s", d.id, version.ref, e.message)
            if self._holds(d):
                await self._changed("swap_failed", d, to=version.ref, error=e.message)
            raise
        if self._holds(d):
            await self._changed("swap", d)
        return d

    def _base_for(self, version: ModelVersion) -> Deployment:
        """The deployment an adapter version runs on: the oldest one serving its base version (409 if none)."""
        for d in self._deployments.values():
            if isinstance(d, AdapterDeployment) and d.version.ref == version.ref:
                raise Conflict(f"{version.ref} is deployed already, as {d.id}", code="deployment_exists")
        bases = [d for d in self._deployments.values() if isinstance(d, Deployment) and d.version.ref == version.base]
        if not bases:
            raise Conflict(f"{version.ref} is a LoRA adapter of {version.base}, which is not deployed: "
                           f"deploy {version.base} (with enable_lora) first", code="base_not_deployed",
                           param="model")
        return bases[0]

    def adapters_on(self, d: Served) -> list[AdapterDeployment]:
        """The adapter deployments running on deployment `d`'s workers."""
        return [a for a in self._deployments.values() if isinstance(a, AdapterDeployment) and a.base is d]

    def _holds(self, d: Served) -> bool:
        return self._deployments.get(d.id) is d

    async def unload(self, deployment_id: str, action: str = "unload") -> None:
        """Stop taking requests for it, let in-flight ones finish (up to its drain timeout), stop its workers.
        A base deployment is refused (409) while adapter deployments run on it."""
        d = self.get(deployment_id)
        adapters = self.adapters_on(d)
        if adapters:
            raise Conflict(f"deployment {d.id} runs LoRA adapter deployment(s) "
                           f"{', '.join(a.id for a in adapters)}: unload those first", code="base_in_use")
        del self._deployments[deployment_id]
        self._footprints.pop(deployment_id, None)
        await d.close()
        await self._changed(action, d)

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        ds, self._deployments = list(self._deployments.values()), {}
        await asyncio.gather(*(d.shutdown() for d in ds), return_exceptions=True)

    # -- memory ------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def reserving(self, version: ModelVersion, config: EngineConfig | None, what: str):
        """Count one worker of `version` that is not a deployment's (a validation run) in the budget while
        the block runs: room is made as for a deploy, else InsufficientMemory. A version whose footprint cannot
        be read from its artifact is not counted (the run itself then fails and says why)."""
        try:
            need = await asyncio.to_thread(self._footprint, version, config)
        except ControlError as e:
            logger.warning("%s: not counted in the memory budget: %s", what, e.message)
            need = 0
        await self._reserve(need, what, keep=None)
        try:
            yield
        finally:
            self._reserved -= need

    def _footprint(self, version: ModelVersion, config: EngineConfig | None) -> int:
        try:
            return worker_footprint(version, config).total
        except (OSError, ValueError, AttributeError) as e:
            raise Conflict(f"cannot size {version.ref}'s workers from its artifact: {e}",
                           code="start_failed") from e

    def in_use(self) -> int:
        """Bytes of every running and starting worker (a draining one counts until it is gone)."""
        return self._reserved + sum(self._footprints[i] * d.num_processes() for i, d in self._deployments.items())

    async def _reserve(self, need: int, what: str, keep: Served | None) -> None:
        """Make room for `need` bytes: unload idle deployments (least recently used first) until it fits, else
        raise InsufficientMemory naming the numbers."""
        async with self._lock:
            idle = sorted((d for d in self._deployments.values() if d is not keep and _idle(d)),
                          key=lambda d: d.last_used)
            freeable = sum(self._footprints[d.id] * d.num_processes() for d in idle)
            if self.in_use() - freeable + need <= self.budget.total:  # evict only where that makes it fit
                for victim in idle:
                    if self.in_use() + need <= self.budget.total:
                        break
                    logger.warning("unloading idle deployment %s to make room for %s", victim.id, what)
                    await self.unload(victim.id, "evict")
            self.budget.check(need, self.in_use(), what)
            self._reserved += need

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        """Unload deployments idle for longer than their keep_alive_s."""
        while True:
            await asyncio.sleep(self.reap_every_s)
            now = time.monotonic()
            for d in list(self._deployments.values()):
                if (d.keep_alive_s is not None and _idle(d) and now - d.last_used > d.keep_alive_s
                        and self._holds(d)):
                    logger.info("unloading %s: idle for %.0fs (keep_alive %gs)", d.id, now - d.last_used,
                                d.keep_alive_s)
                    with contextlib.suppress(ControlError):
                        await self.unload(d.id, "expire")

    async def _changed(self, action: str, d: Served, **extra) -> None:
        if self.on_change is not None:
            try:
                done = self.on_change(action, {**d.describe(), **extra})
                if inspect.isawaitable(done):  # e.g. the registry write, off the event loop
                    await done
            except Exception:  # persistence failing must not undo a change that took effect
                logger.exception("on_change(%s, %s) failed", action, d.id)


def _idle(d: Served) -> bool:
    """Nothing in flight, no request holding a lease on it (resolved, not yet in generate), no scale or swap under
    way, no adapter running on its workers: what eviction and keep-alive expiry may unload."""
    return d.num_in_flight() == 0 and d.pinned() == 0 and not d.busy() and not getattr(d, "adapters", None)
