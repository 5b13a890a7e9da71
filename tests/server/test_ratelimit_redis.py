"""Rate limits and token quotas in a real Redis (servelm/server/middleware/ratelimit.py's RedisRateLimitStore): the same
decisions as the in-process store, one set of buckets across several stores (replicas), atomic under
concurrency, and what admission does while Redis is down (503, or admitted with --rate-limit-fail-open)
and after it is back."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from servelm.server.middleware.ratelimit import (
    InMemoryRateLimitStore,
    Limits,
    RateLimitUnavailable,
    RedisRateLimitStore,
)


def _store(redis_server, **kw) -> RedisRateLimitStore:
    return RedisRateLimitStore(redis_server.url, **kw)


def test_decisions_match_the_in_process_store(redis_server):
    limits = Limits(rpm=3, tpm=100)
    shared, local = _store(redis_server), InMemoryRateLimitStore()
    for store in (shared, local):
        got = [store.acquire("k", limits, 1, 30).allowed for _ in range(4)]
        assert got == [True, True, True, False]  # the 4th request: both buckets would go under
        d = store.acquire("k", limits, 0, 50)  # 10 tokens left: refused on tokens, naming them
        assert (d.allowed, d.reason) == (False, "tokens") and 0 < d.retry_after <= 60
        store.settle("k", limits, 40)  # unused tokens come back
        assert 49 <= store.peek("k", limits).remaining_tokens <= 51
        big = store.acquire("other", Limits(None, 100), 0, 101)  # larger than the bucket: a full window
        assert (big.allowed, big.reason, big.retry_after) == (False, "tokens", 60.0)
        assert big.headers()["retry-after"] == "60" and "x-ratelimit-limit-requests" not in big.headers()


def test_replicas_share_one_limit(redis_server):
    """Two stores (two servers) on one Redis: a key gets its limit once, not once per server."""
    a, b = _store(redis_server), _store(redis_server)
    limits = Limits(rpm=10, tpm=None)
    allowed = sum(s.acquire("alice", limits, 1, 0).allowed for _ in range(10) for s in (a, b))
    assert allowed == 10
    assert not a.acquire("alice", limits, 1, 0).allowed and not b.acquire("alice", limits, 1, 0).allowed
    assert a.acquire("bob", limits, 1, 0).allowed  # another key has its own buckets


def test_the_bucket_arithmetic_is_atomic_under_concurrency(redis_server):
    """Threads with their own connections race on one key: exactly the bucket's content is granted (plus
    what it refilled while they ran)."""
    limits, n, per = Limits(rpm=None, tpm=600), 8, 50
    granted: list[int] = []
    start = threading.Barrier(n)

    def work() -> None:
        s = _store(redis_server, timeout_s=5)
        start.wait()
        granted.append(sum(s.acquire("k", limits, 0, 5).allowed for _ in range(per)))

    t0 = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refilled = (time.monotonic() - t0) * 600 / 60  # 10 tokens a second
    assert 600 // 5 <= sum(granted) <= (600 + refilled) // 5 + 1


def test_down_redis_fails_fast_then_limits_apply_again_when_it_is_back(redis_server):
    now = [0.0]
    store = _store(redis_server, retry_s=5.0, clock=lambda: now[0])
    limits = Limits(rpm=2, tpm=None)
    assert store.acquire("k", limits, 1, 0).allowed
    redis_server.stop()
    with pytest.raises(RateLimitUnavailable, match=f"Redis at 127.0.0.1:{redis_server.port}"):
        store.acquire("k", limits, 1, 0)
    redis_server.start()
    with pytest.raises(RateLimitUnavailable):  # within retry_s it does not even try
        store.acquire("k", limits, 1, 0)
    now[0] += 5.0
    # back, and empty (no persistence): the bucket starts full again, and the limit holds
    assert [store.acquire("k", limits, 1, 0).allowed for _ in range(3)] == [True, True, False]


def _admission(store, fail_open: bool):
    from servelm.server.middleware.admission import Admission
    from servelm.server.observability.telemetry import RequestRecord

    config = SimpleNamespace(admission=SimpleNamespace(rate_limit_rpm=5, rate_limit_tpm=1000,
                                                       rate_limit_fail_open=fail_open, default_priority="normal",
                                                       queue_high_watermark=100, queue_low_watermark=50))
    metrics = SimpleNamespace(rate_limited=SimpleNamespace(labels=lambda *a: SimpleNamespace(inc=lambda: None)))
    rec = RequestRecord(request_id="r", method="POST", path="/v1/completions")
    rec.api_key, rec.key_name = None, "anon"
    return Admission(config, metrics, lambda: 0, store=store), rec


def test_admission_refuses_with_503_while_redis_is_down(redis_server):
    from servelm.server.openai.protocol import APIError

    store = _store(redis_server, retry_s=0.0)
    adm, rec = _admission(store, fail_open=False)
    adm.take_request(rec)
    redis_server.stop()
    with pytest.raises(APIError) as e:
        adm.take_request(rec)
    assert e.value.status == 503 and e.value.code == "rate_limit_unavailable"
    assert "Redis at 127.0.0.1" in e.value.message and e.value.headers["Retry-After"] == "1"
    assert adm.limit_headers(rec) == {}  # a response that was admitted still goes out, without the headers
    rec.reserved_tokens = 10
    adm.settle(rec)  # giving tokens back fails quietly (they refill)
    redis_server.start()
    adm.take_request(rec)
    assert adm.limit_headers(rec)["x-ratelimit-remaining-requests"] == "4"


def test_fail_open_admits_unlimited_and_warns(redis_server, caplog):
    store = _store(redis_server, retry_s=0.0)
    adm, rec = _admission(store, fail_open=True)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="servelm.server"):
        for _ in range(10):  # twice the limit: all admitted while the store is down
            adm.take_request(rec)
    warnings = [r for r in caplog.records if "without rate limits" in r.getMessage()]
    assert len(warnings) == 1  # once, not once per request
    adm.admit(rec, "m", 100, None)  # tokens too: admitted, and none counted as taken
    assert rec.reserved_tokens == 0
    redis_server.start()
    adm.settle(rec)  # so nothing is given back that was never taken
    assert adm.limit_headers(rec)["x-ratelimit-remaining-tokens"] == "1000"
