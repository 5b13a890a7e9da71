"""What the `batch_invariant` mode costs: per configuration, two engines on the same model, the mode off and
on, alternating in one process (the order flipped every round, so a noisy minute hits both alike). Per
round: the TTFT of one 512-token prompt (W2's) and W1's throughput (64 prompts of 128 tokens, 128 tokens
each). Prints one JSON object: every round, the medians and the mode's speed relative to off (< 1: slower).

  python bench/batch_invariant_ab.py --threads 1 --rounds 2 --configs float32,bfloat16-torch

A configuration is a dtype, with `-torch` for the PyTorch paths (`SERVELM_CPU_KERNELS=0` while its engines
load). bf16 with the C++ kernels is not worth timing: the mode keeps the kernels, so nothing changes.
A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ab_rounds import prompts  # bench/ is on sys.path when run

SIDES = ("off", "on")


def load(model: str | None, config: str, threads: int, invariant: bool):
    """An LLM for `config` with the mode on or off (kernels turned off while it loads for `-torch`)."""
    from servelm import LLM

    dtype, _, paths = config.partition("-")
    before = os.environ.get("SERVELM_CPU_KERNELS")
    if paths == "torch":
        os.environ["SERVELM_CPU_KERNELS"] = "0"
    try:
        # W1 holds 64 x 256 tokens: 1024 blocks of 16, plus room
        return LLM(model, dtype=dtype, num_threads=threads, enable_prefix_caching=False, num_kv_blocks=1100,
                   batch_invariant=invariant)
    finally:
        if before is None:
            os.environ.pop("SERVELM_CPU_KERNELS", None)
        else:
            os.environ["SERVELM_CPU_KERNELS"] = before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--configs", default="float32", help="comma-separated: float32, bfloat16-torch, ...")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    from servelm import SamplingParams

    def gen(llm, batch, n: int) -> float:
        t = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    out: dict = {"model": a.model or "SmolLM2-135M-Instruct", "threads": a.threads, "rounds": a.rounds}
    for config in a.configs.split(","):
        llms = {side: load(a.model, config, a.threads, side == "on") for side in SIDES}
        vocab = llms["off"].engine.core.model.spec.vocab_size
        w2, w1 = prompts("W2", vocab)[0], prompts("W1", vocab)
        for llm in llms.values():  # warm-up
            gen(llm, [w2], 4)
        res = {side: {"ttft_ms": [], "w1_tok_s": []} for side in SIDES}
        for r in range(a.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                res[side]["ttft_ms"].append(round(1000 * gen(llms[side], [w2], 1), 1))
                res[side]["w1_tok_s"].append(round(64 * 128 / gen(llms[side], w1, 128), 1))
        summary: dict = {"rounds": res}
        for key in ("ttft_ms", "w1_tok_s"):
            m = {side: statistics.median(res[side][key]) for side in SIDES}
            speed = m["off"] / m["on"] if key == "ttft_ms" else m["on"] / m["off"]
            summary[key] = {**m, "on_speed_vs_off": round(speed, 3)}
        out[config] = summary
        del llms
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
