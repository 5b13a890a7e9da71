"""Tool calls in a model's reply: the common formats parsed into OpenAI's `tool_calls`, whole or while streaming.

- hermes (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
- llama3_json (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}` (calls separated by `;`),
  optionally after `<|python_tag|>`
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`

Text that only looks like a call (bad JSON, no name) stays content: a model's mistake is never a 500.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for_template(template: str | None) -> str:
    """The format a chat template teaches its model (hermes when it says nothing)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def _call(obj) -> ToolCall | None:
    """A call from a parsed JSON object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; no calls (and all the text as content) where any call is broken."""
    content, calls = text, []
    if parser == "hermes" and "<tool_call>" in text:
        head = text[:text.index("<tool_call>")]
        blocks = _HERMES.findall(text[len(head):])
        calls = [_call(_loads(b)) for b in blocks]
        content = head
    elif parser == "mistral" and "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        items = _loads(rest.strip())
        calls = [_call(o) for o in (items if isinstance(items, list) else [items])]
        content = head
    elif parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            calls = [_call(_loads(part)) for part in _split_semicolons(body)]
            content = ""
    if not calls or any(c is None for c in calls):
        return text, []
    return (content.strip() or None), calls


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _split_semicolons(body: str) -> list[str]:
    """Top-level `;`-separated JSON values (a `;` inside a string or object does not split)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_str:
            esc, in_str = (not esc and ch == "\\"), in_str and (esc or ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_forced(text: str, named: str | None) -> list[ToolCall] | None:
    """The calls of a reply made under tool_choice required (a JSON array of {name, arguments}) or a named
    function (the arguments object itself); None if it is not that (cut short by max_tokens)."""
    value = _loads(text)
    if named is not None:
        return [ToolCall(named, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = [_call(v) for v in value]
    return None if any(c is None for c in calls) else calls


_TAG = "<|python_tag|>"
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": None}


class ToolStream:
    """One streamed choice under tool_choice auto: content streams as it comes, except from where a call may
    begin, which is held back and parsed at the end (or, for hermes, a call as soon as its block closes)."""

    def __init__(self, parser: str) -> None:
        self.parser, self.marker = parser, _MARKERS[parser]
        self.pending = ""  # text not yet sent: a possible (part of a) call
        self.holding = False  # a call has (possibly) begun: everything from here waits
        self.started = False  # any text seen (llama3_json: a call must be the whole reply)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls complete now)."""
        if not self.holding:
            if self.marker is None:  # llama3_json: a reply that starts with `{` (or the tag) may be a call
                if not self.started:
                    lead = (self.pending + text).lstrip()
                    if not lead:
                        self.pending += text
                        return "", []
                    self.started = True
                    if lead.startswith(("{", _TAG)) or _TAG.startswith(lead):
                        self.holding = True
                        self.pending += text
                        return "", []
                    out, self.pending = self.pending + text, ""
                    return out, []
                return text, []
            self.pending += text
            at = self.pending.find(self.marker)
            if at < 0:
                keep = _partial_suffix(self.pending, self.marker)
                out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                return out, []
            out, self.pending, self.holding = self.pending[:at], self.pending[at:], True
            return out, self._complete_blocks()
        self.pending += text
        return "", self._complete_blocks()

    def _complete_blocks(self) -> list[ToolCall]:
        """hermes: the calls whose </tool_call> has arrived (sent at once; what follows waits)."""
        if self.parser != "hermes":
            return []
        done = []
        while True:
            m = re.match(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", self.pending, re.S)
            if m is None:
                return done
            call = _call(_loads(m.group(1)))
            if call is None:  # broken: leave it for finish(), which returns it as content
                return done
            self.pending = self.pending[m.end():]
            done.append(call)
            self.calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: (content, calls)."""
        rest, self.pending = self.pending, ""
        if not rest.strip():
            return "", []
        content, calls = parse(self.parser, rest)
        if calls:
            self.calls += calls
            return content or "", calls
        return rest, []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: the marker may be arriving)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
