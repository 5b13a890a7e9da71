"""Sleep mode on the CPU: the process's resident memory (RSS, anonymous and file-backed) as an engine fills its KV cache, sleeps at level 1
and 2 and wakes, and how long each sleep and wake takes (a level-2 wake without new weights reads the
checkpoint again). The answers after each wake are checked against those before. Prints one JSON object.

  python bench/sleep_mode.py                      # the default model (SmolLM2-135M, GGUF Q4_1)
  python bench/sleep_mode.py --model DIR --prompts 64 --prompt-len 512 --kv-cache-memory-gb 2

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def rss_mb() -> dict[str, float]:
    """Resident memory by kind (anonymous: heap, weights, KV cache; file: mapped files such as a GGUF's)."""
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}
    return {"anon": round(kb["RssAnon"] / 1024, 1), "file": round(kb["RssFile"] / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a folder or .gguf file (default: the default model)")
    p.add_argument("--prompts", type=int, default=64, help="prompts to fill the KV cache with")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    a = p.parse_args()
    from servelm import LLM, SamplingParams

    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory_gb=a.kv_cache_memory_gb, enable_sleep_mode=True)
    vocab = llm.engine.core.model.spec.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def answers():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    out = {"model": a.model or "default", "kv_cache_memory_gb": a.kv_cache_memory_gb,
           "prompt_tokens": a.prompts * a.prompt_len, "rss_mb": {"loaded": rss_mb()}}
    want = answers()
    out["rss_mb"]["kv_filled"] = rss_mb()
    for level in (1, 2):
        t = time.perf_counter()
        llm.sleep(level=level)
        out[f"sleep_{level}_s"] = round(time.perf_counter() - t, 4)
        out["rss_mb"][f"asleep_{level}"] = rss_mb()
        t = time.perf_counter()
        llm.wake_up()
        out[f"wake_{level}_s"] = round(time.perf_counter() - t, 4)
        out["rss_mb"][f"woken_{level}"] = rss_mb()
        out[f"same_answers_after_{level}"] = answers() == want
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
