"""The reconciler's worker count for one deployment under a spec's autoscaling: the Ray Serve policy's rule
(servelm/ray/app.py: waiting_requests_policy) on the deployment's own engine figures, with the spec's bounds,
and a change made only once it has been wished for its whole delay (so a burst does not flap workers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelm.control.spec import Autoscaling


@dataclass
class Wish:
    """A worker count the figures have asked for since `since` (monotonic seconds)."""

    workers: int
    since: float


def wanted(a: Autoscaling, current: int, running: int, waiting: int, kv_usage: float, lo: int, hi: int) -> int:
    """Workers for every running and waiting request at target_ongoing_requests each, one more than now while
    requests wait and KV cache usage is over kv_cache_high; within [lo, hi]."""
    n = math.ceil((running + waiting) / a.target_ongoing_requests)
    if waiting and kv_usage > a.kv_cache_high:
        n = max(n, current + 1)
    return max(lo, min(hi, n))


def decide(a: Autoscaling, current: int, target: int, wish: Wish | None, now: float) -> tuple[int, Wish | None]:
    """(the count to run now, the wish to remember): `target` once it has been asked for since at least the
    delay of its direction, else `current`."""
    if target == current:
        return current, None
    if wish is None or wish.workers != target:
        wish = Wish(target, now)
    delay = a.upscale_delay_s if target > current else a.downscale_delay_s
    return (target, None) if now - wish.since >= delay else (current, wish)
