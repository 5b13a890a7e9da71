"""Deployment-spec admin routes under /admin (admin key; changes audited), and the reconciler's start with the
server: PUT/GET/DELETE /admin/specs/{name}, GET /admin/specs, GET /admin/specs/{name}/status. The spec's own
checks (control/spec.py) give the 400s, in OpenAI's error shape like every ControlError."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import Body, FastAPI, Request, Response

from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.reconciler import Reconciler
from servelm.control.spec import DeploymentSpec, parse_text
from servelm.server.common import record

logger = logging.getLogger("servelm.server")
STARTUP = "startup"  # the audit actor of the specs applied from --deployment-spec


def spec_file_problem(config: Any) -> str | None:
    """Why the --deployment-spec file cannot be applied (unreadable, not valid, no registry to apply it to),
    else None: checked before any model loads, so a mistake in it stops the start at once."""
    path = config.server.rollout_config.deployment_spec
    if not path:
        return None
    if not config.control_plane:
        return (f"--deployment-spec {path}: deployment specs need the model registry (give --data-dir or "
                "--database-url)")
    try:
        parse_text(Path(path).read_text(), path)
    except OSError as e:
        return f"--deployment-spec: cannot read {path}: {e.strerror or e}"
    except ControlError as e:
        return f"--deployment-spec: {e.message}"
    return None


async def start_reconciler(state: Any) -> Reconciler:
    """The reconciler over the server's control plane and traffic service, with the --deployment-spec file
    applied first (a file that does not parse stops the start: the operator asked for those specs)."""
    srv = state.config.server
    rec = Reconciler(state.control, state.traffic, srv.rollout_config.reconcile_interval_s)
    if srv.rollout_config.deployment_spec:
        path = Path(srv.rollout_config.deployment_spec)
        specs = parse_text(path.read_text(), str(path))
        for spec in specs:
            await rec.apply(spec, STARTUP)
        logger.info("deployment specs applied from %s: %s", path, ", ".join(s.name for s in specs) or "none")
    rec.start()
    return rec


def add_spec_routes(app: FastAPI, state: Any) -> None:
    rec: Reconciler = state.reconciler

    def actor(request: Request) -> str:
        return record(request).key_name

    @app.get("/admin/specs")
    async def list_specs() -> list[dict]:
        return [s.to_dict() for s in await rec.list()]

    @app.put("/admin/specs/{name}")
    async def put_spec(name: str, request: Request, body: dict[str, Any] = Body(
            description="a deployment spec (see the platform docs: versions, canary, shadow, workers, strategy, "
                        "prediction_log, autoscaling); `name` defaults to the path's")) -> dict:
        body = {"name": name, **body}
        if body["name"] != name:
            raise InvalidRequest(f"the spec names {body['name']!r} but the path {name!r}", code="invalid_spec",
                                 param="name")
        return (await rec.apply(DeploymentSpec.from_dict(body), actor(request))).to_dict()

    @app.get("/admin/specs/{name}")
    async def get_spec(name: str) -> dict:
        return (await rec.get(name)).to_dict()

    @app.get("/admin/specs/{name}/status")
    async def spec_status(name: str) -> dict:
        s = await rec.get(name)
        return {"name": name, "generation": s.generation, **(s.status or {"observed_generation": None,
                                                                           "conditions": []})}

    @app.delete("/admin/specs/{name}", status_code=204)
    async def delete_spec(name: str, request: Request):
        await rec.delete(name, actor(request))
        return Response(status_code=204)
