"""OpenAI's Responses API: the request body of POST /v1/responses (text in, text out) and the response object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.config import generation
from servelm.sampling_params import OutputKind, SamplingParams
from servelm.server.openai.protocol import Length, Priority, Text, _Body


class ContentPart(BaseModel):
    """Text in an input message: the caller's (input_text) or an earlier reply quoted back (output_text)."""

    model_config = ConfigDict(extra="allow", strict=True)  # annotations, logprobs of quoted replies

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None  # an earlier output message quoted back carries its id and status
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: Text | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None  # a system message for this response only (not carried to the next)
    previous_response_id: str | None = None
    max_output_tokens: Length | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # with no tools, both mean text
    user: str | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    priority: Priority = None

    def messages(self) -> list[dict[str, str]]:
        """The input as {"role", "content"} messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [{"role": m.role, "content": m.text()} for m in self.input]

    def sampling_params(self, default_max: int, defaults: Mapping | None = None) -> SamplingParams:
        """`defaults`: the model's (--generation-config), for temperature and top_p when unset and for the
        fields this API has no place for."""
        return SamplingParams(**generation.request_values(defaults, temperature=self.temperature, top_p=self.top_p),
                              max_tokens=self.max_output_tokens or generation.default_max_tokens(defaults, default_max),
                              output_kind=OutputKind.DELTA)


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def message_item(item_id: str, text: str, status: str) -> dict:
    """The assistant's output message; while in progress it has no content part yet."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A reasoning model's thinking (under the server's reasoning parser) as OpenAI's reasoning item."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def response_object(rid: str, created: int, model: str, body: ResponsesRequest, status: str,
                    output: list[dict], use: dict | None = None, error: dict | None = None) -> dict[str, Any]:
    """A Response as OpenAI shapes it; `status` in_progress, completed, incomplete or failed."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": False, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "none", "tools": [],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": use,
            "user": body.user, "metadata": body.metadata or {}}
