"""inference.GRPCInferenceService: the Open Inference Protocol over gRPC, over the same model runtime
(`servelm.server.oip.runtime.OipModels`: registry versions, batchers, metrics) as the REST routes. Liveness and
readiness are open, as /v2/health/* are; the other calls need a key where the server has keys."""

from __future__ import annotations

from servelm.server.oip.codec import decode_grpc, encode_grpc
from servelm.server.oip.routes import SERVER_METADATA, server_ready
from servelm.server.oip.runtime import OipModels
from servelm.server.rpc.context import Calls
from servelm.server.rpc.stubs import load

pb, pb_grpc = load("servelm_oip_v2")
SERVICE = "inference.GRPCInferenceService"


class OipService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, oip: OipModels, calls: Calls) -> None:
        self.oip, self.calls = oip, calls

    def _path(self, what: str) -> str:
        return f"/{SERVICE}/{what}"

    async def ServerLive(self, request, context):
        async with self.calls.unary(context, self._path("ServerLive"), open_access=True):
            return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        async with self.calls.unary(context, self._path("ServerReady"), open_access=True):
            return pb.ServerReadyResponse(ready=server_ready(self.oip.state))

    async def ServerMetadata(self, request, context):
        async with self.calls.unary(context, self._path("ServerMetadata")):
            return pb.ServerMetadataResponse(**SERVER_METADATA)

    async def ModelReady(self, request, context):
        async with self.calls.unary(context, self._path("ModelReady")) as req:
            mv = await self.oip.resolve(request.name, request.version or None, req.record.api_key)
            await self.oip.load(mv)
            return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(self, request, context):
        async with self.calls.unary(context, self._path("ModelMetadata")) as req:
            mv = await self.oip.resolve(request.name, request.version or None, req.record.api_key)
            meta = self.oip.metadata(mv, await self.oip.load(mv))
            return pb.ModelMetadataResponse(
                name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["inputs"]],
                outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["outputs"]])

    async def ModelInfer(self, request, context):
        async with self.calls.unary(context, self._path("ModelInfer")) as req:
            rec = req.record
            mv = await self.oip.resolve(request.model_name, request.model_version or None, rec.api_key)
            inputs, outputs, params = decode_grpc(request)
            result = await self.oip.infer(rec, mv, inputs, outputs, params)
            return encode_grpc(pb, mv.name, str(mv.version), request.id, result)


def add_oip_service(server, oip: OipModels, calls: Calls) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(OipService(oip, calls), server)
