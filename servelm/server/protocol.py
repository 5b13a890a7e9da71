"""OpenAI-compatible request schemas (pydantic) and the error shape every failure uses."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.sampling_params import OutputKind, SamplingParams


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


# A priority class by name, or its index (0 high, 1 normal, 2 low; lower is served first, as in vLLM).
Priority = Literal["high", "normal", "low"] | Annotated[int, Field(ge=0, le=2)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions, with OpenAI's ranges plus vLLM's extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    priority: Priority = None
    # vLLM's field: requests share prefix-cache blocks only with requests of the same salt (and, under
    # --prefix-cache-isolation key, of the same API key)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    def _params(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, max_tokens=max_tokens or default_max, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=OutputKind.DELTA,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: score the prompt, generate nothing (what lm-evaluation-harness's loglikelihood sends)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None

    def sampling_params(self, default_max: int) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 is allowed only with echo, to score the prompt)")
        # max_tokens 0 runs one token that the response leaves out: the prompt's logprobs come with it
        params = self._params(1 if self.max_tokens == 0 else self.max_tokens, self.logprobs, default_max)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: only text is supported
            parts = []
            for p in self.content:
                if p.get("type") != "text":
                    raise APIError(400, f"content part type {p.get('type')!r} is not supported", "messages")
                parts.append(p.get("text", ""))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self, default_max: int) -> SamplingParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_completion_tokens or self.max_tokens, lp, default_max)


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class NativeGenerateRequest(BaseModel):
    prompt: str
    max_tokens: Annotated[int, Field(ge=1)] = 128
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stop_sequences: list[str] | None = None
    stream: bool = False
    priority: Priority = None


class NativeChatRequest(NativeGenerateRequest):
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class NativeEmbeddingRequest(BaseModel):
    input: str | list[str]
