"""Turns token-level `SeqOutput`s into user-facing `RequestOutput`s: text, stop strings, logprobs, n samples.

In the server this runs in the API process, so detokenization never slows the engine loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.step_outputs import DecodeOutputs, SeqOutput
from servelm.outputs import CompletionOutput, Logprob, RequestOutput
from servelm.sampling_params import OutputKind, SamplingParams


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0  # delta mode: what was already reported
    sent_tokens: int = 0
    reported_finish: bool = False
    # a request that wants only its final text and has no stop strings: its tokens are detokenized once, when
    # it finishes (one decode instead of one per token), or never under detokenize=False; `decoded` counts the
    # tokens already in the text
    deferred: bool = False
    decoded: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    samples: dict[int, _Sample] = field(default_factory=dict)
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    queue_time: float | None = None  # from the engine: arrival to first scheduled
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.states[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, time.monotonic())

    def abort(self, request_id: str) -> RequestOutput | None:
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        for i in range(st.params.n):
            s = st.samples.get(i) or self._new_sample(st, i)
            st.samples[i] = s
            s.finish_reason = s.finish_reason or "abort"
        return self._make_output(st, True)

    def _new_sample(self, st: _RequestState, index: int) -> _Sample:
        p = st.params
        detok = IncrementalDetokenizer(self.tokenizer, st.prompt_token_ids, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output)
        return _Sample(detok, logprobs=[] if p.logprobs is not None else None,
                       cumulative_logprob=0.0 if p.logprobs is not None else None,
                       deferred=(p.output_kind == OutputKind.FINAL_ONLY and not p.stop) or not p.detokenize)

    def _token_str(self, tok: int) -> str:
        text = self._token_text.get(tok)
        if text is None:
            text = self._token_text[tok] = self.tokenizer.decode([tok])
        return text

    def process(self, outputs: list[SeqOutput], decodes: DecodeOutputs | None = None
                ) -> tuple[list[RequestOutput], list[tuple[str, int, str]]]:
        """Returns the outputs to report, and the samples that hit a stop string (the engine must end them).
        `decodes` are the running batch's plain rows: one token each for sample 0, nothing else."""
        touched: dict[str, _RequestState] = {}
        stopped: list[tuple[str, int, str]] = []
        ended: set[str] = set()  # requests a sample of which ended this step: only they may have finished
        now = time.monotonic()
        take = self._take
        for o in outputs:
            if take(o.request_id, o.index, o.new_token_ids, o, touched, stopped, now):
                ended.add(o.request_id)
        if decodes is not None:
            for rid, tok in zip(decodes.request_ids, decodes.token_ids, strict=True):
                if take(rid, 0, (tok,), None, touched, stopped, now):
                    ended.add(rid)
        results = []
        for st in touched.values():
            finished = st.request_id in ended and st.finished
            if finished or st.params.output_kind != OutputKind.FINAL_ONLY:
                results.append(self._make_output(st, finished))
            if finished:
                del self.states[st.request_id]
        return results, stopped

    def _take(self, request_id: str, index: int, tokens, o: SeqOutput | None, touched: dict[str, _RequestState],
              stopped: list[tuple[str, int, str]], now: float) -> bool:
        """One sample's new tokens (and, with `o`, what else the engine reported for it); whether they ended
        it."""
        st = self.states.get(request_id)
        if st is None:
            return False
        s = st.samples.get(index)
        if s is None:
            s = st.samples[index] = self._new_sample(st, index)
        if s.finish_reason is not None:
            return False  # already ended by a stop string; tokens still in flight are dropped
        if o is not None:
            st.num_cached_tokens = o.num_cached_tokens
            if o.prompt_logprobs is not None:
                st.prompt_logprobs = [None if r is None else self._logprob_entry(r, st.params.detokenize)
                                      for r in o.prompt_logprobs]
            if st.queue_time is None and o.queue_time is not None:
                st.queue_time = o.queue_time
        st.first_token_time = st.first_token_time or now
        touched[request_id] = st
        if s.deferred:  # detokenized when it finishes (_make_output); no stop string to look for until then
            s.token_ids.extend(tokens)
            if s.logprobs is not None and o is not None:
                for res in o.new_logprobs[:len(tokens)]:
                    self._add_logprobs(s, res, st.params.detokenize)
            if o is not None and o.finish_reason is not None:
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
            return s.finish_reason is not None
        p = st.params
        for k, tok in enumerate(tokens):
            s.token_ids.append(tok)
            can_stop = len(s.token_ids) >= p.min_tokens
            hit = s.detok.add_token(tok, check_stop=can_stop)
            if s.logprobs is not None and o is not None and k < len(o.new_logprobs):
                self._add_logprobs(s, o.new_logprobs[k], True)
            if hit is not None:
                s.finish_reason, s.stop_reason = "stop", hit
                if o is None or o.finish_reason is None:
                    stopped.append((request_id, index, hit))
                break
        else:
            if o is not None and o.finish_reason is not None:
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
        return s.finish_reason is not None

    def _logprob_entry(self, res, decode: bool = True) -> dict[int, Logprob]:
        """The top alternatives and the token itself (which may be outside them), by token id; each token's text
        unless `decode` is False (detokenize=False: None)."""
        text = self._token_str if decode else (lambda tok: None)
        entry = {tok: Logprob(lp, rank=i + 1, decoded_token=text(tok))
                 for i, (tok, lp) in enumerate(res.top_logprobs or [])}
        entry[res.token_id] = Logprob(res.logprob, rank=res.rank, decoded_token=text(res.token_id))
        return entry

    def _add_logprobs(self, s: _Sample, res, decode: bool) -> None:
        s.logprobs.append(self._logprob_entry(res, decode))
        s.cumulative_logprob += res.logprob

    def _make_output(self, st: _RequestState, finished: bool) -> RequestOutput:
        """What to report for st now (`finished`: every sample has ended, or the request was aborted)."""
        kind = st.params.output_kind
        completions = []
        for i in sorted(st.samples):
            s = st.samples[i]
            if s.deferred and s.decoded < len(s.token_ids) and st.params.detokenize:
                s.detok.add_tokens(s.token_ids[s.decoded:])
                s.decoded = len(s.token_ids)
            done = s.finish_reason is not None
            end = s.detok.stream_safe_len(done)
            if kind == OutputKind.DELTA:
                text, tokens = s.detok.text[s.sent_text:end], s.token_ids[s.sent_tokens:]
                logprobs = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
                newly_done = done and not s.reported_finish
                if not (text or tokens or newly_done):
                    continue
                s.sent_text, s.sent_tokens, s.reported_finish = end, len(s.token_ids), done
            else:
                text, tokens, logprobs = s.detok.text[:end], list(s.token_ids), s.logprobs
            completions.append(CompletionOutput(i, text, tokens, s.cumulative_logprob, logprobs,
                                                s.finish_reason, s.stop_reason))
        metrics = {"arrival_time": st.arrival}
        if st.first_token_time is not None:
            metrics["first_token_time"] = st.first_token_time
        if st.queue_time is not None:
            metrics["queue_time"] = st.queue_time
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, completions, finished,
                             metrics, st.num_cached_tokens, st.prompt_logprobs)
