"""Stand-ins for an engine or deployment in in-process app tests: the status surface the routes read, idle."""

from __future__ import annotations


class IdleEngine:
    """Always ready, nothing queued or running; subclasses add `generate`."""

    ready, stats, info, max_model_len = True, None, None, 256
    on_ready = on_down = on_step = None

    def num_queued(self) -> int:
        return 0

    def num_in_flight(self) -> int:
        return 0

    def live_counts(self) -> tuple[int, int]:
        return 0, 0

    def check_engine(self) -> bool:
        return True

    async def abort(self, rid) -> None:
        pass
