"""The operator's webhook: a JSON event POSTed to `--webhook-url` on a canary rollback, a canary promotion that
could not be applied, and a drift alert that starts.

`send()` never waits: it puts the event on a bounded queue (callable from any thread) and returns; one
background task delivers the events in order, each with a short timeout and a bounded number of retries
(exponential backoff). A request, the canary loop or a drift check therefore never waits on the receiver.
An event that cannot be delivered (every attempt failed, or the queue was full) is logged and counted in
servelm:webhook_failures_total; delivered ones in servelm:webhook_deliveries_total.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

logger = logging.getLogger("servelm.traffic")
QUEUE = 1000  # events waiting for delivery at most; more are dropped (and counted)


class Webhook:
    """Delivers events to `url`; `start()` in the event loop before the first `send()`."""

    def __init__(self, url: str, metrics: Any, *, timeout_s: float = 2.0, retries: int = 2,
                 backoff_s: float = 0.5) -> None:
        self.url, self.metrics, self.timeout_s, self.retries, self.backoff_s = url, metrics, timeout_s, retries, backoff_s
        self.queue: asyncio.Queue[dict] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self.queue = asyncio.Queue(QUEUE)
            self._task = self._loop.create_task(self._deliver_all())

    def send(self, event: dict) -> None:
        """Queue `event` (a JSON-able dict; "at" is added) for delivery; returns at once, from any thread."""
        event = {**event, "at": event.get("at", time.time())}
        loop = self._loop
        if loop is None or loop.is_closed():
            self._failed(event, "the webhook is not running")
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._put(event)
        else:
            loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: dict) -> None:
        assert self.queue is not None
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self._failed(event, f"the queue is full ({QUEUE} events waiting)")

    def _failed(self, event: dict, why: str) -> None:
        logger.warning("webhook %s: event %s not delivered: %s", self.url, event.get("event"), why)
        self.metrics.webhook_failures.labels(str(event.get("event"))).inc()

    async def _deliver_all(self) -> None:
        assert self.queue is not None
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                event = await self.queue.get()
                try:
                    await self._deliver(client, event)
                except Exception as e:  # never let one event end the delivery task
                    self._failed(event, f"{type(e).__name__}: {e}")
                finally:
                    self.queue.task_done()

    async def _deliver(self, client: httpx.AsyncClient, event: dict) -> None:
        why = ""
        for attempt in range(1 + self.retries):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = await client.post(self.url, json=event, headers={"user-agent": "servelm-webhook"})
                if r.status_code < 300:
                    self.metrics.webhook_deliveries.labels(str(event.get("event"))).inc()
                    return
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
        self._failed(event, f"{1 + self.retries} attempts failed, the last with {why}")

    async def flush(self) -> None:
        """Wait until every queued event is delivered or given up (tests; shutdown)."""
        if self.queue is not None:
            await self.queue.join()

    async def close(self, grace_s: float | None = None) -> None:
        """Deliver what is queued for up to `grace_s` (default: one timeout), then stop."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.flush(), self.timeout_s if grace_s is None else grace_s)
        except asyncio.TimeoutError:
            logger.warning("webhook %s: %d events left undelivered at shutdown", self.url, self.queue.qsize())
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
