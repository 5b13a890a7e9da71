"""The gRPC server that `servelm serve --grpc-port` runs beside HTTP, in the same process and event loop.

Sharing the process means sharing everything a request touches: the engines, the admission state (rate-limit
buckets, load shedding), the key store and its auth-failure limiter, and the metrics registry that
/metrics exports. It serves servelm.v1.Llm, the Open Inference Protocol's GRPCInferenceService where the
server has non-LLM models, grpc.health.v1.Health and server reflection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger("servelm.server")


def missing_extra() -> str | None:
    """None when the grpc extra is installed, else what to install."""
    try:
        import grpc  # noqa: F401
        import grpc_health.v1.health  # noqa: F401
        import grpc_reflection.v1alpha.reflection  # noqa: F401
        import grpc_tools  # noqa: F401
    except ImportError as e:
        return f"--grpc-port needs the grpc extra (pip install 'servelm[grpc]'): {e}"
    return None


class RpcServer:
    """A grpc.aio server bound at construction (a port in use fails before any model loads) and started once
    the HTTP app is built."""

    def __init__(self, host: str, port: int) -> None:
        import grpc

        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self.server.add_insecure_port(address)  # RuntimeError when it cannot bind
        self.health = None
        self._stopping = None
        self._follow = None

    async def start(self, gateway) -> None:
        """Add the services over the HTTP gateway's state (and its app's Open Inference Protocol runtime,
        `app.state.oip`, shared with the /v2 routes) and start serving."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        from servelm.server.common import Api
        from servelm.server.oip.routes import server_ready
        from servelm.server.rpc.context import Calls
        from servelm.server.rpc.llm_service import SERVICE, LlmService, pb_grpc

        calls = Calls(gateway)
        pb_grpc.add_LlmServicer_to_server(LlmService(Api(gateway.state), calls), self.server)
        names = [SERVICE]
        oip = getattr(gateway.app.state, "oip", None)
        if oip is not None:
            from servelm.server.rpc.oip_service import SERVICE as OIP
            from servelm.server.rpc.oip_service import add_oip_service

            add_oip_service(self.server, oip, calls)
            names.append(OIP)
        self.health = _Health(gateway.state, ("", *names))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        await self.server.start()
        for name in ("", *names):  # known at once (Check for an unset name is NOT_FOUND); the task corrects it
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._follow = asyncio.ensure_future(follow_readiness(self.health, lambda: server_ready(gateway.state),
                                                              ("", *names)))
        logger.info("gRPC on port %d: %s", self.port, ", ".join(names))

    def begin_stop(self, grace: float) -> None:
        """Start stopping (on SIGTERM, beside HTTP's drain): refuse new calls, report NOT_SERVING, let in-flight
        calls finish for up to `grace` seconds, then cancel the rest."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))

    async def stop(self, grace: float) -> None:
        self.begin_stop(grace)
        await self._stopping

    async def _stop(self, grace: float) -> None:
        if self._follow is not None:
            self._follow.cancel()
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def follow_readiness(health, ready: Callable[[], bool], names: tuple[str, ...], every_s: float = 0.25) -> None:
    """Keep the health service's status of `names` at SERVING while `ready()` holds and NOT_SERVING while it
    does not, so that `Watch` streams see an engine go down and come back (`Check` also asks `ready()` itself,
    so it never lags). Runs until cancelled; after a graceful shutdown began the servicer ignores updates."""
    from grpc_health.v1 import health_pb2

    last = None
    while True:
        now = ready()
        if now != last:
            status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in names:
                await health.set(name, status)
            last = now
        await asyncio.sleep(every_s)  # a poll: readiness is a property of the engines, with no event to wait on


def _Health(state, ours: tuple[str, ...]):
    """The standard health service, where the server's own names answer NOT_SERVING while its engines are
    not ready (as /ready does), not only while the gRPC server is down."""
    from grpc_health.v1 import health, health_pb2

    from servelm.server.oip.routes import server_ready

    class Health(health.aio.HealthServicer):
        async def Check(self, request, context):
            if request.service in ours and not server_ready(state):
                return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
            return await super().Check(request, context)

    return Health()
