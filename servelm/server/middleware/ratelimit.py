"""Per-key rate limits as token buckets: requests per minute and tokens per minute.

Every authenticated API call takes one request; a generation request also takes its worst-case token
count (prompt + max_tokens) at admission, and the unused part is given back when it ends (`settle`). The
buckets live behind `RateLimitStore`: `InMemoryRateLimitStore` is one process's (with N replicas a key gets N
times its limit), `RedisRateLimitStore` keeps them in Redis, where one Lua script does the same arithmetic
atomically, so every replica using that Redis draws from the same buckets. `FailureLimiter` counts failed
authentications per client address, so keys cannot be guessed at network speed (per process: it slows a
guesser down, it is no quota).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("servelm.server")


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


class RateLimitUnavailable(Exception):
    """The shared store cannot be reached: no decision could be made."""


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


# One bucket per (key, kind) as a hash {level, stamp}; times are the Redis server's, so replicas whose clocks
# differ still refill alike. ARGV: mode (acquire | settle | peek), rpm, tpm (-1: no limit), requests, tokens.
# Returns {allowed, requests level, tokens level, wait seconds, reason} (numbers as strings: a Lua number
# becomes a truncated integer in a reply). A bucket idle for a minute is full again, so it may expire then.
_BUCKET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = ARGV[1]
local caps = {tonumber(ARGV[2]), tonumber(ARGV[3])}
local want = {tonumber(ARGV[4]), tonumber(ARGV[5])}
local levels = {}
for i = 1, 2 do
  if caps[i] >= 0 then
    local b = redis.call('HMGET', KEYS[i], 'level', 'stamp')
    local level, stamp = tonumber(b[1]), tonumber(b[2])
    if level == nil or stamp == nil then
      level, stamp = caps[i], now
    end
    levels[i] = math.min(caps[i], level + math.max(0, now - stamp) * caps[i] / 60.0)
  end
end
local allowed, wait, reason = 1, 0, ''
if mode == 'acquire' then
  for i = 1, 2 do
    if caps[i] >= 0 and want[i] > 0 and levels[i] < want[i] then
      local w
      if i == 2 and want[i] > caps[i] then
        w = 60.0
      else
        w = (want[i] - levels[i]) * 60.0 / caps[i]
      end
      if allowed == 1 or w > wait then
        wait = w
        reason = (i == 1) and 'requests' or 'tokens'
      end
      allowed = 0
    end
  end
  if allowed == 1 then
    for i = 1, 2 do
      if caps[i] >= 0 then levels[i] = levels[i] - want[i] end
    end
  end
elseif mode == 'settle' and caps[2] >= 0 then
  levels[2] = math.min(caps[2], levels[2] + want[2])
end
for i = 1, 2 do
  if caps[i] >= 0 then
    redis.call('HSET', KEYS[i], 'level', tostring(levels[i]), 'stamp', tostring(now))
    redis.call('EXPIRE', KEYS[i], 120)
  end
end
return {allowed, tostring(levels[1] or -1), tostring(levels[2] or -1), tostring(wait), reason}
"""


class RedisRateLimitStore:
    """The buckets in Redis (`url`), shared by every server using it. A call that cannot reach Redis within
    `timeout_s` raises RateLimitUnavailable; for `retry_s` after a failure calls fail at once without trying
    (a down Redis costs one timeout per `retry_s`, not one per request), then the next call tries again, so
    limits apply again as soon as Redis is back."""

    def __init__(self, url: str, timeout_s: float = 0.5, retry_s: float = 1.0, prefix: str = "servelm:rl:",
                 clock=time.monotonic) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        # no client-side retries: the caller answers now, and the next request tries again anyway
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._script = self._redis.register_script(_BUCKET_LUA)  # EVALSHA, loaded again after a Redis restart
        self.where = _host_of(url)
        self.prefix, self.retry_s, self.clock = prefix, retry_s, clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down_since: float | None = None
        self._why = ""

    def _keys(self, key: str) -> list[str]:
        # one hash tag for both buckets: in a Redis Cluster they live on one node, as the script needs
        return [f"{self.prefix}{{{key}}}:requests", f"{self.prefix}{{{key}}}:tokens"]

    def _run(self, mode: str, key: str, limits: Limits, requests: int, tokens: int) -> list:
        now = self.clock()
        with self._lock:
            if now < self._down_until:
                raise RateLimitUnavailable(self._why)
        args = [mode, -1 if limits.rpm is None else limits.rpm, -1 if limits.tpm is None else limits.tpm,
                requests, tokens]
        try:
            out = self._script(keys=self._keys(key), args=args)
        except self._errors as e:
            with self._lock:
                first = self._down_since is None
                if first:
                    self._down_since = now
                self._down_until = self.clock() + self.retry_s
                self._why = f"the rate-limit store (Redis at {self.where}) cannot be reached: {e}"
            if first:
                logger.error("%s", self._why)
            raise RateLimitUnavailable(self._why) from e
        with self._lock:
            was_down, self._down_since = self._down_since, None
        if was_down is not None:
            logger.warning("the rate-limit store (Redis at %s) is reachable again after %.1fs", self.where,
                           self.clock() - was_down)
        return out

    def _decision(self, limits: Limits, out: list) -> Decision:
        allowed, req, tok, wait, reason = out
        req_level, tok_level = float(req), float(tok)
        return Decision(bool(int(allowed)), limits, None if limits.rpm is None else int(req_level),
                        None if limits.tpm is None else int(tok_level), float(wait),
                        reason.decode() if isinstance(reason, bytes) else str(reason))

    def acquire(self, key: str, limits: Limits, requests: int, tokens: int) -> Decision:
        return self._decision(limits, self._run("acquire", key, limits, requests, tokens))

    def settle(self, key: str, limits: Limits, unused_tokens: int) -> None:
        if limits.tpm is None or unused_tokens <= 0:
            return
        self._run("settle", key, limits, 0, unused_tokens)

    def peek(self, key: str, limits: Limits) -> Decision:
        return self._decision(limits, self._run("peek", key, limits, 0, 0))

    def ping(self) -> bool:
        """Whether Redis answers now (for a start-up warning; never raises)."""
        try:
            return bool(self._redis.ping())
        except self._errors:
            return False

    def close(self) -> None:
        self._redis.close()


def _host_of(url: str) -> str:
    """host:port of a Redis URL, without credentials (what logs and errors may show)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return u.path if u.scheme == "unix" else f"{u.hostname}:{u.port or 6379}"


def store_for(server_config) -> RateLimitStore:
    """The server's rate-limit store: Redis when redis_url is set, else this process's memory."""
    url = server_config.storage_config.redis_url if server_config is not None else None
    if not url:
        return InMemoryRateLimitStore()
    store = RedisRateLimitStore(url, timeout_s=server_config.storage_config.redis_timeout_s)
    if store.ping():
        logger.info("rate limits and token quotas are kept in Redis at %s", store.where)
    else:
        logger.warning("rate limits and token quotas are kept in Redis at %s, which does not answer yet: "
                       "limited requests are refused (or, with admission.rate_limit_fail_open, admitted "
                       "unlimited) until it does", store.where)
    return store


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
