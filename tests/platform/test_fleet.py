"""Two real `servelm serve` processes sharing one PostgreSQL database and one Redis (tests/support/services.py): a key's
rate limit holds once across both, each sees the other's registrations, promotions and canary decisions, and
while Redis or PostgreSQL is down they say so clearly (503 naming it) and carry on with nothing lost once it
is back. Every wait is for a condition, bounded."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from services import need
from serving import _wait, start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]
ADMIN = {"x-api-key": "sk-admin-fleet-001"}
SHARED = {"x-api-key": "sk-shared-fleet-01"}
FREE = {"x-api-key": "sk-free-fleet-0001"}  # a key with no limit of its own (and none server-wide)
RPM = 6  # the shared key's requests per minute: one refills every 10 s, so a burst runs it dry


def _admin(url: str, method: str, path: str, body: dict | None = None, status: int = 200) -> dict:
    r = httpx.request(method, url + path, json=body, headers=ADMIN, timeout=300)
    assert r.status_code == status, r.text
    return r.json() if r.content else {}


@pytest.fixture(scope="module")
def fleet(llama_dir, tmp_path_factory):
    """(servers [(process, url), (process, url)], Postgres, Redis): two servers started together on one new
    database (so they also race to migrate it), with their own data directories."""
    from services import Postgres, Redis, missing_postgres, missing_redis

    need(missing_postgres())
    need(missing_redis())
    d = tmp_path_factory.mktemp("fleet")
    keys = d / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: shared, key: {SHARED['x-api-key']}, rpm: {RPM}}}\n"
                    f"  - {{name: free, key: {FREE['x-api-key']}}}\n")
    pg, redis = Postgres(), Redis()
    servers: list = []
    try:
        pg.start()
        redis.start()
        url = pg.create_database()

        def start(i: int):
            return start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "256", "--embedding-model",
                                "none", "--data-dir", str(d / f"data{i}"), "--database-url", url, "--redis-url",
                                redis.url, "--api-keys-file", str(keys), "--admin-key", ADMIN["x-api-key"],
                                "--registry-refresh-s", "0.2", "--canary-interval-s", "0.2")

        with ThreadPoolExecutor(2) as pool:
            for fut in [pool.submit(start, i) for i in range(2)]:
                try:
                    servers.append(fut.result())
                except Exception:
                    continue  # the other one is still stopped below
        assert len(servers) == 2, "a server did not start"
        yield servers, pg, redis
    finally:
        for proc, _ in servers:
            stop_server(proc)
        pg.close()
        redis.close()


def test_one_keys_rate_limit_holds_once_across_both_servers(fleet):
    (_, a), (_, b) = fleet[0]
    t0 = time.monotonic()
    codes = [(u, httpx.get(u + "/v1/models", headers=SHARED, timeout=30)) for _ in range(RPM) for u in (a, b)]
    refilled = int((time.monotonic() - t0) * RPM / 60)
    ok = [u for u, r in codes if r.status_code == 200]
    assert RPM <= len(ok) <= RPM + refilled  # not RPM per server: 2 x RPM were sent
    refused = [u for u, r in codes if r.status_code == 429]
    assert len(refused) == 2 * RPM - len(ok)
    if not refilled:  # the requests alternate: each server refuses once the other has used its share up
        assert set(refused) == {a, b}
    r = next(r for u, r in codes if r.status_code == 429)
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["x-ratelimit-limit-requests"] == str(RPM)


def test_each_server_sees_the_others_registrations_promotions_and_canary_decision(fleet, llama_dir):
    (_, a), (_, b) = fleet[0]
    assert _admin(a, "POST", "/admin/models", {"name": "m", "path": str(llama_dir)}, 201)["version"] == 1
    assert [v["version"] for v in _admin(b, "GET", "/admin/models/m")["versions"]] == [1]
    # one version sequence: B's registration is m:2, and A lists it
    assert _admin(b, "POST", "/admin/models", {"name": "m", "path": str(llama_dir)}, 201)["version"] == 2
    assert [v["version"] for v in _admin(a, "GET", "/admin/models/m")["versions"]] == [1, 2]

    path = ["VALIDATING", "STAGING", "STAGING_TESTED"]  # VALIDATING runs the validation: VALIDATED after
    for v, states in ((1, [*path, "CANARY", "PRODUCTION"]), (2, path)):
        for s in states:
            _admin(a, "POST", f"/admin/models/m/versions/{v}/transition", {"state": s})
    # B follows A's promotion (it re-reads PRODUCTION versions every 0.2 s)
    _wait(lambda: _admin(b, "GET", "/admin/models/m")["production"] == "m:1", 30, "B to see m:1 in PRODUCTION")

    for v in (1, 2):
        _admin(a, "POST", "/admin/deployments", {"model": f"m:{v}"}, 201)
    _admin(a, "POST", "/admin/models/m/canary", {"version": 2, "steps": [50, 100], "min_requests": 10**6,
                                                  "min_seconds": 0}, 201)
    seen = _admin(b, "GET", "/admin/models/m/canary")  # B runs no canary: the stored rollout
    assert (seen["status"], seen["percent"], seen["stored"]) == ("running", 50, True)
    _admin(a, "POST", "/admin/models/m/canary/abort", {"reason": "fleet test"})
    seen = _admin(b, "GET", "/admin/models/m/canary")
    assert seen["status"] == "rolled_back" and seen["history"][-1]["reasons"] == ["fleet test"]
    assert _admin(b, "GET", "/admin/models/m/versions/2")["state"] == "ROLLBACK"
    trail = _admin(b, "GET", "/admin/audit")
    assert trail["ok"] and any(e["action"] == "canary.rollback" and e["actor"] == "admin" for e in trail["entries"])


def test_outages_give_clear_errors_and_lose_nothing(fleet, llama_dir):
    (_, a), (_, b) = fleet[0]
    _, pg, redis = fleet

    # Redis down: the limited key gets 503 naming Redis; a key with no limit is not affected
    redis.stop()
    r = httpx.get(a + "/v1/models", headers=SHARED, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "rate_limit_unavailable", r.text
    assert f"Redis at 127.0.0.1:{redis.port}" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
    assert httpx.get(b + "/v1/models", headers=FREE, timeout=30).status_code == 200
    redis.start()  # empty again (no persistence): the key's bucket starts full, and still holds
    _wait(lambda: httpx.get(a + "/v1/models", headers=SHARED, timeout=30).status_code == 200, 30,
          "limits to apply again once Redis is back")
    codes = [httpx.get(u + "/v1/models", headers=SHARED, timeout=30).status_code for _ in range(RPM) for u in (a, b)]
    assert 429 in codes

    # PostgreSQL down: the control routes answer 503 naming the database; serving goes on
    before = _admin(a, "GET", "/admin/models")
    trail = _admin(a, "GET", "/admin/audit")["entries"]
    pg.stop()
    for url in (a, b):
        r = httpx.get(url + "/admin/models", headers=ADMIN, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
    r = httpx.post(b + "/admin/models", json={"name": "m", "path": str(llama_dir)}, headers=ADMIN, timeout=30)
    assert r.status_code == 503, r.text
    r = httpx.post(b + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2}, headers=FREE,
                   timeout=60)
    assert r.status_code == 200, r.text
    pg.start()
    _wait(lambda: httpx.get(a + "/admin/models", headers=ADMIN, timeout=30).status_code == 200, 60,
          "the control routes to work again once PostgreSQL is back")
    assert _admin(a, "GET", "/admin/models") == before and _admin(b, "GET", "/admin/models") == before
    assert _admin(b, "POST", "/admin/models", {"name": "m", "path": str(llama_dir)}, 201)["version"] == 3
    after = _admin(a, "GET", "/admin/audit")
    assert after["ok"] and after["entries"][:len(trail)] == trail and after["entries"][-1]["action"] == "register"
