"""Traffic-management admin routes under /admin (admin key; every change audited through the PolicyStore or
the registry's audit trail): a model's traffic policy, canary rollouts, shadow mirroring, experiments, drift
reports and the prediction log (read, GDPR erasure). Bodies are pydantic models, so they appear in
/openapi.json; the decisions are the traffic service's (control/traffic_service.py), and a refused operation is a
control refusal in OpenAI's error shape."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from servelm.control.canary import CanaryConfig
from servelm.control.canary_runner import start_canary
from servelm.control.errors import NotFound
from servelm.control.traffic import TrafficPolicy
from servelm.control.types import MAX_VERSION
from servelm.server.common import record

Version = Annotated[int, Field(ge=1, le=MAX_VERSION)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ArmIn(_In):
    version: Version
    weight: Annotated[float, Field(ge=0)] = 1.0
    name: str = Field("", description="the arm's label (default v<version>)")


class SegmentIn(_In):
    version: Version
    name: str = ""
    key_names: list[str] = Field([], description="API key names this rule matches")
    key_groups: list[str] = []
    headers: dict[str, str | list[str]] = Field({}, description="header name -> accepted value(s)")
    metadata: dict[str, Any] = {}
    flags: list[str] = []


class ShadowIn(_In):
    version: Version
    fraction: Annotated[float, Field(ge=0, le=1)] = 1.0
    source: Version | None = Field(None, description="mirror only what this version serves (default: any)")


class TrafficBody(_In):
    arms: Annotated[list[ArmIn], Field(min_length=1)]
    sticky: bool = Field(False, description="same user -> same version (user, x-servelm-user, or key name)")
    segments: list[SegmentIn] = Field([], description="ordered rules; the first that matches wins")
    shadow: ShadowIn | None = None
    salt: str = ""


class BanditBody(_In):
    versions: Annotated[list[Version], Field(min_length=2)]
    min_share: Annotated[float, Field(ge=0, le=1)] = Field(0.05, description="least share of traffic per version")
    lo: float = Field(0.0, description="the feedback score that counts as no reward")
    hi: float = Field(1.0, description="the feedback score that counts as full reward")


class CanaryBody(_In):
    version: Version = Field(description="the version to roll out (STAGING_TESTED or CANARY, deployed)")
    production: Version | None = Field(None, description="default: the model's PRODUCTION version")
    steps: list[Annotated[float, Field(gt=0, le=100)]] = [1.0, 5.0, 25.0, 100.0]
    min_requests: Annotated[int, Field(ge=1)] = 200
    min_seconds: Annotated[float, Field(ge=0)] = 300.0
    thresholds: dict[str, float] | None = Field(None, description="alpha, error_margin, latency_ratio, "
                                                "feedback_margin, min_samples")


class AbortBody(_In):
    reason: str | None = None


class ExperimentBody(TrafficBody):
    name: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$")]
    model: Annotated[str, Field(min_length=1)]
    baseline: str | None = Field(None, description="the arm the others are compared with (default: the first)")


class ModeBody(_In):
    mode: str = Field(description="off | metadata | full")


def add_traffic_routes(app: FastAPI, state) -> None:
    """The routes over `state.traffic` (a TrafficService)."""
    svc, cp = state.traffic, state.control

    def actor(request: Request) -> str:
        return record(request).key_name

    def policy_of(name: str, body: TrafficBody) -> TrafficPolicy:
        policy = TrafficPolicy.from_dict({"model": name, **body.model_dump()})
        for v in sorted(policy.versions()):
            cp.registry.get(name, v)  # 404 naming a version that does not exist
        return policy

    # -- policies ----------------------------------------------------------------------------------
    @app.put("/admin/models/{name}/traffic")
    async def put_traffic(name: str, body: TrafficBody, request: Request) -> dict:
        svc._check_free(name)
        policy = policy_of(name, body)
        await svc.set_policy(policy, actor(request))
        return policy.to_dict()

    @app.get("/admin/models/{name}/traffic")
    async def get_traffic(name: str) -> dict:
        policy = svc.policies.get(name)
        if policy is None:
            raise NotFound(f"{name} has no traffic policy (requests go to its PRODUCTION version)",
                           code="not_found", param="name")
        return policy.to_dict()

    @app.delete("/admin/models/{name}/traffic", status_code=204)
    async def delete_traffic(name: str, request: Request):
        svc._check_free(name)
        await svc.clear_policy(name, actor(request))
        return Response(status_code=204)

    @app.put("/admin/models/{name}/bandit")
    async def put_bandit(name: str, body: BanditBody, request: Request) -> dict:
        policy = await svc.set_bandit(name, body.versions, actor(request), min_share=body.min_share, lo=body.lo,
                                      hi=body.hi)
        return policy.to_dict()

    # -- canary ------------------------------------------------------------------------------------
    @app.post("/admin/models/{name}/canary", status_code=201)
    async def canary_start(name: str, body: CanaryBody, request: Request) -> dict:
        prod = body.production or (p.version if (p := cp.registry.production(name)) else 0)
        cfg = CanaryConfig.from_dict({"model": name, "production": prod, "canary": body.version,
                                      "steps": body.steps, "min_requests": body.min_requests,
                                      "min_seconds": body.min_seconds, "thresholds": body.thresholds or {}})
        run = await start_canary(svc, cfg, actor(request))
        return run.status()

    def canary(name: str):
        run = svc.canaries.get(name)
        if run is None:
            raise NotFound(f"{name} has no canary", code="not_found", param="name")
        return run

    @app.get("/admin/models/{name}/canary")
    async def canary_status(name: str) -> dict:
        """The rollout this server runs, else the one stored in the database (run, or decided, by another server
        sharing it): its status, step and decision history as last saved."""
        return await svc.canary_status(name)

    @app.post("/admin/models/{name}/canary/abort")
    async def canary_abort(name: str, request: Request, body: AbortBody | None = None) -> dict:
        run = canary(name)
        await run.abort(actor(request), (body.reason if body else None) or "aborted by an operator")
        return run.status()

    # -- shadow ------------------------------------------------------------------------------------
    @app.put("/admin/models/{name}/shadow")
    async def put_shadow(name: str, body: ShadowIn, request: Request) -> dict:
        policy = await svc.set_shadow(name, body.model_dump(), actor(request))
        return policy.to_dict()

    @app.get("/admin/models/{name}/shadow")
    async def get_shadow(name: str) -> dict:
        policy = svc.policies.get(name)
        mirror = svc.mirrors.get(name)
        return {"model": name, "shadow": policy.to_dict()["shadow"] if policy else None,
                "queued": mirror.queue.qsize() if mirror else 0,
                "stats": mirror.stats.summary() if mirror else None}

    @app.delete("/admin/models/{name}/shadow", status_code=204)
    async def delete_shadow(name: str, request: Request):
        await svc.clear_shadow(name, actor(request))
        return Response(status_code=204)

    # -- experiments -------------------------------------------------------------------------------
    @app.post("/admin/experiments", status_code=201)
    async def experiment_start(body: ExperimentBody, request: Request) -> dict:
        fields = body.model_dump(exclude={"name", "model", "baseline"})
        exp = await svc.start_experiment(body.name, policy_of(body.model, TrafficBody(**fields)), body.baseline,
                                   actor(request))
        return exp.report()

    @app.get("/admin/experiments")
    async def experiment_list() -> list[dict]:
        return [{"name": e.name, "model": e.policy["model"], "started_at": e.started_at, "stopped_at": e.stopped_at}
                for e in svc.experiments.values()]

    @app.get("/admin/experiments/{exp_id}")
    async def experiment_report(exp_id: str) -> dict:
        return svc.experiment(exp_id).report()

    @app.post("/admin/experiments/{exp_id}/stop")
    async def experiment_stop(exp_id: str, request: Request) -> dict:
        return (await svc.stop_experiment(exp_id, actor(request))).report()

    # -- drift -------------------------------------------------------------------------------------
    @app.get("/admin/drift/{model}")
    async def drift(model: str) -> dict:
        # the windows are copied here, on the loop that appends to them: iterating the live deques in the
        # thread raced with requests finishing ("deque mutated during iteration", a 500)
        return await asyncio.to_thread(svc.drift_report, model, svc.watch.snapshot(model))

    @app.post("/admin/drift/{model}/reference")
    async def drift_reference(model: str, request: Request) -> dict:
        n = svc.watch.set_reference(model)
        cp.registry.audit.record(actor(request), "drift.reference", f"model:{model}", None, {"requests": n})
        return {"model": model, "reference_requests": n}

    # -- prediction log ----------------------------------------------------------------------------
    @app.get("/admin/predictions")
    async def predictions(user: str | None = None, model: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=100000)] = 1000) -> list[dict]:
        return await asyncio.to_thread(svc.log.entries, user=user, model=model, limit=limit)

    @app.delete("/admin/predictions")
    async def erase(request: Request, user: Annotated[str, Query(min_length=1)]) -> dict:
        removed = await asyncio.to_thread(svc.log.erase_user, user)
        # the audit trail is permanent and hash-chained: it names the erased user by a keyed hash, never the id
        who = await asyncio.to_thread(svc.store.pseudonym, user)
        cp.registry.audit.record(actor(request), "predictions.erase", f"user:{who}", None, {"removed": removed})
        return {"user": user, "removed": removed}

    @app.put("/admin/models/{name}/prediction-log")
    async def set_mode(name: str, body: ModeBody, request: Request) -> dict:
        await svc.set_log_mode(name, body.mode, actor(request))
        return {"model": name, "mode": body.mode}
