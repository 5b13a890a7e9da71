"""What a step's results change in its sequences: the one place a request changes after a forward pass.

`update_from_output(scheduler_output, runner_output)` takes what `ModelRunner.execute` returned for what
`schedule` chose: prompt logprobs into their requests, computed tokens and prefix-cache commits, forks of n > 1
samples, verified drafts kept or rolled back, the sampled tokens appended up to a stop (which finishes the
sample), and what each sample gained as SeqOutputs. The decode batch's rows take a columnar path (a few vector
operations, then one append per row) and are reported as one DecodeOutputs.

`StepUpdate` is a part of `Scheduler` (engine/scheduler.py), which holds the state it reads: `kv`, `batch`, and
what EngineCore gives it: `spec` (the speculative decoder, or None), `max_model_len`, `unforked` (n > 1 requests
not yet forked) and `on_request_finished` (called once every sample of a request has finished).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from servelm.engine.sequence import Request, Sequence
from servelm.engine.step_outputs import DecodeOutputs, RunnerOutput, SampleResult, SeqOutput

logger = logging.getLogger("servelm.engine.core")  # where these messages were logged before they moved here


class StepUpdate:
    def _init_step_update(self) -> None:
        self.spec = None
        self.max_model_len = math.inf
        self.unforked: set[str] = set()
        self.on_request_finished: Callable[[Request], None] = lambda req: None
        self.prompt_tokens = 0  # prompt tokens computed (engine stats)
        self.generation_tokens = 0  # tokens sampled and kept (engine stats)

    def update_from_output(self, out, ran: RunnerOutput, now: float | None = None
                           ) -> tuple[list[SeqOutput], DecodeOutputs]:
        """Apply one step's results (`out`: what schedule() returned, `ran`: what the runner computed for it);
        returns what each sample gained, as SeqOutputs and, for the decode batch's rows, as columns. `now`:
        when the step's forward ended (time of first tokens)."""
        if now is None:
            now = time.monotonic()
        for req, first, lps in ran.prompt_logprobs:
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            req.prompt_logprobs[first:first + len(lps)] = lps  # a recomputed chunk overwrites, never appends
        outputs: list[SeqOutput] = []
        decodes = self._update_decodes(out, ran.decode_tokens, outputs, now) if out.decode_seqs else DecodeOutputs()
        self._update_from_output(out, ran.results, outputs, now)
        return outputs, decodes

    def _update_decodes(self, out, tokens: list[int], outputs: list[SeqOutput],
                        now: float) -> DecodeOutputs:
        """The decode batch's rows: arrays first, then each token appended; a row whose token may end its
        sample (its length or a stop token) takes the full check (_append), which may finish it."""
        seqs, batch = out.decode_seqs, out.batch
        n = len(seqs)
        check = batch.advance(n, tokens)
        if len(check):
            checked = set(check.tolist())
            rids, toks = [], []
            for i, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
                seq.num_computed_tokens += 1
                if i not in checked:
                    seq.token_ids.append(tok)
                    rids.append(batch.request_ids[i])
                    toks.append(tok)
        else:
            rids, toks = batch.request_ids[:n], tokens
            for seq, tok in zip(seqs, tokens, strict=True):
                seq.num_computed_tokens += 1
                seq.token_ids.append(tok)
        self.generation_tokens += len(toks)
        for i in check.tolist():  # last: a finished sample leaves the batch, which moves another row
            outputs.append(self._append(seqs[i], [SampleResult(tokens[i])], now))
        return DecodeOutputs(rids, toks)

    def _update_from_output(self, out, step_results: list[list[SampleResult]],
                            outputs: list[SeqOutput], now: float) -> None:
        """Every per-sequence change a step makes once its forward has run: computed tokens, prefix-cache
        commits, forks of n > 1 samples, the sampled tokens appended (up to a stop), and what each sample
        gained. A sample left decoding joins the decode batch, whose rows _update_decodes takes."""
        results = iter(step_results)
        kv, append = self.kv, self._append
        commit = kv.commit_computed
        batch = self.batch
        for s in out.scheduled:
            seq = s.seq
            if s.spec_token_ids:
                outputs.append(self._apply_verification(s, next(results), now))
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + s.num_tokens
            commit(seq)  # the prompt's blocks this row filled, if any
            req = seq.request
            if computed <= len(req.prompt_token_ids):
                self.prompt_tokens += s.num_tokens
            samples = s.sample_seqs
            if len(samples) == 1:
                outputs.append(append(seq, next(results), now))
                if req.batchable and batch is not None and batch.can_join(seq):
                    batch.add(seq)
                continue
            if len(samples) > 1:
                for child in samples[1:]:  # fork n>1 siblings onto the parent's blocks
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.num_cached_tokens, child.first_scheduled = seq.num_cached_tokens, seq.first_scheduled
                    kv.fork(seq, child)
                    req.seqs.append(child)
                    self.add_running(child)
                req.forked = True
                self.unforked.discard(req.request_id)
            for q in samples:
                outputs.append(append(q, next(results), now))

    def _apply_verification(self, s, res: list[SampleResult], now: float) -> SeqOutput:
        """The accepted drafts' KV stays (with the verified token's), the rejected drafts' slots are given
        back, and the accepted drafts and the token after them are appended (up to a stop)."""
        seq = s.seq
        accepted = len(res) - 1
        seq.num_computed_tokens += 1 + accepted
        self.kv.roll_back(seq)
        self.spec.record(seq, len(s.spec_token_ids), accepted)
        out = self._append(seq, res, now)
        if not seq.finished:
            self.kv.commit_computed(seq)
        return out

    def _append(self, seq: Sequence, results: list[SampleResult], now: float) -> SeqOutput:
        """Append new tokens one by one, stopping at the first that ends the sample (the rest are dropped)."""
        req = seq.request
        p = req.params
        tokens = seq.token_ids
        num_prompt = len(req.prompt_token_ids)  # seq.num_output_tokens is len(tokens) - num_prompt
        reason, stop_reason = None, None
        emitted = results
        for k, res in enumerate(results):
            tok = res.token_id
            tokens.append(tok)
            n_out = len(tokens) - num_prompt
            if n_out >= p.min_tokens and not p.ignore_eos and tok in p._eos_token_ids:
                reason = "stop"
            elif n_out >= p.min_tokens and tok in p.stop_token_ids:
                reason, stop_reason = "stop", tok
            elif (p.max_tokens is not None and n_out >= p.max_tokens) or len(tokens) >= self.max_model_len:
                reason = "length"
            if seq.matcher is not None and reason != "length":
                reason = self._advance_grammar(seq, tok) or reason
            if reason is not None:
                emitted = results[:k + 1]  # the tokens after a stop are dropped
                break
        self.generation_tokens += len(emitted)
        if seq.first_token_time is None:
            seq.first_token_time = now
        first = len(tokens) - num_prompt == len(emitted)
        queue_time = seq.first_scheduled - req.arrival_time if first else None
        out = SeqOutput(req.request_id, seq.index, [r.token_id for r in emitted],
                        emitted if emitted[0].logprob is not None else [],
                        reason, stop_reason, seq.num_cached_tokens, queue_time)
        # the whole prompt has run: report its logprobs once
        if p.prompt_logprobs is not None and seq.index == 0 and req.needs_prompt_logprobs:
            out.prompt_logprobs = req.prompt_logprobs or [None] * req.num_prompt_tokens
            req.prompt_logprobs, req.prompt_logprobs_done = None, True
        if reason is not None:
            self.finish(seq, reason, stop_reason)
            if req.finished:
                self.on_request_finished(req)
        return out

    @staticmethod
    def _advance_grammar(seq: Sequence, tok: int) -> str | None:
        """Feed the sampled token to the sample's grammar: "stop" once the grammar is complete (its stop token
        accepted), or if the token breaks it (only a banned stop token under min_tokens can: the mask allowed
        nothing else), else None."""
        if not seq.matcher.accept_token(tok):
            logger.warning("request %s: token %d does not fit its grammar; ending the sample",
                           seq.request.request_id, tok)
            return "stop"
        return "stop" if seq.matcher.is_terminated() else None
