"""The reconciler: a loop that drives each model's deployments toward its stored spec (control/spec.py) with
the control plane's own verbs, and reports how far it got as status conditions.

Each pass reads every spec and, per model:

1. a canary the spec asks for that has finished is written back into the spec: promoted, the canary version
   becomes the only version; rolled back, the canary leaves the spec and Degraded says why until the spec
   next changes;
2. every version the spec needs (split, canary, shadow) gets a deployment (ControlPlane.deploy) and its
   worker count (ControlPlane.scale: the spec's, or autoscaling's within min/max), and the routing strategy;
3. once all of them serve: the traffic policy (the spec's split and shadow; while a canary runs, the canary
   runner's steps) and the prediction-log mode, through the traffic service as the admin routes set them;
4. then deployments of the model that the spec no longer needs are unloaded (after traffic left them);
5. the status: observed generation, conditions Ready / Progressing / Degraded, what is deployed.

A pass runs every `interval_s`, and at once after a spec changes (`kick`). Passes never overlap. What the
reconciler does is audited with the actor "reconciler"; what operators do with the imperative verbs on a
model that has a spec is folded into the spec (control/spec_adopt.py) so the next pass keeps it.

The traffic service is reached through `TrafficOps`, the surface control/traffic_service.py's TrafficService
offers (a Protocol: tests pass their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from servelm.control import conditions, spec_adopt
from servelm.control.autoscale import Wish, decide, wanted
from servelm.control.bandit_policy import BanditPolicy
from servelm.control.conditions import DEGRADED, PROGRESSING, READY
from servelm.control.errors import ControlError
from servelm.control.plane import SYSTEM, ControlPlane
from servelm.control.spec import DeploymentSpec, VersionWeight
from servelm.control.spec_store import SpecStore, StoredSpec
from servelm.control.traffic import TrafficPolicy
from servelm.control.types import Kind

logger = logging.getLogger("servelm.reconciler")
RECONCILER = "reconciler"  # the actor of what the reconciler does
MANAGED = frozenset({RECONCILER, SYSTEM})  # changes made by these are not operators' verbs: never adopted
ADOPTED_POLICY_ACTIONS = frozenset({"policy.set", "policy.delete", "shadow.set", "shadow.delete"})


class TrafficOps(Protocol):
    """What the reconciler uses of the traffic service (control/traffic_service.py: TrafficService)."""

    policies: dict[str, Any]  # model -> TrafficPolicy | BanditPolicy in force
    canaries: dict[str, Any]  # model -> CanaryRun (control/canary_runner.py)
    experiment_of: dict[str, str]  # model -> its running experiment
    store: Any  # PolicyStore
    log: Any  # PredictionLog (mode(name))

    async def set_policy(self, policy: Any, actor: str, action: str = ...) -> None: ...

    async def set_log_mode(self, name: str, mode: str, actor: str) -> str: ...


class Reconciler:
    def __init__(self, plane: ControlPlane, traffic: TrafficOps | None, interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plane, self.traffic, self.interval_s, self.clock = plane, traffic, interval_s, clock
        self.store = SpecStore(plane.registry.engine, plane.registry.audit)
        self.passes = 0  # passes completed (tests and the status page wait on it growing)
        self._kick = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wishes: dict[str, Wish] = {}  # deployment id -> autoscaling's pending change
        # model -> (generation, reason, message): an outcome (a canary rolled back) that keeps Degraded True
        # until the spec changes again
        self._notes: dict[str, tuple[int, str, str]] = {}

    # -- life --------------------------------------------------------------------------------------
    def start(self) -> None:
        """In the running event loop: fold operators' verbs into specs from now on, and start the loop."""
        self._loop = asyncio.get_running_loop()
        self.plane.on_verb = self._on_verb
        if self.traffic is not None:
            self.traffic.store.on_change = self._on_record
        if self._task is None:
            self._task = self._loop.create_task(self._run())

    async def close(self) -> None:
        self.plane.on_verb = None
        if self.traffic is not None:
            self.traffic.store.on_change = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def kick(self) -> None:
        """Run a pass now (callable from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._kick.set)

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile_all()
            except Exception:  # the database down, say: try again next time
                logger.exception("reconcile pass failed")
            # Python 3.10's wait_for raises asyncio.TimeoutError, not the builtin
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval_s)

    # -- the specs ---------------------------------------------------------------------------------
    async def apply(self, spec: DeploymentSpec, actor: str) -> StoredSpec:
        """Store `spec` as its model's desired state (every version it names must be registered: 404 naming
        the one that is not) and reconcile at once."""
        reg = self.plane.registry
        for v in spec.needed():
            await reg.io(reg.get, spec.name, v)
        stored = await reg.io(self.store.put, spec, actor)
        self.kick()
        return stored

    async def delete(self, name: str, actor: str) -> StoredSpec:
        """Forget `name`'s spec: the reconciler stops managing it; what is deployed keeps serving."""
        gone = await self.plane.registry.io(self.store.delete, name, actor)
        self._notes.pop(name, None)
        return gone

    async def get(self, name: str) -> StoredSpec:
        return await self.plane.registry.io(self.store.require, name)

    async def list(self) -> list[StoredSpec]:
        return await self.plane.registry.io(self.store.all)

    # -- a pass ------------------------------------------------------------------------------------
    async def reconcile_all(self) -> None:
        async with self._lock:
            self._kick.clear()  # a change after this point asks for another pass
            for stored in await self.list():
                try:
                    status = await self._reconcile(stored)
                except Exception as e:  # one model's failure must not stop the others
                    logger.exception("reconciling %s failed", stored.spec.name)
                    status = self._status(stored, [], [f"{type(e).__name__}: {e}"], [], None)
                if status != stored.status:
                    await self.plane.registry.io(self.store.save_status, stored.spec.name, status)
            self.passes += 1

    async def _reconcile(self, stored: StoredSpec) -> dict:
        spec, name = stored.spec, stored.spec.name
        done: list[str] = []
        errors: list[str] = []
        if spec.canary is not None and self.traffic is not None:
            stored = await self._canary_outcome(stored, done)
            spec = stored.spec
        workers: dict[int, int] = {}
        for v in spec.needed():
            d = self._deployment(name, v)
            if d is None:
                try:
                    await self.plane.deploy(f"{name}:{v}", workers=spec.workers, strategy=spec.strategy,
                                            actor=RECONCILER)
                    done.append(f"deployed {name}:{v}")
                except ControlError as e:
                    errors.append(f"cannot deploy {name}:{v}: {e.message}")
                continue
            if d.version.kind != Kind.GENERATE:
                continue  # an embedding deployment has one worker and no strategy
            n = workers[v] = self._workers(spec, d)
            if d.num_workers != n:
                try:
                    await self.plane.scale(d.id, n, RECONCILER)
                    done.append(f"scaled {d.id} to {n}")
                except ControlError as e:
                    errors.append(f"cannot scale {d.id} to {n}: {e.message}")
            if d.strategy_name != spec.strategy:
                d.set_strategy(spec.strategy)
                done.append(f"{d.id} routes by {spec.strategy}")
        serving = all((d := self._deployment(name, v)) is not None and d.ready for v in spec.needed())
        steered = None
        if self.traffic is not None and serving and not errors:
            steered = await self._traffic(spec, done, errors)
            if spec.prediction_log is not None and self.traffic.log.mode(name) != spec.prediction_log:
                await self.traffic.set_log_mode(name, spec.prediction_log, RECONCILER)
                done.append(f"prediction log {spec.prediction_log}")
        if serving and not errors:
            needed = set(spec.needed())
            for d in [d for d in self.plane.deployments.list() if d.version.name == name]:
                if d.version.version not in needed and d.version.kind != Kind.LORA:
                    await self.plane.unload(d.id, RECONCILER)
                    done.append(f"unloaded {d.id}")
        waiting = [f"{name}:{v} is not ready" for v in spec.needed()
                   if (d := self._deployment(name, v)) is None or not d.ready
                   or (v in workers and d.num_workers != workers[v])]
        if done:
            logger.info("%s (generation %d): %s", name, stored.generation, "; ".join(done))
        return self._status(stored, done, errors, waiting, steered)

    def _deployment(self, name: str, version: int) -> Any:
        return next((d for d in self.plane.deployments.list()
                     if d.version.name == name and d.version.version == version), None)

    def _workers(self, spec: DeploymentSpec, d: Any) -> int:
        """The spec's worker count, or autoscaling's within its bounds."""
        a = spec.autoscaling
        if a is None:
            return spec.workers
        current = d.num_workers
        if not spec.min_workers <= current <= spec.max_workers:  # the bounds changed: at once
            self._wishes.pop(d.id, None)
            return max(spec.min_workers, min(spec.max_workers, current))
        st = d.stats  # the workers' figures summed (None before the first step)
        running, waiting, kv = (st.num_running, st.num_waiting, st.kv_usage) if st is not None else (0, 0, 0.0)
        target = wanted(a, current, running, waiting, kv, spec.min_workers, spec.max_workers)
        n, wish = decide(a, current, target, self._wishes.get(d.id), self.clock())
        if wish is None:
            self._wishes.pop(d.id, None)
        else:
            self._wishes[d.id] = wish
        return n

    async def _traffic(self, spec: DeploymentSpec, done: list[str], errors: list[str]) -> str | None:
        """Set the spec's traffic policy (or start its canary); returns what steers the traffic instead, if
        anything does (an experiment, a bandit: left alone)."""
        assert self.traffic is not None
        name = spec.name
        if name in self.traffic.experiment_of:
            return f"experiment {self.traffic.experiment_of[name]!r}"
        current = self.traffic.policies.get(name)
        if isinstance(current, BanditPolicy):
            return "a bandit"
        if spec.canary is not None:
            run = self.traffic.canaries.get(name)
            if run is not None and run.controller.config.canary == spec.canary.version:
                return None  # running (or just decided: the next pass reads the outcome)
            rec = await self.plane.registry.io(self.traffic.store.get, "canary", name)
            if run is None and rec is not None and rec["config"]["canary"] == spec.canary.version and \
                    rec.get("status") == "running":
                return "the canary run by another server sharing the database"
            if run is not None and run.controller.status == "running":
                await run.abort(RECONCILER, f"the spec of {name} rolls out version {spec.canary.version} instead")
            from servelm.control.canary_runner import start_canary

            try:
                await start_canary(self.traffic, spec.canary.config(name, spec.primary), RECONCILER)
                done.append(f"canary {name}:{spec.canary.version} started")
            except ControlError as e:
                errors.append(f"cannot start the canary of {name}:{spec.canary.version}: {e.message}")
            return None
        salt = current.salt if isinstance(current, TrafficPolicy) else ""
        want = spec.policy(salt)
        if current is None or current.to_dict() != want.to_dict():
            await self.traffic.set_policy(want, RECONCILER, "spec.traffic")
            done.append("traffic " + ", ".join(f"v{v.version}={v.weight:g}" for v in spec.versions))
        return None

    async def _canary_outcome(self, stored: StoredSpec, done: list[str]) -> StoredSpec:
        """A finished canary of the spec's canary version, written back into the spec."""
        assert self.traffic is not None and stored.spec.canary is not None
        spec, name, version = stored.spec, stored.spec.name, stored.spec.canary.version
        run = self.traffic.canaries.get(name)
        if run is not None and run.controller.config.canary == version:
            status, history = run.controller.status, run.history
        else:
            rec = await self.plane.registry.io(self.traffic.store.get, "canary", name)
            if rec is None or rec["config"]["canary"] != version:
                return stored
            status, history = rec.get("status"), rec.get("history") or []
        reasons = "; ".join(next((h["reasons"] for h in reversed(history)
                                  if h.get("action") in ("rollback", "abort", "promote")), []))
        reg = self.plane.registry
        if status == "promoted":
            new = spec.with_(versions=(VersionWeight(version, 1.0),), canary=None)
            stored = await reg.io(self.store.put, new, RECONCILER, "spec.canary_promoted")
            done.append(f"canary {name}:{version} promoted: it is the spec's version now")
        elif status == "rolled_back":
            stored = await reg.io(self.store.put, spec.with_(canary=None), RECONCILER, "spec.canary_rolled_back")
            self._notes[name] = (stored.generation, "CanaryRolledBack",
                                 f"the canary {name}:{version} was rolled back ({reasons or 'no reason given'}); "
                                 "it left the spec")
            done.append(f"canary {name}:{version} rolled back: it left the spec")
        return stored

    def _status(self, stored: StoredSpec, done: list[str], errors: list[str], waiting: list[str],
                steered: str | None) -> dict:
        spec, name = stored.spec, stored.spec.name
        canary = None
        run = self.traffic.canaries.get(name) if self.traffic is not None else None
        if run is not None and spec.canary is not None and run.controller.config.canary == spec.canary.version:
            c = run.controller
            canary = {"version": c.config.canary, "status": c.status, "step": c.step, "percent": c.percent}
        note = self._notes.get(name)
        if note is not None and note[0] != stored.generation:
            self._notes.pop(name)
            note = None
        now: dict[str, tuple[bool, str, str]] = {}
        if errors:
            now[DEGRADED] = (True, "ReconcileFailed", "; ".join(errors))
        elif canary is not None and canary["status"] == "failed":
            now[DEGRADED] = (True, "PromotionFailed", f"the canary {name}:{canary['version']} could not be promoted")
        elif note is not None:
            now[DEGRADED] = (True, note[1], note[2])
        else:
            now[DEGRADED] = (False, "Healthy", "no failures")
        if canary is not None and canary["status"] in ("running", "promoting"):
            now[PROGRESSING] = (True, "CanaryRunning", f"canary {name}:{canary['version']} at step {canary['step']} "
                                f"({canary['percent']:g}% of traffic)")
        elif errors:  # stuck until the spec or the registry changes: retried every pass, no progress
            now[PROGRESSING] = (False, "ReconcileFailed", "; ".join(errors))
        elif done or waiting:
            now[PROGRESSING] = (True, "Reconciling", "; ".join(done + waiting))
        else:
            now[PROGRESSING] = (False, "Converged", "the deployments match the spec")
        if errors:
            now[READY] = (False, "ReconcileFailed", "; ".join(errors))
        elif waiting:
            now[READY] = (False, "WorkersStarting", "; ".join(waiting))
        else:
            message = "every version the spec needs is serving"
            now[READY] = (True, "Serving", message + (f"; traffic is steered by {steered}" if steered else ""))
        before = (stored.status or {}).get("conditions")
        policy = self.traffic.policies.get(name) if self.traffic is not None else None
        return {
            "observed_generation": stored.generation,
            "conditions": conditions.merge(before, now),
            "deployments": [{"id": d.id, "version": d.version.version, "workers": getattr(d, "num_workers", 1),
                             "ready": bool(d.ready)}
                            for d in self.plane.deployments.list() if d.version.name == name],
            "traffic": policy.to_dict() if policy is not None else None,
            "canary": canary,
        }

    # -- operators' verbs --------------------------------------------------------------------------
    async def _on_verb(self, actor: str, action: str, before: dict | None, after: dict | None) -> None:
        """A deploy, scale, swap or unload made through the control plane: folded into its model's spec."""
        if actor in MANAGED:
            return
        name = (after or before or {}).get("name")
        if not name:
            return
        try:
            await self.plane.registry.io(self._adopt, name, actor,
                                         lambda spec: spec_adopt.on_deployment(spec, action, before, after))
        except Exception:  # the verb is done; the spec keeps what it had, and the log says so
            logger.exception("could not write the %s of %s into its spec", action, name)

    def _on_record(self, kind: str, key: str, record: dict | None, actor: str, action: str) -> None:
        """A traffic record changed (on the registry's writer thread): a policy, shadow, canary start or
        prediction-log mode set by an operator is folded into the model's spec."""
        if actor in MANAGED:
            return
        if kind == "policy" and action in ADOPTED_POLICY_ACTIONS:
            def change(spec):
                prod = self.plane.registry.production(key)
                return spec_adopt.on_policy(spec, action, record, prod.version if prod else None)
        elif kind == "logmode" and record is not None:
            def change(spec):
                return spec_adopt.on_log_mode(spec, record["mode"])
        elif kind == "canary" and action == "canary.start" and record is not None:
            def change(spec):
                return spec_adopt.on_canary_start(spec, record["config"])
        else:
            return
        try:
            self._adopt(key, actor, change)
        except Exception:
            logger.exception("could not write the %s of %s into its spec", action, key)

    def _adopt(self, name: str, actor: str, change: Callable[[DeploymentSpec], Any]) -> None:
        stored = self.store.get(name)
        if stored is None:
            return
        new = change(stored.spec)
        if new == spec_adopt.DELETE:
            self.store.delete(name, actor)
        elif new is not None and new != stored.spec:
            self.store.put(DeploymentSpec.from_dict(new.to_dict()), actor, "spec.adopt")  # checked as any spec
        self.kick()
