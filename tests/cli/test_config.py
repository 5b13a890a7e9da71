"""The serve config tree: precedence CLI > env > file, typed parsing, clear errors, exit code 2, run-time patches;
plus the API keys file and the rate-limit token buckets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servelm.config.engine import ConfigError
from servelm.config.settings import env_var, load
from servelm.server.middleware.auth import KeyStore, hash_key, load_keys_file, presented_key
from servelm.server.middleware.ratelimit import InMemoryRateLimitStore, Limits


def test_precedence_cli_over_env_over_file(tmp_path):
    f = tmp_path / "servelm.yaml"
    f.write_text("engine:\n  max_num_seqs: 8\n  block_size: 32\nadmission:\n  queue_timeout_s: 20\n"
                 "  queue_high_watermark: 50\n  queue_low_watermark: 20\n")
    env = {"SERVELM_MAX_NUM_SEQS": "4", "SERVELM_QUEUE_TIMEOUT_S": "25", "SERVELM_LOG_PROMPTS": "true"}
    c = load({"queue_timeout_s": 30.0}, env, str(f))
    assert (c.engine.scheduler_config.max_num_seqs, c.engine.cache_config.block_size, c.admission.queue_timeout_s) == (4, 32, 30.0)
    assert c.admission.queue_high_watermark == 50 and c.server.observability_config.log_prompts is True
    assert c.sources["scheduler.max_num_seqs"] == "env" and c.sources["cache.block_size"] == "file"
    assert c.sources["admission.queue_timeout_s"] == "cli" and c.sources["api.port"] == "default"
    d = c.describe()
    assert d["scheduler"]["max_num_seqs"] == {"value": 4, "source": "env", "runtime": True}
    assert d["api"]["port"]["runtime"] is False


def test_toml_and_json_files_and_config_env_var(tmp_path):
    t = tmp_path / "c.toml"
    t.write_text("[server]\nport = 9001\n[engine]\nenable_prefix_caching = false\n")
    c = load({}, {"SERVELM_CONFIG": str(t)})
    assert c.server.api_config.port == 9001 and c.engine.cache_config.enable_prefix_caching is False
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"admission": {"rate_limit_rpm": 60}}))
    assert load({}, {}, str(j)).admission.rate_limit_rpm == 60


@pytest.mark.parametrize("env,file_text,match", [
    ({"SERVELM_MAX_NUM_SEQS": "0"}, None, r"scheduler\.max_num_seqs must be >= 1 \(set by env SERVELM_MAX_NUM_SEQS\), got 0"),
    ({"SERVELM_MAX_NUM_SEQS": "many"}, None, r"scheduler\.max_num_seqs must be an integer .*got 'many'"),
    ({"SERVELM_ENABLE_PREFIX_CACHING": "maybe"}, None, r"enable_prefix_caching must be a boolean"),
    ({}, "engine:\n  dtype: float8\n", r"model\.dtype must be one of auto.*\(set by file\), got 'float8'"),
    ({}, "engine:\n  max_num_sequences: 3\n", r"engine\.max_num_sequences must be a known key"),
    ({"SERVELM_DEVICE": "tpu"}, None, r"device\.device must be cpu, cuda or cuda:N \(set by env SERVELM_DEVICE\)"),
    ({"SERVELM_GC_YOUNG_THRESHOLD": "0"}, None, r"device\.gc_young_threshold must be >= 1 \(set by env"),
    ({"SERVELM_SLIDING_WINDOW": "0"}, None, r"model\.sliding_window must be >= 1 or None \(set by env"),
    ({}, "schedule:\n  x: 1\n", r"section 'schedule'"),
    ({}, "scheduler:\n  x: 1\n", r"scheduler\.x must be a known key of \[scheduler\]"),
    ({}, "cache:\n  max_num_seqs: 4\n", r"cache\.max_num_seqs must be a known key of \[cache\] \(max_num_seqs is in "
     r"\[scheduler\]\)"),
    ({}, "admission:\n  queue_low_watermark: 2000\n", r"queue_low_watermark must be in \[0, queue_high_watermark"),
    ({"SERVELM_API_KEY": "short"}, None, r"auth\.api_key must be at least 8 characters.*<redacted>"),
])
def test_invalid_values_name_key_value_and_source(tmp_path, env, file_text, match):
    path = None
    if file_text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(file_text)
    with pytest.raises(ConfigError, match=match) as e:
        load({}, env, str(path) if path else None)
    assert "short" not in str(e.value)  # a secret is never echoed


def test_runtime_patch_is_validated_all_or_nothing():
    c = load({}, {})
    applied = c.patch({"max_num_seqs": 3, "admission": {"queue_timeout_s": "2.5"}})
    assert applied == {"scheduler.max_num_seqs": 3, "admission.queue_timeout_s": 2.5}
    assert c.sources["scheduler.max_num_seqs"] == "runtime"
    with pytest.raises(ConfigError, match="changed only at start-up"):
        c.patch({"block_size": 32})
    with pytest.raises(ConfigError, match="queue_low_watermark"):
        c.patch({"queue_timeout_s": 9, "queue_low_watermark": 5000})
    assert c.admission.queue_timeout_s == 2.5  # the bad patch changed nothing
    with pytest.raises(ConfigError, match="known config key"):
        c.patch({"nope": 1})


def test_every_field_has_help_and_a_unique_env_var():
    from servelm.config.settings import all_fields

    names = [f.name for _, f in all_fields()]
    assert len(names) == len(set(names))
    assert all(f.metadata.get("help") for _, f in all_fields())
    assert env_var("max_num_seqs") == "SERVELM_MAX_NUM_SEQS"


def _serve(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "serve", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_cli_invalid_config_exits_2_and_print_config_shows_sources(tmp_path):
    r = _serve("--max-num-seqs", "0")
    assert r.returncode == 2 and "scheduler.max_num_seqs must be >= 1 (set by --max-num-seqs), got 0" in r.stderr
    r = _serve("--print-config", env={"SERVELM_QUEUE_TIMEOUT_S": "abc"})
    assert r.returncode == 2 and "SERVELM_QUEUE_TIMEOUT_S" in r.stderr
    f = tmp_path / "c.yaml"
    f.write_text("server:\n  port: 9100\nengine:\n  max_num_seqs: 7\n")
    r = _serve("--config", str(f), "--print-config", "--max-num-seqs", "5", "--api-key", "sk-secret-key",
               env={"SERVELM_PORT": "9200"})
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["scheduler"]["max_num_seqs"] == {"value": 5, "source": "cli", "runtime": True}
    assert shown["api"]["port"]["value"] == 9200 and shown["api"]["port"]["source"] == "env"
    assert shown["auth"]["api_key"]["value"] == "<redacted>" and "sk-secret-key" not in r.stdout
    bad_keys = tmp_path / "keys.yaml"
    bad_keys.write_text("- name: a\n  key: k1-long-enough\n  rpm: -1\n")
    r = _serve("--api-keys-file", str(bad_keys), "--print-config")
    assert r.returncode == 2 and "rpm must be a positive integer" in r.stderr


def test_keys_file_hashes_and_lookup(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(f"keys:\n  - name: plain\n    key: sk-plain-0001\n    rpm: 5\n    models: [tiny]\n"
                 f"  - name: hashed\n    key_hash: \"{hash_key('sk-hashed-0002')}\"\n    priority: low\n"
                 f"  - name: ops\n    key: sk-ops-00003\n    admin: true\n")
    keys = load_keys_file(str(f))
    store = KeyStore(keys, admin_digest=None)
    assert store.lookup("sk-plain-0001").name == "plain" and store.lookup("sk-plain-0001").rpm == 5
    assert store.lookup("sk-hashed-0002").priority == "low"
    assert store.lookup("sk-wrong") is None and store.lookup(None) is None
    assert store.is_admin("sk-ops-00003") and not store.is_admin("sk-plain-0001")
    assert all(len(k.digest) == 32 for k in keys)  # only digests are kept
    f.write_text("- name: x\n  key: a\n  key_hash: b\n")
    with pytest.raises(ValueError, match="exactly one of key or key_hash"):
        load_keys_file(str(f))
    f.write_text("- name: x\n  key_hash: sha256:abc\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        load_keys_file(str(f))


def test_presented_key_from_bearer_or_x_api_key():
    assert presented_key({"authorization": "Bearer sk-1"}) == "sk-1"
    assert presented_key({"x-api-key": "sk-2"}) == "sk-2"
    assert presented_key({"authorization": "Basic abc"}) is None


def test_token_buckets_refill_settle_and_refuse_without_taking():
    now = [0.0]
    store = InMemoryRateLimitStore(clock=lambda: now[0])
    lim = Limits(rpm=2, tpm=100)
    assert store.acquire("k", lim, 1, 60).allowed
    d = store.acquire("k", lim, 1, 60)  # tokens: 40 left < 60
    assert not d.allowed and d.reason == "tokens" and d.remaining_requests == 1 and d.remaining_tokens == 40
    assert d.retry_after == pytest.approx(20 * 60 / 100)
    assert d.headers()["retry-after"] == "12" and d.headers()["x-ratelimit-limit-tokens"] == "100"
    store.settle("k", lim, 50)  # the first request used only 10 of its 60
    assert store.acquire("k", lim, 1, 60).allowed
    d = store.acquire("k", lim, 1, 0)
    assert not d.allowed and d.reason == "requests" and d.retry_after == pytest.approx(30.0)
    now[0] += 30.0  # one request refills every 30 s at rpm=2
    assert store.acquire("k", lim, 1, 0).allowed
    assert not store.acquire("k", lim, 0, 101).allowed  # larger than the bucket: never fits
    assert store.peek("other", lim).remaining_requests == 2  # keys have separate buckets


@pytest.mark.parametrize("spec,ok", [("{c}", True), ("{c}-{c}", True), (" {c} ", True), ("{c}-0", False),
                                     ("a", False), ("", False), ("{c},", False), ("100000", False),
                                     ("{c}-100000", False)])
def test_cpu_bind_accepts_only_this_process_cpus(spec, ok):
    import os

    from servelm.config.engine import EngineConfig

    first = min(os.sched_getaffinity(0))  # "{c}-0" is backwards unless CPU 0 alone: then it is valid
    spec = spec.format(c=first)
    ok = ok or spec == "0-0"
    if ok:
        assert EngineConfig(cpu_bind=spec).device_config.cpu_bind == spec
    else:
        with pytest.raises(ConfigError, match=r"cpu_bind must be a list of this process's CPUs"):
            EngineConfig(cpu_bind=spec)


def test_cpu_bind_from_env_names_its_source():
    import os

    first = str(min(os.sched_getaffinity(0)))
    assert load({}, {"SERVELM_CPU_BIND": first}).engine.device_config.cpu_bind == first
    with pytest.raises(ConfigError, match=r"device\.cpu_bind must be .*\(set by env SERVELM_CPU_BIND\), got 'x'"):
        load({}, {"SERVELM_CPU_BIND": "x"})


def test_cpu_bind_binds_the_engine_process_and_sets_one_thread_per_cpu():
    import os

    torch = pytest.importorskip("torch")  # absent in the Python 3.10 smoke run

    from servelm.config.engine import EngineConfig
    from servelm.engine.threads import configure_threads

    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = min(cpus)
    try:
        configure_threads(EngineConfig(cpu_bind=str(first)))
        assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
        configure_threads(EngineConfig(cpu_bind=f"{first}-{first}", num_threads=2))
        assert torch.get_num_threads() == 2  # an explicit count wins over one per CPU
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)


def test_http_keep_alive_outlasts_clients_idle_expiry():
    """uvicorn's own keep-alive (5 s) equals httpx's idle expiry, so a client could reuse a connection at the
    moment the server closed it (a reset in a one-hour soak). The server's keep-alive is a setting, passed to
    uvicorn, and by default longer than httpx's (the openai SDK's) expiry."""
    import httpx

    from servelm.config.settings import load
    from servelm.server.serve import uvicorn_config

    default = load({}, env={}).server
    assert uvicorn_config(None, default).timeout_keep_alive == default.api_config.http_keep_alive_s
    assert default.api_config.http_keep_alive_s > httpx.Limits().keepalive_expiry
    assert uvicorn_config(None, load({"http_keep_alive_s": 12}, env={}).server).timeout_keep_alive == 12
    with pytest.raises(Exception, match="http_keep_alive_s"):
        load({"http_keep_alive_s": 0}, env={})


def test_engine_process_freezes_its_heap_and_sets_the_young_gc_threshold():
    import gc

    from servelm.config.engine import EngineConfig
    from servelm.worker.process import settle_heap

    before = gc.get_threshold()
    assert EngineConfig().device_config.gc_young_threshold > before[0]  # the default is larger than Python's
    try:
        settle_heap(12345)
        assert gc.get_threshold() == (12345, *before[1:]) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_shared_state_urls_precedence_and_masked_passwords():
    """database_url and redis_url come from CLI > env > file like every setting; their passwords never show
    in the described config; registry_url is database_url's older name, and the two may not disagree."""
    env = {"SERVELM_DATABASE_URL": "postgresql+psycopg://svc:env-secret@db/servelm",
           "SERVELM_REDIS_URL": "redis://:redis-secret@cache:6379/0"}
    cfg = load({"database_url": "postgresql://svc:cli-secret@db2/servelm"}, env=env)
    assert cfg.server.database() == "postgresql://svc:cli-secret@db2/servelm" and cfg.control_plane
    shown = json.dumps(cfg.describe())
    assert "secret" not in shown and "postgresql://svc:***@db2/servelm" in shown and "redis://:***@cache:6379/0" in shown
    assert load({}, env=env).server.storage_config.database_url == env["SERVELM_DATABASE_URL"]
    assert load({}, env={"SERVELM_REGISTRY_URL": "sqlite:////x.db"}).server.database() == "sqlite:////x.db"
    with pytest.raises(ConfigError, match="registry_url"):
        load({"registry_url": "sqlite:////a.db", "database_url": "sqlite:////b.db"}, env={})
    with pytest.raises(ConfigError, match="redis_url"):
        load({"redis_url": "http://cache"}, env={})
    assert load({"rate_limit_fail_open": True}, env={}).admission.rate_limit_fail_open is True


def test_every_choice_field_takes_exactly_the_names_its_annotation_lists():
    """Fields that take one of a few names declare them once, as a Literal: each name loads, from a file value as
    from a flag, and anything else is a ConfigError naming the field."""
    import dataclasses
    import importlib.util
    import typing

    from servelm.config.engine import choices
    from servelm.config.settings import SECTIONS

    found = []
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            names = choices(tp) or next((choices(a) for a in typing.get_args(tp) if choices(a)), None)
            if names is None:
                continue
            found.append(f.name)
            for name in names:
                if name == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
                    continue  # allowed only where installed (a rule of its own, tested with it)
                extra = {"speculative_model": "self:1"} if name == "draft" else {}
                assert getattr(load({f.name: name, **extra}, env={}).section(_section_of(cls)), f.name) == name
            with pytest.raises(ConfigError, match=f.name):
                load({f.name: "no-such-choice"}, env={})
    assert {"dtype", "quantization", "scheduling_policy", "preemption_mode", "structured_output_backend",
            "speculative_method", "ui", "tool_call_parser", "prefix_cache_isolation", "default_priority"} <= set(found)


def _section_of(cls) -> str:
    from servelm.config.settings import SECTIONS

    return next(sec for sec, c in SECTIONS.items() if c is cls)
