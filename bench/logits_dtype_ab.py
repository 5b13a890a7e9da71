"""W1 throughput (64 prompts, 128 tokens each) of the default model with its logits stored in float32 (the
default: the C++ kernels' float32 sums, unrounded) against the same model with the lm_head's output rounded
to bf16, in one process, alternating the two every repeat. Greedy and sampled (temperature 0.8). Prints one
JSON object: the repeats, the medians and float32's ratio to bf16.

  python bench/logits_dtype_ab.py --repeats 4 --threads 2

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
from common import prompts  # noqa: E402  (the peers' workload drawing, shared)

from servelm import LLM, SamplingParams  # noqa: E402
from servelm.model.layers import blocks  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    llm = LLM(num_threads=a.threads, enable_prefix_caching=False)
    w1 = prompts("W1", llm.engine.core.model.spec.vocab_size)
    float32_call = blocks.Linear.__call__

    def rounded_call(self, x, float32: bool = False):  # the lm_head's output as bf16, as before float32 logits
        return float32_call(self, x, False)

    def tok_s(temperature: float) -> float:
        t = time.perf_counter()
        llm.generate(w1, SamplingParams(temperature=temperature, seed=0, max_tokens=128, ignore_eos=True),
                     use_tqdm=False)
        return round(64 * 128 / (time.perf_counter() - t), 1)

    res: dict = {"threads": a.threads, "lm_head": llm.engine.core.model.lm_head.kernel.name}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        tok_s(temperature)  # warm-up
        runs: dict[str, list[float]] = {"float32": [], "bf16": []}
        for r in range(a.repeats):
            for mode in ("float32", "bf16") if r % 2 == 0 else ("bf16", "float32"):
                blocks.Linear.__call__ = float32_call if mode == "float32" else rounded_call
                runs[mode].append(tok_s(temperature))
        blocks.Linear.__call__ = float32_call
        med = {m: statistics.median(v) for m, v in runs.items()}
        res[name] = {"w1_tok_s": runs, "median": med, "float32_over_bf16": round(med["float32"] / med["bf16"], 3)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
