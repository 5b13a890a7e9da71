"""Results handed to users: `RequestOutput` holding one `CompletionOutput` per sample; for encoder models
(`LLM.embed`, `LLM.score`, `LLM.classify`), vLLM's pooling outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one position, with its rank in the distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (as vLLM)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    model_version: str | None = None  # "name:version" of the deployment version that served it (servelm serve)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # L2-normalised

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's sigmoid, or the cosine similarity of two embeddings


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label, in the model's label order (id2label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's tokens as the model read them (an embedding model: both texts')
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
