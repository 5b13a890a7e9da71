"""Dynamic batching for one non-LLM model: requests queue (by priority, then arrival), and each batch stacks
the rows of queued requests of the same shape into one predictor call, run in the model's own thread.

The batch window is how long the first request of a batch waits for others (0: run whatever is queued at
once; requests arriving while a batch runs still ride together in the next one). A batch holds at most
`max_batch_size` rows (a larger request runs alone); at most `max_queue` requests wait, beyond that a
request is refused (QueueFull) rather than queued into a timeout. A batch that fails is retried one request
at a time, so one bad request never fails the others it was batched with.

Why a thread and not a process: the runtimes (scikit-learn's and XGBoost's tree code, onnxruntime) do their
work in native code that releases the GIL, so the API process's event loop keeps serving while a batch runs,
and handing a batch over costs no pickling or IPC: for millisecond-sized tabular models a process hop would
cost as much as the model. One thread per model keeps a model's batches in order and its memory in one
place.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from servelm.runtimes.predictors import Predictor


class QueueFull(Exception):
    pass


class _Job:
    __slots__ = ("inputs", "outputs", "rows", "key", "future", "arrived")

    def __init__(self, inputs: dict[str, np.ndarray], outputs: list[str], future: asyncio.Future) -> None:
        self.inputs, self.outputs, self.future = inputs, outputs, future
        self.rows = len(next(iter(inputs.values())))
        self.key = (tuple((n, a.dtype.str, a.shape[1:]) for n, a in sorted(inputs.items())), tuple(outputs))
        self.arrived = time.monotonic()


class PredictBatcher:
    def __init__(self, predictor: Predictor, name: str, window_s: float, max_batch_size: int, max_queue: int,
                 on_batch: Callable[[int, int, float], None] | None = None) -> None:
        self.predictor, self.window, self.max_batch_size, self.max_queue = predictor, window_s, max_batch_size, max_queue
        self.on_batch = on_batch  # (rows, requests, seconds) of each batch run
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"servelm-predict-{name}"[:40])
        self._heap: list = []
        self._seq = itertools.count()
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a running batch)."""
        return sum(1 for *_, j in self._heap if not j.future.done())

    async def submit(self, inputs: dict[str, np.ndarray], outputs: list[str], priority: int = 1) -> dict:
        """Predict; returns the named outputs. Raises QueueFull, or what the predictor raised (ValueError for
        bad input). Cancelling the caller takes the request out of the queue."""
        if self.depth >= self.max_queue:
            raise QueueFull(f"{self.depth} requests are queued for this model (its limit); retry later")
        if self._task is None or self._task.done():
            self._arrived = asyncio.Event()
            self._task = asyncio.create_task(self._loop())
        job = _Job(inputs, outputs, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, (priority, next(self._seq), job))
        self._arrived.set()
        return await job.future

    def _pop_live(self) -> _Job | None:
        while self._heap:
            _, _, job = self._heap[0]
            if not job.future.done():
                return job
            heapq.heappop(self._heap)  # cancelled while queued
        return None

    def _queued_rows(self, key) -> int:
        return sum(j.rows for *_, j in self._heap if j.key == key and not j.future.done())

    async def _loop(self) -> None:
        while True:
            head = self._pop_live()
            if head is None:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if self.window > 0:  # wait for company, until the batch is full or the head has waited the window
                while self._queued_rows(head.key) < self.max_batch_size:
                    left = head.arrived + self.window - time.monotonic()
                    if left <= 0 or head.future.done():
                        break
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), left)
                    except asyncio.TimeoutError:
                        break
                if head.future.done():
                    continue
            batch = self._take(head.key)
            if batch:
                await self._run(batch)

    def _take(self, key) -> list[_Job]:
        """The queued requests of this shape, in priority order, up to max_batch_size rows (at least one)."""
        batch, rows, keep = [], 0, []
        while self._heap:
            item = heapq.heappop(self._heap)
            job = item[2]
            if job.future.done():
                continue
            if job.key == key and (not batch or rows + job.rows <= self.max_batch_size):
                batch.append(job)
                rows += job.rows
            else:
                keep.append(item)
            if rows >= self.max_batch_size:
                break
        for item in keep:
            heapq.heappush(self._heap, item)
        return batch

    async def _run(self, batch: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            results = await loop.run_in_executor(self.pool, _predict_batch, self.predictor, batch)
        except Exception:
            results = None
        if self.on_batch is not None:
            self.on_batch(sum(j.rows for j in batch), len(batch), time.perf_counter() - t0)
        if results is None:  # retried alone: only the request at fault fails
            for job in batch:
                try:
                    [res] = await loop.run_in_executor(self.pool, _predict_batch, self.predictor, [job])
                except Exception as e:
                    if not job.future.done():
                        job.future.set_exception(e)
                    continue
                if not job.future.done():
                    job.future.set_result(res)
            return
        for job, res in zip(batch, results, strict=True):
            if not job.future.done():
                job.future.set_result(res)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _predict_batch(predictor: Predictor, batch: list[_Job]) -> list[dict[str, np.ndarray]]:
    """Stack the batch's inputs, predict once, split the outputs back by rows (in the model's thread)."""
    if len(batch) == 1:
        out = predictor.predict(batch[0].inputs, batch[0].outputs)
        return [out]
    names = list(batch[0].inputs)
    stacked = {n: np.concatenate([j.inputs[n] for j in batch]) for n in names}
    out = predictor.predict(stacked, batch[0].outputs)
    cuts = np.cumsum([j.rows for j in batch])[:-1]
    parts = {n: np.split(a, cuts) for n, a in out.items()}
    return [{n: parts[n][i] for n in out} for i in range(len(batch))]
