"""Tool calls in a model's reply: the common formats parsed into OpenAI's `tool_calls`, whole or while streaming.

- hermes (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
- llama3_json (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}` (calls separated by `;`),
  optionally after `<|python_tag|>`
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`
- qwen3_coder (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
  each value raw text typed by the tool's parameter schema (a string stays text, a number, boolean, object or
  array is read as one)
- pythonic (Llama 3.2 and 4, and others with vLLM's pythonic templates): the reply is a Python list of calls,
  `[get_weather(city="Paris"), get_time(zone=1)]`, optionally between `<|python_start|>` and `<|python_end|>`;
  read as a syntax tree of literals, never evaluated
- phi4_mini_json (Phi-4-mini): `functools` then a JSON array of `{"name": ..., "arguments": {...}}`
- granite (Granite 3.x): the reply is a JSON array of `{"name": ..., "arguments": {...}}`, after `<|tool_call|>`
  (Granite 3.0) or `<tool_call>` (3.1 and later)

Text that only looks like a call (bad JSON, no name) stays content: a model's mistake is never a 500.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "phi4_mini_json", "granite")
# a tool's name -> its parameters' JSON schema (qwen3_coder types its raw values by it)
Schemas = Mapping[str, Mapping[str, Any]]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_schemas(tools: list[dict] | None) -> dict[str, Mapping[str, Any]]:
    """Each offered tool's parameters schema by name, from tools in OpenAI's shape."""
    out: dict[str, Mapping[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function") or {}
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def parser_for_template(template: str | None) -> str:
    """The format a chat template teaches its model (hermes when it says nothing)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<parameter=" in text and "<function=" in text:
        return "qwen3_coder"
    if "<|python_start|>" in text or "func_name1(" in text:
        return "pythonic"
    if "available_tools<|end_of_role|>" in text or "<|tool_call|>" in text:  # Granite's tools role
        return "granite"
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


def parse(parser: str, text: str, schemas: Schemas | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; no calls (and all the text as content) where any call is broken.
    `schemas`: the offered tools' parameters (qwen3_coder types its values by them)."""
    content, calls = text, []
    if parser == "qwen3_coder" and "<tool_call>" in text:
        head = text[:text.index("<tool_call>")]
        rest = text[len(head):]
        blocks = _QWEN3_CODER_BLOCK.findall(rest)
        calls = [_xml_call(b, schemas or {}) for b in blocks] if blocks else [None]
        content = head
    elif parser == "pythonic":
        body = text.strip()
        if body.startswith(("[", _PY_START)):
            calls = _pythonic_calls(body) or [None]
            content = ""
    elif parser == "phi4_mini_json" and (at := _FUNCTOOLS.search(text)) is not None:
        head, rest = text[:at.start()], text[at.end():]
        items = _loads(rest.strip())
        calls = [_call(o) for o in items] if isinstance(items, list) and items else [None]
        content = head
    elif parser == "hermes" and "<tool_call>" in text:
        head = text[:text.index("<tool_call>")]
        blocks = _HERMES.findall(text[len(head):])
        calls = [_call(_loads(b)) for b in blocks]
        content = head
    elif parser == "mistral" and "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        items = _loads(rest.strip())
        calls = [_call(o) for o in (items if isinstance(items, list) else [items])]
        content = head
    elif parser == "granite":
        body = text.strip()
        for tag in _GRANITE_TAGS:
            body = body.removeprefix(tag).lstrip()
        if body.startswith("["):
            items = _loads(body)
            calls = [_call(o) for o in items] if isinstance(items, list) and items else [None]
            content = ""
    elif parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            calls = [_call(_loads(part)) for part in _split_semicolons(body)]
            content = ""
    if not calls or any(c is None for c in calls):
        return text, []
    return (content.strip() or None), calls


_GRANITE_TAGS = ("<|tool_call|>", "<tool_call>")
_QWEN3_CODER_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_FUNCTOOLS = re.compile(r"functools\s*(?=\[)")


def _xml_call(block: str, schemas: Schemas) -> ToolCall | None:
    """A qwen3_coder call from the text of one <tool_call> block, or None if it is not one."""
    m = _XML_FUNCTION.match(block)
    if m is None or not m.group(1).strip():
        return None
    name = m.group(1).strip()
    props = (schemas.get(name) or {}).get("properties") or {}
    args = {}
    for key, raw in _XML_PARAMETER.findall(m.group(2)):
        key = key.strip()
        args[key] = _typed(_trim_newline(raw), props.get(key))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _trim_newline(raw: str) -> str:
    """A value as written between its tags, less the one line break the format puts on either side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _typed(raw: str, schema: Any) -> Any:
    """A raw parameter value as its schema types it: text for a string (or an unknown parameter, or a schema
    with no type), else the number, boolean, null, object or array it reads as (text when it does not)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return raw
    text = raw.strip()
    if text == "null" and "null" in kinds:
        return None
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in kinds:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in kinds:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
    if "object" in kinds or "array" in kinds:
        value = _loads(text)
        if value is None:
            try:
                value = _literal(ast.parse(text, mode="eval").body)
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                value = None
        if isinstance(value, (dict, list)):
            return value
    return raw


def _pythonic_calls(body: str) -> list[ToolCall] | None:
    """The calls of a pythonic reply (a list of calls with keyword arguments that are literals), or None."""
    body = body.removeprefix(_PY_START).strip()
    body = body[:-len(_PY_END)].strip() if body.endswith(_PY_END) else body
    try:
        node = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for item in node.elts:
        if not (isinstance(item, ast.Call) and not item.args and isinstance(item.func, (ast.Name, ast.Attribute))):
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in item.keywords if kw.arg is not None}
        except (ValueError, RecursionError):
            return None
        if len(args) != len(item.keywords):  # **kwargs
            return None
        calls.append(ToolCall(ast.unparse(item.func), json.dumps(args, ensure_ascii=False)))
    return calls


_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A literal's value (Python's, and JSON's true, false and null); ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return {k: _literal(v) for k, v in zip(keys, node.values, strict=True)}
    raise ValueError("not a literal")


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
# where a call may begin in a reply that also has content
_MARKERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]",
            "phi4_mini_json": "functools[", "llama3_json": None, "pythonic": None, "granite": None}
# formats whose calls are the whole reply: how such a reply begins
_LEADS = {"llama3_json": ("{", _TAG), "pythonic": ("[", _PY_START), "granite": ("[", *_GRANITE_TAGS)}


class ToolStream:
    """One streamed choice under tool_choice auto: content streams as it comes, except from where a call may
    begin, which is held back and parsed at the end (or, for hermes, a call as soon as its block closes)."""

    def __init__(self, parser: str, schemas: Schemas | None = None) -> None:
        self.parser, self.marker, self.schemas = parser, _MARKERS[parser], schemas or {}
        self.pending = ""  # text not yet sent: a possible (part of a) call
        self.holding = False  # a call has (possibly) begun: everything from here waits
        self.started = False  # any text seen (llama3_json: a call must be the whole reply)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls complete now)."""
        if not self.holding:
            if self.marker is None:  # llama3_json, pythonic, granite: a reply that starts as a call may be one
                if not self.started:
                    lead = (self.pending + text).lstrip()
                    if not lead:
                        self.pending += text
                        return "", []
                    self.started = True
                    leads = _LEADS[self.parser]
                    if lead.startswith(leads) or any(t.startswith(lead) for t in leads):
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
        """hermes, qwen3_coder: the calls whose </tool_call> has arrived (sent at once; what follows waits)."""
        if self.parser not in ("hermes", "qwen3_coder"):
            return []
        done = []
        while True:
            m = re.match(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", self.pending, re.S)
            if m is None:
                return done
            call = _call(_loads(m.group(1))) if self.parser == "hermes" else _xml_call(m.group(1), self.schemas)
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
        content, calls = parse(self.parser, rest, self.schemas)
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
