"""The output processor: a request that wants only its final text is detokenized once, when it finishes, and
gets exactly what token-by-token detokenization gives."""

from __future__ import annotations

import dataclasses
import random

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.output_processor import OutputProcessor
from servelm.engine.step_outputs import DecodeOutputs, SampleResult, SeqOutput
from servelm.sampling_params import OutputKind, SamplingParams


def _run(tokenizer, params: SamplingParams, samples: list[list[int]]):
    """Feeds each sample's tokens one step at a time (sample 0 through the decode columns, the rest as
    SeqOutputs with logprobs), the last step finishing them; returns every RequestOutput reported."""
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2, 3], params)
    reported = []
    steps = max(len(s) for s in samples)
    for k in range(steps):
        outs, cols = [], DecodeOutputs([], [])
        for i, toks in enumerate(samples):
            if k >= len(toks):
                continue
            done = "length" if k == len(toks) - 1 else None
            if i == 0 and done is None and params.logprobs is None:
                cols.request_ids.append("r")
                cols.token_ids.append(toks[k])
            else:
                lp = [SampleResult(toks[k], -0.5, 1, [])] if params.logprobs is not None else []
                outs.append(SeqOutput("r", i, [toks[k]], lp, done))
        got, _ = proc.process(outs, cols)
        reported += got
    return reported


def test_a_final_only_request_gets_the_text_of_token_by_token_decoding(tokenizer, monkeypatch):
    rng = random.Random(3)
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    text_ids = tokenizer("Héllo wörld 🙂 — naïve café", add_special_tokens=False).input_ids
    samples = [text_ids, [rng.randrange(vocab) for _ in range(40)], [rng.randrange(300) for _ in range(33)]]
    calls = []
    real = IncrementalDetokenizer.add_token
    monkeypatch.setattr(IncrementalDetokenizer, "add_token",
                        lambda self, t, check_stop: calls.append(t) or real(self, t, check_stop))
    for logprobs in (None, 0):
        base = SamplingParams(n=3, temperature=1.0, max_tokens=64, logprobs=logprobs)
        calls.clear()
        final = _run(tokenizer, dataclasses.replace(base, output_kind=OutputKind.FINAL_ONLY), samples)
        deferred_calls = len(calls)
        cumulative = _run(tokenizer, dataclasses.replace(base, output_kind=OutputKind.CUMULATIVE), samples)
        assert len(final) == 1 and final[0].finished  # reported once, when it finished
        for got, exp in zip(final[0].outputs, cumulative[-1].outputs, strict=True):
            assert got.text == exp.text and got.token_ids == exp.token_ids
            assert got.finish_reason == exp.finish_reason == "length"
            assert got.logprobs == exp.logprobs and got.cumulative_logprob == exp.cumulative_logprob
        # decoded at the end: only each sample's last few tokens one at a time, not all of them
        assert deferred_calls <= 3 * 8 < sum(map(len, samples))


def test_stop_strings_keep_token_by_token_decoding(tokenizer):
    """A final-only request with a stop string is still cut at it (its tokens are looked at as they come)."""
    ids = tokenizer("one two three four five", add_special_tokens=False).input_ids
    out = _run(tokenizer, SamplingParams(max_tokens=64, stop=["three"], output_kind=OutputKind.FINAL_ONLY), [ids])
    assert out[-1].finished and out[-1].outputs[0].text == "one two "
    assert out[-1].outputs[0].finish_reason == "stop" and out[-1].outputs[0].stop_reason == "three"


def test_an_aborted_final_only_request_reports_its_text(tokenizer):
    ids = tokenizer("partial answer here", add_special_tokens=False).input_ids
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=64, output_kind=OutputKind.FINAL_ONLY))
    for t in ids:
        assert proc.process([], DecodeOutputs(["r"], [t]))[0] == []  # nothing until it ends
    out = proc.abort("r")
    assert out.outputs[0].text == "partial answer here" and out.outputs[0].finish_reason == "abort"
