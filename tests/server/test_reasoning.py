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
        ReasoningStream("granite")
