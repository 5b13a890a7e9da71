"""Speculative decoding side by side: batch-1 greedy decode without speculation, with n-gram prompt lookup and
with a draft model, on two workloads, in one process (variants alternate every repeat, so a noisy minute hits
all alike). Prints JSON: per workload and variant the median TPOT, the acceptance figures, the speed-up over
plain decoding, and whether the tokens were identical to plain decoding (greedy speculation must not change
a single token).

  W2    the shared workload's 512-token random prompt, 128 output tokens (EOS ignored): little to copy.
  copy  a chat request asking the model to repeat a passage with one word changed: mostly copying.

The draft model is by default the target's own first layers (`--draft self:8`: no extra weights, its own KV
cache); any model sharing the target's tokenizer can be named instead.

  python bench/spec_decode.py --model ~/.cache/servelm-bench/models/smollm2-135m --threads 4 --repeats 5
  python bench/spec_decode.py --model DIR --draft self:8 --k 4          # the real run (an idle machine)
  python bench/spec_decode.py --model TINY_DIR --tokens 8 --repeats 1    # a smoke run on a tiny model
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers" / "workers"))
from common import prompts  # noqa: E402  (the shared workloads' token ids)

PASSAGE = (
    "The harbour town wakes before the sun. Fishing boats slip out past the breakwater while the bakery on "
    "the corner lights its ovens, and by six the market square smells of bread, salt and diesel. Visitors "
    "come for the lighthouse, which has stood on the northern cliff since 1862, and stay for the quiet: "
    "there is one road in, one road out, and the last bus leaves at nine. In winter the storms close the "
    "harbour for days at a time, and the town waits them out with soup, cards and long stories about the "
    "year the lighthouse keeper rowed out alone to bring a stranded crew home."
)
INSTRUCTION = "Repeat the following passage exactly, word for word, but write 'village' instead of 'town':\n\n"


def copy_prompt(tokenizer) -> list[int]:
    msgs = [{"role": "user", "content": INSTRUCTION + PASSAGE}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(INSTRUCTION + PASSAGE).input_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--draft", default="self:8", help="speculative_model of the draft variant")
    args = p.parse_args()

    from servelm import LLM, SamplingParams

    common = dict(dtype=args.dtype, gguf_file=args.gguf_file, num_threads=args.threads, num_kv_blocks=512)
    # threshold 0: measure speculation itself, not the fall-back (which would hide a poor acceptance rate)
    spec = dict(num_speculative_tokens=args.k, spec_fallback_threshold=0.0)
    variants = {"plain": LLM(args.model, **common),
                "ngram": LLM(args.model, speculative_method="ngram", **spec, **common),
                "draft": LLM(args.model, speculative_model=args.draft, **spec, **common)}
    tok = variants["plain"].get_tokenizer()
    vocab = variants["plain"].engine.core.model.spec.vocab_size
    workloads = {"W2": (prompts("W2", vocab)[0], True), "copy": (copy_prompt(tok), False)}

    def gen(llm, prompt, n: int, ignore_eos: bool) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos),
                           use_tqdm=False)
        return time.perf_counter() - t, out[0].outputs[0].token_ids

    result: dict = {"config": vars(args), "workloads": {}}
    for name, (prompt, ignore_eos) in workloads.items():
        for llm in variants.values():  # warm-up
            gen(llm, prompt, 4, ignore_eos)
        tpot: dict[str, list[float]] = {v: [] for v in variants}
        tokens: dict[str, list[int]] = {}
        before = {v: llm.engine.get_stats() for v, llm in variants.items()}
        order = list(variants)
        for r in range(args.repeats):
            for v in order[r % len(order):] + order[:r % len(order)]:
                ttft, _ = gen(variants[v], prompt, 1, ignore_eos)
                total, toks = gen(variants[v], prompt, args.tokens, ignore_eos)
                tokens[v] = toks
                tpot[v].append(1000 * (total - ttft) / max(1, len(toks) - 1))
        rows = {}
        base = statistics.median(tpot["plain"])
        for v, llm in variants.items():
            a, b = before[v], llm.engine.get_stats()
            proposed = b.spec_proposed_tokens - a.spec_proposed_tokens
            accepted = b.spec_accepted_tokens - a.spec_accepted_tokens
            verifications = b.spec_verifications - a.spec_verifications
            med = statistics.median(tpot[v])
            rows[v] = {"tpot_ms": round(med, 3), "tpot_ms_rounds": [round(x, 3) for x in tpot[v]],
                       "speedup": round(base / med, 3), "output_tokens": len(tokens[v]),
                       "identical_to_plain": tokens[v] == tokens["plain"]}
            if v != "plain":
                pos_p = [y - x for x, y in zip(a.spec_proposed_by_position or [0] * args.k,
                                               b.spec_proposed_by_position, strict=False)]
                pos_a = [y - x for x, y in zip(a.spec_accepted_by_position or [0] * args.k,
                                               b.spec_accepted_by_position, strict=False)]
                rows[v] |= {"acceptance_rate": round(accepted / proposed, 3) if proposed else None,
                            "acceptance_by_position": [round(x / y, 3) if y else None
                                                       for x, y in zip(pos_a, pos_p, strict=True)],
                            "mean_accepted_length": round(accepted / verifications, 3) if verifications else None,
                            "verifications": verifications}
        result["workloads"][name] = rows
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
