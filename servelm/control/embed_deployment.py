"""An embedding deployment: one Kind.EMBED version served by the embedding worker (its own process, with dynamic
batching; servelm/runtimes/embedder.py). One worker: an encoder this small is bound by batching, not by
processes. Swapping starts the new version's worker, switches over, then lets the old one finish its batches."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from servelm.control.errors import Conflict, ControlError, InvalidRequest, Unavailable
from servelm.control.lease import Lease
from servelm.control.types import Kind, ModelVersion
from servelm.runtimes.embedder import Embedder

_POLL_S = 0.05


class EmbedDeployment:
    """`embed(texts)` for one embedding version; the manager handles it as it handles a Deployment."""

    kind = Kind.EMBED
    strategy_name = "single"

    def __init__(self, version: ModelVersion, deployment_id: str | None = None, keep_alive_s: float | None = None,
                 drain_timeout_s: float = 600.0, max_batch_size: int = 32, batch_window_ms: float = 5.0) -> None:
        if version.kind != Kind.EMBED:
            raise InvalidRequest(f"{version.ref} generates text; it deploys as a generation deployment",
                                 code="wrong_kind")
        self.id = deployment_id or f"{version.name}-v{version.version}"
        self.version, self.keep_alive_s, self.drain_timeout_s = version, keep_alive_s, drain_timeout_s
        self.max_batch_size, self.batch_window_ms = max_batch_size, batch_window_ms
        self.num_workers = 1
        self.embedder: Embedder | None = None
        self._in_flight = 0
        self._held = 0  # leases of requests that resolved to it
        self._processes = 0
        self.last_used = time.monotonic()

    @property
    def served_name(self) -> str:
        return self.version.ref

    @property
    def ready(self) -> bool:
        return self.embedder is not None and self.embedder.pid is not None

    def check_engine(self) -> bool:
        return self.ready

    @property
    def stats(self):
        return self.embedder.stats if self.embedder else None

    def num_in_flight(self) -> int:
        return self._in_flight

    def pin(self) -> Lease:
        """A request's lease: it counts as in use (not evicted, not expired) until released."""
        self._held += 1
        self.last_used = time.monotonic()

        def release() -> None:
            self._held -= 1
            self.last_used = time.monotonic()
        return Lease(self, None, release)

    def pinned(self) -> int:
        return self._held

    def busy(self) -> bool:
        """Never skipped by eviction or expiry (a swap here is one process started beside the other)."""
        return False

    def num_processes(self) -> int:
        """Worker processes now running or starting (what the memory budget counts)."""
        return self._processes

    async def _started(self, version: ModelVersion) -> Embedder:
        emb = Embedder(Path(version.artifact), self.max_batch_size, self.batch_window_ms, name=version.ref)
        self._processes += 1
        try:
            await emb.wait_ready()
        except Exception as e:
            emb.close()
            self._processes -= 1
            raise Conflict(f"{version.ref} failed to start: {e}", code="start_failed") from e
        return emb

    async def start(self) -> None:
        self.embedder = await self._started(self.version)

    @property
    def task(self) -> str:
        """"embed" (sentence vectors) or "classify" (a sequence classifier's logits): Embedder.task."""
        return self.embedder.task if self.embedder else "embed"

    @property
    def labels(self) -> list[str]:
        return self.embedder.labels if self.embedder else []

    @property
    def activation(self) -> str:
        return self.embedder.activation if self.embedder else "classify"

    async def embed(self, texts: list[str | list[int]], truncate: int | None = None, side: str = "right",
                    dimensions: int | None = None) -> tuple[list[np.ndarray], int]:
        """Sentence vectors and the token count (EmbedderDown while its process restarts); `truncate`, `side`
        and `dimensions` as Embedder.embed's."""
        return await self._call("embed", texts, truncate, side, dimensions)

    async def classify(self, texts: list[str], pairs: list[str] | None = None, truncate: int | None = None,
                       side: str = "right") -> tuple[list[np.ndarray], int]:
        """A sequence classifier's logits for each text or (text, pair): Embedder.classify."""
        return await self._call("classify", texts, pairs, truncate, side)

    async def _call(self, method: str, *args):
        emb = self.embedder
        if emb is None:
            raise Unavailable(f"{self.version.ref} is not loaded", code="engine_unavailable")
        self.last_used = time.monotonic()
        self._in_flight += 1
        try:
            return await getattr(emb, method)(*args)
        finally:
            self._in_flight -= 1
            self.last_used = time.monotonic()

    async def scale(self, n: int) -> None:
        if n != 1:
            raise InvalidRequest(f"embedding deployments run one worker, got {n}", param="workers")

    async def swap(self, version: ModelVersion, tokenizer=None) -> None:
        """Serve `version` instead: start its worker, switch, let the old one finish, stop it."""
        if version.kind != Kind.EMBED:
            raise InvalidRequest(f"{version.ref} generates text; swap an embedding deployment to an "
                                 "embedding version", code="wrong_kind")
        try:
            new = await self._started(version)
        except ControlError as e:
            raise type(e)(f"{e.message}; {self.version.ref} keeps serving", e.code) from e
        old, self.embedder, self.version = self.embedder, new, version
        await self._retire(old)

    async def _retire(self, emb: Embedder | None) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:  # requests that began on it finish first
            await asyncio.sleep(_POLL_S)
        if emb is not None:
            emb.close()
            self._processes -= 1

    async def close(self) -> None:
        emb, self.embedder = self.embedder, None
        await self._retire(emb)

    async def shutdown(self) -> None:
        if self.embedder is not None:
            self.embedder.close()
            self.embedder, self._processes = None, 0

    def describe(self) -> dict:
        emb = self.embedder
        return {"id": self.id, "name": self.version.name, "version": self.version.version, "ref": self.version.ref,
                "kind": Kind.EMBED.value, "workers": 1, "strategy": self.strategy_name,
                "keep_alive_s": self.keep_alive_s, "ready": self.ready, "in_flight": self._in_flight,
                "worker_status": [{"id": 0, "pid": emb.pid if emb else None, "restarts": emb.restarts if emb else 0}]}
