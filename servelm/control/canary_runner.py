"""A running canary: a background task that asks its CanaryController for a decision every
`canary_interval_s` and applies it.

- advance: the next step's split becomes the model's traffic policy (audited);
- rollback (a check failed, or an operator aborted): traffic to the canary goes to 0 at once (policy first,
  so no new request reaches it; requests it is serving finish normally), the version -> ROLLBACK in the
  registry, audit entries, servelm:canary_rollbacks_total;
- promote (a clean last step): the control plane's zero-downtime promotion (CANARY -> PRODUCTION, swapping
  the production deployment where the canary has none of its own), then the policy is removed so the bare
  name goes to the new PRODUCTION version; servelm:canary_promotions_total.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from servelm.control.canary import ADVANCE, PROMOTE, ROLLBACK, CanaryConfig, CanaryController, CanaryDecision
from servelm.control.errors import Conflict, ControlError
from servelm.control.types import State

logger = logging.getLogger("servelm.traffic")
SYSTEM = "system"


class CanaryRun:
    """One model's rollout, owned by the TrafficService (`svc`)."""

    def __init__(self, svc: Any, config: CanaryConfig, interval_s: float,
                 controller: CanaryController | None = None, history: list[dict] | None = None) -> None:
        self.svc, self.interval = svc, interval_s
        self.controller = controller or CanaryController(config, time.monotonic)
        self.last: CanaryDecision | None = None
        self.history: list[dict] = list(history or [])
        self.task: asyncio.Task | None = None

    @classmethod
    def resume(cls, svc: Any, record: dict, interval_s: float) -> CanaryRun:
        """A stored rollout that was running when the server stopped, at its step (its windows start again),
        evaluated again from now on."""
        ctl = CanaryController.from_dict(record, time.monotonic)
        run = cls(svc, ctl.config, interval_s, ctl, record.get("history"))
        run.task = asyncio.create_task(run._loop())
        return run

    @property
    def name(self) -> str:
        return self.controller.config.model

    async def start(self, actor: str) -> None:
        await self._save(actor, "canary.start")
        await self.svc.set_policy(self.controller.policy(), actor, "canary.traffic")
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def status(self) -> dict:
        c = self.controller
        return {"model": self.name, "status": c.status, "step": c.step, "percent": c.percent,
                "config": c.config.to_dict(),
                "windows": {f"v{v}": w.summary() for v, w in c.windows.items()},
                "last_decision": self.last.to_dict() if self.last else None, "history": self.history}

    async def _loop(self) -> None:
        while self.controller.status == "running":
            await asyncio.sleep(self.interval)
            try:
                await self.apply(self.controller.evaluate())
            except Exception:  # keep evaluating: one failed application must not end the rollout unseen
                logger.exception("canary of %s: applying a decision failed", self.name)

    async def apply(self, d: CanaryDecision, actor: str = SYSTEM) -> None:
        """Carry out one decision (hold: nothing)."""
        self.last = d
        if d.action not in (ADVANCE, PROMOTE, ROLLBACK):
            return
        self.history.append({"at": time.time(), "action": d.action, "step": d.step, "percent": d.percent,
                             "reasons": d.reasons})
        cfg = self.controller.config
        logger.warning("canary %s:%d %s at step %d: %s", cfg.model, cfg.canary, d.action, d.step, "; ".join(d.reasons))
        if d.action == ADVANCE:
            await self.svc.set_policy(self.controller.policy(), actor, "canary.advance")
            await self._save(actor, "canary.advance")
        elif d.action == ROLLBACK:
            await self._rollback(actor, "; ".join(d.reasons), "automatic" if actor == SYSTEM else "aborted")
        else:
            try:
                await self.svc.cp.transition(cfg.model, cfg.canary, State.PRODUCTION.value, actor,
                                             f"canary promoted: {'; '.join(d.reasons)}")
            except Exception as e:  # the status must not claim a promotion that did not happen; alert on it
                # counted and recorded before the status says so: whoever reads "failed" finds both
                self.svc.metrics.canary_failures.labels(cfg.model, str(cfg.canary)).inc()
                self.history.append({"at": time.time(), "action": "promotion_failed", "step": d.step,
                                     "percent": self.controller.percent, "reasons": [f"{type(e).__name__}: {e}"]})
                self.controller.promotion_applied(False)
                await self._save(actor, "canary.promote_failed")
                self._notify("canary.promotion_failed", f"{type(e).__name__}: {e}", actor)
                raise
            # the policy cleared and the promotion counted before the status says so: whoever reads
            # "promoted" finds the new version serving alone and the metric counted
            if cfg.model in self.svc.policies:
                await self.svc.clear_policy(cfg.model, actor)
            self.svc.metrics.promotions.labels(cfg.model, str(cfg.canary)).inc()
            self.controller.promotion_applied(True)
            await self._save(actor, "canary.promote")

    async def abort(self, actor: str, reason: str) -> None:
        """An operator's rollback: as an automatic one, with their name and reason."""
        if self.controller.status != "running":
            raise Conflict(f"the canary of {self.name} is {self.controller.status} already",
                           code="canary_finished")
        self.controller.status = "rolled_back"
        self.history.append({"at": time.time(), "action": "abort", "step": self.controller.step, "percent": 0.0,
                             "reasons": [reason]})
        await self.stop()
        await self._rollback(actor, reason, "aborted")

    async def _rollback(self, actor: str, reason: str, kind: str) -> None:
        cfg = self.controller.config
        policy = self.controller.policy()
        self.svc.apply_policy(policy)  # canary traffic -> 0 at once, before anything is written
        await self.svc.set_policy(policy, actor, "canary.rollback")
        reg = self.svc.cp.registry
        try:
            if reg.get(cfg.model, cfg.canary).state == State.CANARY:
                await asyncio.to_thread(reg.transition, cfg.model, cfg.canary, State.ROLLBACK, actor,
                                        f"canary rolled back: {reason}")
        finally:
            await self._save(actor, "canary.rollback")
            self.svc.metrics.rollbacks.labels(cfg.model, str(cfg.canary), kind).inc()
            self._notify("canary.rollback", reason, actor, kind=kind)

    def _notify(self, event: str, reason: str, actor: str, **more: Any) -> None:
        """Tell the operator (the service's webhook); never waits."""
        notify = getattr(self.svc, "notify", None)
        if notify is not None:
            c = self.controller
            notify({"event": event, "model": self.name, "version": c.config.canary,
                    "production": c.config.production, "step": c.step, "reason": reason, "actor": actor, **more})

    async def _save(self, actor: str, action: str) -> None:
        record = {**self.controller.to_dict(), "history": self.history}
        await self.svc.write(self.svc.store.put, "canary", self.name, record, actor, action)


async def start_canary(svc: Any, config: CanaryConfig, actor: str) -> CanaryRun:
    """Check and start a rollout of `config.canary` against the model's PRODUCTION version: the canary
    version moves STAGING_TESTED -> CANARY (or is CANARY already), both versions must be deployed."""
    reg, name = svc.cp.registry, config.model
    svc._check_free(name)
    prod = reg.production(name)
    if prod is None or prod.version != config.production:
        raise Conflict(f"{name}:{config.production} is not the PRODUCTION version of {name} "
                       f"(that is {prod.ref if prod else 'none'})", code="not_production", param="production")
    mv = reg.get(name, config.canary)
    if mv.state not in (State.STAGING_TESTED, State.CANARY):
        raise Conflict(f"{mv.ref} is {mv.state.value}; a canary starts from STAGING_TESTED (or CANARY)",
                       code="illegal_transition", param="version")
    for v in (config.production, config.canary):
        try:
            svc.cp.deployments.resolve(f"{name}:{v}")
        except ControlError:
            raise Conflict(f"{name}:{v} is not deployed; deploy it before the canary starts",
                           code="not_deployed", param="version") from None
    if mv.state == State.STAGING_TESTED:
        await asyncio.to_thread(reg.transition, name, config.canary, State.CANARY, actor, "canary started")
    old = svc.canaries.get(name)
    if old is not None:
        await old.stop()
    run = svc.canaries[name] = CanaryRun(svc, config, svc.cfg.rollout_config.canary_interval_s)
    await run.start(actor)
    return run
