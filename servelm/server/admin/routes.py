"""The model platform's admin API under /admin (the gateway requires the admin key): models and versions
(register, list, show, validate, transition, delete, rollback; a LoRA adapter registers with its `base` version
and deploys into the workers of its base's deployment), deployments (create, scale, swap, unload),
the audit trail (GET verifies its hash chain) and artifact gc. Mounted when the server has a control plane
(`--data-dir`, `--registry-url`, or models declared in the config file). A refused operation is a
control.errors.ControlError, answered in OpenAI's error shape with the status server/errors.py maps its class to."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from servelm.control.types import MAX_VERSION
from servelm.server.common import record

VersionNumber = Annotated[int, Path(ge=1, le=MAX_VERSION, description="a version number")]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RegisterBody(_In):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    path: Annotated[str, Field(min_length=1, description="model folder or .gguf file on the server's machine")]
    labels: dict[str, str] | None = None
    engine: dict[str, Any] | None = Field(None, description="engine settings for this version's workers")
    golden_prompts: list[Annotated[str, Field(min_length=1)]] | None = None
    validate_now: bool = Field(False, alias="validate", description="validate it before answering")
    base: Annotated[str, Field(min_length=3, max_length=300)] | None = Field(
        None, description="NAME:VERSION of the generation model a LoRA adapter adapts: `path` is then a PEFT "
                          "adapter folder, registered as a version of kind lora")


class TransitionBody(_In):
    state: str = Field(description="the lifecycle state to move to, e.g. STAGING or PRODUCTION")
    reason: str | None = None


class RollbackBody(_In):
    reason: str | None = None


class DeployBody(_In):
    model: Annotated[str, Field(min_length=1, description="name:version, or name for its PRODUCTION version")]
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    strategy: str = Field("least_loaded", description="round_robin | least_loaded | memory_aware | prefix_aware")
    keep_alive_s: Annotated[float, Field(ge=0)] | None = None
    id: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$")] | None = None
    enable_lora: bool = Field(False, description="run its workers with LoRA enabled, so that adapter versions of "
                                                 "this version can be deployed into them")


class ScaleBody(_In):
    workers: Annotated[int, Field(ge=1, le=64)]


class SwapBody(_In):
    version: int | str = Field(description="a version number of the deployed model, or name:version")


class GcBody(_In):
    keep_last: Annotated[int, Field(ge=1)]


class VersionOut(BaseModel):
    name: str
    version: int
    ref: str
    state: str
    kind: str
    artifact: str
    sha256: str
    source: str
    architecture: str | None = None
    dtype: str | None = None
    size_bytes: int = 0
    num_params: int | None = None
    created_by: str
    created_at: float
    labels: dict[str, str] = {}
    engine: dict[str, Any] = {}
    golden_prompts: list[str] = []
    golden_outputs: list[str] = []
    failure: str | None = None
    base: str | None = None


class ModelOut(BaseModel):
    name: str
    production: str | None
    versions: list[VersionOut]


class DeploymentOut(BaseModel):
    id: str
    name: str
    version: int
    ref: str
    workers: int
    strategy: str
    keep_alive_s: float | None = None
    ready: bool = False
    in_flight: int = 0
    kind: str = "generate"
    enable_lora: bool = Field(False, description="its workers take LoRA adapters")
    adapters: list[str] = Field([], description="the adapter versions running on its workers")
    base: str | None = Field(None, description="an adapter deployment: the base version it adapts")
    base_deployment: str | None = Field(None, description="an adapter deployment: the deployment it runs on")
    worker_status: list[dict[str, Any]] = []


class AuditEntry(BaseModel):
    id: int
    at: float
    actor: str
    action: str
    target: str
    before: Any = None
    after: Any = None
    prev_hash: str
    hash: str


class AuditOut(BaseModel):
    ok: bool = Field(description="whether the hash chain verifies from the first entry to the last")
    first_bad_id: int | None = Field(description="the first entry that does not match its hash or its link")
    entries: list[AuditEntry]


def add_admin_routes(app: FastAPI, state) -> None:
    """The /admin model and deployment routes over `state.control` (a ControlPlane)."""
    cp = state.control

    def actor(request: Request) -> str:
        return record(request).key_name

    def model_out(name: str) -> ModelOut:
        versions = cp.registry.versions(name)
        if not versions:
            cp.version(name)  # 404 naming the models there are
        prod = cp.registry.production(name)
        return ModelOut(name=name, production=prod.ref if prod else None,
                        versions=[VersionOut(**v.to_dict()) for v in versions])

    # -- models and versions -------------------------------------------------------------------------
    @app.get("/admin/models", response_model=list[ModelOut])
    async def list_models():
        return [model_out(n) for n in cp.registry.models()]

    @app.post("/admin/models", response_model=VersionOut, status_code=201)
    async def register(body: RegisterBody, request: Request):
        mv = await cp.register(body.name, body.path, labels=body.labels, engine=body.engine,
                               golden_prompts=body.golden_prompts, actor=actor(request), validate=body.validate_now,
                               base=body.base)
        return mv.to_dict()

    @app.get("/admin/models/{name}", response_model=ModelOut)
    async def show_model(name: str):
        return model_out(name)

    @app.get("/admin/models/{name}/versions/{version}", response_model=VersionOut)
    async def show_version(name: str, version: VersionNumber):
        return cp.registry.get(name, version).to_dict()

    @app.post("/admin/models/{name}/versions/{version}/validate", response_model=VersionOut)
    async def validate(name: str, version: VersionNumber, request: Request):
        return (await cp.validate(name, version, actor(request))).to_dict()

    @app.post("/admin/models/{name}/versions/{version}/transition", response_model=VersionOut)
    async def transition(name: str, version: VersionNumber, body: TransitionBody, request: Request):
        return (await cp.transition(name, version, body.state, actor(request), body.reason)).to_dict()

    @app.delete("/admin/models/{name}/versions/{version}", status_code=204)
    async def delete_version(name: str, version: VersionNumber, request: Request):
        await cp.delete(name, version, actor(request))
        return Response(status_code=204)

    @app.post("/admin/models/{name}/rollback", response_model=VersionOut)
    async def rollback(name: str, request: Request, body: RollbackBody | None = None):
        return (await cp.rollback(name, actor(request), body.reason if body else None)).to_dict()

    # -- deployments -------------------------------------------------------------------------------
    @app.get("/admin/deployments", response_model=list[DeploymentOut])
    async def list_deployments():
        return cp.list_deployments()

    @app.post("/admin/deployments", response_model=DeploymentOut, status_code=201)
    async def deploy(body: DeployBody, request: Request):
        return await cp.deploy(body.model, workers=body.workers, strategy=body.strategy, actor=actor(request),
                               keep_alive_s=body.keep_alive_s, deployment_id=body.id, enable_lora=body.enable_lora)

    @app.get("/admin/deployments/{deployment_id}", response_model=DeploymentOut)
    async def show_deployment(deployment_id: str):
        return cp.describe(deployment_id)

    @app.patch("/admin/deployments/{deployment_id}", response_model=DeploymentOut)
    async def scale(deployment_id: str, body: ScaleBody, request: Request):
        return await cp.scale(deployment_id, body.workers, actor(request))

    @app.post("/admin/deployments/{deployment_id}/swap", response_model=DeploymentOut)
    async def swap(deployment_id: str, body: SwapBody, request: Request):
        return await cp.swap(deployment_id, str(body.version), actor(request))

    @app.delete("/admin/deployments/{deployment_id}", status_code=204)
    async def unload(deployment_id: str, request: Request):
        await cp.unload(deployment_id, actor(request))
        return Response(status_code=204)

    # -- audit and storage -------------------------------------------------------------------------
    @app.get("/admin/audit", response_model=AuditOut)
    async def audit(target: str | None = None, limit: Annotated[int, Field(ge=1, le=100000)] | None = None):
        ok, bad = await cp.registry.io(cp.registry.audit.verify)
        entries = await cp.registry.io(cp.registry.audit.entries, target=target)
        return {"ok": ok, "first_bad_id": bad, "entries": entries[-limit:] if limit else entries}

    @app.post("/admin/gc")
    async def gc(body: GcBody, request: Request) -> dict:
        return {"removed": await cp.gc(body.keep_last, actor(request))}
