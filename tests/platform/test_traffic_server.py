"""Traffic management end to end on a real server with real deployments (engine-core workers of a tiny random
model): a canary whose version fails every request (fault label) is rolled back automatically while 8
clients keep sending; no request fails except with the injected fault, and afterwards every request is
served by production. Then a header segment pins a version, and the prediction log names version and arm."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]
ADMIN = {"x-api-key": "sk-admin-traffic-srv"}


def _admin(url: str, method: str, path: str, body: dict | None = None, status: int = 200) -> dict:
    r = httpx.request(method, url + path, json=body, headers=ADMIN, timeout=300)
    assert r.status_code == status, r.text
    return r.json() if r.content else {}


def test_canary_rollback_under_load_and_segments(llama_dir, tmp_path):
    proc, url = start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "256", "--embedding-model",
                             "none", "--data-dir", str(tmp_path / "data"), "--admin-key", ADMIN["x-api-key"],
                             "--canary-interval-s", "0.2", "--prediction-log", "metadata",
                             env={"SERVELM_ALLOW_FAULTS": "1"})
    try:
        for labels, states in (({}, ["STAGING", "STAGING_TESTED", "CANARY", "PRODUCTION"]),
                               ({"servelm.fault": "error"}, ["STAGING", "STAGING_TESTED"])):
            v = _admin(url, "POST", "/admin/models", {"name": "m", "path": str(llama_dir), "labels": labels,
                                                      "validate": True}, 201)
            for s in states:
                _admin(url, "POST", f"/admin/models/m/versions/{v['version']}/transition", {"state": s})
            _admin(url, "POST", "/admin/deployments", {"model": v["ref"]}, 201)
        _admin(url, "POST", "/admin/models/m/canary", {"version": 2, "steps": [50, 100], "min_requests": 10**6,
                                                       "min_seconds": 0, "thresholds": {"min_samples": 10}}, 201)

        def one(i: int) -> httpx.Response:
            return httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": [1, 300 + i % 50], "max_tokens": 2, "user": f"u{i}"})

        results: list[httpx.Response] = []
        with ThreadPoolExecutor(8) as pool:
            for batch in range(100):
                results += pool.map(one, range(batch * 16, batch * 16 + 16))
                if _admin(url, "GET", "/admin/models/m/canary")["status"] == "rolled_back":
                    break
        assert _admin(url, "GET", "/admin/models/m/canary")["status"] == "rolled_back"
        for r in results:
            if r.status_code != 200:
                assert (r.status_code, r.json()["error"]["code"]) == (503, "injected_fault"), r.text
                assert r.headers["x-servelm-model-version"] == "m:2"
        assert any(r.status_code == 503 for r in results)
        after = [one(i) for i in range(20)]
        assert all(r.status_code == 200 and r.headers["x-servelm-model-version"] == "m:1" for r in after)
        assert _admin(url, "GET", "/admin/models/m/versions/2")["state"] == "ROLLBACK"

        _admin(url, "PUT", "/admin/models/m/traffic", {"arms": [{"version": 1}], "segments": [
            {"version": 2, "name": "qa", "headers": {"x-tier": "qa"}}]})
        r = httpx.post(url + "/v1/completions", headers={"x-tier": "qa", "x-request-id": "qa-1"}, timeout=60,
                       json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert (r.status_code, r.headers["x-servelm-model-version"], r.headers["x-servelm-arm"]) == \
            (503, "m:2", "segment:qa")
        rows = _admin(url, "GET", "/admin/predictions", None)
        qa = next(x for x in rows if x["request_id"] == "qa-1")
        assert (qa["version"], qa["arm"], qa["prompt"]) == (2, "segment:qa", None)  # metadata mode: no text
        metrics = httpx.get(url + "/metrics").text
        assert 'servelm:arm_requests_total{arm="segment:qa",model_name="m",model_version="2",outcome="error"} 1.0' \
            in metrics
    finally:
        assert stop_server(proc) == 0
