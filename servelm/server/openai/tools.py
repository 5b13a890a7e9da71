"""Tool calling on /v1/chat/completions: the conversation and tools as chat templates take them, and the reply's
tool calls as OpenAI returns them (whole, or as `delta.tool_calls` chunks)."""

from __future__ import annotations

import json

from servelm.sampling_params import SamplingParams
from servelm.server.openai import protocol as p
from servelm.server.openai.reasoning import active, fit_params
from servelm.server.openai.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolStream,
    parse,
    parse_forced,
    parser_for_template,
    tool_schemas,
)


def template_messages(messages: list[p.ChatMessage]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool calls with their arguments as objects (what
    Hugging Face templates expect), a tool result with its tool_call_id (and name)."""
    conv = []
    for msg in messages:
        item: dict = {"role": msg.role, "content": msg.text()}
        if msg.name is not None:
            item["name"] = msg.name
        if isinstance(msg, p.AssistantMessage) and msg.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _as_object(c.function.arguments)}} for c in msg.tool_calls]
        if isinstance(msg, p.ToolMessage) and msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        conv.append(item)
    return conv


def _as_object(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_tools(req: p.ChatCompletionRequest) -> list[dict] | None:
    """The tools for the chat template (none under tool_choice none: the model is not told about them)."""
    if req.tool_mode == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def choose_parser(setting: str, chat_template: str | None) -> str:
    """--tool-call-parser, or (auto) the format the model's chat template uses."""
    return setting if setting in PARSERS else parser_for_template(chat_template)


def reply_readers(api_config, m, tool_fields: p.ToolFields, params, ids: list[int]) -> tuple[ToolReply, str | None]:
    """How a chat reply is read, on every API that generates one (chat, Responses, Messages): its tool calls (the
    parser --tool-call-parser names, else the template's format) and its reasoning (--reasoning-parser, None when
    off). `params` are fitted to them: special tokens kept for Mistral's [TOOL_CALLS] marker (and [THINK]), a
    grammar held back until the reasoning ends."""
    tools = ToolReply(tool_fields, choose_parser(api_config.tool_call_parser,
                                                 getattr(m.tokenizer, "chat_template", None)))
    if tools.active and tools.parser == "mistral":
        params.skip_special_tokens = False  # [TOOL_CALLS] is a special token: the parser must see it
    thinking = active(api_config.reasoning_parser)
    if thinking and isinstance(params, SamplingParams):
        fit_params(thinking, params, m.tokenizer, ids)
    return tools, thinking


class ToolReply:
    """Turns one request's choices into tool calls according to its tool_choice."""

    def __init__(self, req: p.ChatCompletionRequest, parser: str) -> None:
        self.mode, self.parser = req.tool_mode, parser
        self.named = req.tool_choice.function.name if self.mode == "named" else None
        self.single = req.parallel_tool_calls is False
        self.schemas = tool_schemas(template_tools(req))  # qwen3_coder types its raw values by them

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls[:1] if self.single else calls

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, and its finish_reason."""
        plain = {"role": "assistant", "content": text, "refusal": None}
        if not self.active or finish == "length":  # cut short: whatever it holds is returned as text
            return plain, finish
        if self.mode == "auto":
            content, calls = parse(self.parser, text, self.schemas)
        else:
            content, calls = None, parse_forced(text, self.named) or []
        if not calls:
            return plain, finish
        return ({"role": "assistant", "content": content, "refusal": None,
                 "tool_calls": [c.as_openai() for c in self._limit(calls)]}, "tool_calls")

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


def delta_events(d: dict, text, call, arguments) -> list:
    """One chat-completions delta (a ChoiceStream's) as another API's events: `text(content)`, `call(id, name)`
    where a tool call starts, `arguments(piece)` as its arguments come (the Responses and Messages APIs)."""
    if d.get("content"):
        return text(d["content"])
    out = []
    for t in d.get("tool_calls", []):
        if t.get("id"):
            out += call(t["id"], t["function"]["name"])
        if t["function"].get("arguments"):
            out += arguments(t["function"]["arguments"])
    return out


class ChoiceStream:
    """One streamed choice: deltas for the text the model produced, with tool calls as OpenAI's
    `delta.tool_calls` (the first chunk of a call has its index, id, type and name, the next its arguments)."""

    def __init__(self, reply: ToolReply) -> None:
        self.reply = reply
        self.auto = ToolStream(reply.parser, reply.schemas) if reply.mode == "auto" else None
        self.held = ""  # required / named: the whole reply is one JSON value, parsed at the end
        self.sent_calls = 0

    def deltas(self, text: str, finish: str | None) -> tuple[list[dict], str | None]:
        """The deltas to send for new text (and, with finish, the end), and the finish_reason to report."""
        out: list[dict] = []
        if self.auto is not None:
            content, calls = self.auto.feed(text) if text else ("", [])
            if content:
                out.append({"content": content})
            out += self._call_deltas(calls)
            if finish is not None:
                if finish == "length":  # cut short: what was held back goes out as text, unparsed
                    content, calls, self.auto.pending = self.auto.pending, [], ""
                else:
                    content, calls = self.auto.finish()
                if content:
                    out.append({"content": content})
                out += self._call_deltas(calls)
        else:
            self.held += text
            if finish is not None:
                calls = parse_forced(self.held, self.reply.named) if finish != "length" else None
                if calls:
                    out += self._call_deltas(calls)
                elif self.held:
                    out.append({"content": self.held})
        if finish is not None and self.sent_calls:
            finish = "tool_calls"
        return out, finish

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict]:
        out = []
        for c in calls:
            if self.reply.single and self.sent_calls:
                break
            k = self.sent_calls
            self.sent_calls += 1
            out.append({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": c.arguments}}]})
        return out
