"""Tool calling: the parsers (whole replies and every way a stream can split them), and a real server driven by
the openai SDK. The tiny random model never writes a call by itself, so the auto tests make it write one with a
grammar (guided_choice): the server's parser then has to find it; required and named calls are grammars (the
server tests run with each structured output backend). The server splits off reasoning (qwen3's parser), which
a reply made the same way may hold before its calls."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pydantic
import pytest
from serving import grammar_backends, start_server, stop_server

from servelm.server.openai.tool_parsers import ToolStream, parse, parse_forced

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
SEARCH = {"type": "object", "properties": {
    "q": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}, "filters": {"type": "object"},
    "tags": {"type": "array"}, "score": {"type": ["number", "null"]}, "note": {"description": "no type"}}}
PARSE_SCHEMAS = {**SCHEMAS, "search": SEARCH}
QC_SEARCH = ("<tool_call>\n<function=search>\n<parameter=q>\n12 Main St\nflat 3\n</parameter>\n<parameter=limit>\n5\n"
             "</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n{\"a\": [1, null]}\n</parameter>\n"
             "<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n<parameter=note>\n7\n"
             "</parameter>\n</function>\n</tool_call>")
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'

# A Hermes-style template of our own: it shows the model the tools, earlier calls and their results. Thinking is
# off unless enable_thinking is true (as Granite's template does it): its prompt then closes an empty <think>
# block, so the tool tests' grammars apply from the reply's first token under the server's reasoning parser.
TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {% for t in tools %}{{ t.function | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if not enable_thinking | default(false) %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", "Sure. " + HERMES_CALL + HERMES_CALL.replace("Paris", "Rome"), "Sure.",
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_weather", {"city": "Rome", "unit": "C"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # unclosed at EOS
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": </tool_call>', None, []),  # broken: all content
    ("hermes", "no calls at all", "no calls at all", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": ";"}}; {"name": "g", "parameters": {}}', None,
     [("f", {"a": ";"}), ("g", {})]),
    ("llama3_json", '{"not": "a call"}', None, []),
    ("mistral", 'ok[TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}]', "ok", [("f", {"x": [1, 2]})]),
    ("mistral", "[TOOL_CALLS][{", None, []),
    # qwen3_coder: raw values typed by the tool's schema; text where the schema says string or is silent
    ("qwen3_coder", "Let me look.\n" + QC_SEARCH, "Let me look.", [("search", {
        "q": "12 Main St\nflat 3", "limit": 5, "exact": True, "filters": {"a": [1, None]}, "tags": ["x", "y"],
        "score": 0.5, "note": "7"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\n-3\n</parameter>\n</function>\n</tool_call>"
     "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nC\n", None,
     [("get_time", {"zone": -3}), ("get_weather", {"city": "Paris", "unit": "C"})]),  # the last unclosed at EOS
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=limit>\nmany\n</parameter>\n</function>\n"
     "</tool_call>", None, [("search", {"limit": "many"})]),  # not an integer: kept as written
    ("qwen3_coder", "<tool_call>\n<parameter=zone>\n1\n</parameter>\n</tool_call>", None, []),  # no function
    # pythonic: a list of calls whose arguments are literals, read as a syntax tree
    ("pythonic", '[get_weather(city="Paris", unit="C"), get_time(zone=-3)]', None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": -3})]),
    ("pythonic", '<|python_start|>[search(q="a;b", filters={"k": [1, 2.5, None]}, exact=true)]<|python_end|>', None,
     [("search", {"q": "a;b", "filters": {"k": [1, 2.5, None]}, "exact": True})]),
    ("pythonic", "Sure: [get_time(zone=1)]", None, []),  # not the whole reply
    ("pythonic", '[get_time(zone=1), __import__("os").system("ls")]', None, []),  # no literal call
    ("pythonic", "[get_time(zone=f(1))]", None, []),
    ("pythonic", "[get_time(zone=1)", None, []),
    ("pythonic", "[1, 2] are numbers", None, []),
    # phi4_mini_json: functools and a JSON array
    ("phi4_mini_json", 'I will check. functools[{"name": "get_time", "arguments": {"zone": 2}}]', "I will check.",
     [("get_time", {"zone": 2})]),
    ("phi4_mini_json", "import functools, then functools.partial", None, []),
    ("phi4_mini_json", 'functools[{"name": "get_time", "arguments": {"zone": ', None, []),
    # granite: the reply is a JSON array, after <|tool_call|> (3.0) or <tool_call> (3.1+)
    ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {"zone": 2}}, {"name": "f", "arguments": {}}]', None,
     [("get_time", {"zone": 2}), ("f", {})]),
    ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ("granite", '[{"name": "f", "arguments": {"a": [1]}}]', None, [("f", {"a": [1]})]),
    ("granite", "The answer is [1, 2].", None, []),  # not the whole reply
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {', None, []),  # cut short: all content
])
def test_parsers_whole_and_streamed_at_every_split(parser, text, content, calls):
    got_content, got = parse(parser, text, PARSE_SCHEMAS)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else text)
    for cut in range(len(text) + 1):  # every two-piece split, and one character at a time
        for pieces in ([text[:cut], text[cut:]], list(text)) if cut == 0 else ([text[:cut], text[cut:]],):
            s = ToolStream(parser, PARSE_SCHEMAS)
            sent, streamed = "", []
            for piece in pieces:
                out, new = s.feed(piece)
                sent, streamed = sent + out, streamed + new
            out, new = s.finish()
            sent, streamed = sent + out, streamed + new
            assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls
            if not calls:
                assert sent == text  # nothing lost, nothing invented
            else:
                assert sent.strip() == (content or "")


def test_parser_chosen_by_flag_else_by_template():
    from servelm.server.openai.tools import choose_parser

    assert choose_parser("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert choose_parser("auto", "<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert choose_parser("auto", "<function=example_function_name>\n<parameter=example_parameter_1>") == \
        "qwen3_coder"
    assert choose_parser("auto", "[func_name1(params_name1=params_value1)]") == "pythonic"
    assert choose_parser("auto", "{{- '<|start_of_role|>available_tools<|end_of_role|>' }}") == "granite"
    assert choose_parser("auto", TEMPLATE) == choose_parser("auto", None) == "hermes"
    assert choose_parser("mistral", TEMPLATE) == "mistral"


def test_forced_replies():
    assert [c.name for c in parse_forced('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
                                         None)] == ["a", "b"]
    assert json.loads(parse_forced('{"x": 1}', "f")[0].arguments) == {"x": 1}
    assert parse_forced('{"x": ', "f") is None and parse_forced("[]", None) is None


@pytest.fixture(scope="module")
def tool_model(llama_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tools") / "m"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    return model


@pytest.fixture(scope="module", params=grammar_backends())
def server(tool_model, request):
    model = tool_model
    proc, url = start_server(model, "--num-kv-blocks", "256", "--max-model-len", "1024", "--embedding-model", "none",
                             "--structured-output-backend", request.param, "--reasoning-parser", "qwen3")
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def _check(call, names=SCHEMAS):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), names[call.function.name])


def test_named_and_required_follow_the_parameter_schema(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=80, temperature=1,
                                       seed=3, n=2, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
        _check(c.message.tool_calls[0])
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=1,
                                       seed=4, tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    _check(c.message.tool_calls[0])


def test_streamed_required_calls_assemble_from_deltas(client):
    stream = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=160,
                                            temperature=1, seed=9, tool_choice="required", stream=True)
    calls, finish = {}, None
    for chunk in stream:
        d = chunk.choices[0].delta
        for t in d.tool_calls or []:
            if t.id:
                assert t.index not in calls and t.function.name
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
            calls[t.index]["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls and sorted(calls) == list(range(len(calls)))
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_sdk_parse_helper_gives_typed_arguments(client):
    class GetTime(pydantic.BaseModel):
        zone: int = pydantic.Field(ge=-12, le=12)

    r = client.chat.completions.parse(model="tiny", messages=MSGS, max_tokens=40, temperature=0,
                                      tools=[openai.pydantic_function_tool(GetTime, name="get_time")],
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetTime) and -12 <= call.function.parsed_arguments.zone <= 12


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_what_the_model_wrote_and_keeps_broken_calls_as_text(client, stream):
    def ask(reply: str):
        kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0,
                  extra_body={"guided_choice": [reply]})
        if not stream:
            c = client.chat.completions.create(**kw).choices[0]
            return c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], \
                c.finish_reason
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                calls.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return content or None, [tuple(v) for _, v in sorted(calls.items())], finish

    content, calls, finish = ask("Let me check. " + HERMES_CALL)
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "unit": "C"})]
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert ask(broken) == (broken, [], "stop")


def test_history_with_calls_and_results_reaches_the_template(client, server):
    import httpx

    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]

    def prompt_tokens(**kw):
        r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    plain = prompt_tokens(messages=MSGS)
    with_tools = prompt_tokens(messages=MSGS, tools=TOOLS)
    assert prompt_tokens(messages=MSGS, tools=TOOLS, tool_choice="none") == plain  # not offered: not shown
    with_history = prompt_tokens(messages=history, tools=TOOLS)
    assert plain < with_tools < with_history
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"  # completions have no tools


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tool_requests_are_400(server, body, param):
    import httpx

    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 4, **body},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_offline_chat_passes_tools_to_the_template(tool_model):
    from servelm import LLM, SamplingParams

    llm = LLM(str(tool_model), dtype="float32", num_kv_blocks=32)
    plain, offered = (llm.chat(MSGS, SamplingParams(max_tokens=1), use_tqdm=False, tools=t)[0] for t in (None, TOOLS))
    text = llm.get_tokenizer().decode(offered.prompt_token_ids)
    assert len(offered.prompt_token_ids) > len(plain.prompt_token_ids) and '"name": "get_time"' in text
    # vLLM's chat_template argument: this conversation rendered with its own template
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    [out] = llm.chat(MSGS, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=own)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "".join(f"[{m['role']}] {m['content']}" for m in MSGS)


THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_apart_from_content_and_calls(client, stream):
    """Under --reasoning-parser qwen3, a reply's <think> part is message.reasoning (and reasoning_content),
    the rest its content and tool calls; include_reasoning false leaves the reasoning out."""
    def ask(reply: str, **extra):
        kw = dict(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=0,
                  extra_body={"guided_choice": [reply], **extra})
        if not stream:
            c = client.chat.completions.create(**kw).choices[0]
            m = c.message.model_dump()
            return m.get("reasoning"), m.get("reasoning_content"), (c.message.content or "").strip() or None, \
                [t.function.name for t in c.message.tool_calls or []], c.finish_reason
        thought, old_name, content, calls, finish = "", "", "", [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta.model_dump()
            thought += d.get("reasoning") or ""
            old_name += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            calls += [t["function"]["name"] for t in d.get("tool_calls") or [] if t["function"].get("name")]
            finish = chunk.choices[0].finish_reason or finish
        return thought or None, old_name or None, content.strip() or None, calls, finish

    want = "\nThe user wants the weather.\n"
    assert ask(THOUGHT + "Let me check. " + HERMES_CALL) == (want, want, "Let me check.", ["get_weather"],
                                                             "tool_calls")
    assert ask(THOUGHT + "It is sunny.") == (want, want, "It is sunny.", [], "stop")
    assert ask("No thinking at all.") == (None, None, "No thinking at all.", [], "stop")
    assert ask(THOUGHT + "It is sunny.", include_reasoning=False) == (None, None, "It is sunny.", [], "stop")


def test_a_grammar_waits_for_the_reasoning_to_end(client):
    """With thinking on, the prompt leaves the reasoning open: the grammar (here a guided_choice) waits for the
    reply's </think>, which the random model never writes, so the reply runs free to max_tokens; with the
    template's thinking off the same request follows the grammar from its first token."""
    kw = dict(model="tiny", messages=MSGS, max_tokens=8, temperature=0)
    forced = {"guided_choice": ["It is sunny."]}
    free = client.chat.completions.create(**kw, extra_body={**forced, "chat_template_kwargs": {
        "enable_thinking": True}}).choices[0]
    plain = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {
        "enable_thinking": True}}).choices[0]
    assert free.message.content == plain.message.content != "It is sunny." and free.finish_reason == "length"
    assert client.chat.completions.create(**kw, extra_body=forced).choices[0].message.content == "It is sunny."


def test_ollama_think_asks_the_template_and_splits_the_reply(server, client):
    """Ollama's think reaches the chat template as enable_thinking (the prompt it renders is the one
    chat_template_kwargs gives), and with the server's parser a reply is split into thinking and content."""
    import httpx

    from servelm.server.ollama.routes import _Reply

    base = {"model": "tiny", "messages": MSGS, "stream": False, "options": {"temperature": 0, "num_predict": 4}}
    plain = httpx.post(server + "/api/chat", json=base).json()
    on = httpx.post(server + "/api/chat", json={**base, "think": True}).json()
    ref = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on["prompt_eval_count"] == ref.usage.prompt_tokens < plain["prompt_eval_count"]
    assert on["message"]["content"] == ref.choices[0].message.content and "thinking" not in on["message"]
    off = httpx.post(server + "/api/chat", json={**base, "think": False}).json()
    assert off["prompt_eval_count"] == plain["prompt_eval_count"]
    assert off["message"]["content"] == plain["message"]["content"]
    bad = httpx.post(server + "/api/chat", json={**base, "think": "high"})
    assert bad.status_code == 400 and "think" in bad.json()["error"]
    text = THOUGHT + "It is sunny."
    assert _Reply(chat=True, thinking="qwen3").whole(text, "stop")["message"] == {
        "role": "assistant", "content": "It is sunny.", "thinking": "\nThe user wants the weather.\n"}
    for size in (1, 3, 7):
        reply = _Reply(chat=False, thinking="qwen3")
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        lines = [line for i, piece in enumerate(pieces)
                 for line in reply.chunks(piece, "stop" if i == len(pieces) - 1 else None)]
        assert "".join(line.get("thinking", "") for line in lines) == "\nThe user wants the weather.\n"
        assert "".join(line["response"] for line in lines) == "It is sunny."


# -- the Responses API ------------------------------------------------------------------------------------------

RTOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat form


def _calls(response) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]


def test_responses_function_calls_are_chats(client):
    """tool_choice named and required give the calls chat completions gives for the same conversation, as
    function_call items (call_id, name, JSON arguments), and no message."""
    for choice, chat_choice in (({"type": "function", "name": "get_time"},
                                 {"type": "function", "function": {"name": "get_time"}}),
                                ("required", "required")):
        r = client.responses.create(model="tiny", input=MSGS[0]["content"], tools=RTOOLS, tool_choice=choice,
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=120)
        chat = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=chat_choice,
                                              parallel_tool_calls=False, temperature=0, max_tokens=120)
        want = [(t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls]
        assert _calls(r) == want and len(want) == 1
        [item] = r.output
        assert item.call_id.startswith("call_") and item.id.startswith("fc_") and item.status == "completed"
        assert r.status == "completed" and r.tools[0].name == "get_weather" and r.parallel_tool_calls is False
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


def test_responses_streamed_calls_arrive_as_argument_deltas(client):
    kw = dict(model="tiny", input=MSGS[0]["content"], tools=RTOOLS, tool_choice="required", temperature=0,
              max_output_tokens=160)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] * len(_calls(whole)) and all(i.arguments == "" for i in added)
    for i, item in enumerate(added):
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.item_id == item.id)
        [done] = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == item.id]
        assert deltas == done.arguments == _calls(whole)[i][1] and done.output_index == i
    final = events[-1]
    assert final.type == "response.completed" and _calls(final.response) == _calls(whole)


def test_responses_go_on_from_a_call_and_its_output(client, server):
    """A function call's output continues the conversation, by previous_response_id or with the call quoted back
    in the input: the model sees what chat completions shows it for the same history."""
    import httpx

    r = client.responses.create(model="tiny", input=MSGS[0]["content"], tools=RTOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                max_output_tokens=80)
    [call] = [o for o in r.output if o.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}]
    chat = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                             "max_tokens": 4, "temperature": 0}, timeout=60).json()
    by_id = client.responses.create(model="tiny", previous_response_id=r.id, input=[result], tools=RTOOLS,
                                    max_output_tokens=4, temperature=0)
    quoted = client.responses.create(model="tiny", tools=RTOOLS, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": MSGS[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result])
    for got in (by_id, quoted):
        assert got.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert got.output_text == chat["choices"][0]["message"]["content"]


def test_responses_auto_with_no_call_is_a_message(client):
    r = client.responses.create(model="tiny", input=MSGS[0]["content"], tools=RTOOLS, temperature=0,
                                max_output_tokens=8)
    chat = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=8)
    assert [o.type for o in r.output] == ["message"] and r.tool_choice == "auto"
    assert r.output_text == chat.choices[0].message.content and not _calls(r)


# -- Anthropic's Messages API ------------------------------------------------------------------------------------

ATOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
           **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
          for t in TOOLS]  # Anthropic's shape


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)


def test_messages_answer_as_chat_does(claude, client):
    """Anthropic's SDK against /v1/messages: the reply chat completions gives the same conversation, as a text
    block with Anthropic's stop reason and usage; streamed, the same text from text_delta events."""
    kw = dict(model="tiny", max_tokens=8, temperature=0, system="Be brief.",
              messages=[{"role": "user", "content": "Say something"}])
    r = claude.messages.create(**kw)
    chat = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}])
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat.choices[0].message.content
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == r.content[0].text and final.stop_reason == r.stop_reason
    assert claude.messages.count_tokens(model="tiny", system="Be brief.", messages=kw["messages"]).input_tokens == \
        chat.usage.prompt_tokens


def test_messages_call_tools_and_take_their_results(claude, client):
    """tool_choice any and tool give chat's calls as tool_use blocks (stop_reason tool_use), streamed as
    input_json_delta; a tool_result goes back to the template as chat's tool message does."""
    r = claude.messages.create(model="tiny", max_tokens=80, temperature=0, messages=MSGS, tools=ATOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"})
    chat = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=80, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [use] = [b for b in r.content if b.type == "tool_use"]
    [call] = chat.choices[0].message.tool_calls
    assert r.stop_reason == "tool_use" and (use.name, use.input) == (call.function.name,
                                                                    json.loads(call.function.arguments))
    with claude.messages.stream(model="tiny", max_tokens=80, temperature=0, messages=MSGS, tools=ATOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    # the call and its result, back: the prompt chat completions renders for the same history
    history = MSGS + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "21 degrees"}]}]
    n = claude.messages.count_tokens(model="tiny", messages=history, tools=ATOOLS).input_tokens
    chat_history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21 degrees"}]
    assert n == client.chat.completions.create(model="tiny", messages=chat_history, tools=TOOLS,
                                               max_tokens=1).usage.prompt_tokens


def test_messages_errors_have_anthropics_shape(claude):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:  # max_tokens is required
        claude.messages.create(model="tiny", messages=MSGS, max_tokens=0)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", messages=MSGS, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
