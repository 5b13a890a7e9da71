"""Fair dynamic batching for embedding requests.

Each request is a job; a batch is filled by taking one text from each waiting job in turn (round robin), so a
large request is split over many batches and a small request that arrives meanwhile rides in the next batch
instead of waiting for the whole large one. A job hands out its texts shortest first, so that its batches hold
texts of similar length: a batch is padded to its longest text, and a request's texts in their own order (a
retrieval corpus of 8-128 words) left 43% of each batch padding. Texts arriving within the batch window join a batch that is not
yet full. A client that goes away takes its remaining texts out of the queue.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

RunBatch = Callable[[list[str]], Awaitable[tuple[list[Any], list[int]]]]


def input_length(item) -> int:
    """How long an input is, to batch like with like: its characters (a pair's, both texts'); token ids count as
    four characters each, about what a token of English spells."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, list):
        return 4 * len(item)
    return sum(input_length(x) for x in item if isinstance(x, (str, list)))


class _Job:
    __slots__ = ("texts", "order", "next", "results", "left", "future")

    def __init__(self, texts: list[str], future: asyncio.Future) -> None:
        self.texts, self.next, self.future = texts, 0, future
        self.order = sorted(range(len(texts)), key=lambda i: input_length(texts[i]))  # handed out in this order
        self.results: list = [None] * len(texts)
        self.left = len(texts)


class FairBatcher:
    def __init__(self, run: RunBatch, max_batch_size: int, window_s: float) -> None:
        self.run, self.max_batch_size, self.window = run, max_batch_size, window_s
        self._jobs: deque[_Job] = deque()  # jobs with texts not yet sent, in turn order
        self._queued = 0  # texts not yet sent
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, texts: list[str]) -> list[tuple[Any, int]]:
        """Embed texts; returns (vector, tokens) per text, in order."""
        if self._task is None or self._task.done():
            self._arrived = asyncio.Event()
            self._task = asyncio.create_task(self._loop())
        job = _Job(texts, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        self._queued += len(texts)
        self._arrived.set()
        try:
            return await job.future
        finally:
            if job.future.cancelled() or not job.future.done():  # the caller is gone: skip its other texts
                job.future.cancel()
                self._drop(job)

    def _drop(self, job: _Job) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
            self._queued -= len(job.texts) - job.next

    def _take(self) -> list[tuple[_Job, int]]:
        """The next batch: one text from each job in turn until it is full."""
        batch = []
        while self._jobs and len(batch) < self.max_batch_size:
            job = self._jobs.popleft()
            batch.append((job, job.order[job.next]))
            job.next += 1
            self._queued -= 1
            if job.next < len(job.texts):
                self._jobs.append(job)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._jobs:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = loop.time() + self.window
            while self._queued < self.max_batch_size and (left := deadline - loop.time()) > 0:
                self._arrived.clear()  # wait for more texts, briefly, to fill the batch
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take()
            if not batch:
                continue
            try:
                vecs, lens = await self.run([job.texts[i] for job, i in batch])
            except Exception as e:  # one bad batch must not kill the batcher; its jobs fail
                for job, _ in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
                    self._drop(job)
                continue
            for (job, i), v, n in zip(batch, vecs, lens, strict=True):
                if isinstance(v, Exception):  # this input failed alone: its request fails, the others go on
                    if not job.future.done():
                        job.future.set_exception(v)
                    self._drop(job)
                    continue
                job.results[i] = (v, n)
                job.left -= 1
                if job.left == 0 and not job.future.done():
                    job.future.set_result(job.results)
