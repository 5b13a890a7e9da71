"""Vectorized sampling over a batch of logits rows, each row with its own SamplingParams.

Order: logprobs of the raw distribution; logit_bias; min_tokens masking; repetition, frequency and presence
penalties; the grammar's mask (structured output, only in rows that have a grammar); then greedy argmax, or
temperature, top-k, top-p, min-p and a draw. Draws use the "exponential race" (argmax of p / Exp(1) noise), so
a seeded row only consumes its own generator and its result does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from servelm.engine.sequence import Sequence
from servelm.engine.step_outputs import SampleResult
from servelm.model import cpu_kernels


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """First argmax of each row; the C++ kernel on CPU (torch's reduction there is scalar and was 6% of a
    batch-64 step), torch elsewhere. Both return the first of tied maxima."""
    kernels = cpu_kernels.load() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
    return kernels.argmax_rows(x) if kernels is not None else x.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    @staticmethod
    def plain_greedy(seqs: list[Sequence]) -> bool:
        """True when every row is greedy with nothing to apply before its argmax and no logprobs."""
        for s in seqs:
            p = s.request.params
            if not p.greedy or p.logprobs is not None or p.logit_bias or p.needs_penalties \
                    or s.num_output_tokens < p.min_tokens or s.matcher is not None:
                return False
        return True

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], num_bare: int = 0
               ) -> tuple[list[int], list[SampleResult]]:
        """Tokens for each row: the first `num_bare` rows (which want no logprobs) as bare token ids, the rest
        as SampleResults. Logits on a GPU stay there for a plain greedy batch (only the chosen ids cross to the
        host); anything else runs here on the host (seeded generators, penalties, logprobs)."""
        if logits.device.type != "cpu":
            if self.plain_greedy(seqs):
                token_list = logits.argmax(dim=-1).tolist()
                return token_list[:num_bare], [SampleResult(t) for t in token_list[num_bare:]]
            logits = logits.cpu()
        params = [s.request.params for s in seqs]
        want_lp = [p.logprobs is not None for p in params]
        # logits arrive in the model's dtype: a greedy row takes its argmax there (widening to float32 is
        # exact, so the choice is the same), everything else widens first.
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(want_lp) else None
        logits = self._process(logits, seqs)
        grammar_rows = [r for r, s in enumerate(seqs) if s.matcher is not None]
        if grammar_rows:  # a batch without structured output never gets here
            from servelm.engine.structured import mask_logits

            logits = mask_logits(logits, seqs, grammar_rows)
        tokens = self._choose(logits, seqs)
        token_list = tokens.tolist()
        results = [SampleResult(t) for t in token_list[num_bare:]]
        if raw_logprobs is not None:
            self._attach_logprobs(raw_logprobs[num_bare:], tokens[num_bare:], params[num_bare:], results)
        return token_list[:num_bare], results

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows, cols, vals = [], [], []
        banned_rows, banned_cols = [], []
        penalty_rows = []
        for r, s in enumerate(seqs):
            p = s.request.params
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(r)
                cols.append(tok)
                vals.append(bias)
            if s.num_output_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p._eos_token_ids))
                banned_rows += [r] * len(stop_ids)
                banned_cols += list(stop_ids)
            if p.needs_penalties:
                penalty_rows.append(r)
        if not (rows or banned_rows or penalty_rows):
            return logits
        logits = logits.to(torch.float32, copy=True)
        if rows:
            logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals), accumulate=True)
        if banned_rows:
            logits[torch.tensor(banned_rows), torch.tensor(banned_cols)] = float("-inf")
        if penalty_rows:
            idx = torch.tensor(penalty_rows)
            logits[idx] = self._penalize(logits[idx], [seqs[r] for r in penalty_rows], vocab)
        return logits

    @staticmethod
    def _penalize(logits: torch.Tensor, seqs: list[Sequence], vocab: int) -> torch.Tensor:
        n = len(seqs)
        out_counts = torch.zeros(n, vocab + 1)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool)
        max_out = max(s.num_output_tokens for s in seqs)
        if max_out:
            ids = torch.full((n, max_out), vocab, dtype=torch.long)  # padding lands in the spare column
            for r, s in enumerate(seqs):
                out = s.output_token_ids
                ids[r, : len(out)] = torch.tensor(out, dtype=torch.long)
            out_counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        for r, s in enumerate(seqs):
            seen[r, torch.tensor(s.request.prompt_token_ids, dtype=torch.long)] = True
        out_counts, seen = out_counts[:, :vocab], (seen[:, :vocab] | (out_counts[:, :vocab] > 0))
        rep = torch.tensor([s.request.params.repetition_penalty for s in seqs])[:, None]
        freq = torch.tensor([s.request.params.frequency_penalty for s in seqs])[:, None]
        pres = torch.tensor([s.request.params.presence_penalty for s in seqs])[:, None]
        # Repetition penalty (transformers/CTRL style) over prompt and output tokens.
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        # OpenAI frequency/presence penalties over output tokens only.
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens = argmax_rows(logits)
        rand_rows = [r for r, s in enumerate(seqs) if not s.request.params.greedy]
        if not rand_rows:
            return tokens
        rr = torch.tensor(rand_rows)
        probs = self.probs(logits[rr], [seqs[r] for r in rand_rows])
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rand_rows) if seqs[r].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, r in enumerate(rand_rows):
            g = seqs[r].generator
            if g is not None:
                noise[i].exponential_(generator=g)
        tokens[rr] = argmax_rows(probs / noise)
        return tokens

    @staticmethod
    def probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each (processed) row of a sampled request draws from: temperature, top-k, top-p
        and min-p applied (min-p's survivors are left unnormalized; a draw does not need them normalized)."""
        ps = [s.request.params for s in seqs]
        x = logits.float() / torch.tensor([p.temperature for p in ps])[:, None]
        top_k = torch.tensor([p.effective_top_k for p in ps])
        top_p = torch.tensor([p.top_p for p in ps])
        if (top_k > 0).any() or (top_p < 1).any():
            x = _top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([p.min_p for p in ps])
        if (min_p > 0).any():
            thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
        return probs

    @staticmethod
    def _attach_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params, results: list[SampleResult]) -> None:
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        k_max = max((p.logprobs or 0) for p in params)
        top_v, top_i = raw.topk(k_max, dim=-1) if k_max else (None, None)
        for r, (p, res) in enumerate(zip(params, results, strict=True)):
            if p.logprobs is None:
                continue
            res.logprob = float(chosen[r])
            res.rank = int(ranks[r])
            k = p.logprobs
            res.top_logprobs = list(zip(top_i[r, :k].tolist(), top_v[r, :k].tolist(), strict=True)) if k else []


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


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); at least one token always survives."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)
