"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's reply split into its reasoning, the text
between `<think>` and `</think>`, and its content, the text after. Chat completions return the reasoning as
`message.reasoning` (and under its older name, `reasoning_content`); Ollama's API as `thinking`.

- `deepseek_r1`: the reply starts inside its reasoning (DeepSeek-R1's template opens `<think>` in the prompt; a
  reply that opens it itself is read the same). Everything before `</think>` is reasoning; with no `</think>`
  (cut short) the whole reply is.
- `qwen3`: the reply reasons only when it opens with `<think>` (Qwen3 with `enable_thinking` off, and any other
  reply, has no reasoning and is all content); a `</think>` ends the reasoning.
- `mistral` (Magistral): as `qwen3`, with `[THINK]` and `[/THINK]`, which Mistral's tokenizers hold as control
  tokens: the reply is decoded with its special tokens so that the parser sees them.
- `granite` (Granite 3.2 and 3.3 with `thinking` on): as `qwen3`, with plain-text tags: "Here is my thought
  process:" (or "Here's ...") opens the reasoning and "Here is my response:" (or "Here's ...") ends it. No token
  sequence ends such reasoning, so a grammar (structured output, a required tool call) constrains the whole reply.

The content after `</think>` starts at its first character that is not a line break. A stream is split the
same way (`ReasoningStream`), whichever way its text is cut into pieces.
"""

from __future__ import annotations

import re
from typing import Any

from servelm.server.openai.protocol import APIError

# parser -> the tags around the reasoning: (the opening tags, the closing tags), each any one of a few
TAGS = {"deepseek_r1": (("<think>",), ("</think>",)), "qwen3": (("<think>",), ("</think>",)),
        "mistral": (("[THINK]",), ("[/THINK]",)),
        "granite": (("Here is my thought process:", "Here's my thought process:"),
                    ("Here is my response:", "Here's my response:"))}
PARSERS = tuple(TAGS)
OPENED_IN_PROMPT = {"deepseek_r1"}  # the template opens the reasoning: the reply starts inside it
# OpenAI's reasoning_effort values; a chat template that reads the variable (GPT-OSS's) takes them as they are
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_EFFORT_VARIABLE = re.compile(r"\breasoning_effort\b")


def active(setting: str) -> str | None:
    """The parser a server setting names (server.reasoning_parser), None for "none"."""
    return None if setting == "none" else setting


def effort_kwargs(tokenizer: Any, effort: str | None, param: str, template: str | None = None) -> dict:
    """The chat template variable a request's reasoning effort sets: `reasoning_effort`, for a model whose
    template reads it (GPT-OSS's do, as vLLM passes it), or for the request's own `template`. With any other
    template the effort would change nothing, so it is a 400 naming `param` rather than silently ignored."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise APIError(400, f"{param} must be one of {', '.join(EFFORTS)}", param)
    templates = template if template is not None else getattr(tokenizer, "chat_template", None)
    sources = templates.values() if isinstance(templates, dict) else [templates or ""]
    if not any(_EFFORT_VARIABLE.search(src) for src in sources):
        raise APIError(400, f"'{param}' needs a model whose chat template reads reasoning_effort (this model's "
                            "does not, so the effort would change nothing)", param, "unsupported_parameter")
    return {"reasoning_effort": effort}


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for a part the reply does not have."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, last=True)
    return (reasoning if stream.reasoned else None), (content if content or not stream.reasoned else None)


def fit_params(parser: str, params: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    """Fit a request's params to the reasoning parser: its tags decoded where the tokenizer holds them as
    special tokens (Mistral's [THINK]), and its grammar deferred (defer_grammar)."""
    starts, _ = TAGS[parser]
    if any(s in (getattr(tokenizer, "all_special_tokens", None) or ()) for s in starts):
        params.skip_special_tokens = False
    defer_grammar(parser, params, tokenizer, prompt_ids)


def defer_grammar(parser: str, params: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    """Under a reasoning parser, a request's grammar (structured output, a required tool call) constrains the
    answer, not the reasoning before it (vLLM's rule): it waits for the output to end with the closing tag as
    the tokenizer encodes it, unless the prompt already closed the reasoning (Qwen3's template with
    enable_thinking off ends with an empty `<think></think>`)."""
    _, ends = TAGS[parser]
    if params.structured_outputs is None or len(ends) > 1:  # several ways to end it: no one token sequence
        return
    if tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False).rstrip().endswith(ends[0]):
        return
    params._grammar_after = list(tokenizer.encode(ends[0], add_special_tokens=False))


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `tags` (and must wait for the next piece)."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the first of `tags` to occur in `text` begins, and which it is (None: none occurs)."""
    found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    return min(found) if found else None


class ReasoningStream:
    """Splits a reply streamed in pieces: `feed(piece)` gives the (reasoning, content) text that piece completes,
    and with `last` also what was held back. A piece that may end inside a tag is held until the next."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(PARSERS)})")
        self.parser = parser
        self.starts, self.ends = TAGS[parser]
        # "open": before the reply's first text (has it opened <think>?); "reasoning"; "content"
        self.state = "open"
        self.reasoned = False  # whether the reply has a reasoning part
        self.pending = ""
        self.content_started = False  # past the line breaks that follow </think>

    def feed(self, piece: str, last: bool = False) -> tuple[str, str]:
        reasoning, content = self._feed(piece)
        if last:
            more_reasoning, more_content = self._finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _feed(self, piece: str) -> tuple[str, str]:
        self.pending += piece
        reasoning, content = "", ""
        while True:
            if self.state == "open":
                text = self.pending.lstrip()
                if any(len(text) < len(s) and s.startswith(text) for s in self.starts):  # nothing yet, or a tag's start
                    return reasoning, content
                opened = next((s for s in self.starts if text.startswith(s)), None)
                if opened is not None:
                    self.pending, self.state, self.reasoned = text[len(opened):], "reasoning", True
                elif self.parser in OPENED_IN_PROMPT:
                    self.state, self.reasoned = "reasoning", True
                else:
                    self.state = "content"
                    self.content_started = True
            elif self.state == "reasoning":
                found = _first(self.pending, self.ends)
                if found is None:
                    keep = _held(self.pending, self.ends)
                    reasoning += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return reasoning, content
                at, end = found
                reasoning += self.pending[:at]
                self.pending, self.state = self.pending[at + len(end):], "content"
            else:
                if not self.content_started:
                    self.pending = self.pending.lstrip("\r\n")
                    if not self.pending:
                        return reasoning, content
                    self.content_started = True
                content += self.pending
                self.pending = ""
                return reasoning, content

    def _finish(self) -> tuple[str, str]:
        """The text held back at the end of the reply."""
        held, self.pending = self.pending, ""
        if self.state == "open":  # the reply was only (a beginning of) <think>, or nothing
            if held.strip() in self.starts:
                self.reasoned = True
                return "", ""
            if self.parser in OPENED_IN_PROMPT and held:
                self.reasoned = True
                return held, ""
            return "", held
        if self.state == "reasoning":
            return held, ""
        return "", held if self.content_started else ""
