"""Shadow traffic: mirror requests to a shadow version off the caller's path and compare the answers.

The caller hands over a mirrored request once the primary's answer is complete (`offer`, which never
waits: a full queue drops the request and counts it). Worker tasks run the shadow request with the
caller's `run` coroutine and record, per pair, whether the outputs agree exactly, their token-level
similarity (difflib's ratio over token ids), the latency difference (shadow - primary) and errors.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servelm.control.experiments import Reservoir, Welford

log = logging.getLogger(__name__)


@dataclass
class ShadowResult:
    """What one side produced: its output token ids, latency in seconds, and error (None when it worked)."""

    tokens: Sequence[int] = ()
    latency: float = 0.0
    error: str | None = None


@dataclass
class ShadowJob:
    """A mirrored request: what to send to the shadow (opaque to this module) and the primary's result."""

    request: Any
    primary: ShadowResult


MAX_COMPARED = 2048  # tokens of each output compared: difflib is quadratic in the worst case


def similarity(a: Sequence[int], b: Sequence[int]) -> float:
    """Token-level similarity in [0, 1]: 2 * matching tokens / total tokens (1 for two empty outputs), over
    the first MAX_COMPARED tokens of each."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, list(a[:MAX_COMPARED]), list(b[:MAX_COMPARED]), autojunk=False).ratio()


@dataclass
class ShadowStats:
    """Pairs compared so far between one primary and one shadow version."""

    pairs: int = 0
    exact: int = 0
    shadow_errors: int = 0
    primary_errors: int = 0
    dropped: int = 0  # mirrored requests refused because the queue was full
    similarity: Welford = field(default_factory=Welford)
    latency_delta: Reservoir = field(default_factory=lambda: Reservoir(2048))

    def record(self, primary: ShadowResult, shadow: ShadowResult, sim: float | None = None) -> None:
        """One pair; `sim` is their similarity when already computed (off the event loop)."""
        self.pairs += 1
        self.primary_errors += primary.error is not None
        self.shadow_errors += shadow.error is not None
        if primary.error is None and shadow.error is None:
            self.exact += list(primary.tokens) == list(shadow.tokens)
            self.similarity.add(sim if sim is not None else similarity(primary.tokens, shadow.tokens))
            self.latency_delta.add(shadow.latency - primary.latency)

    def summary(self) -> dict[str, Any]:
        both_ok = self.similarity.n
        return {"pairs": self.pairs, "compared": both_ok, "dropped": self.dropped,
                "exact_agreement": self.exact / both_ok if both_ok else None,
                "similarity_mean": self.similarity.mean if both_ok else None,
                "shadow_errors": self.shadow_errors, "primary_errors": self.primary_errors,
                "latency_delta_p50": self.latency_delta.quantile(0.5),
                "latency_delta_p95": self.latency_delta.quantile(0.95)}


class ShadowMirror:
    """A bounded queue of mirrored requests and `concurrency` worker tasks that run them."""

    def __init__(self, run: Callable[[Any], Awaitable[ShadowResult]], *, maxsize: int = 64,
                 concurrency: int = 1) -> None:
        self.run, self.concurrency = run, concurrency
        self.queue: asyncio.Queue[ShadowJob] = asyncio.Queue(maxsize)
        self.stats = ShadowStats()
        self._tasks: list[asyncio.Task] = []

    def offer(self, request: Any, primary: ShadowResult) -> bool:
        """Queue a mirrored request without waiting; False (and counted as dropped) when the queue is full."""
        try:
            self.queue.put_nowait(ShadowJob(request, primary))
            return True
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return False

    def start(self) -> None:
        """Start the workers (inside the running event loop)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]

    async def drain(self) -> None:
        """Wait until every queued request has been run and recorded."""
        await self.queue.join()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                try:
                    result = await self.run(job.request)
                except Exception as e:  # a failing shadow is data, not a crash of the mirror
                    result = ShadowResult(error=f"{type(e).__name__}: {e}")
                sim = None
                if job.primary.error is None and result.error is None:  # difflib off the loop serving requests
                    sim = await asyncio.to_thread(similarity, job.primary.tokens, result.tokens)
                self.stats.record(job.primary, result, sim)
            except Exception:
                log.exception("shadow comparison failed")
            finally:
                self.queue.task_done()
