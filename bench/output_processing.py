#!/usr/bin/env python3
"""Host time of turning a batch's tokens into text (`OutputProcessor.process`), per token, for requests that want
only their final text (offline `LLM.generate`): detokenized once when they finish against detokenized token by
token as they come (what a request with stop strings still does). 256 requests of 128 tokens each, taken from
real text and from random ids, one step at a time through the running batch's decode columns, with SmolLM2's
tokenizer; both ways run alternately in one process. Prints one JSON object.

    python bench/output_processing.py
    python bench/output_processing.py --requests 64 --tokens 512 --repeats 5

A benchmark, not a test: CI does not run it (tests/engine/test_output_processor.py checks the texts agree).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from servelm.engine.output_processor import OutputProcessor
from servelm.engine.step_outputs import DecodeOutputs, SeqOutput
from servelm.model.loading.metadata import load_gguf_config_and_tokenizer
from servelm.model.loading.source import default_model_path
from servelm.sampling_params import OutputKind, SamplingParams


class TokenByToken(OutputProcessor):
    """The same processor with every sample detokenized as its tokens come."""

    def _new_sample(self, st, index):
        s = super()._new_sample(st, index)
        s.deferred = False
        return s


def run(proc_cls, tokenizer, streams: list[list[int]]) -> tuple[float, list[str]]:
    """Seconds in process() for every step, and each request's final text."""
    proc = proc_cls(tokenizer)
    params = SamplingParams(max_tokens=len(streams[0]), output_kind=OutputKind.FINAL_ONLY)
    for i in range(len(streams)):
        proc.add_request(f"r{i}", None, [1, 2, 3], params)
    rids = [f"r{i}" for i in range(len(streams))]
    texts: dict[str, str] = {}
    seconds = 0.0
    last = len(streams[0]) - 1
    for k in range(len(streams[0])):
        if k < last:
            outs, cols = [], DecodeOutputs(rids, [s[k] for s in streams])
        else:  # the last token ends every request
            outs, cols = [SeqOutput(r, 0, [s[k]], [], "length") for r, s in zip(rids, streams, strict=True)], None
        t = time.perf_counter()
        results, _ = proc.process(outs, cols)
        seconds += time.perf_counter() - t
        for r in results:
            texts[r.request_id] = r.outputs[0].text
    return seconds, [texts[r] for r in rids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    _, tokenizer = load_gguf_config_and_tokenizer(default_model_path())
    rng = random.Random(0)
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    prose = tokenizer(" ".join(["The quick brown fox jumps over the lazy dog, naïve café 🙂 日本語."] * 200),
                      add_special_tokens=False).input_ids
    streams = []
    for i in range(a.requests):
        if i % 2:
            streams.append([rng.randrange(vocab) for _ in range(a.tokens)])
        else:
            start = rng.randrange(len(prose) - a.tokens)
            streams.append(prose[start:start + a.tokens])
    per_token: dict[str, list[float]] = {"at_end": [], "token_by_token": []}
    n = a.requests * a.tokens
    for _ in range(a.repeats):
        end_s, end_texts = run(OutputProcessor, tokenizer, streams)
        each_s, each_texts = run(TokenByToken, tokenizer, streams)
        assert end_texts == each_texts, "the two ways gave different texts"
        per_token["at_end"].append(end_s / n * 1e6)
        per_token["token_by_token"].append(each_s / n * 1e6)
    med = {k: round(statistics.median(v), 3) for k, v in per_token.items()}
    print(json.dumps({"requests": a.requests, "tokens": a.tokens, "repeats": a.repeats, "cpu": platform.processor(),
                      "us_per_token_detokenized_at_end": med["at_end"],
                      "us_per_token_token_by_token": med["token_by_token"],
                      "token_by_token_over_at_end": round(med["token_by_token"] / med["at_end"], 2)}))


if __name__ == "__main__":
    main()
