"""W2 (TTFT, TPOT) and W1 (throughput) of the default model (bf16, or `--dtype`; greedy, or sampled at
`--temperature`) for two or more checkouts, each run in a
process of its own with that checkout first on PYTHONPATH, alternating checkouts every repeat so that a noisy
minute hits all alike. For changes one process cannot hold both sides of (a new build system, a changed
Python dispatch). Prints one JSON object: per checkout the repeats, the medians and the ratio to the first.

  python bench/checkouts_ab.py --src /path/to/old/checkout --src . --repeats 3 --threads 1

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(threads: int, dtype: str, ttft_only: bool, temperature: float) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers" / "workers"))
    from common import prompts

    from servelm import LLM, SamplingParams

    llm = LLM(dtype=dtype, num_threads=threads, enable_prefix_caching=False)
    vocab = llm.engine.core.model.spec.vocab_size
    w2, w1 = prompts("W2", vocab)[0], prompts("W1", vocab)

    def gen(batch, n: int) -> float:
        t = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=temperature, seed=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    gen([w2], 8)
    ttft = gen([w2], 1)
    if ttft_only:  # the median of five
        print(json.dumps({"ttft_ms": round(1000 * sorted([ttft] + [gen([w2], 1) for _ in range(4)])[2], 1)}))
        return
    tpot = (gen([w2], 128) - ttft) / 127
    print(json.dumps({"ttft_ms": round(1000 * ttft, 1), "tpot_ms": round(1000 * tpot, 2),
                      "w1_tok_s": round(64 * 128 / gen(w1, 128), 1)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", action="append", required=True, help="a checkout (repeatable; the first is the base)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32 or auto")
    p.add_argument("--ttft-only", action="store_true", help="W2's TTFT alone (median of 5 per repeat)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above: sampled")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.threads, a.dtype, a.ttft_only, a.temperature)
    runs: dict[str, list[dict]] = {s: [] for s in a.src}
    for r in range(a.repeats):
        for src in a.src if r % 2 == 0 else a.src[::-1]:
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            out = subprocess.run([sys.executable, __file__, "--worker", "--src", src, "--threads", str(a.threads),
                                  "--dtype", a.dtype, "--temperature", str(a.temperature),
                                  *(["--ttft-only"] if a.ttft_only else [])],
                                 env=env, cwd="/", capture_output=True, text=True, check=True).stdout
            runs[src].append(json.loads(out.strip().splitlines()[-1]))
    res: dict = {"threads": a.threads, "dtype": a.dtype, "temperature": a.temperature, "repeats": runs, "median": {}}
    for src, rs in runs.items():
        res["median"][src] = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
    base = res["median"][a.src[0]]
    res["ratio_to_first"] = {src: {k: round(m[k] / base[k], 3) for k in m} for src, m in res["median"].items()}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
