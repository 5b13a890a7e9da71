"""Structured output: response_format, vLLM's guided_* and structured_outputs, on a real server and offline, with
each grammar backend (llguidance, xgrammar). The tiny random-weight model emits garbage, which is what makes
these tests meaningful: whatever it emits must still parse and validate."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from serving import _wait, grammar_backends, start_server, stats, stop_server

from servelm import LLM, SamplingParams
from servelm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.server

# Bounded: every string and number has a maximum length, so a complete object fits well within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
                         "kind": {"enum": ["cat", "dog"]}}}
REGEX = r"[a-z]{2,4}-[0-9]{3}"
MSGS = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module", params=grammar_backends())
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(llama_dir, backend):
    proc, url = start_server(llama_dir, "--num-kv-blocks", "256", "--max-model-len", "512",
                             "--embedding-model", "none", "--structured-output-backend", backend)
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def test_chat_json_schema_strict_every_sample_validates(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=120, temperature=1.0, seed=7, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 3
    texts = set()
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        texts.add(c.message.content)
    assert len(texts) > 1  # the samples differ: the grammar masks, the draws stay random


def test_completions_json_object_streamed_and_guided_json(client):
    stream = client.completions.create(model="tiny", prompt="JSON:", max_tokens=30, temperature=0.8, seed=1,
                                       stream=True, extra_body={"response_format": {"type": "json_object"}})
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    # a free-form object may run to max_tokens; a finished one must be a JSON object
    assert finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=120, temperature=1.0, seed=2,
                                  extra_body={"guided_json": json.dumps(SCHEMA)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body, check", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": ["red", "green", "light blue"]}, lambda t: t in ("red", "green", "light blue")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'},
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
])
def test_regex_choice_and_grammar_streamed(server, body, check):
    """Streamed chat with n=2: each sample's deltas join into a string the grammar accepts."""
    texts, finish = {0: ""}, {}
    payload = {"model": "tiny", "messages": MSGS, "max_tokens": 60, "temperature": 1.0, "seed": 5, "n": 2,
               "stream": True, **body}
    with httpx.stream("POST", server + "/v1/chat/completions", json=payload, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
                finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    assert set(texts) == {0, 1}
    for i in (0, 1):
        assert finish[i] == "stop" and check(texts[i]), texts[i]


def test_free_requests_are_unchanged_beside_grammar_requests(client):
    """A batch mixing grammar and free requests: the free one's greedy output is what it is alone."""
    def free():
        return client.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def guided(i):
        return client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=60, temperature=1, seed=i,
                                         extra_body={"guided_regex": REGEX}).choices[0].text

    alone = free()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(guided, i) for i in range(3)] + [pool.submit(free)]
        results = [f.result() for f in futures]
    assert results[-1] == alone
    assert all(re.fullmatch(REGEX, t) for t in results[:3])


def test_stop_string_and_max_tokens_end_a_grammar_early(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0,
                                  extra_body={"guided_json": SCHEMA})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")
    r = client.completions.create(model="tiny", prompt="x", max_tokens=100, temperature=0, stop=[","],
                                  extra_body={"guided_json": SCHEMA})
    assert r.choices[0].finish_reason == "stop" and "," not in r.choices[0].text
    assert r.choices[0].text.startswith('{"name": ')


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}}}}},
     "response_format.json_schema.schema", "'not'"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems'"),
    # a whole schema is an object: booleans (a 500 once) and their JSON text are 400s naming the field
    ({"guided_json": False}, "guided_json", "guided_json"),
    ({"guided_json": True}, "guided_json", "guided_json"),
    ({"guided_json": "false"}, "guided_json", "must be a JSON schema (an object)"),
    ({"structured_outputs": {"json": True}}, "structured_outputs.json", "structured_outputs.json"),
    ({"structured_outputs": {"json": False}}, "structured_outputs.json", "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema"),
    ({"guided_regex": "a(b"}, None, "regex"),  # found by the engine's compiler
    ({"guided_grammar": "root ::= undefined_rule"}, None, "undefined_rule"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "not supported"),
])
def test_bad_grammars_are_400_naming_the_problem(server, body, param, needle):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS})):
        r = httpx.post(server + path, json={"model": "tiny", "max_tokens": 5, **base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and (param is None or err["param"] == param)
    # nothing left behind in the engine: a leaked request would keep it busy until the wait fails (the previous
    # test's stop-string finish reaches the engine as an abort after its client has the response)
    _wait(lambda: (s := stats(server))["engine"]["in_flight"] == 0 and s["scheduler"]["num_running"] == 0,
          what="the engine to be idle")


def test_offline_api_preemption_and_only_grammar_rows_masked(llama_dir, backend, monkeypatch):
    """SamplingParams(structured_outputs=...) offline; a KV cache so small that samples are preempted and
    recomputed mid-grammar (each keeps its matcher); the mask touches only the rows that have a grammar; a
    speculating neighbour changes nothing."""
    from servelm.engine import structured

    masked_rows = []
    real = structured.mask_logits

    def spy(logits, seqs, rows):
        masked_rows.append([seqs[r].request.params.structured_outputs is not None for r in range(len(seqs))]
                           == [r in rows for r in range(len(seqs))])
        return real(logits, seqs, rows)
    monkeypatch.setattr(structured, "mask_logits", spy)
    # with n-gram speculation on: the free request speculates, the grammar's samples never do
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=6, block_size=16, max_model_len=96, max_num_seqs=8,
              speculative_method="ngram", num_speculative_tokens=3, structured_output_backend=backend)
    guided = SamplingParams(n=2, max_tokens=70, temperature=1.0, seed=11,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate([[1] + [50 + i] * 20 for i in range(2)], [guided, free], use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_proposed_tokens > 0
    for o in outs[:1]:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert masked_rows and all(masked_rows)
    with pytest.raises(ValueError, match="'if'"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"if": {}})))


def test_a_grammar_after_reasoning_waits_for_its_end_tag(llama_dir, backend):
    """SamplingParams._grammar_after (what the server's reasoning parser sets to </think>'s ids): each sample
    runs free, as greedy decoding does, until its output ends with those ids, and follows the grammar from the
    next token; without it the grammar holds from the first."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, structured_output_backend=backend)
    tok = llm.get_tokenizer()
    prompt = [1] + list(range(60, 75))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    end = free[3:5]  # two of its greedy tokens stand for the end tag
    k = next(i for i in range(len(free)) if free[i:i + 2] == end) + 2  # where the tag first ends
    choice = StructuredOutputsParams(choice=["yes", "no"])
    deferred = SamplingParams(n=2, temperature=0, max_tokens=40, structured_outputs=choice)
    deferred._grammar_after = list(end)
    for c in llm.generate([prompt], deferred, use_tqdm=False)[0].outputs:
        assert c.token_ids[:k] == free[:k]
        assert tok.decode(c.token_ids[k:], skip_special_tokens=True) in ("yes", "no") and c.finish_reason == "stop"
    now = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=choice),
                       use_tqdm=False)[0].outputs[0]
    assert now.text in ("yes", "no")


def test_base_install_without_xgrammar(llama_dir, monkeypatch):
    """Without the structured extra (xgrammar cannot be imported): auto is llguidance and grammars work offline;
    asking for xgrammar is a configuration error that says how to install it."""
    import sys

    from servelm.config.engine import ConfigError, EngineConfig
    from servelm.engine import structured

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    monkeypatch.setattr(structured, "_xgr_apply", None)  # (an earlier test may have loaded xgrammar's kernel)
    assert not structured.installed("xgrammar") and structured.resolve_backend("auto") == "llguidance"
    with pytest.raises(ConfigError, match=r"servelm\[structured\]"):
        EngineConfig(structured_output_backend="xgrammar")
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, max_model_len=256)
    assert llm.engine.core.grammars.backend == "llguidance"
    params = SamplingParams(n=2, max_tokens=120, temperature=1.0, seed=3,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for c in llm.generate("A pet:", params, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    out = llm.generate("x", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
        grammar='start: "yes" | "no"')), use_tqdm=False)[0].outputs[0]  # Lark, which only llguidance reads
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert structured._xgr_apply is None  # the mask applied without xgrammar


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_apply_bitmask_matches_the_bits(rows):
    """The mask sets exactly the cleared bits' logits to -inf, in the listed rows only, with a vocabulary that
    is not a multiple of 32."""
    import torch

    from servelm.engine.structured import apply_bitmask

    vocab = 1000
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(4, vocab, generator=g)
    want = logits.clone()
    for r in rows:
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    from servelm.engine.structured import _apply_numpy, _apply_unpacked

    # the path in use (xgrammar's kernel where it is installed), the numpy one (the base install), and the one for
    # logits on a GPU (here run on the CPU: the bitmask rows unpacked with torch)
    for apply in (lambda x: apply_bitmask(x, bitmask, rows),
                  lambda x: _apply_numpy(x, bitmask[rows], rows, rows == [0, 1, 2, 3]),
                  lambda x: _apply_unpacked(x, bitmask[rows], rows, rows == [0, 1, 2, 3])):
        out = logits.clone()
        apply(out)
        assert torch.equal(out, want)


def test_schema_for_llguidance():
    from servelm.engine.json_schema import for_llguidance

    schema = {"type": "object", "unevaluatedProperties": False, "properties": {
        "format": {"type": "string", "format": "uri-reference"}, "when": {"type": "string", "format": "date"},
        "either": {"anyOf": [{"type": "object", "unevaluatedProperties": False}], "unevaluatedProperties": False}}}
    assert for_llguidance(schema) == {"type": "object", "additionalProperties": False, "properties": {
        "format": {"type": "string"}, "when": {"type": "string", "format": "date"},
        "either": {"anyOf": [{"type": "object", "additionalProperties": False}], "unevaluatedProperties": False}}}
