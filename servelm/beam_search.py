"""Beam search: vLLM's `LLM.beam_search` and the OpenAI routes' `use_beam_search`, run on top of the engine.

The engine knows nothing of beams. Each step of a search asks it for one token of every live beam, with the
top 2 x beam_width log-probabilities of the raw distribution; the beams of a prompt share their prompt and
earlier tokens through the prefix cache, so a step costs about one token per beam. From the candidates (every
beam extended by each of its top tokens) the beam_width best by cumulative log-probability live on. A candidate
that ends in an end-of-sequence token is complete and leaves the beam. After max_tokens steps, or once no beam
is left, the complete and live beams are ranked by score = cumulative logprob / length ** length_penalty, the
length counting the prompt and not a final end-of-sequence token (vLLM's rule), and the beam_width best are
the result.

`BeamSearch` is one prompt's search, whatever runs the steps: `LLM.beam_search` drives it over `LLMEngine`,
`beam_search_outputs` over any EngineClient's `generate`, each step's beams running at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from servelm.outputs import CompletionOutput, Logprob, RequestOutput
from servelm.sampling_params import OutputKind, SamplingParams

# A step asks for the top 2 x beam_width logprobs of each beam, within the engine's max_logprobs (20 by default).
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    """How to search (vLLM's `BeamSearchParams`). `temperature` 0 expands each beam by its top tokens only;
    above 0 each beam also draws one token at that temperature, which joins its candidates (vLLM's meaning)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the end-of-sequence token's text in a complete beam's text
    # servelm's: the alternatives each output position reports where the search answers a server request
    # (its logprobs field); None: none. The offline API's sequences always hold every candidate.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")

    @property
    def n(self) -> int:
        """The number of sequences it returns (what admission counts, as SamplingParams.n)."""
        return self.beam_width

    def step_params(self) -> SamplingParams:
        """One beam's request for one step: a token and the top 2 x beam_width logprobs, whatever the token
        (the search, not the engine, decides what an end-of-sequence token ends)."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and then the beam's own tokens (vLLM's convention); `logprobs` has
    one {token id: Logprob} per own token, the candidates it was chosen among. `text` is filled at the end."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"
    stop_reason: int | None = None  # the end-of-sequence token that completed it


@dataclass
class BeamSearchOutput:
    """A prompt's result: the beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """What ranks beams: cumulative logprob over length ** length_penalty (prompt included, a final
    end-of-sequence token not)."""
    length = len(seq.tokens) - (1 if seq.finish_reason == "stop" and seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: `beams` to expand, `advance` with each one's candidates, `result` at the end."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int]) -> None:
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """One step: `candidates[i]` holds beam i's next-token logprobs; keeps the best beam_width extensions."""
        if len(candidates) != len(self.beams):
            raise ValueError(f"{len(candidates)} candidate sets for {len(self.beams)} beams")
        extended = []
        for beam, top in zip(self.beams, candidates, strict=True):
            for token, lp in top.items():
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                if token in self.eos:
                    seq.finish_reason, seq.stop_reason = "stop", token
                    self.completed.append(seq)
                else:
                    extended.append(seq)
        # every live candidate has the same length, so this is the order of their scores too
        extended.sort(key=lambda s: s.cum_logprob, reverse=True)
        self.beams = extended[:self.params.beam_width]
        self.steps += 1

    def result(self) -> list[BeamSearchSequence]:
        """The beam_width best of the complete and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.completed + self.beams, reverse=True,
                        key=lambda s: beam_score(s, self.eos, self.params.length_penalty))
        return ranked[:self.params.beam_width]

    def output_ids(self, seq: BeamSearchSequence) -> list[int]:
        """A sequence's own tokens (the end-of-sequence token included)."""
        return seq.tokens[self.prompt_len:]

    def text_ids(self, seq: BeamSearchSequence) -> list[int]:
        """The tokens its text shows: the end-of-sequence token only with include_stop_str_in_output."""
        ids = self.output_ids(seq)
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            ids = ids[:-1]
        return ids


def top_logprobs(output: RequestOutput) -> dict[int, Logprob]:
    """The next-token candidates of a beam's one-token request."""
    sample = output.outputs[0]
    if not sample.logprobs:
        raise RuntimeError(f"beam request {output.request_id} came back without logprobs")
    return sample.logprobs[0]


def request_output(search: BeamSearch, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   decode: Callable[[list[int]], str], logprobs: int | None = None) -> RequestOutput:
    """The search's result as one finished RequestOutput, one sample per beam (what the server answers).
    `logprobs`: keep each position's chosen token and its top `logprobs` candidates (None: none)."""
    samples = []
    for i, seq in enumerate(search.result()):
        ids = search.output_ids(seq)
        lps = None
        if logprobs is not None:
            lps = [{t: lp for t, lp in top.items() if t == tok or (lp.rank is not None and lp.rank <= logprobs)}
                   for tok, top in zip(ids, seq.logprobs, strict=True)]
        samples.append(CompletionOutput(i, decode(search.text_ids(seq)), ids, seq.cum_logprob, lps,
                                        seq.finish_reason, seq.stop_reason))
    return RequestOutput(request_id, prompt, list(prompt_token_ids), samples, finished=True)


async def beam_search_outputs(generate: Callable[..., AsyncIterator[RequestOutput]], request_id: str,
                              prompt_token_ids: list[int], params: BeamSearchParams, prompt: str | None,
                              eos_token_ids: frozenset[int], decode: Callable[[list[int]], str],
                              logprobs: int | None = None) -> AsyncIterator[RequestOutput]:
    """Beam search over `generate(request_id, prompt_token_ids, params, prompt)` (an EngineClient's, its other
    arguments bound): one finished RequestOutput holding the beams. Each step's beams run at once; leaving
    early aborts the step's requests."""
    search = BeamSearch(prompt_token_ids, params, eos_token_ids)
    step_params = params.step_params()
    model_version = None

    async def one(rid: str, ids: list[int]) -> RequestOutput:
        nonlocal model_version
        gen = generate(rid, ids, step_params, None)
        last = None
        try:
            async for out in gen:
                last = out
        finally:  # cancelled with its step: closing the stream aborts the request in the engine
            with contextlib.suppress(Exception):
                await gen.aclose()
        if last is None or not last.finished:
            raise RuntimeError(f"beam request {rid} ended without an output")
        model_version = last.model_version or model_version
        return last

    while not search.done:
        tasks = [asyncio.ensure_future(one(f"{request_id}-beam{search.steps}.{i}", beam.tokens))
                 for i, beam in enumerate(search.beams)]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        search.advance([top_logprobs(o) for o in outs])
    out = request_output(search, request_id, prompt, prompt_token_ids, decode, logprobs)
    out.model_version = model_version
    yield out


def generate_outputs(client: Any, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams | BeamSearchParams, prompt: str | None, *args: Any,
                     **kwargs: Any) -> AsyncIterator[RequestOutput]:
    """`client.generate(...)` for sampling, the beam search over it for BeamSearchParams: what the server and
    the shadow mirror run a request with. `client` is an EngineClient with a `tokenizer` (a served model): the
    end-of-sequence ids come from what its engine reported when ready, else from the tokenizer."""
    if not isinstance(params, BeamSearchParams):
        return client.generate(request_id, prompt_token_ids, params, prompt, *args, **kwargs)
    tok = client.tokenizer
    eos = getattr(client.info, "eos_token_ids", None) or [tok.eos_token_id]
    return beam_search_outputs(lambda *a: client.generate(*a, *args, **kwargs), request_id,
                               prompt_token_ids, params, prompt, frozenset(t for t in eos if t is not None),
                               lambda ids: tok.decode(ids, skip_special_tokens=True), params.logprobs)
