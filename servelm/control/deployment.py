"""A deployment: one model version served by N engine workers, behind the AsyncEngine surface.

The HTTP layer uses a Deployment exactly as it uses one AsyncEngine (generate, abort, stats, readiness). Inside,
each request is routed to a worker by the deployment's strategy (control/router.py) and stays within the
*generation* (version + tokenizer + workers) current when it arrived, so a swap never mixes versions within one
response. A request whose worker dies before it produced output is re-sent to another worker of its generation;
one that already streamed ends with the engine's clean error. `scale(n)` adds warmed-up workers or drains
some away; `swap(version)` starts and warms the new version's workers beside the old, switches new requests
over in one assignment, then drains the old workers and shuts them down.

A deployment whose workers run with `enable_lora` also serves LoRA adapter versions of its version
(control/adapter_deployment.py): `add_adapter` loads one into every worker and adds it to the generation's
settings, so a worker started later (scale-up) or restarted after a crash loads it at start as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from servelm.config.engine import EngineConfig, RuntimeSettings, cpu_list, parse_lora_module
from servelm.control.errors import Conflict, ControlError, InvalidRequest
from servelm.control.lease import Lease
from servelm.control.router import RouteRequest, blocks_needed, make_strategy
from servelm.control.types import Kind, ModelVersion
from servelm.engine.step_outputs import EngineStats
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.worker.client import AsyncEngine, EngineDeadError
from servelm.worker.handle import HealthSettings, Worker

logger = logging.getLogger("servelm.deployments")
_POLL_S = 0.05  # how often a drain or a re-send waiting for a worker looks again


_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(version: ModelVersion, config: EngineConfig):
    """The version's tokenizer, as `servelm serve` loads it (no model classes, no torch). One load at a time:
    transformers' lazy imports are not thread-safe (two at once can fail with an ImportError)."""
    from servelm.model.loading.metadata import load_tokenizer as load
    from servelm.model.loading.metadata import resolve_model

    with _TOKENIZER_LOCK:
        return load(resolve_model(config.model_config.model, config.model_config.gguf_file), config.model_config.tokenizer, config.model_config.chat_template)


def with_adapter(config: EngineConfig, name: str, path: str | None) -> EngineConfig:
    """`config` with the LoRA adapter `name` loaded at start from `path` (None: without it)."""
    kept = tuple(m for m in config.lora_config.lora_modules if parse_lora_module(m)[0] != name)
    if path is not None:
        kept += (f"{name}={path}",)
    return config.replace(lora_modules=kept, enable_lora=config.lora_config.enable_lora or path is not None)


@dataclass
class Generation:
    """What a deployment serves between two swaps: a version, its tokenizer and its workers."""

    version: ModelVersion
    config: EngineConfig
    tokenizer: object
    workers: list[Worker] = field(default_factory=list)  # routable unless draining
    active: int = 0  # requests inside generate() (a re-sent one is between workers for a moment)
    held: int = 0  # leases of requests that resolved to it (they may not have reached generate() yet)

    @property
    def info(self):
        return next((w.engine.info for w in self.workers if w.engine.info is not None), None)

    @property
    def max_model_len(self) -> int:
        return min((w.engine.max_model_len for w in self.workers if w.engine.info), default=0)

    def in_use(self) -> bool:
        """Requests hold it or run on it: a drain of its workers waits for them."""
        return bool(self.active or self.held)


class Deployment:
    """One ModelVersion with N workers; an EngineClient (worker/engine_client.py) plus `version`, `workers`, `strategy`."""

    kind = Kind.GENERATE

    def __init__(self, version: ModelVersion, base: EngineConfig, workers: int = 1,
                 strategy: str = "least_loaded", tokenizer=None, deployment_id: str | None = None,
                 start_timeout: float = 600.0, health: HealthSettings | None = None,
                 drain_timeout_s: float = 600.0, keep_alive_s: float | None = None) -> None:
        if version.kind != Kind.GENERATE:
            raise InvalidRequest(f"{version.ref} is an embedding model; deploy generation models only",
                                 code="wrong_kind")
        if workers < 1:
            raise InvalidRequest(f"workers must be >= 1, got {workers}", param="workers")
        self.id = deployment_id or f"{version.name}-v{version.version}"
        self.base = base
        self.num_workers = workers
        self.strategy_name = strategy
        self.start_timeout, self.health = start_timeout, health or HealthSettings()
        self.drain_timeout_s, self.keep_alive_s = drain_timeout_s, keep_alive_s
        config = version.engine_config(base)
        self.strategy = self._strategy(strategy, config)
        self._gen = Generation(version, config, tokenizer)
        self._old: list[Generation] = []  # draining: the workers of a swapped-out version, or scaled away
        self._ids = itertools.count()
        self._where: dict[str, Worker] = {}  # request id -> the worker serving it (for abort)
        self._lock = asyncio.Lock()  # one scale, swap or close at a time
        self._starting: list[Worker] = []  # launched, not yet warm (shutdown() stops them too)
        self._health_task: asyncio.Task | None = None
        self._closing = False
        self._unloading = False  # close() drains: requests that resolved before it still run on its workers
        self.last_used = time.monotonic()
        self.last_swap: dict[str, float] = {}
        self.on_ready = self.on_down = self.on_step = None  # as AsyncEngine's, for every worker
        self.on_replaced = None  # as AsyncEngine's, for every worker, with the worker's id in before and after
        self.adapters: dict[str, str] = {}  # LoRA adapters its workers hold for adapter deployments: name -> path
        self._reloads: set[asyncio.Task] = set()  # restarted workers loading the adapters

    def set_strategy(self, name: str) -> None:
        """Route new requests by another strategy from now on (requests already routed stay where they are)."""
        self.strategy, self.strategy_name = self._strategy(name, self.config), name

    @staticmethod
    def _strategy(name: str, config: EngineConfig):
        try:
            return make_strategy(name, config.cache_config.block_size)
        except ValueError as e:
            raise InvalidRequest(str(e), code="unknown_strategy", param="strategy") from e

    # -- the AsyncEngine surface -------------------------------------------------------------------
    @property
    def version(self) -> ModelVersion:
        return self._gen.version

    @property
    def served_name(self) -> str:
        return self._gen.version.ref

    @property
    def tokenizer(self):
        return self._gen.tokenizer

    @property
    def workers(self) -> list[Worker]:
        return list(self._gen.workers)

    @property
    def config(self) -> EngineConfig:
        return self._gen.config

    def busy(self) -> bool:
        """A scale, swap or close is under way (eviction and expiry leave it alone)."""
        return self._lock.locked()

    def num_processes(self) -> int:
        """Worker processes now running or starting, draining ones included (what the memory budget counts)."""
        return len(self._all_workers())

    def _all_workers(self) -> list[Worker]:
        return list(self._gen.workers) + [w for g in self._old for w in g.workers]

    @property
    def ready(self) -> bool:
        return any(w.routable for w in self._gen.workers)

    def check_engine(self) -> bool:
        """Whether some worker can serve now (each one asked, so a dead process is noticed here)."""
        return any([w.engine.check_engine() and not w.draining for w in self._gen.workers])

    @property
    def info(self):
        return self._gen.info

    @property
    def max_model_len(self) -> int:
        return self._gen.max_model_len

    @property
    def engine_pid(self) -> int | None:
        return next((w.pid for w in self._gen.workers if w.engine.ready), None)

    @property
    def up_since(self) -> float | None:
        """Wall-clock time since which some worker has been ready: the earliest of the ready ones (None: none)."""
        return min((w.engine.up_since for w in self._gen.workers if w.engine.ready), default=None)

    @property
    def restarts(self) -> int:
        return sum(w.engine.restarts for w in self._gen.workers)

    def num_in_flight(self) -> int:
        return sum(w.engine.num_in_flight() for w in self._all_workers())

    def num_queued(self) -> int:
        return sum(w.engine.num_queued() for w in self._all_workers())

    def live_counts(self) -> tuple[int, int]:
        counts = [w.engine.live_counts() for w in self._all_workers()]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    @property
    def stats(self) -> EngineStats | None:
        """The current workers' engine figures summed (KV usage and hit rate recomputed from the sums)."""
        all_stats = [w.engine.stats for w in self._gen.workers if w.engine.stats is not None]
        if not all_stats:
            return None
        lists = ("spec_proposed_by_position", "spec_accepted_by_position")
        names = ("running_lora_adapters", "waiting_lora_adapters")  # what any worker runs or queues
        first = all_stats[0]
        # counts add up; what describes the workers (the KV cache's dtype, the adapter slots of each) is the
        # same on each: the first's
        described = {f.name: getattr(first, f.name) for f in dataclasses.fields(EngineStats)
                     if isinstance(getattr(first, f.name), str) or f.name == "max_loras"}
        total = {f.name: 0 for f in dataclasses.fields(EngineStats)
                 if f.name not in ("kv_usage", "waiting_by_priority", "prefix_cache_hit_rate", *lists, *names,
                                   *described)}
        for st in all_stats:
            for k in total:
                total[k] += getattr(st, k)
        blocks, free = total["num_kv_blocks"], total["num_free_blocks"]
        queries = total["prefix_cache_queries"]
        return EngineStats(**total, **described, kv_usage=(blocks - free) / blocks if blocks else 0.0,
                           prefix_cache_hit_rate=total["prefix_cache_hits"] / queries if queries else 0.0,
                           waiting_by_priority=[sum(s.waiting_by_priority[i] for s in all_stats) for i in range(3)],
                           **{k: [sum(c) for c in zip(*(getattr(s, k) for s in all_stats), strict=False)]
                              for k in lists},
                           **{k: sorted(set().union(*(getattr(s, k) for s in all_stats))) for k in names})

    async def update_config(self, settings: RuntimeSettings) -> None:
        """Change every worker's scheduler settings now, and those of workers started later."""
        self.base = settings.apply(self.base)
        config = self._gen.version.engine_config(self.base)
        for name, path in self.adapters.items():  # the adapters stay in what later workers start with
            config = with_adapter(config, name, path)
        self._gen.config = config
        for w in self._all_workers():
            await w.engine.update_config(settings)

    def pin(self) -> Lease:
        """A request's lease on the current generation (see control/lease.py): it holds the tokenizer, version
        and workers the request started with, and counts as in use until released."""
        gen = self._gen
        gen.held += 1
        self.last_used = time.monotonic()

        def release() -> None:
            gen.held -= 1
            self.last_used = time.monotonic()
        return Lease(self, gen, release)

    def pinned(self) -> int:
        """Leases held on any of its generations (a deployment with some is not idle)."""
        return self._gen.held + sum(g.held for g in self._old)

    async def abort(self, request_id: str) -> None:
        worker = self._where.get(request_id)
        if worker is not None:
            await worker.engine.abort(request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, priority: int = 1, queue_timeout: float | None = None,
                       cache_salt: str | None = None, *, generation: Generation | None = None,
                       lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs from one worker of the current generation (or of the one a request's lease
        pinned, even if swapped out since), each tagged with the version (`model_version`); re-sent to another
        worker of that generation if its worker dies before any output."""
        gen = generation or self._gen
        self.last_used = time.monotonic()
        req = RouteRequest(prompt_token_ids, params.max_tokens or 0, cache_salt)
        need = blocks_needed(req, gen.config.cache_config.block_size)
        tried: set[int] = set()
        gen.active += 1
        try:
            for attempt in itertools.count():
                worker = self._route(gen, req, tried) if attempt == 0 else \
                    await self._reroute(gen, req, tried, queue_timeout)
                started = False
                worker.pending[request_id] = need
                worker.routed += 1
                self._where[request_id] = worker
                try:
                    # aclosing: a caller that leaves early closes the worker's stream now, which aborts the request
                    async with contextlib.aclosing(worker.engine.generate(
                            request_id, prompt_token_ids, params, prompt, priority, queue_timeout, cache_salt,
                            **({"lora": lora} if lora is not None else {}))) as stream:
                        async for out in stream:
                            if not started:
                                started = True
                                worker.pending.pop(request_id, None)
                            out.model_version = gen.version.ref
                            yield out
                    return
                except EngineDeadError:
                    if started or attempt >= 2 * len(gen.workers) + 1:
                        raise
                    tried.add(worker.id)
                    logger.warning("worker %d of %s failed before request %s produced output; re-sending it",
                                   worker.id, self.id, request_id)
                finally:
                    worker.pending.pop(request_id, None)
                    if self._where.get(request_id) is worker:
                        del self._where[request_id]
        finally:
            gen.active -= 1
            self.last_used = time.monotonic()

    def _candidates(self, gen: Generation) -> list[Worker]:
        if gen is self._gen and not self._unloading:
            return [w for w in gen.workers if w.routable]
        # a swapped-out generation still serves (only) its own re-sent requests until it has drained
        return [w for w in gen.workers if w.engine.ready and not w.stopped]

    def _route(self, gen: Generation, req: RouteRequest, tried: set[int]) -> Worker:
        candidates = self._candidates(gen)
        fresh = [w for w in candidates if w.id not in tried]
        if not candidates:
            raise EngineDeadError(f"no worker of {gen.version.ref} is ready")
        if gen is not self._gen:  # its router went with it
            return min(fresh or candidates, key=Worker.load)
        return self.strategy.pick(fresh or candidates, req)

    async def _reroute(self, gen: Generation, req: RouteRequest, tried: set[int],
                       queue_timeout: float | None) -> Worker:
        """A worker for a re-sent request, waiting (up to the queue timeout, else the start timeout) for one to
        come back if none is ready: a lone worker's queued requests wait for its restart rather than fail."""
        deadline = time.monotonic() + (queue_timeout or self.start_timeout or float("inf"))
        while (not self._candidates(gen) and any(not w.stopped for w in gen.workers)
               and time.monotonic() < deadline and not self._closing):
            await asyncio.sleep(_POLL_S)
        return self._route(gen, req, tried)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start and warm up every worker (ControlError if one cannot start), then watch their health."""
        if self._gen.tokenizer is None:
            self._gen.tokenizer = await self._tokenizer(self._gen.version, self._gen.config)
        try:
            await self._start_workers(self._gen, self.num_workers)
        except BaseException:
            await self._stop_workers(self._gen.workers)
            raise
        self._health_task = asyncio.create_task(self._watch())

    @staticmethod
    async def _tokenizer(version: ModelVersion, config: EngineConfig):
        try:
            return await asyncio.to_thread(load_tokenizer, version, config)
        except Exception as e:
            raise Conflict(f"{version.ref} failed to start: its tokenizer could not be loaded: {e}",
                           code="start_failed") from e

    def _worker_config(self, config: EngineConfig, slot: int) -> EngineConfig:
        """Worker `slot`'s settings: with `cpu_bind` and several workers, each worker gets its own share of the
        CPUs (slot k of n: the k-th of n equal parts), so workers do not contend for cores."""
        cpus = cpu_list(config.device_config.cpu_bind) if config.device_config.cpu_bind else None
        n = self.num_workers
        if not cpus or n < 2 or len(cpus) < n:
            return config
        per = len(cpus) // n
        mine = cpus[(slot % n) * per:(slot % n + 1) * per]
        return config.replace(cpu_bind=",".join(map(str, mine)),
                                   num_threads=min(config.device_config.num_threads or per, per))

    def _new_worker(self, gen: Generation, slot: int) -> Worker:
        engine = AsyncEngine(self._worker_config(gen.config, slot), gen.tokenizer, start_timeout=self.start_timeout)
        worker = Worker(next(self._ids), engine)
        worker.slot = slot
        engine.on_ready = lambda msg, restarted: self._ready(worker, msg, restarted)
        engine.on_down = lambda: self.on_down and self.on_down()
        engine.on_step = lambda msg, outs: self.on_step and self.on_step(msg, outs)
        engine.on_replaced = lambda before, after: self.on_replaced and self.on_replaced(
            {"worker": worker.id, **before}, {"worker": worker.id, **after})
        return worker

    def _ready(self, worker: Worker, msg, restarted: bool) -> None:
        if restarted and self.adapters and not worker.stopped:
            # a process launched just before an adapter was added started without it: load what it may lack
            # (a no-op in an engine that loaded it at start)
            task = asyncio.get_running_loop().create_task(self._reload_adapters(worker))
            self._reloads.add(task)
            task.add_done_callback(self._reloads.discard)
        if self.on_ready is not None:
            self.on_ready(msg, restarted)

    async def _reload_adapters(self, worker: Worker) -> None:
        for name, path in list(self.adapters.items()):
            try:
                await self._adapter_op(worker, "load", name, path)
            except ControlError as e:
                logger.error("%s: restarted worker %d could not load adapter %s: %s", self.id, worker.id, name,
                             e.message)

    async def _start_workers(self, gen: Generation, n: int) -> list[Worker]:
        """Start n workers of `gen` at once and add them to it once all are warm; on any failure stop them and
        raise ControlError naming the reason."""
        used = {w.slot for w in gen.workers}
        slots = [s for s in range(len(used) + n) if s not in used][:n]
        new = [self._new_worker(gen, slot) for slot in slots]
        self._starting += new
        try:  # every exit but success (an error, a cancelled caller, a shutdown meanwhile) stops what it launched
            for w in new:
                w.engine.launch()
            results = await asyncio.gather(*(w.engine.wait_ready() for w in new), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if self._closing:
                raise Conflict(f"{self.id} was unloaded while {gen.version.ref} was starting",
                               code="start_failed")
            if errors:
                raise Conflict(f"{gen.version.ref} failed to start: {errors[0]}", code="start_failed")
        except BaseException:
            await self._stop_workers(new)
            raise
        finally:
            self._starting = [w for w in self._starting if w not in new]
        gen.workers.extend(new)
        return new

    async def _stop_workers(self, workers: list[Worker]) -> None:
        for w in workers:
            w.stopped = True
        await asyncio.gather(*(w.engine.shutdown() for w in workers), return_exceptions=True)

    async def _drain(self, workers: list[Worker], gen: Generation | None = None) -> None:
        """Wait (up to drain_timeout_s) until these workers (or the whole generation) have nothing in flight;
        then shut them down (anything still in flight ends with an error, or is re-sent if it had no output)."""
        for w in workers:
            w.draining = True
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline and (any(w.engine.num_in_flight() for w in workers)
                                               or (gen is not None and gen.in_use())):
            await asyncio.sleep(_POLL_S)
        await self._stop_workers(workers)
        for w in workers:
            self.strategy.forget(w.id)

    async def scale(self, n: int) -> None:
        """Run n workers: new ones join once warm; surplus ones stop taking requests, finish theirs, and stop."""
        if n < 1:
            raise InvalidRequest(f"workers must be >= 1, got {n}", param="workers")
        async with self._lock:
            gen = self._gen
            have = len(gen.workers)
            if n > have:
                self.num_workers = n  # before the start: each new worker's CPU share depends on it
                try:
                    await self._start_workers(gen, n - have)
                except BaseException:
                    self.num_workers = have
                    raise
            elif n < have:
                # the least useful go first: not ready, then least loaded
                victims = sorted(gen.workers, key=lambda w: (w.engine.ready, w.load()))[:have - n]
                for w in victims:
                    w.draining = True
                gen.workers = [w for w in gen.workers if w not in victims]
                self._old.append(Generation(gen.version, gen.config, gen.tokenizer, victims))
                try:
                    await self._drain(victims)
                finally:
                    self._old = [g for g in self._old if g.workers is not victims]
            self.num_workers = n

    async def swap(self, version: ModelVersion, tokenizer=None) -> None:
        """Serve `version` instead, with no request failed: start and warm its workers beside the old ones,
        switch new requests over at once, then drain the old workers and shut them down. If the new version
        cannot start, the old one keeps serving and ControlError says why."""
        if version.kind != Kind.GENERATE:
            raise InvalidRequest(f"{version.ref} is an embedding model; deploy generation models only",
                                 code="wrong_kind")
        async with self._lock:
            if self.adapters:  # an adapter fits the weights it was trained on, not another version's
                raise Conflict(f"{self.id} serves LoRA adapter(s) {', '.join(sorted(self.adapters))} of "
                               f"{self.version.ref}: unload their deployments before swapping it to "
                               f"{version.ref}", code="base_in_use")
            t0 = time.monotonic()
            config = version.engine_config(self.base)
            new = Generation(version, config, tokenizer)
            try:
                if new.tokenizer is None:
                    new.tokenizer = await self._tokenizer(version, config)
                await self._start_workers(new, self.num_workers)
            except ControlError as e:
                raise type(e)(f"{e.message}; {self.version.ref} keeps serving", e.code) from e
            old = self._gen
            self._gen, self.strategy = new, self._strategy(self.strategy_name, config)  # the switch-over
            switched = time.monotonic()
            self._old.append(old)
            try:
                await self._drain(old.workers, old)
            finally:
                self._old = [g for g in self._old if g is not old]
            self.last_swap = {"start_s": switched - t0, "drain_s": time.monotonic() - switched}
            logger.info("%s swapped %s -> %s (new workers warm after %.2fs)", self.id, old.version.ref,
                        version.ref, switched - t0)

    # -- LoRA adapters -----------------------------------------------------------------------------
    async def add_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` into every worker, and have workers started later (a
        scale-up, a restarted process) load it at start. 409 when the workers run without LoRA; a worker that
        cannot load it (e.g. an adapter of another base shape) undoes the load everywhere and says why."""
        async with self._lock:  # not during a scale: the workers it is starting are in the list once it is done
            if self._closing or self._unloading:
                raise Conflict(f"{self.id} is being unloaded", code="not_deployed")
            if not self._gen.config.lora_config.enable_lora:
                raise Conflict(f"deployment {self.id} of {self.version.ref} runs without LoRA: deploy the "
                               "base with enable_lora (POST /admin/deployments {\"enable_lora\": true}, "
                               "`servelm models deploy --enable-lora`), register it with engine "
                               "{\"enable_lora\": true}, or start the server with --enable-lora",
                               code="lora_disabled")
            if name in self.adapters:  # one adapter deployment per name: unloading one must not strip another
                raise Conflict(f"{self.id} serves adapter {name} already", code="deployment_exists")
            self.adapters[name] = path
            self._gen.config = with_adapter(self._gen.config, name, path)
            try:
                for w in list(self._gen.workers):
                    await self._adapter_op(w, "load", name, path)
            except BaseException:  # all or none: no worker keeps an adapter its deployment was refused
                self.adapters.pop(name, None)
                self._gen.config = with_adapter(self._gen.config, name, None)
                for w in list(self._gen.workers):
                    with contextlib.suppress(Exception):
                        await self._adapter_op(w, "unload", name, None)
                raise

    async def remove_adapter(self, name: str) -> None:
        """Unload the adapter `name` from every worker (waiting, up to the drain timeout, for requests that use
        it to finish), and from what later workers load."""
        async with self._lock:
            self.adapters.pop(name, None)
            self._gen.config = with_adapter(self._gen.config, name, None)
            for w in self._all_workers():
                try:
                    await self._adapter_op(w, "unload", name, None)
                except ControlError as e:  # the adapter goes with the worker's next restart in any case
                    logger.warning("%s: worker %d kept adapter %s: %s", self.id, w.id, name, e.message)

    async def _adapter_op(self, w: Worker, action: str, name: str, path: str | None) -> None:
        """Load or unload an adapter in one worker. Its engine's settings change first: a worker restarting
        from here on has it (or not) from its start; one that is down now gets it that way."""
        engine = w.engine
        engine.config = with_adapter(engine.config, name, path if action == "load" else None)
        deadline = time.monotonic() + self.drain_timeout_s
        while not w.stopped and engine.check_engine():
            try:
                done = await engine.lora_adapter(action, name, path or "")
            except EngineDeadError:
                return  # it restarts with the settings above
            if done.error is None or (action == "unload" and "no adapter named" in done.error):
                return
            if action == "unload" and "in use" in done.error and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)  # requests with it are finishing
                continue
            refused = InvalidRequest if action == "load" else Conflict
            raise refused(f"worker {w.id} of {self.id} could not {action} adapter {name}: {done.error}",
                          code="invalid_adapter" if action == "load" else "adapter_in_use")

    async def _watch(self) -> None:
        """Health checks: dead workers are noticed, hung ones killed (the client restarts both), and a
        restarted worker's remembered prefixes forgotten."""
        while not self._closing:
            t = time.monotonic()
            await asyncio.sleep(self.health.interval_s)
            if time.monotonic() - t > self.health.interval_s + self.health.timeout_s / 2:
                continue  # this process was stalled, not the workers: their answers may be unread yet
            for w in self._all_workers():
                with contextlib.suppress(Exception):  # a check must never stop the watcher
                    await w.check_health(self.health)
                if w.engine.restarts != w.seen_restarts:
                    w.seen_restarts = w.engine.restarts
                    self.strategy.forget(w.id)

    async def close(self) -> None:
        """Unload gracefully: stop routing, let in-flight requests finish (up to drain_timeout_s), stop. A scale
        or swap under way completes first (under the same lock), so no worker it starts outlives the close."""
        async with self._lock:
            self._unloading = True
            for w in self._gen.workers:
                w.draining = True
            await self._drain(self._all_workers(), self._gen)
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every worker now, those still starting included (in-flight requests end with an error; a scale
        or swap under way fails rather than add workers)."""
        self._closing = True
        if self._health_task is not None:
            self._health_task.cancel()
        await self._stop_workers(self._all_workers() + self._starting)

    def describe(self) -> dict:
        """A JSON-able record: what the admin API shows and the registry persists."""
        return {"id": self.id, "name": self.version.name, "version": self.version.version, "ref": self.version.ref,
                "kind": Kind.GENERATE.value, "workers": self.num_workers, "strategy": self.strategy_name, "keep_alive_s": self.keep_alive_s,
                "ready": self.ready, "in_flight": self.num_in_flight(),
                "enable_lora": self.config.lora_config.enable_lora, "adapters": sorted(self.adapters),
                "worker_status": [w.describe() for w in self._all_workers()]}
