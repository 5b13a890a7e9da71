"""Ollama's request bodies (/api/generate, /api/chat, /api/embed, /api/show) and their `options`.

Ollama's own server ignores top-level fields it does not know, and so do these models, so that clients of newer
Ollama versions keep working. Fields whose meaning servelm does not implement (images, custom templates,
thinking, ...) are refused with 400 when they ask for something, rather than silently ignored. `format` (JSON
output) and `tools` take the OpenAI routes' paths: the same grammars and the same tool-call parsers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servelm.config import generation
from servelm.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import INT32_MAX, APIError
from servelm.server.openai.reasoning import active, effort_kwargs

# Options that set up a model's runtime in Ollama (context size, threads, GPU layers, memory mapping): servelm's
# engine is configured at start, so a request's values change nothing and are accepted without effect.
RUNTIME_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                             "vocab_only", "use_mmap", "use_mlock", "num_thread", "numa", "num_keep",
                             "repeat_last_n", "penalize_newline"})
# Sampling options servelm does not implement, each with the value that changes nothing (accepted); others: 400.
NEUTRAL_OPTIONS: dict[str, tuple] = {"mirostat": (0,), "mirostat_tau": (5.0,), "mirostat_eta": (0.1,),
                                     "tfs_z": (1.0,), "typical_p": (1.0,)}


# servelm's sampling field -> the Ollama option that sets it, where the names differ
OPTION_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


class Options(BaseModel):
    """The sampling part of Ollama's `options`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    stop: list[Annotated[str, Field(min_length=1)]] | Annotated[str, Field(min_length=1)] | None = None
    # -1: until the model stops (or the context is full), -2: fill the context (both: servelm's default)
    num_predict: Annotated[int, Field(ge=-2, le=INT32_MAX)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> Options:
        raw = dict(raw or {})
        for name in list(raw):
            if name in RUNTIME_OPTIONS:
                del raw[name]
            elif name in NEUTRAL_OPTIONS:
                if raw[name] not in NEUTRAL_OPTIONS[name]:
                    raise APIError(400, f"option {name!r} is not supported by this server", f"options.{name}",
                                   "unsupported_parameter")
                del raw[name]
        return validate(cls, raw, "options.")

    def sampling_params(self, default_max: int, defaults: Mapping | None = None) -> SamplingParams:
        """Ollama's defaults are the model's (its Modelfile's parameters); servelm's are the model's too, from its
        generation_config.json (--generation-config), else OpenAI's (temperature 1, no penalties)."""
        if self.num_predict == 0:
            raise APIError(400, "options.num_predict must be -1, -2 or at least 1", "options.num_predict")
        n = self.num_predict if self.num_predict and self.num_predict > 0 else None
        return SamplingParams(
            **generation.request_values(defaults, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                        min_p=self.min_p, repetition_penalty=self.repeat_penalty,
                                        presence_penalty=self.presence_penalty,
                                        frequency_penalty=self.frequency_penalty),
            seed=self.seed, stop=self.stop, max_tokens=n or generation.default_max_tokens(defaults, default_max),
            output_kind=OutputKind.DELTA)


KEEP_FOREVER_S = 10 * 365 * 86400.0  # a negative keep_alive: loaded until memory pressure evicts it
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | int | float | None) -> float | None:
    """Ollama's keep_alive in seconds: a number of seconds, or a Go duration ("5m", "1h30m", "0"); a negative
    one keeps the model loaded (KEEP_FOREVER_S); None where it is not given. A 400 naming keep_alive for any
    other value."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise APIError(400, "keep_alive must be a duration such as \"5m\" or a number of seconds", "keep_alive")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        parts = _DURATION_PART.findall(text)
        if re.fullmatch(r"\d+(\.\d+)?", text):  # a bare number: seconds
            seconds = float(text)
        elif parts and "".join(n + u for n, u in parts) == text:
            seconds = sum(float(n) * _DURATION_UNIT[u] for n, u in parts)
        else:
            raise APIError(400, f"keep_alive {value!r} is not a duration such as \"5m\", \"1h30m\" or \"-1\"",
                           "keep_alive")
        seconds *= sign
    return KEEP_FOREVER_S if seconds < 0 else seconds


# Ollama's think levels (GPT-OSS's reasoning efforts); true and false are the other values
THINK_LEVELS = ("low", "medium", "high")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | int | float | None = None  # for a model loaded on demand: how long it stays loaded idle
    format: Any = None  # "json" or a JSON schema
    think: Any = None
    logprobs: bool = False  # each generated token's logprob, with its top_logprobs most likely alternatives
    top_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None

    def logprobs_k(self) -> int | None:
        """How many alternatives each generated token's logprob comes with; None: no logprobs."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar `format` asks for: any JSON object ("json"), or a JSON schema (400 if it is neither, or
        uses a keyword the grammar cannot enforce)."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return StructuredOutputsParams(json_object=True)
        if not isinstance(self.format, dict):
            raise APIError(400, f"format must be \"json\" or a JSON schema (an object), got "
                                f"{json.dumps(self.format)[:40]}", "format")
        return StructuredOutputsParams(json=p._schema_of(self.format, "format"))

    def refuse_unsupported(self) -> None:
        self.structured()

    def thinking(self, parser: str) -> str | None:
        """The reasoning parser the reply is split with (`parser`, the server's, unless think is false; None: the
        reply is all content). think true, or a level, on a server without one is a 400."""
        if self.think not in (None, True, False, *THINK_LEVELS):
            raise APIError(400, f"think must be true, false or a level ({', '.join(THINK_LEVELS)})", "think")
        if self.think not in (None, False) and parser == "none":
            raise APIError(400, "'think' needs a server started with --reasoning-parser (deepseek_r1, qwen3 or mistral)",
                           "think", "unsupported_parameter")
        return None if self.think is False else active(parser)

    def template_kwargs(self, tokenizer: Any) -> dict:
        """What think asks of the chat template: Qwen3's templates read enable_thinking (false: no reasoning);
        a level (GPT-OSS's "low", "medium", "high") is the template's reasoning_effort, for a template that reads
        it (else a 400)."""
        if self.think is None:
            return {}
        if isinstance(self.think, bool):
            return {"enable_thinking": self.think}
        return {"enable_thinking": True, **effort_kwargs(tokenizer, self.think, "think")}


class GenerateRequest(_Request):
    prompt: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    suffix: str | None = None
    images: list[str] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("suffix", "template"):
            if getattr(self, name):
                raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
        if self.images:
            raise APIError(400, "this model takes no images", "images", "unsupported_parameter")


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1)]
    arguments: dict[str, Any] | str = {}  # Ollama's are an object; JSON text is taken too


class ToolCall(BaseModel):
    """A call in an assistant message: `{"function": {"name": ..., "arguments": {...}}}`."""

    model_config = ConfigDict(extra="ignore")

    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool result's: the function that produced it

    def to_chat(self, index: int) -> p.ChatMessage:
        """The message as the OpenAI routes hold it (what the chat template renders)."""
        if self.role == "assistant":
            calls = [p.AssistantToolCall(id=f"call_{index}_{k}", function=p.CalledFunction(
                name=c.function.name, arguments=c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False))) for k, c in enumerate(self.tool_calls or [])]
            return p.AssistantMessage(role="assistant", content=self.content, tool_calls=calls or None)
        if self.role == "tool":
            return p.ToolMessage(role="tool", content=self.content, name=self.tool_name)
        return (p.SystemMessage if self.role == "system" else p.UserMessage)(role=self.role, content=self.content)


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: p.FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


class Tool(BaseModel):
    """A tool on offer, as OpenAI's: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: Function


class ChatRequest(_Request):
    messages: list[Message] = []
    tools: list[Tool] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for i, m in enumerate(self.messages):
            if m.images:
                raise APIError(400, "this model takes no images", f"messages.{i}.images", "unsupported_parameter")

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template, as the OpenAI route gives them (the model picks whether to call
        one: Ollama has no tool_choice)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None  # a Matryoshka model's vectors cut to this many values


class LegacyEmbeddingsRequest(BaseModel):
    """/api/embeddings, Ollama's older route: one `prompt`, one `embedding`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # older clients' field
    insecure: bool = False
    stream: bool = True


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # older clients' field
    verbose: bool = False


def validate(cls: type[BaseModel], data: Any, prefix: str = ""):
    """`cls` from a JSON value, a pydantic error becoming a 400 that names the field."""
    if not isinstance(data, dict):
        raise APIError(400, f"{prefix.rstrip('.') or 'the request body'} must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = prefix + ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            raise APIError(400, f"unknown option {param!r}", param, "unsupported_parameter") from None
        raise APIError(400, f"{param or 'body'}: {err.get('msg')}", param or None) from None
