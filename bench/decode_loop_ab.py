"""The C++ decode layer loop (`decode_layers`) against the Python layer loop, alternating in one process so
that a noisy minute hits both alike: W2's TPOT (one 512-token prompt, 128 tokens) and optionally W1's
throughput, per round. Prints one JSON object with each side's rounds, medians and the ratio.

  python bench/decode_loop_ab.py --model ~/.cache/servelm-bench/models/smollm2-135m --threads 1 --rounds 5

A benchmark, not a test: CI does not run it.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--w1", action="store_true", help="also time W1 (64 x 128 tokens) each round")
    a = p.parse_args()
    from servelm import LLM, SamplingParams

    llm = LLM(a.model, dtype="bfloat16", num_threads=a.threads, enable_prefix_caching=False)
    model = llm.engine.core.model
    flat = model.cpp_decode
    if flat is None:
        raise SystemExit("the C++ layer loop does not apply on this machine/model")
    vocab = model.spec.vocab_size
    w2 = prompts("W2", vocab)[0]
    w1 = prompts("W1", vocab)

    def gen(batch, n):
        t = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    res = {"cpp": {"tpot_ms": [], "w1_tok_s": []}, "python": {"tpot_ms": [], "w1_tok_s": []}}
    for side in ("cpp", "python"):  # warm-up both
        model.cpp_decode = flat if side == "cpp" else None
        gen([w2], 8)
    for r in range(a.rounds):
        for side in (("cpp", "python") if r % 2 == 0 else ("python", "cpp")):
            model.cpp_decode = flat if side == "cpp" else None
            ttft = gen([w2], 1)
            res[side]["tpot_ms"].append(round(1000 * (gen([w2], 128) - ttft) / 127, 3))
            if a.w1:
                res[side]["w1_tok_s"].append(round(64 * 128 / gen(w1, 128), 1))
    out = {"model": a.model, "threads": a.threads, "rounds": res}
    for key in ("tpot_ms", "w1_tok_s"):
        if res["cpp"][key]:
            c, py = statistics.median(res["cpp"][key]), statistics.median(res["python"][key])
            out[key] = {"cpp": c, "python": py, "speedup": round(py / c if key == "tpot_ms" else c / py, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
