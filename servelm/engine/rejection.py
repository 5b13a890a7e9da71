"""Verification of draft tokens (speculative decoding): which drafts the target model accepts, and the token
that follows them, so that every emitted token has exactly the target's distribution.

A verification row j holds the target's logits after the sequence's tokens and drafts[:j]. Drafts are point
masses (the n-gram lookup proposes one token; the draft model proposes its argmax), so the modified rejection
sampling rule reduces to: accept draft d with probability p(d); on the first rejection draw from p with d
removed, renormalized; when every draft is accepted draw a bonus token from the last row. Then
P(x) = p(d)[x = d] + (1 - p(d)) p(x)[x != d] / (1 - p(d)) = p(x). Greedy rows accept a draft iff it is the
argmax, which makes the output identical to decoding one token at a time.
"""

from __future__ import annotations

import torch

from servelm.engine.sampler import Sampler, draw
from servelm.engine.sequence import Sequence
from servelm.engine.step_outputs import SampleResult


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """Length of the prefix on which the drafts equal the target's tokens."""
    n = 0
    for d, t in zip(drafts, targets, strict=False):
        if d != t:
            break
        n += 1
    return n


def verify(sampler: Sampler, logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> list[SampleResult]:
    """The tokens one verification emits: the accepted drafts, then the target's own token (1..k+1 results).

    `logits` has len(drafts) + 1 rows. Only requests whose logits processing does not depend on the tokens
    generated so far are speculated (see SpecDecoder.eligible), so every row can be processed as `seq`.
    """
    rows = [seq] * len(logits)
    params = seq.request.params
    if params.greedy:  # the sampler's own choice per row: the same code path as a plain decode
        tokens, with_logprobs = sampler.sample(logits, rows)
        results = [with_logprobs.get(i) or SampleResult(t) for i, t in enumerate(tokens)]
        return results[:num_accepted(drafts, tokens) + 1]
    processed = sampler._process(logits, rows)  # (a copy where anything applies)
    values = None if params.logprobs is None else \
        sampler.logprob_values(processed if sampler.processed_logprobs else logits, rows)
    probs = sampler.weights(processed, rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    gen = seq.generator or sampler.generator
    p_drafts = probs[torch.arange(len(drafts), device=probs.device),
                     torch.tensor(drafts, dtype=torch.long, device=probs.device)].tolist()  # one copy to the host
    tokens: list[int] = []
    for j, d in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < p_drafts[j]:
            tokens.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        tokens.append(_draw(residual, gen))
        break
    else:
        tokens.append(_draw(probs[len(drafts)], gen))
    results = [SampleResult(t) for t in tokens]
    if values is not None:
        sampler._attach_logprobs(values[:len(tokens)], torch.tensor(tokens, device=values.device),
                                 [params] * len(tokens), results)
    return results


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from the (unnormalized) distribution p, drawn as the sampler draws (one uniform number)."""
    return int(draw(p[None], torch.rand(1, generator=gen).to(p.device))[0])
