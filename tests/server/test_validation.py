"""Bad input on a real server: every refusal is a 4xx in OpenAI's error shape naming the field, never a 500, and
no bad request leaves anything behind (a queue slot, a stream, a KV block, a dead engine)."""

from __future__ import annotations

import httpx
import pytest
from serving import start_server, stats, stop_server
from tiny_models import VOCAB

pytestmark = pytest.mark.server

ADMIN = {"x-api-key": "sk-admin-000000"}
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    # a high watermark of 4: four leaked queue slots would turn every later request into a 503
    proc, url = start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "512", "--admin-key",
                             ADMIN["x-api-key"], "--queue-high-watermark", "4", "--queue-low-watermark", "0",
                             "--max-logprobs", "32")
    yield url
    assert stop_server(proc) == 0


def error(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error object of a refused request, after checking its status and shape."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, "seed"),
    (CHAT, {"messages": MSGS, "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, VOCAB]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),  # killed the engine
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2**64}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(2**64): 1}}, None),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [1, VOCAB]}, None),  # outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["ok", "  "]}, "bad_words.1"),
    ("/generate", {"prompt": "hi", "allowed_token_ids": [-1]}, "allowed_token_ids.0"),
])
def test_out_of_range_numbers_are_400_and_leak_nothing(server, path, body, param):
    for _ in range(6):  # more than the high watermark: a leaked slot per request would shed the next request
        err = error(httpx.post(server + path, json={"max_tokens": 2, **body}))
        if param is not None:  # the field, or the exact item in it
            assert err["param"] == param or err["param"].startswith(param + ".")
    ok = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text
    s = stats(server)
    assert s["engine"]["in_flight"] == 0 and s["queue"]["depth"] == 0 and s["engine"]["restarts"] == 0


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/embeddings", b'{"input": ["\\ud800"]}', "input.0"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias.\ud800"),
])
def test_lone_surrogates_are_400(server, path, raw, param):
    err = error(httpx.post(server + path, content=raw, headers={"content-type": "application/json"}))
    assert err["param"] == param
    assert err["code"] == "invalid_unicode"


def test_max_logprobs_sets_how_many_a_request_may_ask_for(server):
    """--max-logprobs 32 (vLLM's flag): 32 top logprobs per token, in order; 33 is a 400 naming the field and
    the limit, and the engine ran nothing for it."""
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "logprobs": True,
                                                          "top_logprobs": 32})
    assert r.status_code == 200, r.text
    for tok in r.json()["choices"][0]["logprobs"]["content"]:
        lps = [t["logprob"] for t in tok["top_logprobs"]]
        assert len(lps) == 32 and lps == sorted(lps, reverse=True)
    r = httpx.post(server + "/v1/completions", json={"prompt": "hello there, my friend", "max_tokens": 1,
                                                       "prompt_logprobs": 32})
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"][1]) >= 32, r.text
    for path, body, param in (("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 33},
                               "top_logprobs"),
                              ("/v1/completions", {"prompt": "hi", "logprobs": 33}, "logprobs")):
        err = error(httpx.post(server + path, json=body))
        assert err["param"] == param and "32" in err["message"]


def test_a_valid_surrogate_pair_is_text(server):
    r = httpx.post(server + "/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_errors_keep_the_keep_alive_connection(server):
    bad = b'{"prompt": "\\ud800", "max_tokens": 2}'
    with httpx.Client(base_url=server, limits=httpx.Limits(max_connections=1)) as client:
        for _ in range(20):
            r = client.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("raw, param", [
    (b'{"max_num_seqs": 1e20}', "scheduler.max_num_seqs"),  # was a 500, yet GET showed it applied
    (b'{"max_num_seqs": 18446744073709551616}', "scheduler.max_num_seqs"),
    (b'{"queue_timeout_s": 1e400}', "admission.queue_timeout_s"),  # a float infinity
    (b'{"max_num_seqs": 5, "default_priority": "urgent"}', "admission.default_priority"),
    (b'{"\\ud800": 1}', "\ud800"),
])
def test_admin_patch_is_validated_and_all_or_nothing(server, raw, param):
    before = httpx.get(server + "/admin/config", headers=ADMIN).json()["config"]
    r = httpx.patch(server + "/admin/config", content=raw, headers=ADMIN)
    assert error(r)["param"] == param
    assert httpx.get(server + "/admin/config", headers=ADMIN).json()["config"] == before
    ok = httpx.patch(server + "/admin/config", json={"max_num_seqs": 8}, headers=ADMIN)
    assert ok.status_code == 200 and ok.json()["applied"] == {"scheduler.max_num_seqs": 8}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSGS, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": [{"role": "tool", "tool_call_id": "c1"}]}, "messages.0.content"),
    (CHAT, {"messages": [*MSGS, {"role": "user", "content": None}]}, "messages.1.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ("/v1/completions", {"prompt": "hi", "temperature_typo": 0.5}, "temperature_typo"),
    (CHAT, {"messages": MSGS, "max_token": 5}, "max_token"),
    ("/v1/embeddings", {"input": "hi", "foo": 1}, "foo"),
    ("/generate", {"prompt": "hi", "logit_bias": {"3": 1}}, "logit_bias"),
    ("/detokenize", {"tokens": [1], "skip": True}, "skip"),
])
def test_validation_gaps_are_400_naming_the_field(server, path, body, param):
    assert error(httpx.post(server + path, json=body))["param"] == param


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": MSGS, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/completions", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"messages": MSGS, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", {"prompt": "hi", "suffix": " end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    (CHAT, {"messages": MSGS, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    # media parts, named as such: a multimodal model is served by its language model alone
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages"),
    ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "x"}]}]}, "input"),
])
def test_fields_not_implemented_yet_are_400_naming_them(server, path, body, param):
    err = error(httpx.post(server + path, json=body))
    assert err["param"] == param and err["code"] == "unsupported_parameter" and "not supported" in err["message"]


def test_dimensions_of_a_model_not_trained_for_them_are_a_400(server):
    """all-MiniLM-L6-v2 is no Matryoshka model: its vectors cut short would be poor (as vLLM refuses them)."""
    for path in ("/v1/embeddings", "/api/embed"):
        r = httpx.post(server + path, json={"input": "hi", "dimensions": 8})
        assert r.status_code == 400 and "all-MiniLM-L6-v2 is not a Matryoshka" in r.text, r.text
    assert error(httpx.post(server + "/v1/embeddings", json={"input": "hi", "dimensions": 8}))["param"] == "dimensions"


@pytest.mark.parametrize("path, body", [  # values that change nothing, and the implemented extensions
    (CHAT, {"messages": MSGS, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}),
    (CHAT, {"messages": MSGS, "tools": None, "suffix": None, "stream_options": None, "store": False}),
    (CHAT, {"messages": MSGS, "safety_identifier": "user-123", "prompt_cache_key": "conversation-9"}),
    ("/v1/completions", {"prompt": "hi", "suffix": "", "best_of": 1, "spaces_between_special_tokens": True}),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": True, "min_tokens": 1, "include_stop_str_in_output": True,
                         "skip_special_tokens": False, "priority": "low", "user": "u1", "top_k": 5, "min_p": 0.1,
                         "repetition_penalty": 1.1, "stop_token_ids": [7], "seed": -5, "echo": True,
                         "logprobs": 2, "logit_bias": {"7": -100}, "allowed_token_ids": [7, 9],
                         "bad_words": ["cat", "a dog"]}),
    (CHAT, {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": "hi", "name": "bob"},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "more"}],
            "add_generation_prompt": True, "chat_template_kwargs": {}, "max_completion_tokens": 2,
            "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}),
    ("/generate", {"prompt": "hi", "stop_sequences": ["x"], "priority": 1}),
    ("/generate", {"prompt": "hi", "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                   "repetition_penalty": 1.1, "seed": -5, "stop_token_ids": [7], "ignore_eos": True,
                   "min_tokens": 1, "allowed_token_ids": [7, 9], "bad_words": ["cat"]}),
    ("/chat", {"messages": MSGS, "top_k": 5, "seed": 3}),
])
def test_what_servelm_implements_still_works(server, path, body):
    r = httpx.post(server + path, json={"max_tokens": 2, **body})
    assert r.status_code == 200, r.text


def test_the_openai_sdk_still_works(server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, temperature=0, seed=3,
                                          n=2, stop=["\n"], logprobs=True, top_logprobs=1, user="u",
                                          presence_penalty=0.1, frequency_penalty=0.1, top_p=0.9,
                                          max_completion_tokens=2, logit_bias={"7": 1})
    assert len(chat.choices) == 2
    text = client.completions.create(model="tiny", prompt="hi", max_tokens=2, echo=True, logprobs=1,
                                     extra_body={"ignore_eos": True})
    assert text.choices[0].text.startswith("hi")
    assert len(client.embeddings.create(input=["a", "b"], model="all-MiniLM-L6-v2").data) == 2  # base64
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, prediction={"type": "content", "content": "x"})
    assert e.value.body["param"] == "prediction"


def test_chat_message_has_refusal_null(server):
    r = httpx.post(server + CHAT, json={"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["refusal"] is None
    with httpx.stream("POST", server + CHAT, json={"messages": MSGS, "max_tokens": 2, "stream": True}) as s:
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
    assert '"refusal":null' in first


@pytest.mark.parametrize("method, path, allow", [
    ("TRACE", "/v1/completions", "POST"),
    ("TRACE", "/admin/config", "GET, PATCH"),  # was 401 (and 403 with admin routes off)
    ("CONNECT", "/v1/models", "GET"),
    ("DELETE", "/v1/chat/completions", "POST"),
])
def test_unknown_methods_are_405(server, method, path, allow):
    r = httpx.request(method, server + path)
    error(r, 405)
    assert r.headers["allow"] == allow


def test_openapi_lists_real_statuses_and_bounds(server):
    doc = httpx.get(server + "/openapi.json").json()
    assert "422" not in str(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    err = {"$ref": "#/components/schemas/Error"}
    for path, status in [("/v1/completions", {"200", "400", "401", "403", "404", "408", "413", "429", "503"}),
                         ("/v1/embeddings", {"200", "400", "401", "403", "404", "413", "429", "503"})]:
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == status
        assert all(responses[s]["content"]["application/json"]["schema"] == err for s in status - {"200"})
    assert set(doc["paths"]["/ready"]["get"]["responses"]) == {"200", "413", "503"}
    assert set(doc["components"]["schemas"]["Error"]["properties"]["error"]["required"]) == {
        "message", "type", "param", "code"}
    schemas = doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt  # "" is refused, so the document does not offer it
    ids = next(s for s in prompt if s.get("x-token-ids"))
    assert ids["minItems"] == 1 and ids["items"]["maximum"] == VOCAB - 1 and ids["items"]["minimum"] == 0
    assert {"type": "string", "minLength": 1} in schemas["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    assert "text/event-stream" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    patch = doc["paths"]["/admin/config"]["patch"]["requestBody"]["content"]["application/json"]["schema"]
    assert patch["properties"]["max_num_seqs"]["minimum"] == 1 and not patch["additionalProperties"]


@pytest.mark.parametrize("method, path, route, body", [
    ("GET", "/v2/models/nope", "/v2/models/{name}", None),
    ("GET", "/v2/models/nope/versions/1/ready", "/v2/models/{name}/versions/{version}/ready", None),
    ("POST", "/v2/models/nope/infer", "/v2/models/{name}/infer", {"inputs": []}),
    ("POST", "/v1/completions", "/v1/completions", {"model": "nope", "prompt": "hi"}),  # OpenAI's shape
])
def test_404_bodies_match_the_openapi_document(server, method, path, route, body):
    """/v2's errors are the Open Inference Protocol's {"error": "<message>"}, and the document says so."""
    import jsonschema

    doc = httpx.get(server + "/openapi.json").json()
    r = httpx.request(method, server + path, json=body)
    assert r.status_code == 404, r.text
    schema = doc["paths"][route][method.lower()]["responses"]["404"]["content"]["application/json"]["schema"]
    jsonschema.validate(r.json(), {**schema, "components": doc["components"]})


def test_native_default_max_tokens_fits_the_context(server):
    """/generate's default of 128 new tokens is capped by what the context holds (512 - 500 here)."""
    r = httpx.post(server + "/generate", json={"prompt": "hi " * 500, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] <= 512
