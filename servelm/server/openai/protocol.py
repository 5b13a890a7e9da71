"""OpenAI-compatible request schemas (pydantic) and the error shape every failure uses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelm.beam_search import BeamSearchParams
from servelm.config import generation
from servelm.config.settings import CHAT_TEMPLATE_ARGUMENTS
from servelm.engine.json_schema import check_schema
from servelm.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams, truncate_prompt


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
             507: "insufficient_storage"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


INT64 = (-2**63, 2**63 - 1)  # OpenAI documents `seed` as an int64
INT32_MAX = 2**31 - 1  # beyond any vocabulary or context: a cap that keeps counts well inside the engine's ints

# Strings and lists the server refuses when empty say so in the schema (and so in /openapi.json).
Text = Annotated[str, Field(min_length=1)]
Texts = Annotated[list[Text], Field(min_length=1)]
# Token ids: the vocabulary bound is added to /openapi.json once the model is known (see openapi.py).
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]],
                     Field(min_length=1, json_schema_extra={"x-token-ids": True})]
Stop = Text | list[Text] | None
# A request's id, as a client names it (the x-request-id header, vLLM's request_id field): it goes into response
# ids, headers and logs, so it is kept to characters those carry as they are
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
# A number of tokens to generate: /openapi.json bounds it by the context length (see openapi.py).
Length = Annotated[int, Field(ge=1, le=INT32_MAX, json_schema_extra={"x-context-bound": True})]

# A priority class by name, or its index (0 high, 1 normal, 2 low; lower is served first, as in vLLM).
Priority = Literal["high", "normal", "low"] | Annotated[int, Field(ge=0, le=2)] | None


def lone_surrogate(value: Any, path: tuple = ()) -> tuple | None:
    """The path of the first string (or key) in a JSON value holding a lone UTF-16 surrogate (JSON's "\\ud800"
    decodes to one; no tokenizer or encoder takes it), or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for k, v in value.items():
            found = lone_surrogate(k, (*path, k)) or lone_surrogate(v, (*path, k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate(v, (*path, i))
            if found is not None:
                return found
    return None


# Fields of OpenAI's and vLLM's APIs that servelm does not implement yet, each with the values that change nothing
# (always also null). Any other value is a 400 naming the field rather than a result that silently ignores it.
# Shrink the list as features land; a field a request model defines is implemented and never refused here.
NOT_SUPPORTED_YET: dict[str, tuple] = {
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (),  # on completions (chat has them)
    "functions": ([],), "function_call": ("none",), "suffix": ("",), "best_of": (1,),
    # either backend enforces the same grammar: the engine's structured_output_backend setting picks which
    "guided_decoding_backend": ("auto", "xgrammar", "guidance", "llguidance"),
    "guided_whitespace_pattern": (), "logits_processors": (),
    # vLLM's default: special tokens (kept with skip_special_tokens false) decode as the tokenizer joins them
    "spaces_between_special_tokens": (True,),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "verbosity": (),
    "web_search_options": (), "store": (False,), "metadata": (), "service_tier": ("auto", "default"),
}


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, so the server does: integral floats become ints (float fields take
    ints; strict validation still refuses "2" and true)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


class _Body(BaseModel):
    """A request body: valid Unicode, finite numbers, and no field servelm would silently ignore."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", strict=True)  # "5" is not a number

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        path = lone_surrogate(data)
        if path is not None:
            param = ".".join(str(x) for x in path)
            raise APIError(400, f"{param or 'body'}: holds a lone UTF-16 surrogate (invalid Unicode)", param or None,
                           "invalid_unicode")
        if not isinstance(data, dict):
            return data
        data = _integral(data)
        noop = []
        for name, value in data.items():
            if name not in NOT_SUPPORTED_YET or name in cls.model_fields:
                continue
            if value is not None and value not in NOT_SUPPORTED_YET[name]:
                raise APIError(400, f"'{name}' is not supported by this server yet", name, "unsupported_parameter")
            noop.append(name)
        return {k: v for k, v in data.items() if k not in noop} if noop else data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


# a whole JSON schema is an object (booleans are schemas only inside one)
SchemaObject = dict[str, Any]


class JSONSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: SchemaObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    json_: SchemaObject | str | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Texts | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


def _schema_of(value: SchemaObject | str, param: str) -> SchemaObject:
    """A JSON schema given as an object or as JSON text, checked for keywords the grammar cannot enforce (400
    naming the keyword)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(400, f"{param}: not valid JSON: {e}", param) from None
    if not isinstance(value, dict):  # a boolean is a schema only inside another here: as the whole schema, true
        # would constrain nothing and false allow nothing
        raise APIError(400, f"{param}: must be a JSON schema (an object), got {json.dumps(value)[:40]}", param)
    try:
        check_schema(value)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param, "unsupported_schema_feature") from None
    return value


class _VllmSampling(_Body):
    """vLLM's sampling parameters beyond temperature and top_p, with OpenAI's ranges: one declaration for the
    OpenAI routes and the native API (and so gRPC)."""

    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0


class _SamplingFields(_VllmSampling):
    """Fields shared by completions and chat completions, with OpenAI's ranges plus vLLM's extensions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: Stop = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # OpenAI's newer names: `user` split into an end-user id (what traffic policies match when `user` is unset)
    # and a cache-routing hint, which servelm's prefix cache does not need (it finds shared prefixes itself)
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    # OpenAI's request metadata (up to 16 string pairs): traffic-policy segment rules may match it
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    priority: Priority = None
    # vLLM's: the request's id (when no x-request-id header names it): the response's id is the object's prefix
    # and it, and the x-request-id header and the request's log line carry it
    request_id: RequestId | None = None
    # vLLM's field: requests share prefix-cache blocks only with requests of the same salt (and, under
    # --prefix-cache-isolation key, of the same API key)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # structured output: OpenAI's response_format, and vLLM's extensions (at most one of them)
    response_format: ResponseFormat | None = None
    guided_json: SchemaObject | str | None = None
    guided_regex: Text | None = None
    guided_choice: Texts | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's: the logprob and rank of each prompt token after the first, with this many alternatives
    prompt_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # at most --max-logprobs
    # vLLM's: the token ids of the prompt and of each choice beside the text (on a stream, each chunk's new ones)
    return_token_ids: bool = False
    # vLLM's: logprobs name their tokens "token_id:N" (unset: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's beam search: n beams, ranked by cumulative logprob / length ** length_penalty (servelm/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule: they come with the whole answer
            raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be at least 1, or -1 for the model's context length",
                           "truncate_prompt_tokens")
        return self

    def tokens_as_ids(self, server_default: bool) -> bool:
        return server_default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def stream_usage(self, forced: bool) -> tuple[bool, bool]:
        """(a last chunk with the usage, the usage so far on every chunk) of a stream; `forced`: the server's
        --enable-force-include-usage, as if every request asked for include_usage."""
        so = self.stream_options
        final = forced or (so is not None and so.include_usage)
        return final, final and so is not None and so.continuous_usage_stats

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's ids as the request keeps them: its last truncate_prompt_tokens, when it asks."""
        return truncate_prompt(ids, self.truncate_prompt_tokens, max_model_len)

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar the request asks for (400 if it asks for more than one, or for what cannot be enforced)."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(400, "response_format: json_schema is required with type json_schema",
                               "response_format.json_schema")
            schema = rf.json_schema.schema_
            given.append(("response_format", {"json_object": True} if schema is None else
                          {"json": _schema_of(schema, "response_format.json_schema.schema")}))
        if self.guided_json is not None:
            given.append(("guided_json", {"json": _schema_of(self.guided_json, "guided_json")}))
        for name, key in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        so = self.structured_outputs
        if so is not None:
            kw = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object))
                  if v or (k == "json" and v is not None)}
            if "json" in kw:
                kw["json"] = _schema_of(kw["json"], "structured_outputs.json")
            given.append(("structured_outputs", kw))
        if len(given) > 1:
            raise APIError(400, f"only one kind of structured output per request; got {given[0][0]} and "
                                f"{given[1][0]}", given[1][0])
        if not given:
            return None
        try:
            return StructuredOutputsParams(**given[0][1])
        except ValueError as e:
            raise APIError(400, f"{given[0][0]}: {e}", given[0][0]) from None

    def _params(self, max_tokens: int | None, logprobs: int | None, default_max: int,
                defaults: Mapping | None) -> SamplingParams | BeamSearchParams:
        """`defaults`: the model's sampling defaults (--generation-config) for the fields the request leaves
        unset."""
        max_tokens = max_tokens or generation.default_max_tokens(defaults, default_max)
        if self.use_beam_search:
            return self._beam_params(max_tokens, logprobs, defaults)
        return SamplingParams(
            n=self.n, **generation.request_values(
                defaults, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty),
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=OutputKind.DELTA,
            structured_outputs=self.structured(), prompt_logprobs=self.prompt_logprobs,
        )

    def _beam_params(self, max_tokens: int, logprobs: int | None, defaults: Mapping | None) -> BeamSearchParams:
        """use_beam_search's parameters; a 400 naming any field the search would ignore."""
        for name, neutral in BEAM_IGNORES.items():
            if getattr(self, name) not in (None, [], {}, *neutral):
                raise APIError(400, f"{name} cannot be combined with use_beam_search (a beam search ranks "
                                    "the model's own log-probabilities and ends only at end-of-sequence)", name)
        if self.structured() is not None:
            raise APIError(400, "structured output cannot be combined with use_beam_search", "use_beam_search")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    temperature=self.temperature if self.temperature is not None else
                                    (defaults or {}).get("temperature", 0.0), length_penalty=self.length_penalty,
                                    include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs)
        except ValueError as e:  # beam_width is n
            raise APIError(400, f"n: {e} (with use_beam_search, n is the beam width)", "n") from None


# The sampling fields a beam search has no use for, each with the values that change nothing (null and empty
# too): use_beam_search with any other value is a 400.
BEAM_IGNORES: dict[str, tuple] = {
    "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "seed": (), "stop": (), "stop_token_ids": (), "allowed_token_ids": (),
    "bad_words": (), "min_tokens": (0,), "logit_bias": (), "prompt_logprobs": (),
}


class CompletionRequest(_SamplingFields):
    prompt: Text | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    # 0 only with echo: score the prompt, generate nothing (what lm-evaluation-harness's loglikelihood sends)
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX, json_schema_extra={"x-context-bound": True})] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # at most --max-logprobs
    # vLLM's: the tokenizer's special tokens (a BOS) added to a text prompt
    add_special_tokens: bool = True

    def sampling_params(self, default_max: int, defaults: Mapping | None = None) -> SamplingParams | BeamSearchParams:
        if self.use_beam_search and self.echo and (self.max_tokens == 0 or self.logprobs is not None):
            raise APIError(400, "echo with logprobs (or max_tokens 0) cannot be combined with use_beam_search",
                           "use_beam_search")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo, to score the prompt)",
                           "max_tokens")
        # max_tokens 0 runs one token that the response leaves out: the prompt's logprobs come with it
        params = self._params(1 if self.max_tokens == 0 else self.max_tokens, self.logprobs, default_max, defaults)
        if self.echo and self.logprobs is not None and isinstance(params, SamplingParams):
            params.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        return params


class TextPart(BaseModel):
    """An OpenAI content part; only text is supported."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text"]
    text: str


# OpenAI's content parts that carry media rather than text (Chat Completions' and the Responses API's)
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file",
                          "input_file"})


def reject_media_parts(data: Any, param: str) -> Any:
    """A message's media part named as such (a 400 on `param`), rather than failing validation as "not text"."""
    parts = data.get("content") if isinstance(data, dict) else None
    for part in parts if isinstance(parts, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise APIError(400, f"'{kind}' content parts are not supported: servelm takes text (a multimodal "
                           "model is served by its language model alone)", param, "unsupported_parameter")
    return data


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    content: str | list[TextPart]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return reject_media_parts(data, "messages")

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: Text
    arguments: str  # JSON text, as the model wrote it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None  # only the assistant may leave it out (OpenAI: with tool calls)
    tool_calls: list[AssistantToolCall] | None = None


ROLES = ("system", "developer", "user", "tool", "assistant")
ChatMessage = Annotated[SystemMessage | DeveloperMessage | UserMessage | ToolMessage | AssistantMessage,
                        Field(discriminator="role")]
Messages = Annotated[list[ChatMessage], Field(min_length=1)]


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionDef(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(_Body):
    """The tools a request offers and how it lets the model use them, in chat completions' shape (the Responses
    API converts its own to these): one validation and one grammar for both."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ToolFields:
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(400, f"tool_choice: no tool is named {self.tool_choice.function.name!r}",
                           "tool_choice.function.name")
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools offered), auto, required or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def forced_tool_schema(self) -> dict | None:
        """Under tool_choice required or a named function: the JSON schema the reply must follow (the
        function's arguments, or an array of {name, arguments} calls), each function's parameters checked."""
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return None

        def params_of(i: int, tool: Tool) -> dict:
            schema = tool.function.parameters or {"type": "object"}
            _schema_of(schema, f"tools.{i}.function.parameters")
            return schema
        if mode == "named":
            name = self.tool_choice.function.name
            return next(params_of(i, t) for i, t in enumerate(self.tools) if t.function.name == name)
        options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": t.function.name}, "arguments": params_of(i, t)}}
                   for i, t in enumerate(self.tools)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema


# What a request's chat_template_kwargs may not set: apply_chat_template's arguments, which the server and the
# request's own fields set (a template from the kwargs would skip --trust-request-chat-template). A RAG template's
# documents, and tools, may come from them.
_SET_BY_FIELDS = CHAT_TEMPLATE_ARGUMENTS - {"tools", "documents"}


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: Messages
    max_tokens: Length | None = None
    max_completion_tokens: Length | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # at most --max-logprobs
    add_generation_prompt: bool = True
    # vLLM's (transformers'): the last message, an assistant's, is left open for the reply to go on from it
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a Jinja template to render this request with, for a server started with --trust-request-chat-template
    chat_template: Text | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) added on top of what the chat template writes (which for
    # most models already holds them, hence the default)
    add_special_tokens: bool = False
    # vLLM's: the reply's content begins with the last message's when the reply continues it (same role)
    echo: bool = False
    # vLLM's: documents for a RAG chat template (Granite's, Command R's), each a mapping of strings such as
    # {"title": ..., "text": ...}, passed to the template as `documents`
    documents: list[dict[str, str]] | None = None
    # vLLM's: under a reasoning parser, false leaves the reasoning out of the response
    include_reasoning: bool = True
    # OpenAI's: the chat template's reasoning_effort, for a model whose template reads it (400 for one that
    # does not: it would change nothing)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> ChatCompletionRequest:
        reserved = sorted(set(self.chat_template_kwargs or ()) & _SET_BY_FIELDS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server, or the "
                                "request's own fields, do (chat_template, add_generation_prompt, "
                                "continue_final_message)", "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (the reply "
                                "either goes on from the last message or starts a new one); set "
                                "add_generation_prompt to false", "continue_final_message")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """What apply_chat_template takes besides the messages and tools."""
        return {**(self.chat_template_kwargs or {}),
                **({"continue_final_message": True} if self.continue_final_message else {}),
                **({"chat_template": self.chat_template} if self.chat_template is not None else {}),
                **({"documents": self.documents} if self.documents is not None else {})}

    def structured(self) -> StructuredOutputsParams | None:
        forced = self.forced_tool_schema()
        own = super().structured()
        if forced is None:
            return own
        if own is not None:
            raise APIError(400, "tool_choice required or a named function already sets the output's format; it "
                                "cannot be combined with response_format or guided_*", "tool_choice")
        return StructuredOutputsParams(json=forced)

    def sampling_params(self, default_max: int, defaults: Mapping | None = None) -> SamplingParams | BeamSearchParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_completion_tokens or self.max_tokens, lp, default_max, defaults)


class _PooledTruncation(_Body):
    """vLLM's truncate_prompt_tokens on the embedding model's routes: each input keeps at most k tokens
    (-1: the model's longest input), with its special tokens; truncation_side "right" (vLLM's default for
    these models) keeps its first tokens, "left" its last ones."""

    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None

    @property
    def side(self) -> str:
        return self.truncation_side or "right"

    @model_validator(mode="after")
    def _truncation(self):
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be at least 1, or -1 for the model's longest input",
                           "truncate_prompt_tokens")
        return self


# An embedding input's token ids, as OpenAI's API takes them: the embedding model's vocabulary, which is not the
# generation model's, bounds them (checked in the embedding process), so /openapi.json gives them no range.
EmbedTokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]


class EmbeddingRequest(_PooledTruncation):

    input: Text | Texts | EmbedTokenIds | Annotated[list[EmbedTokenIds], Field(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # a Matryoshka model's vectors cut to this many values
    user: str | None = None


class TokenizeRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # one of the two, not null
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True



class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(json_schema_extra={"x-token-ids": True})]


class NativeGenerateRequest(_VllmSampling):
    model: str | None = None  # default: the server's default model
    prompt: Text
    max_tokens: Length = 128
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # unset: the model's default, else 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop_sequences: list[Text] | None = None
    stream: bool = False
    priority: Priority = None

    def completion(self, ids: list[int], max_model_len: int) -> CompletionRequest:
        """The same request as the OpenAI completions route takes, so that both validate and sample alike
        (HTTP and gRPC alike). Unset, max_tokens never asks for more than the context holds."""
        max_tokens = self.max_tokens
        if "max_tokens" not in self.model_fields_set:
            max_tokens = max(1, min(max_tokens, max_model_len - len(ids)))
        return CompletionRequest(prompt=ids, max_tokens=max_tokens, stop=self.stop_sequences,
                                 temperature=self.temperature, top_p=self.top_p,
                                 **{k: getattr(self, k) for k in _VllmSampling.model_fields})


class NativeChatRequest(NativeGenerateRequest):
    prompt: str | None = None
    messages: Messages



class ScoreRequest(_PooledTruncation):
    """vLLM's score API: each text_1 scored with its text_2 (one text_1 scores every text_2). A cross-encoder
    reads each pair together; an embedding model gives the cosine similarity of the two texts' vectors. vLLM's
    other spellings of the two sides, queries/documents, queries/items and data_1/data_2, are taken too."""

    model: str | None = None
    text_1: Text | Texts
    text_2: Text | Texts
    use_activation: bool | None = None  # vLLM's: false gives a cross-encoder's raw logit, not its sigmoid

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for side, names in (("text_1", ("queries", "data_1")), ("text_2", ("documents", "items", "data_2"))):
            for name in names:
                if name in data:
                    if side in data:
                        raise APIError(400, f"{name} and {side} name the same side of a score request; give one",
                                       name)
                    data[side] = data.pop(name)
        return data

    def pairs(self) -> tuple[list[str], list[str]]:
        """(the first side, the second): one text_1 stands for every pair."""
        one = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        two = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(one) != 1 and len(one) != len(two):
            raise APIError(400, f"text_1 has {len(one)} items and text_2 {len(two)}: give one text_1, or as many "
                                "as text_2", "text_1")
        return one, two


class RerankRequest(_PooledTruncation):
    """The rerank API of Jina, Cohere and vLLM: the documents by their relevance to the query (a cross-encoder's
    score of the pair, or the cosine similarity of their vectors), most relevant first."""

    model: str | None = None
    query: Text
    documents: Text | Texts
    top_n: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # 0: all of them
    return_documents: bool = True  # Cohere's: false leaves each result's document out
    use_activation: bool | None = None

    @property
    def docs(self) -> list[str]:
        return [self.documents] if isinstance(self.documents, str) else self.documents


class ClassifyRequest(_PooledTruncation):
    """vLLM's /classify: each input's label and per-label probabilities from a sequence classifier."""

    model: str | None = None
    input: Text | Texts
    user: str | None = None
    use_activation: bool | None = None  # false: the raw logits instead of the probabilities

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class NativeEmbeddingRequest(_Body):
    model: str | None = None  # default: the server's embedding model
    input: Text | Texts
