"""Multi-tenant controls on a real server: keys, rate limits, priorities, backpressure, queue timeout, body limit,
run-time config, metrics, stats and request logs. Tests run in file order; the last one checks that every
metric the earlier ones provoked has moved. Two servers share the keys: `svc` with a small KV pool (evictions),
and `held`, whose context is long enough for a request that holds a batch slot for minutes (`HOLD`, until its
client leaves), for the tests that need requests still running while they look: no check depends on how fast
the machine generates."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import (
    HOLD,
    HOLD_BLOCKS,
    HOLD_CONTEXT,
    _wait,
    raw_request,
    server_log_lines,
    start_server,
    stats,
    stop_server,
)

from servelm.server.middleware.auth import hash_key

pytestmark = pytest.mark.server

ADMIN = {"x-api-key": "sk-admin-000000"}
ALICE = {"Authorization": "Bearer sk-alice-000001"}
GOLD = {"Authorization": "Bearer sk-gold-0000005"}
BRONZE = {"x-api-key": "sk-bronze-000006"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"""keys:
  - {{name: alice, key: sk-alice-000001}}
  - {{name: hashed, key_hash: "{hash_key('sk-hashed-00002')}"}}
  - {{name: limited, key: sk-limited-0003, rpm: 20}}
  - {{name: tokens, key: sk-tokens-00004, tpm: 300}}
  - {{name: gold, key: sk-gold-0000005, priority: high}}
  - {{name: bronze, key: sk-bronze-000006, priority: low, models: [tiny]}}
  - {{name: boxed, key: sk-boxed-000007, models: [another-model]}}
""")
    return keys


@pytest.fixture(scope="module")
def svc(llama_dir, keys_file, tmp_path_factory):
    conf = tmp_path_factory.mktemp("svc") / "servelm.yaml"
    conf.write_text("engine:\n  max_num_seqs: 8\nadmission:\n  queue_timeout_s: 20\n")
    proc, url = start_server(llama_dir, "--config", str(conf), "--api-keys-file", str(keys_file), "--admin-key",
                             ADMIN["x-api-key"], "--max-request-body-bytes", "65536", "--num-kv-blocks", "80",
                             "--max-model-len", "1024", "--embedding-model", "none", "--cpu-nice", "1",
                             env={"SERVELM_MAX_NUM_SEQS": "4"})
    yield proc, url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def held(long_llama_dir, keys_file):
    """A server where HOLD runs for minutes, until its client leaves: the pool fits one HOLD to its end."""
    proc, url = start_server(long_llama_dir, "--api-keys-file", str(keys_file), "--admin-key", ADMIN["x-api-key"],
                             "--num-kv-blocks", str(HOLD_BLOCKS + 64), "--max-model-len", str(HOLD_CONTEXT),
                             "--max-num-seqs", "4", "--queue-timeout-s", "20", "--embedding-model", "none")
    yield proc, url
    assert stop_server(proc) == 0


def test_the_engine_process_runs_at_the_configured_niceness(svc):
    """--cpu-nice 1: the engine process (and so its compute threads) one step below the API process."""
    proc, url = svc
    pid = stats(url, ALICE)["engine"]["pid"]
    assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, proc.pid) + 1


def patch(url: str, **changes) -> httpx.Response:
    return httpx.patch(url + "/admin/config", json=changes, headers=ADMIN)


def complete(url: str, headers: dict, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, **body}, headers=headers,
                      timeout=120)


def queue_depth(url: str) -> int:
    return stats(url, ALICE)["queue"]["depth"]


def test_keys_guard_every_api_route(svc):
    _, url = svc
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/server/stats"), ("POST", "/tokenize"), ("GET", "/no/such/route")]:
        r = httpx.request(method, url + path, json={})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.request(method, url + path, json={}, headers={"x-api-key": "sk-wrong-key"}).status_code == 401
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapes stay open
        assert httpx.get(url + path).status_code == 200
    assert httpx.get(url + "/v1/models", headers=ALICE).status_code == 200  # Bearer
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "sk-alice-000001"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "sk-hashed-00002"}).status_code == 200  # hash only
    # admin routes: no key 401, an ordinary key 403, the admin key 200
    assert httpx.get(url + "/admin/config").status_code == 401
    r = httpx.get(url + "/admin/config", headers=ALICE)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert httpx.get(url + "/admin/config", headers=ADMIN).status_code == 200
    # per-key model lists and priority rules
    r = complete(url, {"x-api-key": "sk-boxed-000007"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    r = complete(url, BRONZE, priority="high")
    assert r.status_code == 403 and r.json()["error"]["param"] == "priority"
    assert complete(url, BRONZE, priority="low").status_code == 200
    assert complete(url, ALICE, priority="low").status_code == 200  # lowering is always allowed


def test_request_id_and_one_json_log_line_per_request(svc):
    proc, url = svc
    r = complete(url, ALICE, max_tokens=3, ignore_eos=True, prompt="tell me")
    assert r.status_code == 200 and len(r.headers["x-request-id"]) >= 16
    r = complete(url, {**ALICE, "x-request-id": "log-test-1"}, max_tokens=3, ignore_eos=True)
    assert r.headers["x-request-id"] == "log-test-1"
    lines = _wait(lambda: [x for x in server_log_lines(proc) if x["request_id"] == "log-test-1"], 10, "the log line")
    assert len(lines) == 1
    line = lines[0]
    assert line["key"] == "alice" and line["model"] == "tiny" and line["status"] == 200
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and line["completion_tokens"] == 3
    assert line["finish_reason"] == "length" and line["priority"] == "normal"
    assert line["queue_ms"] >= 0 and 0 < line["ttft_ms"] <= line["e2e_ms"]
    assert "prompt" not in line and "completion" not in line  # text only with --log-prompts
    # the same prompt again: the log counts the tokens the prefix cache served, as the response does
    for _ in range(2):
        r = complete(url, {**ALICE, "x-request-id": "log-test-2"}, prompt="log test " * 20, max_tokens=1)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    lines = _wait(lambda: [x for x in server_log_lines(proc) if x["request_id"] == "log-test-2"][1:], 10,
                  "the second log line")
    assert lines[0]["cached_tokens"] == cached and 0 < cached < r.json()["usage"]["prompt_tokens"]
    assert "sk-alice" not in Path(proc.log_path).read_text()  # keys are never logged


def test_oversized_body_gets_413(svc):
    _, url = svc
    big = {"prompt": "x" * 70000, "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=big, headers=ALICE)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: counted as it arrives
        for _ in range(20):
            yield b"x" * 5000

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={**ALICE, "content-type": "application/json"})
    assert r.status_code == 413


def test_requests_per_minute_429_with_headers_then_recovery(svc):
    _, url = svc
    key = {"x-api-key": "sk-limited-0003"}
    remaining = []
    for _ in range(60):  # the bucket holds 20 and refills one every 3 s: a burst runs it dry
        r = httpx.get(url + "/v1/models", headers=key)
        if r.status_code != 200:
            break
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-limit-requests"] == "20"
    assert len(remaining) >= 20 and remaining[-1] < remaining[0]
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
    # one request refills every 3 s at 20 rpm
    _wait(lambda: httpx.get(url + "/v1/models", headers=key).status_code == 200, 30, "the bucket to refill")


def test_tokens_per_minute_reserve_and_refuse(svc):
    _, url = svc
    key = {"x-api-key": "sk-tokens-00004"}
    r = complete(url, key, max_tokens=400)  # can never fit a 300-token bucket
    assert r.status_code == 429 and "tokens" in r.json()["error"]["message"]
    assert r.headers["x-ratelimit-limit-tokens"] == "300"
    r = complete(url, key, max_tokens=100, ignore_eos=True)
    assert r.status_code == 200 and int(r.headers["x-ratelimit-remaining-tokens"]) < 300


def test_admin_config_shows_sources_and_validates_patches(svc):
    _, url = svc
    cfg = httpx.get(url + "/admin/config", headers=ADMIN).json()["config"]
    assert cfg["scheduler"]["max_num_seqs"] == {"value": 4, "source": "env", "runtime": True}  # env beats file
    assert cfg["admission"]["queue_timeout_s"]["source"] == "file"
    assert cfg["api"]["max_request_body_bytes"] == {"value": 65536, "source": "cli", "runtime": False}
    assert cfg["auth"]["admin_key"]["value"] == "<redacted>"
    r = patch(url, max_num_seqs=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "scheduler.max_num_seqs"
    r = patch(url, port=1234)
    assert r.status_code == 400 and "start-up" in r.json()["error"]["message"]
    r = patch(url, queue_timeout_s=15)
    assert r.status_code == 200 and r.json()["applied"] == {"admission.queue_timeout_s": 15.0}
    assert httpx.get(url + "/admin/config", headers=ADMIN).json()["config"]["admission"]["queue_timeout_s"] == {
        "value": 15.0, "source": "runtime", "runtime": True}


def test_priorities_under_contention_high_first_the_displaced_run_again(held):
    """One batch slot: a normal request displaces a running low one, a high one displaces the normal one and
    finishes while both still wait or run, and each displaced request runs again when what displaced it is gone."""
    _, url = held
    assert patch(url, max_num_seqs=1, priority_aging_s=600).status_code == 200  # one slot: a strict order
    before = stats(url, ALICE)["scheduler"]["num_priority_preemptions"]
    with httpx.stream("POST", url + "/v1/completions", json=HOLD, headers=BRONZE, timeout=300) as low:
        low_lines = low.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(low_lines).startswith("data:")  # the low request runs
        normal = raw_request(url, "/v1/completions", HOLD, ALICE)
        try:
            _wait(lambda: (s := stats(url, ALICE))["queue"]["by_priority"]["low"] == 1 and s["running"] == 1, 60,
                  "the normal request to displace the low one")
            r = complete(url, GOLD, prompt=[1, 2, 3, 4], max_tokens=20, ignore_eos=True)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20  # first, in full
            _wait(lambda: (s := stats(url, ALICE))["running"] == 1 and s["queue"]["by_priority"]["low"] == 1, 60,
                  "the normal request to run again, the low one still waiting")
            assert stats(url, ALICE)["scheduler"]["num_priority_preemptions"] >= before + 2
        finally:
            normal.close()  # the normal request's client leaves: the low one runs again
        _wait(lambda: (s := stats(url, ALICE))["running"] == 1 and s["queue"]["depth"] == 0, 60,
              "the low request to run again")
        assert stats(url, ALICE)["engine"]["in_flight"] == 1
    _wait(lambda: stats(url, ALICE)["engine"]["in_flight"] == 0, 60, "an idle engine")
    assert patch(url, max_num_seqs=4).status_code == 200


def test_queue_timeout_gives_408(held):
    _, url = held
    assert patch(url, max_num_seqs=1).status_code == 200
    # high priority, admitted under the 20 s timeout: the first holds the slot, the others wait, until they leave
    blockers = [raw_request(url, "/v1/completions", HOLD, GOLD) for _ in range(3)]
    try:
        _wait(lambda: stats(url, ALICE)["running"] == 1 and queue_depth(url) == 2, 60, "the blockers to queue")
        assert patch(url, queue_timeout_s=1).status_code == 200  # applies to requests admitted from now on
        r = complete(url, ALICE)
        assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
        r = complete(url, ALICE, stream=True)  # streaming requests get the status too: nothing was sent yet
        assert r.status_code == 408 and r.json()["error"]["code"] == "queue_timeout"
        assert stats(url, ALICE)["scheduler"]["num_waiting"] >= 1  # blockers still queued: timeouts were not luck
    finally:
        for b in blockers:
            b.close()
    _wait(lambda: queue_depth(url) == 0 and stats(url, ALICE)["running"] == 0, 60, "an idle engine")
    assert patch(url, max_num_seqs=4, queue_timeout_s=20).status_code == 200


def test_backpressure_503_at_high_watermark_until_below_low(held):
    _, url = held
    assert patch(url, max_num_seqs=1, queue_high_watermark=2, queue_low_watermark=1).status_code == 200
    blocker = raw_request(url, "/v1/completions", HOLD, GOLD)
    queued = []
    try:
        _wait(lambda: stats(url, ALICE)["running"] == 1, 60, "the blocker to run")
        queued = [raw_request(url, "/v1/completions", {"prompt": "q", "max_tokens": 2}, ALICE) for _ in range(2)]
        _wait(lambda: queue_depth(url) == 2, 30, "two queued requests")
        r = complete(url, ALICE)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        queued.pop().close()
        _wait(lambda: queue_depth(url) == 1, 30, "one queued request")
        assert complete(url, ALICE).status_code == 503  # still shedding: not yet below the low watermark
        assert stats(url, ALICE)["queue"]["shedding"] is True
        queued.pop().close()
        _wait(lambda: queue_depth(url) == 0, 30, "an empty queue")
    finally:
        for s in [blocker, *queued]:
            s.close()
    _wait(lambda: stats(url, ALICE)["running"] == 0, 60, "the blocker to be aborted")
    assert complete(url, ALICE).status_code == 200  # admitted again
    assert stats(url, ALICE)["queue"]["shedding"] is False
    assert patch(url, max_num_seqs=4, queue_high_watermark=128, queue_low_watermark=64).status_code == 200


def test_stats_json_shape(svc):
    _, url = svc
    complete(url, ALICE, prompt="the same prompt " * 12, max_tokens=2)
    complete(url, ALICE, prompt="the same prompt " * 12, max_tokens=2)  # a prefix cache hit
    s = stats(url, ALICE)
    assert set(s["queue"]["by_priority"]) == {"high", "normal", "low"}
    assert s["engine"]["status"] == "up" and isinstance(s["batch_size"], int) and s["running"] == 0
    assert s["throughput"]["generation_tokens_per_s"] > 0 and s["throughput"]["prompt_tokens_per_s"] > 0
    assert s["throughput"]["window_s"] == 60
    assert 0 <= s["kv_cache"]["usage"] <= 1 and s["kv_cache"]["num_blocks"] == 80
    assert s["prefix_cache"]["hits"] > 0 and 0 < s["prefix_cache"]["hit_rate"] <= 1


def test_prefix_cache_is_isolated_per_key_and_cache_salt(svc):
    """Default --prefix-cache-isolation key: one key never hits blocks cached by another key's requests,
    and a cache_salt makes a namespace of its own within a key."""
    _, url = svc
    hashed = {"x-api-key": "sk-hashed-00002"}
    body = {"prompt": "a prompt only this test sends, long enough for two blocks " * 3, "max_tokens": 1}

    def hits_after(headers: dict, **extra) -> int:
        before = stats(url, ALICE)["prefix_cache"]["hits"]
        assert complete(url, headers, **body, **extra).status_code == 200
        return stats(url, ALICE)["prefix_cache"]["hits"] - before

    assert hits_after(ALICE) == 0  # first time: nothing cached
    assert hits_after(ALICE) > 0  # same key: shared
    assert hits_after(hashed) == 0  # another key, same prompt: not shared
    assert hits_after(ALICE, cache_salt="s1") == 0  # a salt is a namespace of its own
    assert hits_after(ALICE, cache_salt="s1") > 0
    assert hits_after(hashed, cache_salt="s1") == 0  # the same salt under another key is still apart


def _samples(*urls: str) -> dict:
    """The /metrics samples of the servers at `urls`, together."""
    out: dict = {}
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _total(samples: dict, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

def test_ollama_stream_abort_on_disconnect(held):
    """A streamed Ollama generate whose client leaves after one line is aborted in the engine and logged as 499.
    On the `held` server it asks for nearly the whole 65,536-token context, so it is still running whenever the
    disconnect is noticed (on a short context a fast machine could finish it first)."""
    proc, url = held
    want = HOLD["max_tokens"]
    body = {"model": "tiny", "prompt": "Once", "raw": True, "options": {"num_predict": want}}
    with httpx.stream("POST", url + "/api/generate", json=body, headers=ALICE, timeout=60) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        assert '"done":false' in next(r.iter_lines())
    _wait(lambda: stats(url, ALICE)["engine"]["in_flight"] == 0, 60, "the request to be aborted")
    line = _wait(lambda: [x for x in server_log_lines(proc) if x.get("path") == "/api/generate"
                          and x.get("status") == 499], 30, "the request's log line")[-1]
    assert line["completion_tokens"] < want and line["model"] == "tiny"



def test_load_counts_the_requests_being_worked_on(held):
    """vLLM's GET /load (open, as /metrics is, for load balancers): two requests held in the engine count 2, and
    0 again once their clients leave."""
    _, url = held

    def load() -> int:
        r = httpx.get(url + "/load", timeout=10)
        assert r.status_code == 200
        return r.json()["server_load"]

    _wait(lambda: load() == 0, 60, "earlier requests to end")
    socks = [raw_request(url, "/v1/completions", HOLD, ALICE) for _ in range(2)]
    _wait(lambda: load() == 2, 60, "two requests in flight")
    for s in socks:
        s.close()
    _wait(lambda: load() == 0, 60, "the requests to be aborted")


def test_every_metric_is_exported_and_moved(svc, held):
    _, url = svc
    # three distinct 600-token prompts: their cached blocks overflow the 80-block pool, so the third evicts
    for k in range(3):
        assert complete(url, ALICE, prompt=[100 + k] + list(range(1000, 1599)), max_tokens=1).status_code == 200
    s = _samples(url, held[1])  # preemptions, timeouts, backpressure and aborts came from the held server
    moved = ["servelm:prompt_tokens_total", "servelm:generation_tokens_total", "servelm:num_preemptions_total",
             "servelm:num_priority_preemptions_total", "servelm:prefix_cache_queries_total",
             "servelm:prefix_cache_hits_total", "servelm:kv_cache_evictions_total",
             "servelm:backpressure_rejections_total", "servelm:request_timeouts_total",
             "servelm:request_aborts_total", "servelm:rate_limited_requests_total", "servelm:request_success_total",
             "servelm:requests_total"]
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "iteration_tokens_total", "batch_size", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "request_params_n",
              "request_params_max_tokens"):
        moved.append(f"servelm:{h}_count")
    for name in moved:
        assert _total(s, name) > 0, name
    for gauge in ("servelm:num_requests_running", "servelm:num_requests_waiting", "servelm:num_requests_swapped",
                  "servelm:kv_cache_usage_perc", "servelm:num_requests_waiting_by_priority"):
        assert gauge in s, gauge
    assert _total(s, "servelm:engine_up") == 2  # one per server
    assert _total(s, "servelm:requests_total", key="limited", status="429") >= 1
    assert _total(s, "servelm:requests_total", key="alice", status="200", model_name="tiny") >= 1
    assert _total(s, "servelm:requests_total", key="anonymous", status="401") >= 1
    assert _total(s, "servelm:rate_limited_requests_total", key="tokens", limit="tokens") >= 1
    assert _total(s, "servelm:request_success_total", finished_reason="length") >= 1

