"""Sampling parameters of one request (mirrors vLLM's `SamplingParams`)."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


class OutputKind(enum.Enum):
    """What `LLMEngine.step()` reports for a request each step."""

    CUMULATIVE = "cumulative"  # the whole output so far
    DELTA = "delta"  # only what is new since the last report (streaming)
    FINAL_ONLY = "final_only"  # nothing until the request finishes (offline generate)


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one of
    fixed strings (`choice`) or a grammar (`grammar`: GBNF, the EBNF dialect of llama.cpp and xgrammar, or with
    the llguidance backend also Lark). The engine compiles it with its structured output backend (llguidance
    or xgrammar) and masks every token the grammar does not allow."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # as text (property order kept): equal schemas share one compiled grammar
            self.json = json.dumps(self.json, ensure_ascii=False)
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or json_object"
                             f" (got {', '.join(given) or 'none'})")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json is not None:
            if not isinstance(self.json, str):  # a boolean schema too: true constrains nothing, false allows nothing
                raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                                 f"{type(self.json).__name__}")
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(schema).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))

    def key(self) -> str:
        """A hash of the grammar: what the engine's cache of compiled grammars is keyed by."""
        spec = self.choice if self.kind == "choice" else getattr(self, self.kind)
        return hashlib.sha256(json.dumps([self.kind, spec]).encode()).hexdigest()


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The last k of a prompt's ids (k -1: the last max_model_len; None: all of them)."""
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


@dataclass
class SamplingParams:
    """How to sample a request's completion. Invalid values raise `ValueError` naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    # log-probabilities of the prompt's own tokens (the first has none), each with this many alternatives
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = OutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # only these tokens may be drawn (vLLM's allowed_token_ids): every other logit is -inf
    allowed_token_ids: list[int] | None = None
    # words that are never completed: a word's last token is banned wherever the output ends with the tokens
    # before it (vLLM's bad_words; each word as written and after a space, see tokenize_bad_words)
    bad_words: list[str] | None = None
    # keep only the prompt's last k tokens (vLLM's left truncation; -1: the last max_model_len)
    truncate_prompt_tokens: int | None = None
    # vLLM's: False leaves the outputs' text empty (token ids only, never decoded: a training loop's rollouts),
    # and logprobs' decoded_token None; stop strings need the text, so they need it True
    detokenize: bool = True
    # Filled by the engine from the model's generation config; not a user field.
    _eos_token_ids: frozenset[int] = field(default=frozenset(), repr=False)
    # bad_words as token sequences, filled where the tokenizer is (tokenize_bad_words); not a user field
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # structured output after a reasoning part: the grammar applies from the token after the output first ends
    # with these ids (the reasoning's end tag); empty: from the first token. Set by the server's reasoning parser.
    _grammar_after: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:  # the sampler holds it in an int64
            raise bad("top_k", "an integer in [0, 2**31) (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for up to the context length)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        # how many an engine gives is its --max-logprobs (check_logprobs)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "an integer >= 0 or None")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise bad("seed", "an integer in [-2**63, 2**64) (what a torch generator takes) or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are looked for in the text: they need detokenize=True (stop_token_ids "
                             "work without it)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "a non-empty list of non-negative token ids, or None")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "a list of words that are not empty or only spaces")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k == 0 or k < -1):
            raise bad("truncate_prompt_tokens", "at least 1, or -1 for the model's context length, or None")
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")

    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's ids as the request keeps them: its last truncate_prompt_tokens, when it asks."""
        return truncate_prompt(ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_output(self) -> bool:
        """Whether the logits processing reads the tokens generated so far (penalties, bad words): such a row
        cannot be sampled before the host has its previous token, nor verify drafts as one state."""
        return self.needs_penalties or bool(self._bad_words_token_ids)

    def tokenize_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Fill the bad words' token sequences with `encode` (text -> ids, no special tokens): each word as
        written (leading spaces dropped) and with one leading space, as it would follow another word."""
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(encode(text))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self._bad_words_token_ids = seqs

    def check_logprobs(self, cap: int) -> None:
        """At most `cap` logprobs and prompt_logprobs (the engine's max_logprobs, the vocabulary for -1)."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > cap:
                raise ValueError(f"{name}={k} is more than this model's max_logprobs ({cap}); a server started "
                                 "with a higher --max-logprobs gives more")

    def check_vocab(self, vocab_size: int) -> None:
        """Validate token ids against the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})")
