"""An adapter deployment: a LoRA adapter version (Kind.LORA) served by the workers of a deployment of its base
version, with no worker of its own.

To the rest of the control plane it is a deployment like any other: the manager finds it by `name` and
`name:version`, traffic policies (splits, canaries, shadows, experiments) pick its version, requests pin it with
a lease, and it is deployed, swapped and unloaded through the same admin routes. Underneath, every request runs
on the base deployment's workers with the adapter selected by its engine-side name, the adapter version's
`name:version` (unique in the registry, so two adapters of one base never collide), and every output is tagged
with the adapter's version.

Starting it loads the adapter into every worker of the base deployment (`Deployment.add_adapter`: workers
started later load it too); closing it lets its requests finish, then unloads it from them. The base's workers
must run with `enable_lora` (see `Deployment.add_adapter` for the refusal); while an adapter is attached the base
deployment is never swapped to another version, unloaded, evicted or expired (DeploymentManager).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

from servelm.control.deployment import Deployment
from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.lease import Lease
from servelm.control.types import Kind, ModelVersion
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams

_POLL_S = 0.05


class AdapterLease(Lease):
    """A request's pin on an adapter version: the base's generation (its tokenizer, workers, context length) with
    the adapter it resolved, which a swap of the adapter deployment to another version does not change."""

    def __init__(self, adapter: AdapterDeployment, version: ModelVersion, base: Deployment, base_lease: Lease) -> None:
        self._version, self._base = version, base
        adapter._held[version.ref] += 1
        adapter.last_used = time.monotonic()

        def release() -> None:
            adapter._held[version.ref] -= 1
            adapter.last_used = time.monotonic()
            base_lease.release()
        super().__init__(adapter, base_lease.generation, release)

    @property
    def version(self) -> ModelVersion:
        return self._version

    def generate(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
                 priority: int = 1, queue_timeout: float | None = None, cache_salt: str | None = None,
                 lora: str | None = None):
        return self.deployment._generate(self._version, self._base, request_id, prompt_token_ids, params, prompt,
                                         priority, queue_timeout, cache_salt, self.generation)


class AdapterDeployment:
    """One adapter version on a base Deployment; the AsyncEngine surface of the base, with the adapter."""

    kind = Kind.GENERATE  # what its requests are: generation, on the base's workers

    def __init__(self, version: ModelVersion, base: Deployment, deployment_id: str | None = None,
                 keep_alive_s: float | None = None, drain_timeout_s: float = 600.0) -> None:
        if version.kind != Kind.LORA:
            raise InvalidRequest(f"{version.ref} is not a LoRA adapter", code="wrong_kind")
        self.id = deployment_id or f"{version.name}-v{version.version}"
        self._version, self.base = version, base
        self.keep_alive_s, self.drain_timeout_s = keep_alive_s, drain_timeout_s
        self.strategy_name = base.strategy_name
        self.last_used = time.monotonic()
        # adapter ref -> requests running with it / leases held on it (a swap or close waits for both to be 0)
        self._running: Counter[str] = Counter()
        self._held: Counter[str] = Counter()
        self._lock = asyncio.Lock()  # one swap or close at a time
        self._closing = False
        self.last_swap: dict[str, float] = {}

    # -- what the manager and the server read ---------------------------------------------------------
    @property
    def version(self) -> ModelVersion:
        return self._version

    @property
    def lora_name(self) -> str:
        """The adapter's name in the base's engines."""
        return self._version.ref

    @property
    def served_name(self) -> str:
        return self._version.ref

    @property
    def tokenizer(self):
        return self.base.tokenizer

    @property
    def workers(self):
        return self.base.workers

    @property
    def num_workers(self) -> int:
        return self.base.num_workers

    @property
    def config(self):
        return self.base.config

    @property
    def ready(self) -> bool:
        return self.base.ready and not self._closing

    def check_engine(self) -> bool:
        return not self._closing and self.base.check_engine()

    @property
    def info(self):
        return self.base.info

    @property
    def max_model_len(self) -> int:
        return self.base.max_model_len

    @property
    def engine_pid(self) -> int | None:
        return self.base.engine_pid

    @property
    def up_since(self) -> float | None:
        return self.base.up_since

    @property
    def restarts(self) -> int:
        return self.base.restarts

    @property
    def stats(self):
        return self.base.stats  # the engines' figures are the base's: one batch serves both

    def num_in_flight(self) -> int:
        return sum(self._running.values())

    def num_queued(self) -> int:
        return self.base.num_queued()

    def live_counts(self) -> tuple[int, int]:
        return self.num_in_flight(), 0  # its own requests (the base's figures count every request once)

    def num_processes(self) -> int:
        return 0  # the base's workers are the base's in the memory budget

    def busy(self) -> bool:
        return self._lock.locked()

    def pinned(self) -> int:
        return sum(self._held.values())

    async def update_config(self, max_num_seqs: int, scheduling_policy: str, priority_aging_s: float) -> None:
        """Nothing: the base deployment's workers take the change as the base's."""

    def pin(self) -> AdapterLease:
        return AdapterLease(self, self._version, self.base, self.base.pin())

    async def abort(self, request_id: str) -> None:
        await self.base.abort(request_id)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, priority: int = 1, queue_timeout: float | None = None,
                 cache_salt: str | None = None, *, generation=None, lora: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """The base's generate with this adapter; each output is tagged with the adapter's version. (`lora` is
        ignored: the deployment is the adapter.)"""
        return self._generate(self._version, self.base, request_id, prompt_token_ids, params, prompt, priority,
                              queue_timeout, cache_salt, generation)

    async def _generate(self, version: ModelVersion, base: Deployment, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, prompt: str | None, priority: int, queue_timeout: float | None,
                        cache_salt: str | None, generation) -> AsyncIterator[RequestOutput]:
        self._running[version.ref] += 1
        self.last_used = time.monotonic()
        try:
            async for out in base.generate(request_id, prompt_token_ids, params, prompt, priority, queue_timeout,
                                           cache_salt, generation=generation, lora=version.ref):
                out.model_version = version.ref
                yield out
        finally:
            self._running[version.ref] -= 1
            self.last_used = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the adapter into the base deployment's workers (ControlError if they cannot take it)."""
        await self.base.add_adapter(self.lora_name, self._version.artifact)

    async def _drained(self, ref: str) -> None:
        """Wait (up to the drain timeout) until no request holds or runs adapter `ref`."""
        deadline = time.monotonic() + self.drain_timeout_s
        while (self._running[ref] > 0 or self._held[ref] > 0) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)

    async def swap(self, version: ModelVersion, base: Deployment) -> None:
        """Serve adapter `version` (running on `base`, a deployment of its base version) instead, with no request
        failed: load it, switch new requests over, then unload the old adapter once its requests are done."""
        if version.kind != Kind.LORA:
            raise InvalidRequest(f"{version.ref} is not a LoRA adapter: deploy it as a deployment of its own",
                                 code="wrong_kind")
        async with self._lock:
            t0 = time.monotonic()
            try:
                await base.add_adapter(version.ref, version.artifact)
            except ControlError as e:
                raise type(e)(f"{e.message}; {self._version.ref} keeps serving", e.code) from e
            old, old_base = self._version, self.base
            self._version, self.base, self.strategy_name = version, base, base.strategy_name  # the switch-over
            switched = time.monotonic()
            await self._drained(old.ref)
            await old_base.remove_adapter(old.ref)
            self.last_swap = {"start_s": switched - t0, "drain_s": time.monotonic() - switched}

    async def close(self) -> None:
        """Stop taking requests, let its own finish (up to the drain timeout), unload it from the base's workers."""
        async with self._lock:
            self._closing = True
            await self._drained(self._version.ref)
            await self.base.remove_adapter(self.lora_name)

    async def shutdown(self) -> None:
        """Nothing to stop: the base's workers are the base deployment's (stopped with it)."""
        self._closing = True

    def describe(self) -> dict:
        return {"id": self.id, "name": self._version.name, "version": self._version.version,
                "ref": self._version.ref, "kind": Kind.LORA.value, "workers": self.base.num_workers,
                "strategy": self.base.strategy_name, "keep_alive_s": self.keep_alive_s, "ready": self.ready,
                "in_flight": self.num_in_flight(), "base": self._version.base, "base_deployment": self.base.id,
                "worker_status": []}
