"""The sampler's cost per step with and without structured output: a batch of B rows over SmolLM2's vocabulary,
with 0, 1 or all rows under a JSON-schema grammar (the matcher reset each step so its state stays the same).

    python bench/grammar_sampler.py --batch 32 --steps 200 --tokenizer DIR

DIR: a folder with SmolLM2's tokenizer (default: the packaged model's, read from its GGUF).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelm.engine.sampler import Sampler
from servelm.engine.sequence import Request, Sequence
from servelm.engine.structured import GrammarCache, new_matcher
from servelm.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tokenizer", default=None)
    a = ap.parse_args()
    if a.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        from servelm.model.metadata import load_gguf_config_and_tokenizer
        from servelm.model.source import default_model_path

        tok = load_gguf_config_and_tokenizer(default_model_path())[1]
    vocab = 49152
    spec = StructuredOutputsParams(json=SCHEMA)
    compiled = GrammarCache(vocab, lambda: tok).compile(spec, frozenset({2}))
    sampler = Sampler(0)
    logits = torch.randn(a.batch, vocab)
    for n_grammar in (0, 1, a.batch):
        seqs = []
        for r in range(a.batch):
            params = SamplingParams(temperature=a.temperature, max_tokens=16)
            seq = Sequence(Request(str(r), [1, 2, 3], params), 0, [1, 2, 3])
            if r < n_grammar:
                seq.matcher = new_matcher(compiled)
            seqs.append(seq)
        times, cpu = [], []
        for _ in range(a.steps):
            for s in seqs[:n_grammar]:
                s.matcher.reset()
            t, c = time.perf_counter(), time.process_time()
            sampler.sample(logits, seqs)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        # CPU time as well: on a shared machine the wall clock mostly measures the neighbours
        print(f"batch {a.batch}, {n_grammar:3d} rows with a grammar: wall median {1e3 * statistics.median(times):.2f} "
              f"ms/step, CPU median {1e3 * statistics.median(cpu):.2f} ms/step")


if __name__ == "__main__":
    main()
