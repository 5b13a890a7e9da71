"""Structured output's cost per step, over SmolLM2's 49k vocabulary.

    python bench/grammar_sampler.py --batch 32 --steps 200 [--backend llguidance|xgrammar] [--tokenizer DIR]
    python bench/grammar_sampler.py --backends [--batches 1,8,32] [--repeats 5] [--tokenizer DIR]

The first form: the whole sampler, a batch of B rows with 0, 1 or all rows under a JSON-schema grammar (the
matcher reset each step so its state stays the same).

The second (--backends): the grammar backends side by side, as JSON: for each one installed, the time to set up
its tokenizer, to compile the schema, and per step (B rows, each walking a JSON document the schema accepts, a
token a step, then its stop token) the mask's fill (the backend computing the allowed tokens into the bitmask)
and apply (-inf into the logits: xgrammar's CPU kernel where xgrammar is installed, whichever backend filled
the bitmask), medians in ms, wall clock and CPU time (on a shared machine the wall clock mostly measures the
neighbours); and numpy_apply_cpu_ms, the apply of an install without xgrammar. torch runs one thread, as an
engine on a busy machine effectively does.

DIR: a folder with SmolLM2's tokenizer (default: the packaged model's, read from its GGUF).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from servelm.engine.sampler import Sampler
from servelm.engine.sequence import Request, Sequence
from servelm.engine.structured import (
    GrammarCache,
    _apply_numpy,
    apply_bitmask,
    fill_bitmask,
    installed,
    new_matcher,
)
from servelm.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
# what a row writes, a token a step: a document SCHEMA accepts, with both backends' separators
DOCUMENT = {"name": "Rex the very good dog, who lives in the house at the end of the road", "age": 7}
VOCAB = 49152
EOS = 2


def load_tokenizer(path: str | None):
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from servelm.model.loading.metadata import load_gguf_config_and_tokenizer
    from servelm.model.loading.source import default_model_path

    return load_gguf_config_and_tokenizer(default_model_path())[1]


def _seqs(batch: int, n_grammar: int, compiled, temperature: float) -> list[Sequence]:
    seqs = []
    for r in range(batch):
        seq = Sequence(Request(str(r), [1, 2, 3], SamplingParams(temperature=temperature, max_tokens=16)), 0,
                       [1, 2, 3])
        if r < n_grammar:
            seq.matcher = new_matcher(compiled)
        seqs.append(seq)
    return seqs


def sampler_bench(a, tok) -> None:
    compiled = GrammarCache(VOCAB, lambda: tok, a.backend).compile(StructuredOutputsParams(json=SCHEMA),
                                                                    frozenset({EOS}))
    sampler = Sampler(0)
    logits = torch.randn(a.batch, VOCAB)
    for n_grammar in (0, 1, a.batch):
        seqs = _seqs(a.batch, n_grammar, compiled, a.temperature)
        times, cpu = [], []
        for _ in range(a.steps):
            for s in seqs[:n_grammar]:
                s.matcher.reset()
            t, c = time.perf_counter(), time.process_time()
            sampler.sample(logits, seqs)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        print(f"{a.backend}: batch {a.batch}, {n_grammar:3d} rows with a grammar: wall median "
              f"{1e3 * statistics.median(times):.2f} ms/step, CPU median {1e3 * statistics.median(cpu):.2f} ms/step")


def backend_bench(backend: str, tok, batches: list[int], repeats: int) -> dict:
    cache = GrammarCache(VOCAB, lambda: tok, backend)
    t = time.perf_counter()
    cache._get_compiler(frozenset({EOS}))
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = cache.compile(StructuredOutputsParams(json=SCHEMA), frozenset({EOS}))
    compile_ms = 1e3 * (time.perf_counter() - t)
    doc = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False) + [EOS]
    out = {"tokenizer_setup_s": round(setup_s, 3), "schema_compile_ms": round(compile_ms, 2),
           "document_tokens": len(doc), "per_step": {}}
    for batch in batches:
        seqs = _seqs(batch, batch, compiled, 1.0)
        bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        logits = torch.randn(batch, VOCAB)
        rows = list(range(batch))
        fill, apply, fill_cpu, apply_cpu, numpy_apply = [], [], [], [], []
        for _ in range(repeats):
            for s in seqs:
                s.matcher.reset()
            for token in doc:
                work = logits.clone()
                t, c = time.perf_counter(), time.process_time()
                fill_bitmask(bitmask, seqs, rows)
                t2, c2 = time.perf_counter(), time.process_time()
                apply_bitmask(work, bitmask, rows)
                t3, c3 = time.perf_counter(), time.process_time()
                fill.append(t2 - t)
                apply.append(t3 - t2)
                fill_cpu.append(c2 - c)
                apply_cpu.append(c3 - c2)
                assert torch.isfinite(work[:, token]).all(), "the document's next token was masked"
                again = logits.clone()
                c = time.process_time()
                _apply_numpy(again, bitmask, rows, True)
                numpy_apply.append(time.process_time() - c)
                assert torch.equal(again, work)
                for s in seqs:
                    assert s.matcher.accept_token(token)
            assert all(s.matcher.is_terminated() for s in seqs)

        def ms(xs: list[float]) -> float:
            return round(1e3 * statistics.median(xs), 4)
        out["per_step"][f"batch_{batch}"] = {
            "fill_ms": ms(fill), "apply_ms": ms(apply), "total_ms": ms([f + p for f, p in zip(fill, apply, strict=True)]),
            "fill_cpu_ms": ms(fill_cpu), "apply_cpu_ms": ms(apply_cpu),
            "total_cpu_ms": ms([f + p for f, p in zip(fill_cpu, apply_cpu, strict=True)]), "steps": len(fill),
            "numpy_apply_cpu_ms": ms(numpy_apply)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--backend", default="auto", choices=("auto", "llguidance", "xgrammar"))
    ap.add_argument("--backends", action="store_true", help="compare the grammar backends' mask time (JSON)")
    ap.add_argument("--batches", default="1,8,32", help="with --backends: the batch sizes")
    ap.add_argument("--repeats", type=int, default=5, help="with --backends: walks of the document per batch size")
    ap.add_argument("--tokenizer", default=None)
    a = ap.parse_args()
    tok = load_tokenizer(a.tokenizer)
    if not a.backends:
        sampler_bench(a, tok)
        return
    torch.set_num_threads(1)
    batches = [int(b) for b in a.batches.split(",")]
    result = {"vocab": VOCAB, "schema": SCHEMA, "torch_threads": 1, "apply": "xgrammar's kernel" if
              installed("xgrammar") else "numpy", "backends": {}}
    for backend in ("llguidance", "xgrammar"):
        result["backends"][backend] = backend_bench(backend, tok, batches, a.repeats) if installed(backend) \
            else {"error": "not installed"}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
