"""Which of a deployment's workers serves a request: the routing strategies.

Pure logic over what each worker reports (no processes, no I/O), so every strategy is unit-tested with
stand-in workers. A strategy sees only the workers that may take traffic now (ready, not draining) and
returns one of them. Traffic policies between versions (A/B, canary, shadow) sit one level up, choosing a
deployment; these choose a worker inside one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class RoutedWorker(Protocol):
    """What a strategy reads of a worker."""

    @property
    def id(self) -> int: ...

    def load(self) -> int:
        """Sequences running plus waiting on it now."""
        ...

    def free_blocks(self) -> int | None:
        """KV blocks it can still hand out (its last free count less what was sent since); None: unknown."""
        ...


@dataclass
class RouteRequest:
    """What a strategy may know about a request."""

    prompt_token_ids: Sequence[int]
    max_tokens: int = 0
    cache_salt: str | None = None


class Strategy:
    """Picks a worker among `candidates` (never empty)."""

    name = "base"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def pick(self, candidates: Sequence[RoutedWorker], req: RouteRequest) -> RoutedWorker:
        raise NotImplementedError

    def forget(self, worker_id: int) -> None:
        """The worker lost its state (restarted, removed): drop whatever is remembered about it."""


class RoundRobin(Strategy):
    """Each worker in turn."""

    name = "round_robin"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[RoutedWorker], req: RouteRequest) -> RoutedWorker:
        return candidates[next(self._turn) % len(candidates)]


class LeastLoaded(Strategy):
    """The worker with the fewest running + waiting sequences; ties taken in turn, so equal workers share."""

    name = "least_loaded"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[RoutedWorker], req: RouteRequest) -> RoutedWorker:
        return least_loaded(candidates, next(self._turn))


def least_loaded(candidates: Sequence[RoutedWorker], turn: int = 0) -> RoutedWorker:
    """The least-loaded candidate; among equals, the one `turn` points at (rotating over calls)."""
    low = min(w.load() for w in candidates)
    tied = [w for w in candidates if w.load() == low]
    return tied[turn % len(tied)]


def blocks_needed(req: RouteRequest, block_size: int) -> int:
    """KV blocks the request holds at its longest: prompt + max_tokens, rounded up to whole blocks."""
    return -(-(len(req.prompt_token_ids) + max(0, req.max_tokens)) // block_size)


class MemoryAware(Strategy):
    """Among workers with enough free KV blocks for the prompt + max_tokens, the least loaded; when none has
    room, the one with the most free blocks (it will queue there, and is the likeliest to fit first)."""

    name = "memory_aware"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[RoutedWorker], req: RouteRequest) -> RoutedWorker:
        need = blocks_needed(req, self.block_size)
        turn = next(self._turn)
        fits = [w for w in candidates if (w.free_blocks() is None or w.free_blocks() >= need)]
        if fits:
            return least_loaded(fits, turn)
        return max(candidates, key=lambda w: (w.free_blocks() or 0, -w.load()))


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """A chained hash per full block of the prompt: equal hashes at position i mean equal prefixes up to the
    end of block i (and equal salts), as the engine's prefix cache keys its blocks."""
    out, prev = [], hash(("servelm-prefix", salt))
    for i in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[i:i + block_size])))
        out.append(prev)
    return out


class PrefixAware(Strategy):
    """Send a request where its prefix was sent recently, so the worker's prefix cache serves it.

    Remembers, for the block hashes of recent prompts (an LRU of `capacity` entries), which workers got them.
    A request goes to the least-loaded worker among those holding its longest remembered prefix, unless that
    worker has more than `max_imbalance` sequences above the least-loaded worker overall: then it goes to the
    least-loaded one (which then holds the prefix too), so a hot prefix spreads instead of piling up on one
    worker. No remembered prefix: least loaded.
    """

    name = "prefix_aware"

    def __init__(self, block_size: int = 16, capacity: int = 65536, max_imbalance: int = 4) -> None:
        super().__init__(block_size)
        self.capacity, self.max_imbalance = capacity, max_imbalance
        self._seen: OrderedDict[int, set[int]] = OrderedDict()  # block hash -> worker ids
        self._turn = itertools.count()
        self.hits = 0  # requests sent to a worker holding part of their prefix

    def pick(self, candidates: Sequence[RoutedWorker], req: RouteRequest) -> RoutedWorker:
        hashes = block_hashes(req.prompt_token_ids, self.block_size, req.cache_salt)
        turn = next(self._turn)
        best = least_loaded(candidates, turn)
        by_id = {w.id: w for w in candidates}
        chosen = best
        for h in reversed(hashes):  # the longest remembered prefix first
            holders = [by_id[i] for i in self._seen.get(h, ()) if i in by_id]
            if holders:
                holder = least_loaded(holders, turn)
                if holder.load() - best.load() <= self.max_imbalance:
                    chosen = holder
                    self.hits += 1
                break
        self._remember(hashes, chosen.id)
        return chosen

    def _remember(self, hashes: list[int], worker_id: int) -> None:
        for h in hashes:
            holders = self._seen.pop(h, set())
            holders.add(worker_id)
            self._seen[h] = holders  # most recent last
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def forget(self, worker_id: int) -> None:
        for h in list(self._seen):
            holders = self._seen[h]
            holders.discard(worker_id)
            if not holders:
                del self._seen[h]


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (RoundRobin, LeastLoaded, MemoryAware, PrefixAware)}


def make_strategy(name: str, block_size: int = 16) -> Strategy:
    """A strategy by name; ValueError naming the known ones otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown routing strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](block_size)
