"""The Open Inference Protocol's REST API for non-LLM models: /v2 health, server and model metadata, model
readiness and inference (JSON, or with the binary tensor data extension)."""

from __future__ import annotations

import asyncio
import contextlib
import functools

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from servelm.control.errors import ControlError
from servelm.server.common import record, wait_disconnect
from servelm.server.errors import control_api_error
from servelm.server.oip.codec import HEADER, decode_rest, encode_rest, error_body
from servelm.server.oip.runtime import OipModels
from servelm.server.openai.protocol import APIError

SERVER_METADATA = {"name": "servelm", "version": "0.1.0", "extensions": ["binary_tensor_data"]}


def server_ready(state) -> bool:
    return all(m.check_engine() for m in state.models.fixed())


def oip_errors(fn):
    """Answer a route's errors in the protocol's shape (see oip_codec.error_body)."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except ControlError as e:
            err = control_api_error(e)
        except APIError as e:
            err = e
        return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)
    return wrapper


def add_routes(app: FastAPI, state) -> OipModels:
    """Add the /v2 routes; returns the model runtime they share with the gRPC service."""
    oip = OipModels(state)

    @app.get("/v2/health/live")
    @oip_errors
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    @oip_errors
    async def ready():
        if not server_ready(state):
            raise APIError(503, "the server is not ready", code="engine_unavailable")
        return {"ready": True}

    @app.get("/v2")
    @oip_errors
    async def server_metadata():
        return SERVER_METADATA

    async def model(request: Request, name: str, version: str | None):
        mv = await oip.resolve(name, version, record(request).api_key)
        return mv, await oip.load(mv)

    @app.get("/v2/models/{name}")
    @oip_errors
    async def model_metadata(name: str, request: Request):
        mv, loaded = await model(request, name, None)
        return oip.metadata(mv, loaded)

    @app.get("/v2/models/{name}/versions/{version}")
    @oip_errors
    async def version_metadata(name: str, version: str, request: Request):
        mv, loaded = await model(request, name, version)
        return oip.metadata(mv, loaded)

    @app.get("/v2/models/{name}/ready")
    @oip_errors
    async def model_ready(name: str, request: Request):
        mv, _ = await model(request, name, None)
        return {"name": name, "version": str(mv.version), "ready": True}

    @app.get("/v2/models/{name}/versions/{version}/ready")
    @oip_errors
    async def version_ready(name: str, version: str, request: Request):
        mv, _ = await model(request, name, version)
        return {"name": name, "version": str(mv.version), "ready": True}

    async def infer(request: Request, name: str, version: str | None) -> Response:
        rec = record(request)
        mv = await oip.resolve(name, version, rec.api_key)
        inputs, outputs, binary, params, rid = decode_rest(await request.body(), request.headers.get(HEADER))
        task = asyncio.ensure_future(oip.infer(rec, mv, inputs, outputs, params))
        watcher = asyncio.create_task(wait_disconnect(request))
        try:  # a client that leaves takes its request out of the queue
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task not in done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise APIError(499, "client disconnected")
        body, headers = encode_rest(mv.name, str(mv.version), rid, task.result(), binary)
        return Response(body, headers=headers)

    @app.post("/v2/models/{name}/infer")
    @oip_errors
    async def model_infer(name: str, request: Request):
        return await infer(request, name, None)

    @app.post("/v2/models/{name}/versions/{version}/infer")
    @oip_errors
    async def version_infer(name: str, version: str, request: Request):
        return await infer(request, name, version)

    app.state.oip = oip
    return oip
