"""Ways into the server besides the OpenAI API, against one real server with a tiny model and an API key: the web
chat page (in headless Chromium, driven by Selenium), Ollama's API (driven by the `ollama` client: chat, generate,
JSON `format`, `tools`, errors) and OpenAI's Responses API (driven by the `openai` SDK). All go through the same
auth, admission, metrics and aborts as the OpenAI routes, so their greedy output equals those routes' output."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from serving import HOLD_CONTEXT, _wait, server_log_lines, start_server, stats, stop_server

pytestmark = pytest.mark.server

KEY = "sk-test-ollama-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour"}]
# Bounded: every string and number has a maximum length, so a complete object fits well within num_predict.
PET = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
       "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 30},
                      "kind": {"enum": ["cat", "dog"]}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
LONG = HOLD_CONTEXT - 1024  # max_tokens of a reply that runs for minutes unless stopped
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def served(long_llama_dir):
    # llama3_json: a tool call is a reply that is a JSON object, which Ollama's `format` can make the random
    # model write (its chat template says nothing of tools, so the parser would be hermes). The long context:
    # the reply the web page stops is still streaming whenever it is stopped, however fast the machine.
    proc, url = start_server(long_llama_dir, "--max-model-len", str(HOLD_CONTEXT), "--api-key", KEY,
                             "--tool-call-parser", "llama3_json")
    yield proc, url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def url(served):
    return served[1]


@pytest.fixture(scope="module")
def oc(url):
    return ollama.Client(host=url, headers=AUTH)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


# -- Ollama ----------------------------------------------------------------------------------------------------
def test_ollama_chat_equals_openai_chat(oc, client):
    ref = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    res = oc.chat(model="tiny", messages=MSGS, options={"temperature": 0, "num_predict": 12})
    assert res.message.role == "assistant" and res.message.content == ref.choices[0].message.content
    assert res.done and res.done_reason == ("length" if ref.choices[0].finish_reason == "length" else "stop")
    assert res.prompt_eval_count == ref.usage.prompt_tokens and res.eval_count == ref.usage.completion_tokens
    assert res.total_duration >= res.eval_duration > 0
    chunks = list(oc.chat(model="tiny:latest", messages=MSGS, stream=True,
                          options={"temperature": 0, "num_predict": 12}))
    assert len(chunks) > 2 and not any(c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == ref.choices[0].message.content
    assert chunks[-1].eval_count == ref.usage.completion_tokens and chunks[-1].model == "tiny:latest"


def test_ollama_logprobs_are_the_openai_routes(url, oc, client):
    """Ollama's logprobs and top_logprobs (chat and generate, whole or streamed): each generated token's text,
    logprob and most likely alternatives, the numbers OpenAI's chat route gives for the same request."""
    ref = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3)
    want = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in ref.choices[0].logprobs.content]
    opts = {"temperature": 0, "num_predict": 6}

    def got(entries):
        assert all(len(e.top_logprobs) == 3 for e in entries)
        return [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in entries]

    def same(a, b):
        assert [(t, alts) for t, _, alts in a] == [(t, alts) for t, _, alts in b]
        assert [lp for _, lp, _ in a] == pytest.approx([lp for _, lp, _ in b], abs=1e-4)

    res = oc.chat(model="tiny", messages=MSGS, options=opts, logprobs=True, top_logprobs=3)
    same(got(res.logprobs), want)
    chunks = list(oc.chat(model="tiny", messages=MSGS, options=opts, logprobs=True, top_logprobs=3, stream=True))
    same(got([e for c in chunks for e in c.logprobs or []]), want)
    assert "".join(e.token for c in chunks for e in c.logprobs or []) == res.message.content
    gen = oc.generate(model="tiny", prompt=MSGS[1]["content"], options=opts, logprobs=True)
    assert len(gen.logprobs) == gen.eval_count and all(not e.top_logprobs for e in gen.logprobs)
    assert oc.chat(model="tiny", messages=MSGS, options=opts).logprobs is None  # only when asked for
    for body, param in (({"top_logprobs": 2}, "top_logprobs needs logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "--max-logprobs")):
        r = httpx.post(url + "/api/chat", headers=AUTH, json={"model": "tiny", "messages": MSGS, **body})
        assert r.status_code == 400 and param in r.json()["error"], r.text


def test_ollama_generate_templates_raw_and_context(oc, client):
    opts = {"temperature": 0, "num_predict": 8}
    # not raw: the prompt is a user turn through the chat template, as Ollama does
    gen = oc.generate(model="tiny", prompt="Name a colour", system="Be brief.", options=opts)
    assert gen.response == oc.chat(model="tiny", messages=MSGS, options=opts).message.content
    # raw: the text as it is, like /v1/completions
    raw = oc.generate(model="tiny", prompt="Once upon a time", raw=True, options=opts)
    ref = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert raw.response == ref.choices[0].text
    # context: the conversation's tokens so far, which the next request continues
    assert len(raw.context) == ref.usage.prompt_tokens + ref.usage.completion_tokens
    more = oc.generate(model="tiny", prompt=" and then", raw=True, context=raw.context, options=opts)
    assert more.prompt_eval_count > len(raw.context) and more.context[:len(raw.context)] == raw.context
    streamed = list(oc.generate(model="tiny", prompt="Once upon a time", raw=True, options=opts, stream=True))
    assert "".join(c.response for c in streamed) == ref.choices[0].text and streamed[-1].done
    # a request with no prompt only loads the model
    assert oc.generate(model="tiny").done_reason == "load"


def test_ollama_embed_tags_show_ps(oc, client, llama_dir):
    texts = ["a red fox", "a blue whale"]
    ref = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    emb = oc.embed(model="all-MiniLM-L6-v2", input=texts)
    assert np.allclose(emb.embeddings, [d.embedding for d in ref.data], atol=1e-5)
    assert emb.prompt_eval_count == ref.usage.prompt_tokens
    assert np.allclose(oc.embeddings(model="all-MiniLM-L6-v2", prompt=texts[0]).embedding, emb.embeddings[0],
                       atol=1e-5)
    # truncate: false (Ollama's): an input over the model's limit (all-MiniLM: 256 tokens) is an error naming
    # it, where the default cuts it; one within the limit embeds as it would anyway
    long = "fox " * 400
    with pytest.raises(ollama.ResponseError) as e:
        oc.embed(model="all-MiniLM-L6-v2", input=[texts[0], long], truncate=False)
    assert e.value.status_code == 400 and "limit of 256" in e.value.error
    one = oc.embed(model="all-MiniLM-L6-v2", input=texts[0]).prompt_eval_count
    assert oc.embed(model="all-MiniLM-L6-v2", input=[long, texts[0]]).prompt_eval_count == 256 + one
    whole = oc.embed(model="all-MiniLM-L6-v2", input=texts, truncate=False)
    assert np.allclose(whole.embeddings, emb.embeddings, atol=1e-5)
    assert [m.model for m in oc.list().models] == ["tiny", "all-MiniLM-L6-v2"]
    ps = oc.ps().models
    assert ps[0].model == "tiny" and ps[0].context_length == HOLD_CONTEXT
    shown = oc.show("tiny")
    assert "completion" in shown.capabilities and "im_start" in shown.template
    # the details the engine reported: the tiny Llama's family, parameter count and weight type
    from transformers import AutoConfig, AutoModelForCausalLM

    params = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_dir)).num_parameters()
    details = oc.list().models[0].details
    assert (details.family, details.families, details.quantization_level) == ("llama", ["llama"], "F32")
    assert details.parameter_size == f"{params / 1e6:.1f}M" and shown.details.family == "llama"
    # model_info's GGUF keys, where clients read the context length from
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == HOLD_CONTEXT
    assert info["general.parameter_count"] == params
    assert "embedding" in oc.show("all-MiniLM-L6-v2:latest").capabilities


def test_ollama_errors_auth_and_limits(url, oc):
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="nope", messages=MSGS)
    assert e.value.status_code == 404 and "nope" in e.value.error  # Ollama's shape: the error is a string
    for bad, needle in (({"options": {"no_such_option": 1}}, "no_such_option"),
                        ({"options": {"temperature": 9}}, "temperature"),
                        ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
                        ({"options": {"mirostat": 2}}, "mirostat"), ({"format": "yaml"}, "format"),
                        ({"format": {"type": "object", "not": {}}}, "'not'"),  # a keyword no grammar enforces
                        ({"format": {"type": "string", "pattern": "(a"}}, "invalid structured output"),
                        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
                        ({"think": True}, "think")):
        r = httpx.post(url + "/api/chat", json={"model": "tiny", "messages": MSGS, **bad}, headers=AUTH)
        assert r.status_code == 400 and isinstance(r.json()["error"], str) and needle in r.json()["error"], \
            (bad, r.text)
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(model="tiny", prompt="x", format={"type": "array", "uniqueItems": True})
    assert e.value.status_code == 400 and "'uniqueItems'" in e.value.error
    r = httpx.post(url + "/api/chat", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()  # the same API key as every other route
    assert e.value.status_code == 401 and isinstance(e.value.error, str) and "API key" in e.value.error
    # the gateway's and the router's refusals are Ollama's shape on Ollama's routes too
    for method, path, status in (("POST", "/api/chat", 401), ("GET", "/api/chat", 405), ("GET", "/api/nope", 404)):
        r = httpx.request(method, url + path, headers=AUTH if status != 401 else {})
        assert r.status_code == status and isinstance(r.json()["error"], str), (path, r.text)
    # admission's per-request cap applies as on the OpenAI routes
    r = httpx.post(url + "/api/generate", headers=AUTH,
                   json={"model": "tiny", "prompt": "x", "options": {"num_predict": HOLD_CONTEXT}})
    assert r.status_code == 400 and "context length" in r.json()["error"]


def test_ollama_model_management_says_where_models_come_from(url, oc):
    """Ollama's pull of a served model succeeds at once, whole or streamed (nothing to fetch); a pull of any
    other model, push, create, copy and delete (and its blob uploads) are a 501 in Ollama's shape naming
    `servelm pull` and the registry, not a 404 that reads as "no such model"; the model list is unchanged."""
    before = [m.model for m in oc.list().models]
    assert oc.pull("tiny").status == "success"
    assert [p.status for p in oc.pull("tiny:latest", stream=True)][-1] == "success"
    for call in (lambda: oc.pull("llama3.2"), lambda: oc.delete("tiny"), lambda: oc.copy("tiny", "tiny2"),
                 lambda: oc.create(model="x", from_="tiny")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and "servelm pull" in e.value.error
    for method, path in (("HEAD", "/api/blobs/sha256:00"), ("POST", "/api/push")):
        r = httpx.request(method, url + path, headers=AUTH, json={} if method == "POST" else None)
        assert r.status_code == 501, (path, r.text)
    assert httpx.post(url + "/api/pull", json={"model": "tiny"}).status_code == 401  # behind the API key too
    assert [m.model for m in oc.list().models] == before


def test_ollama_format_json_and_schema(oc):
    """format "json" (any JSON object) and a JSON schema, on chat and generate, whole and streamed: whatever the
    random model writes parses, and validates."""
    opts = {"temperature": 1.0, "seed": 3, "num_predict": 120}
    res = oc.chat(model="tiny", messages=MSGS, format=PET, options=opts)
    assert res.done_reason == "stop", res.message.content
    jsonschema.validate(json.loads(res.message.content), PET)
    gen = oc.generate(model="tiny", prompt="A pet as JSON:", format=PET, options={**opts, "seed": 4})
    assert gen.done_reason == "stop"
    jsonschema.validate(json.loads(gen.response), PET)
    chunks = list(oc.chat(model="tiny", messages=MSGS, format=PET, stream=True, options={**opts, "seed": 5}))
    assert chunks[-1].done and chunks[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(c.message.content for c in chunks)), PET)
    res = oc.chat(model="tiny", messages=MSGS, format="json", options={**opts, "num_predict": 40})
    if res.done_reason == "stop":  # a free-form object may run to num_predict
        assert isinstance(json.loads(res.message.content), dict)
    assert res.message.content.startswith("{")


def test_ollama_tools_calls_in_ollamas_shape(oc):
    """A reply the tool-call parser reads as a call (here llama3_json's, which `format` makes the model write)
    comes back as message.tool_calls with the arguments as an object, whole and streamed; the conversation
    then goes on with the call and its result in the history."""
    call = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
            "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER}}
    opts = {"temperature": 1.0, "seed": 7, "num_predict": 120}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    res = oc.chat(model="tiny", messages=ask, tools=TOOLS, format=call, options=opts)
    assert res.done_reason == "stop" and res.message.content == ""
    [tc] = res.message.tool_calls
    assert tc.function.name == "get_weather"
    jsonschema.validate(dict(tc.function.arguments), WEATHER)
    streamed = [c for c in oc.chat(model="tiny", messages=ask, tools=TOOLS, format=call, options=opts, stream=True)]
    calls = [t for c in streamed for t in c.message.tool_calls or []]
    assert [(t.function.name, dict(t.function.arguments)) for t in calls] == \
        [(tc.function.name, dict(tc.function.arguments))]  # the same seed: the same call
    assert "".join(c.message.content for c in streamed) == "" and streamed[-1].done
    # without a call in the reply: plain content, no tool_calls
    plain = oc.chat(model="tiny", messages=ask, tools=TOOLS, options={"temperature": 0, "num_predict": 8})
    assert not plain.message.tool_calls and plain.message.content
    history = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
        {"role": "tool", "content": "21 degrees and sunny", "tool_name": "get_weather"}]
    more = oc.chat(model="tiny", messages=history, tools=TOOLS, options={"temperature": 0, "num_predict": 4})
    assert more.done and more.prompt_eval_count > plain.prompt_eval_count  # the result reached the template


# -- OpenAI Responses --------------------------------------------------------------------------------------------
def _chat(client, msgs, max_tokens):
    return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=max_tokens, temperature=0)


def test_responses_create_and_stream_equal_chat(client):
    ref = _chat(client, MSGS, 12)
    res = client.responses.create(model="tiny", input="Name a colour", instructions="Be brief.",
                                  max_output_tokens=12, temperature=0, safety_identifier="user-7",
                                  prompt_cache_key="colours")
    assert res.output_text == ref.choices[0].message.content and res.object == "response"
    assert (res.safety_identifier, res.prompt_cache_key) == ("user-7", "colours")  # echoed, as OpenAI does
    assert res.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")
    assert res.usage.input_tokens == ref.usage.prompt_tokens
    assert res.usage.output_tokens == ref.usage.completion_tokens
    events = list(client.responses.create(model="tiny", input=[{"role": "user", "content": "Name a colour"}],
                                          instructions="Be brief.", max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{res.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == res.output_text
    assert events[-1].response.output_text == res.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_text_format_is_chats_response_format(client):
    """text.format (json_schema, json_object) constrains the reply with the grammar chat's response_format uses."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}
    r = client.responses.create(model="tiny", input="Name a colour", max_output_tokens=40, temperature=0, text={
        "format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Name a colour"}],
                                          max_tokens=40, temperature=0, response_format={
                                              "type": "json_schema", "json_schema": {"name": "colour",
                                                                                     "schema": schema}})
    assert r.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "colour"
    r = client.responses.create(model="tiny", input="Some JSON", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_object"}})
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Some JSON"}],
                                          max_tokens=20, temperature=0, response_format={"type": "json_object"})
    assert r.output_text == chat.choices[0].message.content and r.output_text.startswith("{")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", text={"format": {"type": "json_schema", "name": "x"}})


def test_responses_previous_response_id_and_store(client):
    first = client.responses.create(model="tiny", input="Name a colour", max_output_tokens=6, temperature=0)
    second = client.responses.create(model="tiny", input="Another one", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    ref = _chat(client, [{"role": "user", "content": "Name a colour"},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "Another one"}], 6)
    assert second.output_text == ref.choices[0].message.content and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):  # a function the request does not offer
        client.responses.create(model="tiny", input="x", tools=[{"type": "function", "name": "f", "parameters": {}}],
                                tool_choice={"type": "function", "name": "g"})
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[])


# -- the web chat page -------------------------------------------------------------------------------------------
def test_web_page_is_public_static_and_can_be_turned_off():
    """In-process: the page and its files need no key (the API behind them does), carry a CSP that allows only
    this server's scripts, name no other host, and `ui: none` leaves them out."""
    import re

    from fakes import IdleEngine
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    for ui, expect in (("chat", 200), ("none", 404)):
        state = build_state(load({"api_key": KEY, "ui": ui}, env={}), None, IdleEngine(), "tiny")
        with TestClient(build_app(state)) as c:
            page = c.get("/")
            assert page.status_code == expect, ui
            assert c.get("/v1/models").status_code == 401
            if expect == 404:
                continue
            assert "script-src 'self'" in page.headers["content-security-policy"]
            assert not re.search(r"https?://", page.text)
            for asset in re.findall(r'(?:src|href)="([^"]+)"', page.text):
                got = c.get(asset)
                assert got.status_code == 200 and got.headers["content-security-policy"], asset
            assert c.get("/ui/..%2Fapi.py").status_code == 404 and c.get("/ui/nope.js").status_code == 404
            paths = c.get("/openapi.json", headers=AUTH).json()["paths"]  # with its stream and statuses
            assert "408" in paths["/v1/responses"]["post"]["responses"]
            assert "text/event-stream" in paths["/v1/responses"]["post"]["responses"]["200"]["content"]
            assert not any(p.startswith(("/api/", "/ui/")) or p == "/" for p in paths)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with Selenium. A machine without Chromium fails this test loudly (the README's test
    command installs it); SERVELM_SKIP_BROWSER=1 skips it, for a machine that cannot have it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (binary and driver):
        if os.environ.get("SERVELM_SKIP_BROWSER") == "1":
            pytest.skip("SERVELM_SKIP_BROWSER=1: the web page is not tested in a browser")
        pytest.fail("the web page test needs Chromium and its driver: apt-get install chromium chromium-driver "
                    "(the README's test command does), or set SERVELM_SKIP_BROWSER=1 to skip it knowingly")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,800", "--user-data-dir=" + str(tmp_path_factory.mktemp("chromium"))):
        opts.add_argument(arg)
    b = webdriver.Chrome(options=opts, service=Service(driver))
    yield b
    b.quit()


def _stored(b) -> dict:
    return b.execute_script("return JSON.parse(localStorage.getItem('servelm.chats.v1'))")


def _reply(b) -> tuple:
    """(state, shown text, stats line) of the page's last reply, read at one moment (the page redraws it)."""
    return tuple(b.execute_script(
        "const m = [...document.querySelectorAll('#messages .msg.assistant')].pop();"
        "return m ? [m.dataset.state, m.querySelector('.body').innerText, m.querySelector('.stats').innerText]"
        " : [null, '', ''];"))


def test_web_page_chat_stream_stop_and_history(served, browser, client, tmp_path_factory):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    proc, url = served
    b = browser
    wait = WebDriverWait(b, 60, poll_frequency=0.05)
    b.get(url + "/")
    # the server needs a key: the page asks for it, then lists the generation models
    wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
    b.find_element(By.ID, "api-key").send_keys(KEY + "\n")
    wait.until(lambda d: [o.text for o in d.find_elements(By.CSS_SELECTOR, "#model option")] == ["tiny"])
    assert not b.find_element(By.ID, "key-form").is_displayed()
    b.find_element(By.CSS_SELECTOR, "#settings summary").click()
    for field, value in (("temperature", "0"), ("max-tokens", "8")):
        box = b.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)

    # a short reply: the same text as the API gives, with its TTFT and rate shown
    b.find_element(By.ID, "prompt").send_keys("Name a colour\n")
    wait.until(lambda d: _reply(d)[0] == "done")
    ref = _chat(client, [{"role": "user", "content": "Name a colour"}], 8)
    chat = _stored(b)["chats"][0]
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][1]["content"] == ref.choices[0].message.content
    shown = _reply(b)[2]
    assert "TTFT" in shown and f"{ref.usage.completion_tokens} tokens" in shown

    # a long reply: text grows while it streams; Stop ends it and the server aborts the request
    box = b.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys(str(LONG))
    b.find_element(By.ID, "prompt").send_keys("Tell a long story\n")
    seen = wait.until(lambda d: (r := _reply(d))[0] == "streaming" and r[1])
    wait.until(lambda d: (r := _reply(d))[0] == "streaming" and len(r[1]) > len(seen))
    b.find_element(By.ID, "stop").click()
    wait.until(lambda d: _reply(d)[0] == "stopped")
    assert not b.find_element(By.ID, "stop").is_displayed()
    _wait(lambda: stats(url, AUTH)["engine"]["in_flight"] == 0, 60, "the stopped request to be aborted")
    line = _wait(lambda: [x for x in server_log_lines(proc) if x.get("path") == "/v1/chat/completions"
                          and x.get("status") == 499], 30, "the stopped request's log line")[-1]
    assert 0 < line["completion_tokens"] < LONG
    before = _stored(b)

    # reload: the conversation is still there, as it was
    b.refresh()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 4)
    assert _stored(b) == before and _reply(b)[0] == "stopped"
    assert "stopped" in _reply(b)[2]
    shot = tmp_path_factory.mktemp("webui") / "chat.png"
    assert b.save_screenshot(str(shot)) and shot.stat().st_size > 1000
    print(f"screenshot: {shot}")

    # a new chat starts empty; the old one is a click away
    b.find_element(By.ID, "new-chat").click()
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#messages .msg"))
    items = b.find_elements(By.CSS_SELECTOR, "#chats li")
    assert [i.text for i in items] == ["New chat", "Name a colour"]
    items[1].click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 4)


def test_web_page_renders_model_markdown_without_html(served, browser):
    """Model text that holds HTML shows as text: no element, no script, no javascript: link comes of it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    b = browser
    evil = ('<img src=x onerror="window.pwned=1"> **bold** and `<b>code</b>`\n\n```html\n<script>window.pwned=2'
            '</script>\n```\n- [click](javascript:window.pwned=3)\n- [docs](https://example.org/x)')
    chat = {"id": "evil", "title": "evil", "messages": [{"role": "user", "content": "<i>hi</i>"},
                                                         {"role": "assistant", "content": evil, "state": "done"}]}
    b.execute_script("localStorage.setItem('servelm.chats.v1', arguments[0])",
                     json.dumps({"current": "evil", "chats": [chat]}))
    b.refresh()
    WebDriverWait(b, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2)
    msgs = b.find_element(By.ID, "messages")
    for tag in ("img", "script", "b", "i"):
        assert not msgs.find_elements(By.TAG_NAME, tag), tag
    assert b.execute_script("return window.pwned") is None
    assert msgs.find_element(By.TAG_NAME, "strong").text == "bold"
    assert "<script>window.pwned=2</script>" in msgs.find_element(By.CSS_SELECTOR, "pre code").text
    assert [a.get_attribute("href") for a in msgs.find_elements(By.TAG_NAME, "a")] == ["https://example.org/x"]
    assert "<img" in msgs.text and "<i>hi</i>" in msgs.text


def test_web_page_shows_reasoning_apart_from_the_answer(served, browser):
    """A reasoning model's stream, as the server's reasoning parser sends it (delta.reasoning, then content):
    the page shows the thinking in its own fold, open while only thinking arrives and folded once the answer
    begins, and the answer alone in the reply's body; the conversation it sends on keeps only the answer. The
    stream is the page's fetch answered in the browser, so that the tiny random model need not think."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, url = served
    b = browser
    wait = WebDriverWait(b, 60, poll_frequency=0.05)
    b.get(url + "/")
    b.execute_script("localStorage.setItem('servelm.apiKey', arguments[0]);"
                     "localStorage.setItem('servelm.chats.v1', JSON.stringify({current: null, chats: []}))", KEY)
    b.refresh()
    wait.until(lambda d: [o.text for o in d.find_elements(By.CSS_SELECTOR, "#model option")] == ["tiny"])
    # each chat request is answered by a stream the test releases one event at a time
    b.execute_script("""
        window.sent = []; window.release = [];
        const real = window.fetch;
        window.fetch = (url, opts) => {
          if (!String(url).endsWith('/v1/chat/completions')) return real(url, opts);
          window.sent.push(JSON.parse(opts.body));
          const enc = new TextEncoder();
          const stream = new ReadableStream({ start(c) {
            window.release.push((event) => {
              if (event === null) c.close();
              else c.enqueue(enc.encode('data: ' + JSON.stringify(event) + '\\n\\n'));
            });
          } });
          return Promise.resolve(new Response(stream, { status: 200 }));
        };""")

    def push(delta=None, done=False):
        event = None if done else {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        b.execute_script("window.release[window.release.length - 1](arguments[0])", event)

    def thinking():
        return b.execute_script(
            "const m = [...document.querySelectorAll('#messages .msg.assistant')].pop();"
            "const t = m && m.querySelector('.thinking');"
            "return t ? [t.open, t.querySelector('summary').innerText, t.querySelector('div').textContent] : null;")

    b.find_element(By.ID, "prompt").send_keys("Is 9.11 more than 9.8?\n")
    wait.until(lambda d: d.execute_script("return window.release.length") == 1)
    push({"role": "assistant", "content": ""})
    push({"reasoning": "Compare the tenths: ", "reasoning_content": "Compare the tenths: "})
    push({"reasoning": "1 < 8.", "reasoning_content": "1 < 8."})
    wait.until(lambda d: thinking() == [True, "Thinking…", "Compare the tenths: 1 < 8."])
    assert _reply(b)[1] == ""
    push({"content": "No, 9.8 is **more**."})
    push(done=True)
    wait.until(lambda d: _reply(d)[0] == "done")
    assert thinking() == [False, "Thought", "Compare the tenths: 1 < 8."]
    assert _reply(b)[1] == "No, 9.8 is more."
    stored = _stored(b)["chats"][0]["messages"][1]
    assert stored["reasoning"] == "Compare the tenths: 1 < 8." and stored["content"] == "No, 9.8 is **more**."
    # the next turn sends the answer, not the thinking, back to the model
    b.find_element(By.ID, "prompt").send_keys("Why?\n")
    wait.until(lambda d: d.execute_script("return window.release.length") == 2)
    assert b.execute_script("return window.sent[1].messages")[-2] == {"role": "assistant",
                                                                       "content": "No, 9.8 is **more**."}
    push(done=True)
