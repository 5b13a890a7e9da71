"""The C++ decode layer loop (`decode_layers`) against the Python layer loop, alternating in one process so
that a noisy minute hits both alike: W2's TPOT (one 512-token prompt, 128 tokens) and optionally W1's
throughput, per round. Prints one JSON object with each side's rounds, medians and the ratio.

  python bench/decode_loop_ab.py --model ~/.cache/servelm-bench/models/smollm2-135m --threads 1 --rounds 5

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import json

from ab_rounds import alternate, parser  # bench/ is on sys.path when run


def main() -> None:
    a = parser(__doc__).parse_args()
    from servelm import LLM

    llm = LLM(a.model, dtype="bfloat16", num_threads=a.threads, enable_prefix_caching=False)
    model = llm.engine.core.model
    flat = model.cpp_decode
    if flat is None:
        raise SystemExit("the C++ layer loop does not apply on this machine/model")

    def select(side: str):
        model.cpp_decode = flat if side == "cpp" else None
        return llm

    out = {"model": a.model, "threads": a.threads,
           **alternate(select, ("cpp", "python"), model.spec.vocab_size, a.rounds, a.w1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
