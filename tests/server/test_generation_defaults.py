"""A model's generation_config.json gives the defaults of a request's unset sampling fields, as in vLLM
(--generation-config auto | vllm | FOLDER, --override-generation-config): the rules that pick them, every front end
that applies them (in-process, with a stub engine that records each request's SamplingParams), and the path from
the engine process to the HTTP process and through LLM.generate, checked against transformers' greedy output."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import httpx
import pytest
from fakes import IdleEngine
from serving import start_server, stop_server
from tiny_models import hf_greedy

from servelm.config import generation
from servelm.config.settings import load
from servelm.outputs import CompletionOutput, Logprob, RequestOutput

CHAT = [{"role": "user", "content": "hi"}]
QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
             "bos_token_id": 1, "eos_token_id": [2, 3]}


def _folder(tmp_path, name: str, gen: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def test_a_files_sampling_fields_are_the_defaults_as_vllm_reads_them(tmp_path):
    """Only the sampling fields, renamed to the request's (max_new_tokens -> max_tokens), and not those equal to
    transformers' own defaults (vLLM reads the file's to_diff_dict: an explicit top_k 50 is no default)."""
    folder = _folder(tmp_path, "m", {**QWEN_LIKE, "max_new_tokens": 64, "min_p": 0.05, "presence_penalty": 0.5})
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64,
            "min_p": 0.05, "presence_penalty": 0.5}
    assert generation.sampling_defaults("auto", folder, None) == want
    same_as_transformers = _folder(tmp_path, "t", {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                                   "repetition_penalty": 1.0, "do_sample": True})
    assert generation.sampling_defaults("auto", same_as_transformers, None) == {}
    # vllm: OpenAI's neutral defaults whatever the file says; the overrides still apply
    assert generation.sampling_defaults("vllm", folder, None) == {}
    assert generation.sampling_defaults("vllm", folder, '{"temperature": 0.2}') == {"temperature": 0.2}
    # the overrides win over the file, field by field; as a mapping too (Python, a config file)
    assert generation.sampling_defaults("auto", folder, {"temperature": 0, "max_new_tokens": 8}) == \
        {**want, "temperature": 0, "max_tokens": 8}
    # a folder named by the setting replaces the model's own file
    other = _folder(tmp_path, "o", {"temperature": 0.3})
    assert generation.sampling_defaults(str(other), folder, None) == {"temperature": 0.3}
    # a GGUF file keeps no generation settings: no model folder, no defaults
    assert generation.sampling_defaults("auto", None, None) == {}
    assert generation.sampling_defaults("auto", tmp_path / "no-such-folder", None) == {}


def test_a_files_invalid_value_is_dropped_with_a_warning_not_a_failed_start(tmp_path, caplog):
    folder = _folder(tmp_path, "m", {"temperature": -1, "top_p": 0.9, "top_k": "many", "max_new_tokens": 0})
    with caplog.at_level(logging.WARNING, logger="servelm.config.generation"):
        assert generation.sampling_defaults("auto", folder, None) == {"top_p": 0.9}
    dropped = " ".join(r.getMessage() for r in caplog.records)
    assert "temperature=-1" in dropped and "top_k='many'" in dropped and "max_new_tokens=0" in dropped
    (folder / "generation_config.json").write_text("{not json")
    assert generation.sampling_defaults("auto", folder, None) == {}


@pytest.mark.parametrize(("field", "value", "says"), [
    ("generation_config", "/no/such/folder", "generation_config.json"),
    ("override_generation_config", "{temperature: 0.5}", "not valid JSON"),
    ("override_generation_config", "[0.5]", "JSON object"),
    ("override_generation_config", '{"do_sample": false}', "unknown field 'do_sample'"),
    ("override_generation_config", '{"top_p": 2}', "top_p must be in (0, 1]"),
    ("override_generation_config", '{"top_k": 2.5}', "top_k must be a whole number"),
    ("override_generation_config", '{"temperature": true}', "temperature must be a finite number"),
    ("override_generation_config", '{"max_new_tokens": 0}', "max_new_tokens must be at least 1"),
])
def test_a_bad_setting_stops_the_start_naming_it(field, value, says):
    with pytest.raises(ValueError, match=field) as e:
        load({field: value}, env={})
    assert says in str(e.value)


def test_the_settings_come_from_flags_env_and_files(tmp_path):
    folder = _folder(tmp_path, "m", {"temperature": 0.3})
    assert load({}, env={}).engine.model_config.generation_config == "auto"
    env = {"SERVELM_GENERATION_CONFIG": str(folder), "SERVELM_OVERRIDE_GENERATION_CONFIG": '{"top_k": 5}'}
    mc = load({}, env=env).engine.model_config
    assert mc.generation_config == str(folder) and json.loads(mc.override_generation_config) == {"top_k": 5}
    file = tmp_path / "servelm.yaml"
    file.write_text("engine:\n  generation_config: vllm\n  override_generation_config:\n    temperature: 0.5\n")
    mc = load({}, env={}, file=str(file)).engine.model_config
    assert mc.generation_config == "vllm" and json.loads(mc.override_generation_config) == {"temperature": 0.5}


# -- every front end -----------------------------------------------------------------------------------------

DEFAULTS = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
            "presence_penalty": 0.25, "frequency_penalty": 0.125, "max_tokens": 7}
NEUTRAL = {**generation.NEUTRAL}


class RecordingEngine(IdleEngine):
    """A model with the sampling defaults `defaults` that records every request's SamplingParams."""

    def __init__(self, defaults: dict, vocab_size: int) -> None:
        self.info = SimpleNamespace(sampling_defaults=defaults, vocab_size=vocab_size)
        self.params: list = []

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, *,
                       lora=None):
        self.params.append(params)
        # a beam search's step asks for logprobs: two candidates
        lp = [{5: Logprob(-0.5, 1), 6: Logprob(-1.0, 2)}] if params.logprobs else None
        yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(0, "x", [5], logprobs=lp,
                                                                      finish_reason="length")], True)


def _client(tokenizer, engine):
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False}, env={})
    return TestClient(build_app(build_state(config, tokenizer, engine, "tiny")))


def _sampling(params) -> dict:
    return {k: getattr(params, k) for k in [*NEUTRAL, "max_tokens"]}


# (path, body with no sampling fields, body that sets temperature, top_k and the length; what the length is)
FRONT_ENDS = [
    ("/v1/chat/completions", {"messages": CHAT}, {"messages": CHAT, "temperature": 0.9, "top_k": 3, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": None},
     {"prompt": "hi", "temperature": 0.9, "top_k": 3, "max_tokens": 4}),
    ("/v1/responses", {"input": "hi"}, {"input": "hi", "temperature": 0.9, "max_output_tokens": 4}),
    ("/api/generate", {"prompt": "hi", "stream": False},
     {"prompt": "hi", "stream": False, "options": {"temperature": 0.9, "top_k": 3, "num_predict": 4}}),
    ("/api/chat", {"messages": CHAT, "stream": False},
     {"messages": CHAT, "stream": False, "options": {"temperature": 0.9, "top_k": 3, "num_predict": 4}}),
]


@pytest.mark.parametrize(("path", "unset", "given"), FRONT_ENDS, ids=[f[0] for f in FRONT_ENDS])
def test_every_front_end_fills_unset_fields_from_the_models_defaults(tokenizer, path, unset, given):
    engine = RecordingEngine(DEFAULTS, len(tokenizer))
    with _client(tokenizer, engine) as client:
        for body in (unset, given):
            r = client.post(path, json={"model": "tiny", **body})
            assert r.status_code == 200, r.text
    assert _sampling(engine.params[0]) == DEFAULTS
    # what a request gives wins; what it leaves out is still the model's (the Responses API has no top_k)
    want = {**DEFAULTS, "temperature": 0.9, "max_tokens": 4} | ({} if path == "/v1/responses" else {"top_k": 3})
    assert _sampling(engine.params[1]) == want


def test_ollamas_show_lists_the_defaults_as_modelfile_parameters(tokenizer):
    with _client(tokenizer, RecordingEngine({"temperature": 0.7, "repetition_penalty": 1.05, "max_tokens": 64},
                                            len(tokenizer))) as client:
        r = client.post("/api/show", json={"model": "tiny"})
        assert r.status_code == 200, r.text
        assert r.json()["parameters"].splitlines() == ["temperature 0.7", "repeat_penalty 1.05", "num_predict 64"]
    with _client(tokenizer, RecordingEngine({}, len(tokenizer))) as client:
        assert client.post("/api/show", json={"model": "tiny"}).json()["parameters"] == ""


def test_without_model_defaults_the_neutral_values_and_the_room_left_apply(tokenizer):
    engine = RecordingEngine({}, len(tokenizer))
    with _client(tokenizer, engine) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
        assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert _sampling(engine.params[0]) == {**NEUTRAL, "max_tokens": engine.max_model_len - prompt_tokens}


def test_a_models_max_new_tokens_never_asks_for_more_than_the_context_holds(tokenizer):
    engine = RecordingEngine({"max_tokens": 100_000}, len(tokenizer))
    with _client(tokenizer, engine) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
        assert r.status_code == 200, r.text
    assert engine.params[0].max_tokens == engine.max_model_len - r.json()["usage"]["prompt_tokens"]


def test_the_native_api_and_beam_search_take_the_models_temperature(tokenizer):
    engine = RecordingEngine(DEFAULTS | {"temperature": 0.5}, len(tokenizer))
    with _client(tokenizer, engine) as client:
        r = client.post("/generate", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert _sampling(engine.params[-1]) == {**DEFAULTS, "temperature": 0.5, "max_tokens": 2}
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1,
                                                 "use_beam_search": True, "n": 2})
        assert r.status_code == 200, r.text
    # a beam's step samples with the beam search's temperature and no other sampling field
    step = engine.params[-1]
    assert step.temperature == 0.5 and step.top_k == 0 and step.top_p == 1.0


# -- the real engine ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_by_default(llama_dir, tmp_path_factory):
    """The tiny Llama whose generation_config.json asks for greedy decoding and 5 new tokens."""
    out = tmp_path_factory.mktemp("gen") / "llama"
    shutil.copytree(llama_dir, out)
    path = out / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 5}))
    return out


PROMPT = [5, 17, 42, 99, 7, 23]


def test_llm_generate_without_params_follows_the_models_generation_config(greedy_by_default, hf_models):
    from servelm import LLM, SamplingParams

    want = hf_greedy(hf_models["llama"], PROMPT, 5)
    llm = LLM(str(greedy_by_default), dtype="float32", num_kv_blocks=64)
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want and out.finish_reason == "length"
    # given SamplingParams are used as they are: SamplingParams' own max_tokens of 16
    assert len(llm.generate([PROMPT], SamplingParams(temperature=0.0), use_tqdm=False)[0].outputs[0].token_ids) == 16
    llm = LLM(str(greedy_by_default), dtype="float32", num_kv_blocks=64, generation_config="vllm",
              override_generation_config={"temperature": 0.0, "max_new_tokens": 3})
    assert llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids == want[:3]


def test_the_server_applies_the_defaults_its_engine_process_reads(greedy_by_default, hf_models, tokenizer):
    """The engine process reads the file and reports the defaults with its Ready; the HTTP process applies them."""
    want = tokenizer.decode(hf_greedy(hf_models["llama"], PROMPT, 5))
    proc, url = start_server(greedy_by_default)
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": None},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["text"] == want
        r = httpx.post(f"{url}/api/generate", json={"model": "tiny", "prompt": tokenizer.decode(PROMPT),
                                                    "raw": True, "stream": False}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 5
    finally:
        stop_server(proc)
