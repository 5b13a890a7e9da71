"""`vllm serve` command lines run unchanged: the flags vLLM users paste are accepted with vLLM's meaning
(--chat-template, --trust-remote-code, --dtype half, --max-model-len 32k, several --served-model-name, the CORS
flags, --gpu-memory-utilization). In-process with stub engines, except one real server started with a pasted
vLLM command line."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fakes import StubEngine
from serving import start_server, stop_server

from servelm.config.engine import ConfigError, EngineConfig, read_chat_template, token_count
from servelm.config.settings import load

TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


def _serve_args(*argv: str):
    from servelm.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def _config(*argv: str):
    """The serve config from a command line, as `servelm serve` builds it (no SERVELM_* env vars)."""
    import os
    from unittest import mock

    from servelm.server import serve

    args = _serve_args(*argv)
    with mock.patch.dict(os.environ, {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")},
                         clear=True):
        return serve.load_config(args)


# -- --max-model-len 32k and the other token counts ------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [
    ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 1_000_000), ("1M", 2**20), ("2g", 2 * 10**9),
    ("4096", 4096), (" 8k ", 8000)])
def test_token_counts_read_as_vllm_reads_them(text, value):
    assert token_count(text) == value
    assert _config("--max-model-len", text).engine.model_config.max_model_len == value
    assert _config("--max-num-batched-tokens", text).engine.scheduler_config.max_num_batched_tokens == value
    assert load({}, env={"SERVELM_MAX_MODEL_LEN": text}).engine.model_config.max_model_len == value


def test_max_model_len_auto_is_the_default_and_bad_counts_are_refused(capsys):
    for auto in ("auto", "-1"):
        assert _config("--max-model-len", auto).engine.model_config.max_model_len is None
        assert load({}, env={"SERVELM_MAX_MODEL_LEN": auto}).engine.model_config.max_model_len is None
    with pytest.raises(SystemExit):
        _serve_args("--max-model-len", "1.5K")  # vLLM: no decimals with a binary suffix
    assert "did you mean 1.5k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve_args("--max-num-batched-tokens", "auto")  # auto only where the setting can be derived
    with pytest.raises(ConfigError, match="SERVELM_MAX_NUM_BATCHED_TOKENS"):
        load({}, env={"SERVELM_MAX_NUM_BATCHED_TOKENS": "lots"})


# -- --dtype half, float, bf16 ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float", "float32"), ("bf16", "bfloat16"),
                                             ("float16", "float16"), ("auto", "auto")])
def test_vllm_dtype_spellings_name_servelm_dtypes(given, dtype):
    assert EngineConfig(dtype=given).model_config.dtype == dtype
    assert _config("--dtype", given).engine.model_config.dtype == dtype
    assert load({}, env={"SERVELM_DTYPE": given}).engine.model_config.dtype == dtype


def test_an_unknown_dtype_is_still_refused():
    with pytest.raises(ConfigError, match="half"):
        EngineConfig(dtype="double")


# -- --trust-remote-code, --gpu-memory-utilization -----------------------------------------------------------

def test_trust_remote_code_and_gpu_memory_utilization_are_accepted_and_said_to_be_unused():
    config = _config("--trust-remote-code", "--gpu-memory-utilization", "0.9")
    assert config.engine.model_config.trust_remote_code is True and config.engine.cache_config.gpu_memory_utilization == 0.9
    notes = config.engine.unused_vllm_settings()
    assert any("--trust-remote-code is not needed" in n and "built-in architectures" in n for n in notes)
    assert any("--gpu-memory-utilization 0.9 is not used" in n and "--kv-cache-memory-gb" in n for n in notes)
    assert _config().engine.unused_vllm_settings() == []
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        _config("--gpu-memory-utilization", "1.5")


def test_vllms_request_log_flags_set_servelms():
    assert _config("--disable-log-requests").server.observability_config.log_requests is False
    assert _config("--enable-log-requests").server.observability_config.log_requests is True
    assert _config().server.observability_config.log_requests is True


def test_unused_vllm_settings_are_logged_at_start(tmp_path, caplog):
    """`serve` says so before anything loads (here it stops at the model check: the folder is empty)."""
    import logging

    from servelm.server.serve import cmd_serve

    with caplog.at_level(logging.INFO, logger="servelm.server"), pytest.raises((ValueError, OSError)):
        cmd_serve(_serve_args(str(tmp_path), "--trust-remote-code", "--embedding-model", "none",
                              "--enable-auto-tool-choice"))
    assert "--trust-remote-code is not needed" in caplog.text
    assert "--enable-auto-tool-choice is not needed: a request that offers tools is always parsed" in caplog.text


@pytest.mark.parametrize(("flag", "value"), [
    ("--load-format", "dummy"), ("--load-format", "mistral"), ("--tokenizer-mode", "mistral"),
    ("--tokenizer-mode", "slow"), ("--config-format", "mistral"), ("--chat-template-content-format", "openai"),
    ("--pipeline-parallel-size", "2"), ("-pp", "4"), ("--data-parallel-size", "2"), ("-dp", "8"),
    ("--distributed-executor-backend", "ray"), ("--distributed-executor-backend", "external_launcher")])
def test_vllm_flags_with_one_servelm_way_refuse_the_others(flag, value):
    """--load-format, --config-format, --tokenizer-mode, --chat-template-content-format and the parallelism
    flags: vLLM's values for what servelm does are accepted (above, in a pasted command line); another value
    would change what the command means, so it stops the start naming the values servelm takes."""
    from servelm.config.vllm_flags import VLLM_ONE_WAY, VLLM_ONE_WAY_SHORT

    long = {v: k for k, v in VLLM_ONE_WAY_SHORT.items()}.get(flag, flag)
    dest = long[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=dest) as e:
        _config(flag, value)
    assert all(ok in str(e.value) for ok in VLLM_ONE_WAY[long][0]) and value in str(e.value)
    for ok in VLLM_ONE_WAY[long][0]:
        _config(flag, ok)


@pytest.mark.parametrize(("task", "runner"), [("generate", "generate"), ("embed", "pooling"),
                                              ("embedding", "pooling"), ("classify", "pooling"),
                                              ("score", "pooling"), ("auto", "auto")])
def test_vllms_task_flag_names_the_runner(task, runner):
    assert _config("--task", task).engine.model_config.runner == runner


def test_task_refuses_what_servelm_does_not_serve_and_a_second_runner():
    for task in ("reward", "transcription", "draft"):
        with pytest.raises(ConfigError, match="task") as e:
            _config("--task", task)
        assert "generate" in str(e.value)
    with pytest.raises(ConfigError, match="runner must be given once"):
        _config("--task", "embed", "--runner", "generate")


# -- --speculative-config, --kv-cache-memory-bytes, --num-gpu-blocks-override, -tp -----------------------------

def test_speculative_config_json_becomes_servelms_settings():
    spec = _config("--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2,
    })).engine.speculative_config
    assert (spec.speculative_method, spec.speculative_model, spec.num_speculative_tokens, spec.ngram_lookup_max,
            spec.ngram_lookup_min) == ("ngram", None, 3, 5, 2)
    # vLLM's n-gram defaults: both lookups 5, or the one given for both; "model": "ngram" names the method
    for given, lookups in (({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 6}, (6, 6)),
                           ({"model": "ngram"}, (5, 5))):
        spec = _config("--speculative-config", json.dumps({"method": "ngram", **given} if "model" not in given
                                                          else given)).engine.speculative_config
        assert (spec.speculative_method, spec.speculative_model, spec.ngram_lookup_min, spec.ngram_lookup_max) == \
            ("ngram", None, *lookups)
    for draft in ({"model": "./draft", "num_speculative_tokens": 2},
                  {"method": "draft_model", "model": "./draft", "num_speculative_tokens": 2}):
        spec = _config("--speculative-config", json.dumps(draft)).engine.speculative_config
        assert (spec.speculative_method, spec.speculative_model, spec.num_speculative_tokens) == \
            ("draft", "./draft", 2)
    assert not _config().engine.speculative_config.enabled


@pytest.mark.parametrize(("value", "says"), [
    ({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "EAGLE"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}, "disable_by_batch_size"),
    ({"method": "ngram", "model": "./draft"}, "no model with method ngram"),
    ({"method": "draft_model"}, "a \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 40}, "num_speculative_tokens"),
    ("not json", "a JSON object"),
])
def test_speculative_config_refuses_what_servelm_would_not_do(value, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        _config("--speculative-config", value if isinstance(value, str) else json.dumps(value))


def test_vllms_kv_cache_sizes_and_tp_short_flag():
    assert _config("--kv-cache-memory-bytes", "8G").engine.cache_config.kv_cache_memory_gb == 8.0
    assert _config("--kv-cache-memory-bytes", "1073741824").engine.cache_config.kv_cache_memory_gb == 1.0
    assert _config("--num-gpu-blocks-override", "96").engine.cache_config.num_kv_blocks == 96
    assert _config("-tp", "2").engine.parallel_config.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="num_kv_blocks must be given once"):  # not a silent choice of one
        _config("--num-gpu-blocks-override", "96", "--num-kv-blocks", "64")
    with pytest.raises(ConfigError, match="num_speculative_tokens must be given once"):
        _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                "--num-speculative-tokens", "2")
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        _config("--kv-cache-memory-bytes", "lots")


def test_default_chat_template_kwargs_and_the_http_servers_settings():
    api = _config("--default-chat-template-kwargs", '{"enable_thinking": false}', "--uvicorn-log-level", "info",
                  "--disable-fastapi-docs").server.api_config
    assert api.chat_template_defaults() == {"enable_thinking": False}
    assert api.uvicorn_log_level == "info" and api.disable_fastapi_docs is True
    assert load({"default_chat_template_kwargs": {"enable_thinking": True}}).server.api_config \
        .chat_template_defaults() == {"enable_thinking": True}  # a config file's mapping
    with pytest.raises(ConfigError, match="default_chat_template_kwargs"):
        _config("--default-chat-template-kwargs", '["enable_thinking"]')
    with pytest.raises(ConfigError, match="not add_generation_prompt"):  # every rendering sets it itself
        _config("--default-chat-template-kwargs", '{"add_generation_prompt": false}')
    with pytest.raises(ConfigError, match="uvicorn_log_level"):
        _config("--uvicorn-log-level", "loud")


def test_max_log_len_cuts_the_logged_prompt_and_completion():
    from servelm.server.observability.telemetry import RequestRecord

    rec = RequestRecord("r1", "POST", "/v1/completions")
    rec.prompt_text, rec.completion_text = "a" * 50, "b" * 8
    assert rec.log_fields(True, 10)["prompt"] == "a" * 10 and rec.log_fields(True, 10)["completion"] == "b" * 8
    assert rec.log_fields(True)["prompt"] == "a" * 50 and "prompt" not in rec.log_fields(False, 10)
    assert _config("--max-log-len", "10").server.observability_config.max_log_len == 10


# -- --chat-template -------------------------------------------------------------------------------------------

def test_chat_template_is_a_file_or_the_template_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE  # names no file, holds Jinja: the template itself
    assert read_chat_template(None) is None
    with pytest.raises(ConfigError, match="looks like a file path"):  # caught before anything loads
        _config("--chat-template", str(tmp_path / "missing.jinja"))
    assert _config("--chat-template", str(path)).engine.model_config.chat_template == str(path)


def _start(config):
    """The models `servelm serve` would start, with stub engines: (state's arguments) as build_state takes."""
    from servelm.server.launch import fixed_models, start_engines

    started = asyncio.run(start_engines(fixed_models(config), 10, StubEngine))
    (engine, tok, name), more = started[0], started[1:]
    return engine, tok, name, more


def _app(config, engine, tok, name, more=()):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    return TestClient(build_app(build_state(config, tok, engine, name, more=list(more))))


def test_chat_template_replaces_the_tokenizers_for_the_model_given_only(tmp_path, llama_dir):
    """MODEL's chat requests render with --chat-template; a model of the config file's list keeps its own."""
    import yaml

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"models": [{"name": "other", "path": str(llama_dir)}]}))
    config = _config(str(llama_dir), "--served-model-name", "tiny", "--chat-template", TEMPLATE, "--config",
                     str(cfg), "--embedding-model", "none", "--no-log-requests")
    engine, tok, name, more = _start(config)
    assert tok.chat_template == TEMPLATE and more[0][1].chat_template != TEMPLATE
    with _app(config, engine, tok, name, more) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        assert tok.decode(engine.prompts[-1]) == "<<hello>>"


# -- --served-model-name a b c ---------------------------------------------------------------------------------

def test_several_served_model_names_from_the_command_line_env_and_file(tmp_path):
    assert _config("--served-model-name", "a", "b", "c").server.api_config.served_model_name == ("a", "b", "c")
    assert load({}, env={"SERVELM_SERVED_MODEL_NAME": "a,b"}).server.api_config.served_model_name == ("a", "b")
    assert load({}, env={"SERVELM_SERVED_MODEL_NAME": '["a", "b"]'}).server.api_config.served_model_name == ("a", "b")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: {served_model_name: [a, b]}\n")
    assert load({}, env={}, file=str(cfg)).server.api_config.served_model_name == ("a", "b")
    assert load({"served_model_name": "one"}, env={}).server.api_config.served_model_name == ("one",)
    with pytest.raises(ConfigError, match="each given once"):
        _config("--served-model-name", "a", "a")


def test_served_model_names_before_model_cannot_swallow_it(tmp_path):
    """nargs: `serve --served-model-name a ./model` would take ./model as a name and serve the default model;
    it is refused, saying to give MODEL first."""
    with pytest.raises(ConfigError, match="give MODEL first"):
        _config("--served-model-name", "a", str(tmp_path))
    assert _config(str(tmp_path), "--served-model-name", "a", "b").server.api_config.served_model_name == ("a", "b")


def test_every_served_model_name_selects_the_model_and_responses_carry_the_first(llama_dir):
    config = _config(str(llama_dir), "--served-model-name", "main", "alias-1", "alias-2", "--embedding-model",
                     "none", "--no-log-requests")
    engine, tok, name, _ = _start(config)
    assert name == "main"
    with _app(config, engine, tok, name) as client:
        for model in ("main", "alias-1", "alias-2", None):
            body = {"prompt": [1, 2, 3], "max_tokens": 1} | ({"model": model} if model else {})
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == "main", r.text
        cards = client.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["main", "alias-1", "alias-2"]  # as vLLM lists them, the first first
        assert {c.get("root") for c in cards[1:]} == {"main"} and "root" not in cards[0]
        assert client.get("/v1/models/alias-2").json()["root"] == "main"
        err = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}).json()["error"]
        assert "'main', 'alias-1', 'alias-2'" in err["message"]
        metrics = client.get("/metrics").text
        assert 'model_name="alias-1"' not in metrics  # one model: its figures stay under its id


def test_a_key_limited_to_a_model_may_use_its_aliases(tmp_path, llama_dir):
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {name: k, key: main-only-key-1, models: [main]}\n")
    config = _config(str(llama_dir), "--served-model-name", "main", "alias", "--api-keys-file", str(keys),
                     "--embedding-model", "none", "--no-log-requests")
    engine, tok, name, _ = _start(config)
    with _app(config, engine, tok, name) as client:
        r = client.post("/v1/completions", json={"model": "alias", "prompt": [1, 2], "max_tokens": 1},
                        headers={"Authorization": "Bearer main-only-key-1"})
        assert r.status_code == 200, r.text


def test_an_alias_may_not_repeat_a_models_list_name(tmp_path, llama_dir):
    from servelm.server.launch import fixed_models

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"models": [{"name": "b", "path": str(llama_dir)}]}))
    config = _config(str(llama_dir), "--served-model-name", "a", "b", "--config", str(cfg))
    with pytest.raises(ConfigError, match="differs"):
        fixed_models(config)


# -- CORS: --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials ---------------------------

ORIGIN = "http://localhost:3000"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_lists_from_the_command_line_env_and_file(tmp_path):
    srv = _config("--allowed-origins", f'["{ORIGIN}", "https://app.example"]').server  # vLLM's JSON form
    assert srv.api_config.allowed_origins == (ORIGIN, "https://app.example")
    assert srv.api_config.allowed_methods == ("*",) and srv.api_config.allowed_headers == ("*",) and srv.api_config.allow_credentials is False
    assert _config("--allowed-origins", ORIGIN, "https://b.example").server.api_config.allowed_origins == (ORIGIN,
                                                                                            "https://b.example")
    assert load({}, env={"SERVELM_ALLOWED_ORIGINS": "*"}).server.api_config.allowed_origins == ("*",)
    assert _config("--allowed-methods", '["GET", "POST"]').server.api_config.allowed_methods == ("GET", "POST")
    assert _config().server.api_config.allowed_origins == ()  # none by default
    with pytest.raises(ConfigError, match="allowed_origins"):
        _config("--allowed-origins", "localhost:3000")  # an origin has a scheme


def _cors_app(llama_dir, *flags: str):
    config = _config(str(llama_dir), "--served-model-name", "tiny", "--api-key", "cors-test-key-1",
                     "--embedding-model", "none", "--no-log-requests", *flags)
    engine, tok, name, _ = _start(config)
    return _app(config, engine, tok, name)


def test_preflight_is_answered_for_an_allowed_origin_before_keys_are_asked_for(llama_dir):
    with _cors_app(llama_dir, "--allowed-origins", f'["{ORIGIN}"]') as client:
        r = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        other = client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # the request itself, and an error a browser page must be able to read, carry the header
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        ok = client.post("/v1/chat/completions", json=body,
                         headers={"Origin": ORIGIN, "Authorization": "Bearer cors-test-key-1"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        denied = client.post("/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN


def test_cors_methods_headers_and_credentials_are_as_configured(llama_dir):
    with _cors_app(llama_dir, "--allowed-origins", ORIGIN, "--allowed-methods", "POST", "--allowed-headers",
                   "content-type", "--allow-credentials") as client:
        r = client.options("/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers":
                                                            "content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"
        assert client.options("/v1/chat/completions", headers=PREFLIGHT).status_code == 400  # authorization
        put = client.options("/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT",
                                                              "Access-Control-Request-Headers": "content-type"})
        assert put.status_code == 400


def test_without_allowed_origins_there_is_no_cross_origin_access(llama_dir):
    with _cors_app(llama_dir) as client:
        r = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


# -- a vLLM command line, pasted ---------------------------------------------------------------------------------

@pytest.mark.server
def test_a_pasted_vllm_serve_command_line_runs(llama_dir, tmp_path, tokenizer):
    """`vllm serve MODEL` with the flags vLLM users paste: the server starts and each flag does what it does in
    vLLM (the KV cache is given as blocks: servelm does not size it from --gpu-memory-utilization)."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}{{ mark | default('') }}>>{% endfor %}")
    proc, url = start_server(llama_dir, "--served-model-name", "tiny", "tiny-chat", "--max-model-len", "0.5k",
                             "--dtype", "float", "--trust-remote-code", "--chat-template", str(template),
                             "--allowed-origins", f'["{ORIGIN}"]', "--gpu-memory-utilization", "0.9",
                             "--max-num-batched-tokens", "1k", "--num-gpu-blocks-override", "64",
                             "--embedding-model", "none", "-tp", "1",
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-requests",
                             "--enable-prompt-tokens-details", "--disable-log-stats", "--disable-uvicorn-access-log",
                             "--uvicorn-log-level", "info", "--disable-fastapi-docs",
                             "--default-chat-template-kwargs", '{"mark": "!"}',
                             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                             "--load-format", "safetensors", "--tokenizer-mode", "auto", "--config-format", "hf",
                             "--chat-template-content-format", "string", "-pp", "1", "--data-parallel-size", "1",
                             "--distributed-executor-backend", "mp", "--task", "generate")
    try:
        cards = httpx.get(url + "/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "tiny-chat"] and cards[0]["max_model_len"] == 500
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-chat", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hello"}]}, headers={"Origin": ORIGIN})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny" and r.headers["access-control-allow-origin"] == ORIGIN
        # the template got the server's default kwargs, and a request's own win over them
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer("<<hello!>>", add_special_tokens=False).input_ids)
        r = httpx.post(url + "/v1/chat/completions", json={"max_tokens": 2, "chat_template_kwargs": {"mark": "?!?"},
                                                           "messages": [{"role": "user", "content": "hello"}]})
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer("<<hello?!?>>", add_special_tokens=False).input_ids)
        pre = httpx.options(url + "/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        for path in ("/docs", "/redoc", "/openapi.json"):  # --disable-fastapi-docs
            assert httpx.get(url + path).status_code == 404
        engine = httpx.get(url + "/server/stats").json()["scheduler"]
        assert engine["num_kv_blocks"] == 64  # --num-gpu-blocks-override
        assert len(engine["spec_proposed_by_position"]) == 2  # --speculative-config: 2 draft positions, counted
    finally:
        assert stop_server(proc) == 0
    with open(proc.log_path) as f:
        log = f.read()
    assert "--trust-remote-code is not needed" in log and "--gpu-memory-utilization 0.9 is not used" in log
    assert "--enable-auto-tool-choice is not needed" in log and "--disable-log-stats is not needed" in log
    assert "--disable-uvicorn-access-log is not needed" in log
    assert "--load-format safetensors is not needed" in log and "--tokenizer-mode auto is not needed" in log
    assert "--pipeline-parallel-size 1 is not needed" in log and "--data-parallel-size 1 is not needed" in log
    assert "Application startup complete" in log  # --uvicorn-log-level info: uvicorn's own lines
    assert '"event": "request"' not in log and '"event":"request"' not in log  # --disable-log-requests


@pytest.mark.parametrize(("backend", "engine"), [("xgrammar", "xgrammar"), ("guidance", "llguidance"),
                                                 ("llguidance", "llguidance"), ("auto", "auto")])
def test_vllms_older_guided_decoding_backend_names_the_grammar_engine(backend, engine):
    if engine == "xgrammar":
        pytest.importorskip("xgrammar")
    assert _config("--guided-decoding-backend", backend).engine.structured_outputs_config \
        .structured_output_backend == engine


def test_guided_decoding_backend_refuses_engines_servelm_does_not_run_and_a_second_setting():
    with pytest.raises(ConfigError, match="guided_decoding_backend") as e:
        _config("--guided-decoding-backend", "outlines")
    assert "xgrammar" in str(e.value)
    with pytest.raises(ConfigError, match="given once"):
        _config("--guided-decoding-backend", "xgrammar", "--structured-output-backend", "llguidance")


def test_enable_log_outputs_and_the_flags_for_what_servelm_always_does():
    assert _config("--enable-log-outputs").server.observability_config.log_prompts is True
    assert _config().server.observability_config.log_prompts is False
    for flag in ("--disable-custom-all-reduce", "--disable-frontend-multiprocessing"):
        assert flag in _serve_args(flag).vllm_always_on
