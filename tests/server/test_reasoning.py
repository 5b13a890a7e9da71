"""The reasoning parsers (servelm/server/openai/reasoning.py): whole replies, and every way a stream can cut
them into pieces gives the same split. Through a server: tests/server/test_tool_calling.py."""

from __future__ import annotations

import pytest

from servelm.server.openai.reasoning import ReasoningStream, split


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nplan it\n</think>\n\nThe answer.", "\nplan it\n", "The answer."),
    ("qwen3", "no thinking here", None, "no thinking here"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut short", "cut short", None),  # max_tokens inside the reasoning
    ("qwen3", "<think>x</think>\n\n", "x", None),
    ("qwen3", "<thi", None, "<thi"),  # not a tag after all
    ("qwen3", "a </think> in the content", None, "a </think> in the content"),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "plan it\n</think>\n\nThe answer.", "plan it\n", "The answer."),  # <think> was in the prompt
    ("deepseek_r1", "<think>plan</think>ans", "plan", "ans"),
    ("deepseek_r1", "all reasoning, cut short", "all reasoning, cut short", None),
    ("deepseek_r1", "x</think>", "x", None),
    ("mistral", "[THINK]plan it[/THINK]\nThe answer.", "plan it", "The answer."),  # Magistral's control tokens
    ("mistral", "no thinking here", None, "no thinking here"),
    ("mistral", "[THINK]cut short", "cut short", None),
    ("mistral", "<think>not its tags</think>", None, "<think>not its tags</think>"),
    ("mistral", "[THI", None, "[THI"),
    # Granite 3.2/3.3: plain-text tags, either wording
    ("granite", "Here is my thought process:\nplan it\nHere is my response:\nThe answer.", "\nplan it\n",
     "The answer."),
    ("granite", "Here's my thought process: a. Here's my response:\n\nb", " a. ", "b"),
    ("granite", "Here is my thought process: a Here's my response:\nb", " a ", "b"),  # the wordings mixed
    ("granite", "Here is the answer.", None, "Here is the answer."),
    ("granite", "Here is my thought process: cut short", " cut short", None),
    ("granite", "Here is my", None, "Here is my"),
    ("granite", "<think>not its tags</think>", None, "<think>not its tags</think>"),
])
def test_whole_and_streamed_at_every_split(parser, text, reasoning, content):
    assert split(parser, text) == (reasoning, content)
    cuts = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        stream = ReasoningStream(parser)
        got_r, got_c = "", ""
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, last=i == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning or "", content or ""), pieces
        assert stream.reasoned == (reasoning is not None)


def test_a_piece_is_sent_as_soon_as_it_cannot_be_a_tag():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<think>I think") == ("I think", "")
    assert stream.feed(" so</th") == (" so", "")  # "</th" may begin </think>: held
    assert stream.feed("ink>\n") == ("", "")
    assert stream.feed("\nYes") == ("", "Yes")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningStream("nonexistent")


def test_params_keep_special_tokens_where_the_tags_are_special(tokenizer_dir):
    """Mistral's tokenizers hold [THINK] as a control token, which decoding would drop: under the mistral parser
    the reply keeps its special tokens, and a grammar waits for [/THINK] as the tokenizer encodes it. Qwen3's
    <think> is plain text: nothing changes."""
    from transformers import AutoTokenizer

    from servelm.sampling_params import SamplingParams, StructuredOutputsParams
    from servelm.server.openai.reasoning import fit_params

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    prompt = tok.encode("Say yes.", add_special_tokens=False)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"]))
    fit_params("mistral", params, tok, prompt)
    assert params.skip_special_tokens is False
    assert params._grammar_after == tok.encode("[/THINK]", add_special_tokens=False) and len(
        params._grammar_after) == 1  # one control token
    closed = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"]))
    fit_params("mistral", closed, tok, prompt + tok.encode("[THINK]x[/THINK]", add_special_tokens=False))
    assert not closed._grammar_after  # the prompt closed the reasoning: the grammar applies from the first token
    plain = SamplingParams()
    fit_params("qwen3", plain, AutoTokenizer.from_pretrained(tokenizer_dir), prompt)
    assert plain.skip_special_tokens is True
    granite = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"]))
    fit_params("granite", granite, AutoTokenizer.from_pretrained(tokenizer_dir), prompt)
    assert not granite._grammar_after  # two wordings end Granite's reasoning: the grammar holds from the start


def test_the_mistral_parser_through_the_api(tokenizer):
    """A server with --reasoning-parser mistral returns Magistral's [THINK] part as the reasoning on chat
    completions (whole and streamed) and as Ollama's thinking. In-process, with a stub engine's reply."""
    import json

    from starlette.testclient import TestClient
    from test_tool_call_formats import Replies

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    engine = Replies()
    engine.text = "[THINK]The user greets me.[/THINK]Hello!"
    config = load({"embedding_model": "none", "log_requests": False, "reasoning_parser": "mistral"}, env={})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(build_state(config, tokenizer, engine, "tiny"))) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("The user greets me.", "Hello!")
        stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in stream.splitlines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == "The user greets me."
        assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
        ollama = client.post("/api/chat", json={**body, "stream": False}).json()["message"]
        assert (ollama["thinking"], ollama["content"]) == ("The user greets me.", "Hello!")
