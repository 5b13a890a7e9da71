"""One worker of a deployment: an engine process's client, with what routing and health checks read of it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from servelm.worker.client import AsyncEngine, EngineDeadError

logger = logging.getLogger("servelm.deployments")


@dataclass
class HealthSettings:
    """How a deployment watches its workers. A dead process is noticed at once (its sentinel). A live one that
    answers nothing (neither step outputs nor pings) for `timeout_s` is taken out of rotation and its queued
    requests are re-sent elsewhere, so within interval_s + timeout_s; it rejoins if it answers again (a very
    long step), and is killed and restarted once silent for `kill_after_s` (hung)."""

    interval_s: float = 1.0
    timeout_s: float = 4.0
    kill_after_s: float = 30.0


class Worker:
    """An engine worker: routable while its engine is ready and it is not draining."""

    def __init__(self, wid: int, engine: AsyncEngine) -> None:
        self.id = wid
        self.engine = engine
        self.draining = False
        self.stopped = False  # shut down for good (scaled away, swapped out): never comes back
        self.unresponsive = False  # silent past the health timeout: out of rotation until it answers
        self.routed = 0  # requests sent to it (re-sent ones included)
        self.slot = 0  # its place among the deployment's workers (which share of the CPUs it is bound to)
        self.pending: dict[str, int] = {}  # request id -> KV blocks promised, until its first output
        self.seen_restarts = 0  # restarts already reported to the router (a restarted engine has no cache)

    @property
    def routable(self) -> bool:
        return self.engine.ready and not self.draining and not self.unresponsive

    def load(self) -> int:
        """Sequences running plus waiting on it now (the client's own count, current to the request)."""
        running, waiting = self.engine.live_counts()
        return running + waiting

    def free_blocks(self) -> int | None:
        """Free KV blocks at its last step, less those promised to requests sent since that have not started."""
        st = self.engine.stats
        return None if st is None else st.num_free_blocks - sum(self.pending.values())

    @property
    def pid(self) -> int | None:
        return self.engine.engine_pid

    async def check_health(self, health: HealthSettings) -> None:
        """Notice a dead process; take a silent one out of rotation (re-sending its queued requests), kill a
        hung one (the client restarts it); ping the rest."""
        engine = self.engine
        if not engine.check_engine():  # down or starting: the client restarts it, and it rejoins when warm
            self.unresponsive = False
            return
        silent = time.monotonic() - engine.last_heard
        if silent > health.kill_after_s:
            logger.error("worker %d (pid %s) answered nothing for %.1fs: killing it to restart it", self.id,
                         engine.engine_pid, silent)
            self.unresponsive = False
            engine.kill()
            return
        if silent > health.timeout_s and not self.unresponsive:
            self.unresponsive = True
            moved = engine.fail_queued(EngineDeadError("the worker stopped answering; re-sending the request"))
            logger.error("worker %d (pid %s) answered nothing for %.1fs: out of rotation, %d queued requests "
                         "re-sent", self.id, engine.engine_pid, silent, moved)
        elif silent <= health.timeout_s and self.unresponsive:
            self.unresponsive = False
            logger.warning("worker %d (pid %s) answers again: back in rotation", self.id, engine.engine_pid)
        await engine.ping()

    def describe(self) -> dict:
        st = self.engine.stats
        return {"id": self.id, "pid": self.pid, "ready": self.engine.ready, "draining": self.draining,
                "unresponsive": self.unresponsive,
                "restarts": self.engine.restarts, "routed": self.routed, "in_flight": self.engine.num_in_flight(), "load": self.load(),
                "free_blocks": st.num_free_blocks if st else None}
