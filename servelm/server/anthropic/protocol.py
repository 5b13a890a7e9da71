"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as vLLM serves it: the request body,
and its conversion to the chat machinery's messages, tools and sampling fields."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import APIError, FunctionName


class Block(BaseModel):
    """A content block: text; an assistant's tool_use or thinking; a user's tool_result."""

    model_config = ConfigDict(extra="allow")  # cache_control, citations and the like: accepted, not used

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, type "custom"

    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages: text blocks joined, an assistant's tool_use blocks as its tool_calls,
        a user's tool_result blocks as tool messages before the user's own text (thinking blocks are dropped:
        a chat template takes no reasoning back)."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            where = f"messages.{i}.content"
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls = [], []
            for j, b in enumerate(m.content):
                if b.type in ("image", "document"):
                    raise APIError(400, f"{where}.{j}: {b.type} blocks are not supported (text-only models)",
                                   f"{where}.{j}.type")
                if b.type == "text":
                    texts.append(b.text or "")
                elif b.type == "tool_use" and m.role == "assistant":
                    calls.append({"id": b.id or f"toolu_{i}_{j}", "type": "function",
                                  "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}})
                elif b.type == "tool_result" and m.role == "user":
                    result = b.content if isinstance(b.content, str) else _text(b.content or [], f"{where}.{j}")
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
                elif b.type in ("tool_use", "tool_result"):
                    raise APIError(400, f"{where}.{j}: a {b.type} block belongs to the "
                                        f"{'assistant' if b.type == 'tool_use' else 'user'}", f"{where}.{j}.type")
            if texts or calls or m.role == "assistant":
                msg: dict = {"role": m.role, "content": "".join(texts) if texts or not calls else None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        return out

    def tool_fields(self) -> p.ToolFields:
        """tools and tool_choice in chat completions' shape: any is required, tool is a named function."""
        tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                   **({"description": t.description} if t.description else {})}}
                 for t in self.tools or []]
        tc = self.tool_choice
        choice = None if tc is None else {"auto": "auto", "none": "none", "any": "required"}.get(tc.type)
        if tc is not None and tc.type == "tool":
            if not tc.name:
                raise APIError(400, "tool_choice: type tool needs a name", "tool_choice.name")
            choice = {"type": "function", "function": {"name": tc.name}}
        parallel = False if tc is not None and tc.disable_parallel_tool_use else None
        return p.ToolFields(tools=tools or None, tool_choice=choice, parallel_tool_calls=parallel)


class MessagesRequest(_Conversation):
    max_tokens: Annotated[int, Field(ge=1, le=p.INT32_MAX)]
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=p.INT32_MAX)] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # the template decides whether a model thinks: accepted, not used

    def chat_request(self, messages: list[dict]) -> p.ChatCompletionRequest:
        """The same request as chat completions takes, so that both validate and sample alike."""
        tf = self.tool_fields()
        return p.ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences, stream=self.stream,
            tools=tf.tools, tool_choice=tf.tool_choice, parallel_tool_calls=tf.parallel_tool_calls)


class CountTokensRequest(_Conversation):
    thinking: dict[str, Any] | None = None


def _text(value: str | list, where: str) -> str:
    """The text of a system prompt or tool result: a string, or text blocks joined."""
    if isinstance(value, str):
        return value
    parts = []
    for k, b in enumerate(value):
        block = b if isinstance(b, dict) else b.model_dump()
        if block.get("type") != "text":
            raise APIError(400, f"{where}.{k}: only text blocks are supported here", f"{where}.{k}.type")
        parts.append(block.get("text") or "")
    return "".join(parts)


# finish_reason -> Anthropic's stop_reason
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def stop_reason(finish: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish or "", "end_turn"), None


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error", 529: "overloaded_error"}.get(status, "api_error")
