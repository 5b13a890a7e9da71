"""Per-key rate limits as token buckets: requests per minute and tokens per minute.

Every authenticated API call takes one request; a generation request also takes its worst-case token
count (prompt + max_tokens) at admission, and the unused part is given back when it ends (`settle`). The buckets live behind `RateLimitStore`, so a
shared store (e.g. Redis with an atomic script doing the same arithmetic) can serve several API
replicas; `InMemoryRateLimitStore` is the single-process one. `FailureLimiter` counts failed authentications per
client address, so keys cannot be guessed at network speed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    rpm: int | None
    tpm: int | None


@dataclass
class Decision:
    allowed: bool
    limits: Limits
    remaining_requests: int | None
    remaining_tokens: int | None
    retry_after: float = 0.0  # seconds until the request would fit (when not allowed)
    reason: str = ""  # "requests" | "tokens" when refused

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, for the limits that are set."""
        h = {}
        if self.limits.rpm is not None:
            h["x-ratelimit-limit-requests"] = str(self.limits.rpm)
            h["x-ratelimit-remaining-requests"] = str(max(0, self.remaining_requests or 0))
        if self.limits.tpm is not None:
            h["x-ratelimit-limit-tokens"] = str(self.limits.tpm)
            h["x-ratelimit-remaining-tokens"] = str(max(0, self.remaining_tokens or 0))
        if not self.allowed:
            h["retry-after"] = str(max(1, int(self.retry_after + 0.999)))
        return h


class RateLimitStore(Protocol):
    def acquire(self, key: str, limits: Limits, requests: int, tokens: int) -> Decision:
        """Take `requests` and `tokens` from key's buckets if both have room; else take nothing."""

    def settle(self, key: str, limits: Limits, unused_tokens: int) -> None:
        """Give back tokens reserved at admission but not used."""

    def peek(self, key: str, limits: Limits) -> Decision:
        """The current state, taking nothing."""


class _Bucket:
    """Capacity `rate` per minute, refilled continuously; capacity follows the limit if it changes."""

    __slots__ = ("level", "stamp")

    def __init__(self, capacity: float, now: float) -> None:
        self.level, self.stamp = capacity, now

    def refill(self, capacity: float, now: float) -> float:
        self.level = min(capacity, self.level + (now - self.stamp) * capacity / 60.0)
        self.stamp = now
        return self.level


class InMemoryRateLimitStore:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    def _levels(self, key: str, limits: Limits, now: float) -> tuple[_Bucket | None, _Bucket | None]:
        out = []
        for kind, cap in (("requests", limits.rpm), ("tokens", limits.tpm)):
            if cap is None:
                out.append(None)
                continue
            b = self._buckets.get((key, kind))
            if b is None:
                b = self._buckets[(key, kind)] = _Bucket(cap, now)
            b.refill(cap, now)
            out.append(b)
        return out[0], out[1]

    def acquire(self, key: str, limits: Limits, requests: int, tokens: int) -> Decision:
        with self._lock:
            now = self.clock()
            req, tok = self._levels(key, limits, now)
            waits = []
            if req is not None and requests and req.level < requests:
                waits.append(("requests", (requests - req.level) * 60.0 / limits.rpm))
            if tok is not None and tokens and tok.level < tokens:
                # a request larger than the whole bucket can never fit: say so with a full window
                wait = 60.0 if tokens > limits.tpm else (tokens - tok.level) * 60.0 / limits.tpm
                waits.append(("tokens", wait))
            if waits:
                reason, wait = max(waits, key=lambda w: w[1])
                return Decision(False, limits, _floor(req), _floor(tok), wait, reason)
            if req is not None:
                req.level -= requests
            if tok is not None:
                tok.level -= tokens
            return Decision(True, limits, _floor(req), _floor(tok))

    def settle(self, key: str, limits: Limits, unused_tokens: int) -> None:
        if limits.tpm is None or unused_tokens <= 0:
            return
        with self._lock:
            _, tok = self._levels(key, limits, self.clock())
            tok.level = min(limits.tpm, tok.level + unused_tokens)

    def peek(self, key: str, limits: Limits) -> Decision:
        with self._lock:
            req, tok = self._levels(key, limits, self.clock())
            return Decision(True, limits, _floor(req), _floor(tok))


def _floor(b: _Bucket | None) -> int | None:
    return None if b is None else int(b.level)


class FailureLimiter:
    """Failed authentications per client address: a bucket of `per_minute` failures, refilled continuously.
    While it is empty the address is refused (429) whatever key it sends, so a correct guess looks the same
    as a wrong one. Full buckets are forgotten, so memory stays bounded by the addresses failing now."""

    def __init__(self, clock=time.monotonic, prune_above: int = 10_000) -> None:
        self.clock, self.prune_above = clock, prune_above
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def retry_after(self, address: str, per_minute: int) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        with self._lock:
            b = self._buckets.get(address)
            if b is None or b.refill(per_minute, self.clock()) >= 1:
                return 0.0
            return (1 - b.level) * 60.0 / per_minute

    def record_failure(self, address: str, per_minute: int) -> bool:
        """Count one failure; True when it used the address's last allowed attempt."""
        with self._lock:
            now = self.clock()
            b = self._buckets.get(address)
            if b is None:
                if len(self._buckets) >= self.prune_above:
                    self._prune(per_minute, now)
                b = self._buckets[address] = _Bucket(per_minute, now)
            b.level = max(0.0, b.refill(per_minute, now) - 1)
            return b.level < 1

    def _prune(self, per_minute: int, now: float) -> None:
        for addr in [a for a, b in self._buckets.items() if b.refill(per_minute, now) >= per_minute]:
            del self._buckets[addr]
