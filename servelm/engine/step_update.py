"""What a step's results change in its sequences: the one place a request changes after a forward pass.

`update_from_output(scheduler_output, runner_output)` takes what `ModelRunner.execute` returned for what
`schedule` chose: prompt logprobs into their requests, computed tokens and prefix-cache commits, forks of n > 1
samples, verified drafts kept or rolled back, the sampled tokens appended up to a stop (which finishes the
sample), and what each sample gained. It works on the running batch's columns (engine/input_batch.py): every
row advances with a few vector operations and one append per row, and only the rows with more to report than
their token (a possible stop, a first token, logprobs, a fork, a verification) take the full check, `_append`:
the step's output is the columns as one DecodeOutputs plus those rows' SeqOutputs.

`StepUpdate` is a part of `Scheduler` (engine/scheduler.py), which holds the state it reads: `kv`, `batch`, and
what EngineCore gives it: `spec` (the speculative decoder, or None), `max_model_len`, `unforked` (n > 1 requests
not yet forked) and `on_request_finished` (called once every sample of a request has finished).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

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
        returns what each sample gained: the rows with nothing to report but their token as DecodeOutputs
        columns, the rest as SeqOutputs. `now`: when the step's forward ended (time of first tokens).

        Every row computed its tokens; a row that samples took one token (ran.tokens, in row order). The
        columns advance for all of them at once; a row whose token may end its sample, or that has more to
        report (logprobs, a first token, a fork, a verification), then takes the full check (_append)."""
        if now is None:
            now = time.monotonic()
        for req, first, lps in ran.prompt_logprobs:
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            req.prompt_logprobs[first:first + len(lps)] = lps  # a recomputed chunk overwrites, never appends
        sampling, full = self._advance_rows(out, ran)
        decodes = self._append_tokens(out, sampling, ran.tokens, full)
        outputs: list[SeqOutput] = []
        if full:
            token_of = dict(zip(sampling, ran.tokens, strict=True))
            for r in sorted(full):  # last: a finished sample leaves the batch, which moves another row
                self._full_update(out, r, token_of[r], ran, now, outputs)
        return outputs, decodes

    def _advance_rows(self, out, ran: RunnerOutput) -> tuple[range | list[int], set[int]]:
        """The batch's columns for every row of the step: tokens computed, the sampled token appended. Returns
        the step rows that sample, and those of them that take the full check (a token that may end the sample,
        or more to report than the token). Also counts the prompt tokens computed."""
        batch, rows, sampled = out.batch, out.rows, out.sampled
        every = out.all_sampled
        sampling = range(len(rows)) if every else sampled.nonzero()[0].tolist()
        whole = every and len(rows) == len(batch)  # rows 0..n-1: slices instead of gathers
        one_each = out.num_batched_tokens == len(rows)
        check = batch.advance(slice(0, len(rows)) if whole else rows[sampling],
                              np.asarray(ran.tokens, dtype=np.int64), one_each)
        # a step of every row's last token leaves every row one to compute (until a row joins or is re-synced)
        batch.steady = whole and one_each
        if not every:  # partial prompt chunks: their tokens computed, nothing sampled
            chunk = (~sampled).nonzero()[0]
            batch.pos[rows[chunk]] += out.num_tokens[chunk]
        if out.prompt_rows:
            in_prompt = np.maximum(batch.prompt_len[rows] - out.start, 0)
            self.prompt_tokens += int(np.minimum(out.num_tokens, in_prompt).sum())
        full = {sampling[k] for k in check.nonzero()[0].tolist()}
        if ran.logprobs or out.drafts or out.forks:
            full |= ran.logprobs.keys() | out.drafts.keys() | out.forks.keys()
        return sampling, full

    def _append_tokens(self, out, sampling: range | list[int], tokens: list[int], full: set[int]) -> DecodeOutputs:
        """The sequences of the rows that do not take the full check: their computed tokens, their sampled token
        appended (then reported as columns); a partial prompt chunk's computed tokens and the prompt blocks it
        filled. The usual decode step is a loop of two statements a row."""
        seqs = out.seqs
        if not full and out.num_batched_tokens == len(seqs) == len(sampling):  # one token a row, sampled: decodes
            for seq, tok in zip(seqs, tokens, strict=True):
                seq.num_computed_tokens += 1
                seq.token_ids.append(tok)
            whole = len(seqs) == len(out.batch)
            rids = out.batch.request_ids[:len(seqs)] if whole else [s.request.request_id for s in seqs]
            self.generation_tokens += len(tokens)
            toks = tokens
        else:
            counts = out.num_tokens.tolist()
            rids, toks = [], []
            for r, tok in zip(sampling, tokens, strict=True):
                if r in full:
                    continue
                seq = seqs[r]
                seq.num_computed_tokens += counts[r]
                seq.token_ids.append(tok)
                rids.append(seq.request.request_id)
                toks.append(tok)
            self.generation_tokens += len(toks)
            for r in (~out.sampled).nonzero()[0].tolist():
                seqs[r].num_computed_tokens += counts[r]
        commit = self.kv.commit_computed
        for r in out.prompt_rows:
            if r not in full:  # (the full path commits its rows once their computed count is up to date)
                commit(seqs[r])  # the prompt's blocks that filled
        return DecodeOutputs(rids, toks)

    def _full_update(self, out, r: int, tok: int, ran: RunnerOutput, now: float, outputs: list[SeqOutput]) -> None:
        """Row r of the step, a row that samples, through the general path: its computed tokens and prompt
        blocks, then a verification's accepted drafts, a fork's new samples, or its one token, up to a stop."""
        seq = out.seqs[r]
        if r in out.drafts:
            outputs.append(self._apply_verification(seq, ran.verified[r], now))
            return
        seq.num_computed_tokens += int(out.num_tokens[r])
        self.kv.commit_computed(seq)  # the prompt's blocks this row filled, if any
        forks = out.forks.get(r)
        if not forks:
            outputs.append(self._append(seq, [ran.logprobs.get(r) or SampleResult(tok)], now))
            if seq.batch_row >= 0:
                self.batch.first_token_done(seq)
            return
        req = seq.request
        for child in forks:  # fork n > 1 siblings onto the parent's blocks
            child.num_computed_tokens = seq.num_computed_tokens
            child.num_cached_tokens, child.first_scheduled = seq.num_cached_tokens, seq.first_scheduled
            self.kv.fork(seq, child)
            req.seqs.append(child)
            self.add_running(child)
        req.forked = True
        self.unforked.discard(req.request_id)
        for q, res in zip([seq, *forks], ran.forked[r], strict=True):
            outputs.append(self._append(q, [res], now))
            if q.batch_row >= 0:
                self.batch.sync(q)
                self.batch.first_token_done(q)

    def _apply_verification(self, seq: Sequence, res: list[SampleResult], now: float) -> SeqOutput:
        """The accepted drafts' KV stays (with the verified token's), the rejected drafts' slots are given
        back, and the accepted drafts and the token after them are appended (up to a stop)."""
        accepted = len(res) - 1
        seq.num_computed_tokens += 1 + accepted
        self.kv.roll_back(seq)
        self.spec.record(seq, len(seq.spec_token_ids), accepted)
        out = self._append(seq, res, now)
        if not seq.finished:
            self.kv.commit_computed(seq)
            self.batch.sync(seq)
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
                if not seq.grammar_after:
                    reason = self._advance_grammar(seq, tok) or reason
                elif n_out >= len(seq.grammar_after) and tuple(tokens[-len(seq.grammar_after):]) == seq.grammar_after:
                    seq.grammar_after = ()  # the reasoning has ended: the grammar holds from the next token
            if reason is not None:
                emitted = results[:k + 1]  # the tokens after a stop are dropped
                break
        self.generation_tokens += len(emitted)
        if seq.first_token_time is None:
            seq.first_token_time = now
        first = len(tokens) - num_prompt == len(emitted)
        queue_time = seq.first_scheduled - req.arrival_time if first and seq.first_scheduled is not None else None
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
