"""OpenAI's Responses API: the request body of POST /v1/responses (text and function calls in, text and function
calls out) and the response object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelm.config import generation
from servelm.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import FunctionName, Length, Priority, Text, _Body


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

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return p.reject_media_parts(data, "input")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A function call of an earlier reply, quoted back (or carried by previous_response_id)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(BaseModel):
    """The caller's result of a function call, for the model to go on from."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningInput(BaseModel):
    """A reasoning item of an earlier reply, quoted back (as clients that keep no server-side state send the
    whole conversation): accepted, and left out of the prompt, as chat templates take no earlier reasoning."""

    model_config = ConfigDict(extra="allow", strict=True)  # its summary, content or encrypted_content

    type: Literal["reasoning"]
    id: str | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningInput


class FunctionTool(BaseModel):
    """A function the model may call, in the Responses API's flat form (chat completions nest it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    """The reply's format: text, any JSON object, or JSON following a schema (OpenAI's structured outputs)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: the schema's name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.schema_ is None:
                raise p.APIError(400, "text.format: json_schema needs a schema", "text.format.schema")
            return StructuredOutputsParams(json=p._schema_of(self.schema_, "text.format.schema"))
        return None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """The reasoning settings: effort is the chat template's reasoning_effort (for a model whose template reads
    it); the reasoning itself comes back whole as a reasoning item's text, so the only summary is auto's (none)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None  # summary's older name


class ResponsesRequest(_Body):
    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None  # a system message for this response only (not carried to the next)
    previous_response_id: str | None = None
    max_output_tokens: Length | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    # what else the output carries: reasoning.encrypted_content asks for the reasoning in a form to send back,
    # which servelm has no use for (earlier reasoning never re-enters a prompt); its reasoning items carry the
    # text in `content` instead
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None  # as chat's
    prompt_cache_key: str | None = None  # as chat's: a hint the prefix cache does not need
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    priority: Priority = None

    def messages(self) -> list[dict]:
        """The input as chat messages: a function call joins the assistant message before it (the reply it was
        part of), or opens one; a function call's output is a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, ReasoningInput):
                continue  # the answers carry the conversation, as chat templates drop earlier reasoning
            elif isinstance(item, FunctionCallItem):
                if not out or out[-1]["role"] != "assistant":
                    out.append({"role": "assistant", "content": None})
                out[-1].setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def tool_fields(self) -> p.ToolFields:
        """The tools and tool_choice in chat completions' shape, validated as chat validates them."""
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in self.tools or []]
        return p.ToolFields(tools=tools, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls)

    def sampling_params(self, default_max: int, defaults: Mapping | None = None) -> SamplingParams:
        """`defaults`: the model's (--generation-config), for temperature and top_p when unset and for the
        fields this API has no place for."""
        return SamplingParams(**generation.request_values(defaults, temperature=self.temperature, top_p=self.top_p),
                              max_tokens=self.max_output_tokens or generation.default_max_tokens(defaults, default_max),
                              output_kind=OutputKind.DELTA, structured_outputs=self.structured())

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar of the reply: a forced function call (tool_choice required or named) or text.format's."""
        forced = self.tool_fields().forced_tool_schema()
        fmt = self.text.format.structured() if self.text is not None and self.text.format is not None else None
        if forced is not None and fmt is not None:
            raise p.APIError(400, "tool_choice required or a named function already sets the reply's format; it "
                                  "cannot be combined with text.format", "text.format")
        return StructuredOutputsParams(json=forced) if forced is not None else fmt


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def message_item(item_id: str, text: str, status: str) -> dict:
    """The assistant's output message; while in progress it has no content part yet."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [part]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    """A function call the reply makes (its arguments, JSON text, empty while in progress)."""
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


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
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": (body.reasoning.summary or body.reasoning.generate_summary) if body.reasoning
                          else None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "tool_choice": _dump(body.tool_choice) or ("auto" if body.tools else "none"),
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": use,
            "user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key, "metadata": body.metadata or {}}


def _dump(value):
    return value.model_dump() if isinstance(value, BaseModel) else value
