"""RayServeEngine: the AsyncEngine surface (what servelm's HTTP layer calls) over a Ray Serve deployment of
EngineReplicas. Ray Serve's router picks the replica for each request (the least queued of two, with the
replicas' own queue lengths); servelm's registry, keys, admission, traffic policies and metrics stay in the
API process, unchanged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

from servelm.config.engine import EngineConfig, RuntimeSettings
from servelm.engine.step_outputs import EngineStats
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.worker.client import EngineDeadError, RequestRejected

logger = logging.getLogger("servelm.ray")
STATS_EVERY_S = 1.0  # how often the API process asks a replica for its engine counters


def _replica_lost(e: BaseException) -> bool:
    """Whether an error means the replica (not the request) failed: its actor died or became unreachable."""
    from ray import exceptions as rex

    lost = (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError, rex.NodeDiedError)
    return isinstance(e, lost) or isinstance(getattr(e, "cause", None), lost)


class RayServeEngine:
    """The EngineClient (worker/engine_client.py) of one served model, whose workers are the replicas of a Ray Serve deployment. `deploy` is a
    callable that (blocking) deploys the application and returns its DeploymentHandle."""

    def __init__(self, config: EngineConfig, deploy, start_timeout: float = 600.0, max_resends: int = 3) -> None:
        self.config, self._deploy, self.start_timeout, self.max_resends = config, deploy, start_timeout, max_resends
        self.tokenizer = None
        self.handle = None
        self.ready = False
        self.info = None  # max_model_len, vocab_size
        self.stats: EngineStats | None = None
        self.restarts = 0  # replicas found lost by requests (Ray Serve replaces them)
        self.resent = 0  # requests re-sent after their replica was lost before producing output
        self.engine_pid = None
        self.last_heard = 0.0
        self._streams: dict[str, bool] = {}  # request id -> started (has output)
        self._launch: asyncio.Future | None = None
        self._stats_task: asyncio.Task | None = None
        self.on_step = self.on_ready = self.on_down = None

    # -- lifecycle (as AsyncEngine) ------------------------------------------------------------------
    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # the API process tokenizes; the replicas detokenize

    def launch(self) -> None:
        """Deploy the replicas without waiting (they load the model while the API process loads the tokenizer)."""
        self._launch = asyncio.ensure_future(asyncio.to_thread(self._deploy))

    async def wait_ready(self) -> None:
        timeout = self.start_timeout or None
        self.handle = await asyncio.wait_for(self._launch, timeout)
        info = await asyncio.wait_for(self.handle.ready.remote(), timeout)
        self.info = SimpleNamespace(**info, pid=None)
        await self._refresh_stats()
        self.ready, self.last_heard = True, time.monotonic()
        self._stats_task = asyncio.create_task(self._stats_loop())
        if self.on_ready is not None and self.stats is not None:
            self.on_ready(SimpleNamespace(stats=self.stats), False)

    async def start(self) -> None:
        self.launch()
        await self.wait_ready()

    async def shutdown(self) -> None:
        self.ready = False
        if self._stats_task is not None:
            self._stats_task.cancel()

    # -- health and load -------------------------------------------------------------------------------
    def check_engine(self) -> bool:
        return self.ready

    async def ping(self) -> None:
        await self._refresh_stats()

    async def _refresh_stats(self) -> None:
        try:
            reply = await self.handle.stats.remote()
        except Exception as e:  # a replica on its way out: the next poll reaches another one
            logger.debug("replica stats: %s", e)
            return
        self.last_heard = time.monotonic()
        if reply["stats"] is not None:
            self.stats = EngineStats(**reply["stats"])

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            await self._refresh_stats()

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info else 0

    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_queued(self) -> int:
        return sum(1 for started in self._streams.values() if not started)

    def live_counts(self) -> tuple[int, int]:
        """(running, waiting) from the API process's own registry: a request waits until its first output."""
        queued = self.num_queued()
        return len(self._streams) - queued, queued

    async def update_config(self, settings: RuntimeSettings) -> None:
        from servelm.control.errors import Conflict

        raise Conflict("scheduler settings of Ray replicas are set when the application is deployed",
                       code="not_supported_on_ray")

    # -- requests ----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, priority: int = 1, queue_timeout: float | None = None,
                       cache_salt: str | None = None, *, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request from a replica. A replica lost before the request's first output: the request is
        re-sent (Ray Serve routes it to a live replica, a replacement included); lost after: EngineDeadError,
        which the HTTP layer turns into a 503 or an error event. Nothing waits on a dead replica."""
        if not self.ready:
            raise EngineDeadError("the engine is not ready")
        if lora is not None:  # a replica's generate takes no adapter: refused, not run on the base
            raise RequestRejected(f"LoRA adapter {lora!r} is not served by Ray replicas")
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self._streams[request_id] = False
        try:
            for attempt in range(self.max_resends + 1):
                stream = self.handle.options(stream=True).generate.remote(
                    request_id, prompt_token_ids, params, prompt, priority, queue_timeout, cache_salt)
                try:
                    async for out in stream:
                        self._streams[request_id] = True
                        self.last_heard = time.monotonic()
                        yield out
                    return
                except Exception as e:
                    if not _replica_lost(e):
                        raise
                    self.restarts += 1
                    if self._streams[request_id] or attempt == self.max_resends:
                        raise EngineDeadError(f"the Ray replica serving the request was lost: {e}") from None
                    self.resent += 1
                    logger.warning("replica lost before request %s started; re-sending it", request_id)
                finally:
                    stream.cancel()  # a client that left, or any error: the replica aborts the request
        finally:
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        # generate's stream.cancel() aborts it on its replica; nothing is held here beyond the stream
        self._streams.pop(request_id, None)
