"""One worker of a deployment: an engine process's client, with what routing and health checks read of it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from servelm.worker.client import AsyncEngine

logger = logging.getLogger("servelm.deployments")


@dataclass
class HealthSettings:
    """How a deployment watches its workers. A dead process is noticed at once (its sentinel); a hung one
    (a live process that answers nothing, neither steps nor pings, for `timeout_s`) is killed and restarted,
    so it is out of rotation within interval_s + timeout_s."""

    interval_s: float = 1.0
    timeout_s: float = 4.0


class Worker:
    """An engine worker: routable while its engine is ready and it is not draining."""

    def __init__(self, wid: int, engine: AsyncEngine) -> None:
        self.id = wid
        self.engine = engine
        self.draining = False
        self.stopped = False  # shut down for good (scaled away, swapped out): never comes back
        self.routed = 0  # requests sent to it (re-sent ones included)
        self.pending: dict[str, int] = {}  # request id -> KV blocks promised, until its first output
        self.seen_restarts = 0  # restarts already reported to the router (a restarted engine has no cache)

    @property
    def routable(self) -> bool:
        return self.engine.ready and not self.draining

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

    async def check_health(self, timeout_s: float) -> bool:
        """Notice a dead process, kill a hung one, ping a quiet one; False when it was found hung."""
        engine = self.engine
        if not engine.check_engine():
            return True  # down or starting: the client restarts it; nothing to ping
        silent = time.monotonic() - engine.last_heard
        if silent > timeout_s:
            logger.error("worker %d (pid %s) answered nothing for %.1fs: killing it to restart it", self.id,
                         engine.engine_pid, silent)
            engine.kill()
            return False
        await engine.ping()
        return True

    def describe(self) -> dict:
        st = self.engine.stats
        return {"id": self.id, "pid": self.pid, "ready": self.engine.ready, "draining": self.draining,
                "restarts": self.engine.restarts, "routed": self.routed, "in_flight": self.engine.num_in_flight(), "load": self.load(),
                "free_blocks": st.num_free_blocks if st else None}
