"""Vectorized sampling over a batch of logits rows, each row with its own SamplingParams, on the logits' device:
only the chosen ids and the requested logprobs cross to the host.

Order: logit_bias; allowed_token_ids; bad words and min_tokens masking; repetition, frequency and presence
penalties; the grammar's mask (structured output, only in rows that have a grammar); then greedy argmax, or
temperature, top-k, top-p and min-p and a draw with one uniform number per row (`kept_weights`, `draw`). A
seeded row draws its number from its own generator, so its tokens do not depend on the rest of the batch.

Logprobs (the engine's logprobs_mode, as vLLM's): by default of the raw distribution, before any of that;
processed_* of the distribution the token was drawn from (a greedy row's: its processed logits, which no
temperature scales); *_logits the values before the softmax.
"""

from __future__ import annotations

import torch

from servelm.engine.sequence import Sequence
from servelm.engine.step_outputs import SampleResult
from servelm.model.kernels import cpu as cpu_kernels

_TINY = torch.finfo(torch.float32).tiny  # the smallest weight that stays: a weight of 0 never does


def _cpu_kernels(x: torch.Tensor):
    return cpu_kernels.load() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """First argmax of each row; the C++ kernel on CPU (torch's reduction there is scalar and was 6% of a
    batch-64 step), torch elsewhere. Both return the first of tied maxima."""
    kernels = _cpu_kernels(x)
    return kernels.argmax_rows(x) if kernels is not None else x.argmax(dim=-1)


def kept_weights(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p, as weights e = exp((x - max) / T) (1 for
    the most likely token) with 0 where a token was dropped; unnormalized, which a draw does not need.

    Top-k keeps the weights at least the k-th largest; top-p the tokens for which the kept weight of strictly more
    likely tokens is below p times all kept weight (the smallest nucleus reaching p); min-p the weights at least
    min_p. Ties at a cut all stay, so the result does not depend on how a sort orders equal values. The C++ kernel
    (model/kernels/csrc/sample.cpp) computes the same cuts without sorting a whole row."""
    x = logits.float()
    vocab = x.shape[-1]
    e = torch.exp((x - x.max(dim=-1, keepdim=True).values) / temperature[:, None])
    lo = torch.full_like(e[:, :1], _TINY)
    cut_k = (top_k > 0) & (top_k < vocab)
    cut_p = top_p < 1
    if bool((cut_k | cut_p).any()):
        s = e.sort(dim=-1, descending=True).values
        kth = s.gather(1, (torch.where(cut_k, top_k, vocab) - 1)[:, None])
        lo = torch.where(cut_k[:, None], kth.clamp(min=_TINY), lo)
        s = torch.where(s >= lo, s, 0.0)
        before = s.cumsum(dim=-1) - s  # kept weight of the more likely tokens (the first of ties: strictly more)
        inside = (before < top_p[:, None] * s.sum(dim=-1, keepdim=True)).sum(dim=-1, keepdim=True).clamp(min=1)
        lo = torch.where(cut_p[:, None], torch.maximum(lo, s.gather(1, inside - 1)), lo)
    lo = torch.maximum(lo, min_p[:, None].to(lo.dtype))
    return torch.where(e >= lo, e, 0.0)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalized weights: the first, in vocabulary order, at which the running sum passes
    u times the row's total (u uniform in [0, 1))."""
    cum = weights.cumsum(dim=-1)
    tokens = (cum <= u[:, None].to(cum) * cum[:, -1:]).sum(dim=-1)
    past = tokens >= weights.shape[-1]  # rounding put the target at the very end: the last kept token
    if bool(past.any()):
        last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
        tokens = torch.where(past, last, tokens)
    return tokens


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `kept_weights`, drawn with u: the C++ kernel on CPU (a sort and a full-vocabulary
    draw per row cost more than a decode step there), torch elsewhere."""
    kernels = _cpu_kernels(logits)
    if kernels is not None:
        return kernels.sample_rows(logits, temperature, top_k, top_p, min_p, u)
    return draw(kept_weights(logits, temperature, top_k, top_p, min_p), u)


def _bad_word_ends(words: list[list[int]], output: list[int]) -> set[int]:
    """The tokens that would complete a bad word now: each word's last token, where the output ends with the
    tokens before it (a one-token word always)."""
    ends = set()
    for w in words:
        head = len(w) - 1
        if head == 0 or (len(output) >= head and output[-head:] == w[:-1]):
            ends.add(w[-1])
    return ends


class Sampler:
    def __init__(self, seed: int, logprobs_mode: str = "raw_logprobs") -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.processed_logprobs = logprobs_mode.startswith("processed")
        self.logprobs_as_logits = logprobs_mode.endswith("logits")

    @staticmethod
    def plain_greedy(seqs: list[Sequence]) -> bool:
        """True when every row is greedy with nothing to apply before its argmax and no logprobs."""
        for s in seqs:
            p = s.request.params
            if not p.greedy or p.logprobs is not None or p.logit_bias or p.reads_output \
                    or p.allowed_token_ids is not None or s.num_output_tokens < p.min_tokens or s.matcher is not None:
                return False
        return True

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, SampleResult]]:
        """A token for each row, and the SampleResult (with logprobs) of each row whose request asks for
        logprobs, by row. Everything runs where the logits are; the ids and logprobs come back in one copy each."""
        if self.plain_greedy(seqs):
            return argmax_rows(logits).tolist(), {}
        params = [s.request.params for s in seqs]
        lp_rows = [r for r, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return self._process_and_choose(logits, seqs).tolist(), {}
        # logits arrive in float32, or the model's dtype where its lm_head kernel stores no float32
        # (DecoderLM.logits): a greedy row takes its argmax as they are (widening to float32 is exact, so the
        # choice is the same), everything else widens first.
        lp_idx = torch.tensor(lp_rows, device=logits.device) if len(lp_rows) < len(seqs) else None

        def lp_part(x: torch.Tensor) -> torch.Tensor:
            return x if lp_idx is None else x[lp_idx]

        lp_seqs = [seqs[r] for r in lp_rows]
        if not self.processed_logprobs:  # taken before the grammar's mask, which may write into the logits
            values = self.logprob_values(lp_part(logits), lp_seqs)
        processed = self._processed(logits, seqs)
        if self.processed_logprobs:
            values = self.logprob_values(lp_part(processed), lp_seqs)
        tokens = self._choose(processed, seqs)
        token_list = tokens.tolist()
        results = [SampleResult(token_list[r]) for r in lp_rows]
        self._attach_logprobs(values, lp_part(tokens), [params[r] for r in lp_rows], results)
        return token_list, dict(zip(lp_rows, results, strict=True))

    def logprob_values(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The values each row's logprobs report (logprobs_mode), in a tensor of their own: a log-softmax, or
        logits, of the raw rows, or of the distribution each row's token is drawn from. `logits`: the raw rows,
        or in a processed mode the rows after `_processed`."""
        x = self._drawn_from(logits, seqs) if self.processed_logprobs else logits.float()
        return x.clone() if self.logprobs_as_logits else torch.log_softmax(x, dim=-1)

    def _drawn_from(self, processed: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits each row's token is drawn from: a sampled row's scaled by its temperature, with -inf where
        top-k, top-p or min-p drop a token (the tokens `kept_weights` keeps); a greedy row's as they are."""
        x = processed.float()
        rand_rows = [r for r, s in enumerate(seqs) if not s.request.params.greedy]
        if not rand_rows:
            return x
        x = x.clone()  # never write into the logits the model produced
        idx = torch.tensor(rand_rows, device=x.device)
        temperature, top_k, top_p, min_p = self._filters([seqs[r] for r in rand_rows], x.device)
        kept = kept_weights(x[idx], temperature, top_k, top_p, min_p) > 0
        x[idx] = torch.where(kept, x[idx] / temperature[:, None], float("-inf"))
        return x

    @torch.inference_mode()
    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A token for each row, where the logits are (no copy to the host, no wait): for rows whose requests
        want no logprobs."""
        if self.plain_greedy(seqs):
            return argmax_rows(logits)
        return self._process_and_choose(logits, seqs)

    def _process_and_choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logit bias, min_tokens, penalties and the grammar's mask, then a token for each row (greedy or drawn)."""
        return self._choose(self._processed(logits, seqs), seqs)

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits after logit bias, allowed tokens, bad words, min_tokens, penalties and the grammar's mask:
        the same tensor where nothing applies."""
        logits = self._process(logits, seqs)
        grammar_rows = [r for r, s in enumerate(seqs) if s.matcher is not None and not s.grammar_after]
        if grammar_rows:  # a batch without structured output never gets here
            from servelm.engine.structured import mask_logits

            logits = mask_logits(logits, seqs, grammar_rows)
        return logits

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows, cols, vals = [], [], []
        banned_rows, banned_cols = [], []
        allowed_rows, allowed_cols = [], []
        penalty_rows = []
        for r, s in enumerate(seqs):
            p = s.request.params
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(r)
                cols.append(tok)
                vals.append(bias)
            banned = _bad_word_ends(p._bad_words_token_ids, s.output_token_ids) if p._bad_words_token_ids else None
            if s.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p._eos_token_ids))
                banned = stops if banned is None else banned | stops
            if banned:
                banned_rows += [r] * len(banned)
                banned_cols += list(banned)
            if p.allowed_token_ids is not None:
                allowed_rows += [r] * len(p.allowed_token_ids)
                allowed_cols += p.allowed_token_ids
            if p.needs_penalties:
                penalty_rows.append(r)
        if not (rows or banned_rows or allowed_rows or penalty_rows):
            return logits
        dev = logits.device
        logits = logits.to(torch.float32, copy=True)
        if rows:
            logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                              torch.tensor(vals, device=dev), accumulate=True)
        if allowed_rows:  # the rows that list their tokens keep only those; the other rows keep all
            keep = torch.ones_like(logits, dtype=torch.bool)
            keep[torch.tensor(sorted(set(allowed_rows)), device=dev)] = False
            keep[torch.tensor(allowed_rows, device=dev), torch.tensor(allowed_cols, device=dev)] = True
            logits.masked_fill_(~keep, float("-inf"))
        if banned_rows:
            logits[torch.tensor(banned_rows, device=dev), torch.tensor(banned_cols, device=dev)] = float("-inf")
        if penalty_rows:
            idx = torch.tensor(penalty_rows, device=dev)
            logits[idx] = self._penalize(logits[idx], [seqs[r] for r in penalty_rows])
        return logits

    @staticmethod
    def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Repetition penalty (transformers/CTRL style) over prompt and output tokens; OpenAI frequency and
        presence penalties over output tokens. The token ids of all rows travel as one ragged array."""
        n, vocab = logits.shape
        dev = logits.device
        outs = [s.output_token_ids for s in seqs]
        prompts = [s.request.prompt_token_ids for s in seqs]
        out_counts = torch.zeros(n, vocab, device=dev)
        if any(outs):
            ids = torch.tensor([t for o in outs for t in o], dtype=torch.long, device=dev)
            owner = torch.repeat_interleave(torch.arange(n), torch.tensor([len(o) for o in outs])).to(dev)
            out_counts.index_put_((owner, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        seen = out_counts > 0
        ids = torch.tensor([t for pr in prompts for t in pr], dtype=torch.long, device=dev)
        owner = torch.repeat_interleave(torch.arange(n), torch.tensor([len(pr) for pr in prompts])).to(dev)
        seen[owner, ids] = True
        ps = [s.request.params for s in seqs]
        rep, freq, pres = (torch.tensor([getattr(p, f) for p in ps], device=dev)[:, None]
                           for f in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rand_rows = [r for r, s in enumerate(seqs) if not s.request.params.greedy]
        if not rand_rows:
            return argmax_rows(logits)
        rand_seqs = [seqs[r] for r in rand_rows]
        temperature, top_k, top_p, min_p = self._filters(rand_seqs, logits.device)
        u = self._uniforms(rand_seqs).to(logits.device)
        if len(rand_rows) == len(seqs):
            return sample_rows(logits, temperature, top_k, top_p, min_p, u)
        tokens = argmax_rows(logits)
        rr = torch.tensor(rand_rows, device=logits.device)
        tokens[rr] = sample_rows(logits[rr], temperature, top_k, top_p, min_p, u)
        return tokens

    @staticmethod
    def _filters(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Each row's temperature, top-k (0: off), top-p and min-p as tensors on `device`."""
        ps = [s.request.params for s in seqs]
        return (torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device),
                torch.tensor([p.effective_top_k for p in ps], dtype=torch.int64, device=device),
                torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device),
                torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device))

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform number per row: from the row's own generator when its request has a seed."""
        u = torch.rand(len(seqs), generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand((), generator=s.generator)
        return u

    def weights(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each (processed) row of a sampled request draws from, as `kept_weights`."""
        return kept_weights(logits, *self._filters(seqs, logits.device))

    @staticmethod
    def _attach_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params, results: list[SampleResult]) -> None:
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        k_max = max((p.logprobs or 0) for p in params)
        top_v, top_i = raw.topk(k_max, dim=-1) if k_max else (raw[:, :0], tokens[:, None][:, :0])
        chosen, ranks, top_v, top_i = chosen.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
        for r, (p, res) in enumerate(zip(params, results, strict=True)):
            if p.logprobs is None:
                continue
            res.logprob = chosen[r]
            res.rank = ranks[r]
            k = p.logprobs
            res.top_logprobs = list(zip(top_i[r][:k], top_v[r][:k], strict=True))


def prompt_logprob_results(logits: torch.Tensor, targets: list[int], k: int) -> list[SampleResult]:
    """Each row's log-probability of its target token under the raw distribution, its rank and the top k."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long, device=raw.device)
    chosen = raw.gather(1, tgt[:, None]).squeeze(1)
    ranks = ((raw > chosen[:, None]).sum(dim=-1) + 1).tolist()
    top_v, top_i = raw.topk(k, dim=-1) if k else (None, None)
    tops = list(zip(top_i.tolist(), top_v.tolist(), strict=True)) if k else None
    return [SampleResult(t, lp, r, list(zip(*tops[i], strict=True)) if k else [])
            for i, (t, lp, r) in enumerate(zip(targets, chosen.tolist(), ranks, strict=True))]
