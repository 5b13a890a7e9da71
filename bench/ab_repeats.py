"""Two variants of servelm alternating in one process, so that a noisy minute hits both alike: per repeat,
W2's TPOT (one 512-token prompt, 128 tokens) and optionally W1's throughput on each, the order flipped
every repeat. Shared by the A/B benchmarks (`decode_loop_ab.py`, `huge_pages_ab.py`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers" / "workers"))
from common import prompts  # noqa: E402  (the shared workloads' token ids)


def parser(doc: str) -> argparse.ArgumentParser:
    """The A/B benchmarks' common options: model folder, threads, repeats, and whether to time W1 too."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--w1", action="store_true", help="also time W1 (64 x 128 tokens) each repeat")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU time instead of wall time (steadier on a shared machine, "
                        "blind to waits)")
    return p


def alternate(select: Callable[[str], object], sides: tuple[str, ...], vocab: int, repeats: int,
              w1: bool, clock: str = "wall") -> dict:
    """`select(side)` makes a side current and returns its `LLM`; `sides[0]` is the candidate, `sides[1]`
    the baseline (any further sides are timed too, and the candidate's speed-up over each is given).
    Returns each side's repeats and, per figure, the medians and the candidate's speed-up."""
    from servelm import SamplingParams

    w2_prompt, w1_prompts = prompts("W2", vocab)[0], prompts("W1", vocab)

    now = time.process_time if clock == "cpu" else time.perf_counter

    def gen(llm, batch, n: int) -> float:
        t = now()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return now() - t

    res = {side: {"tpot_ms": [], "w1_tok_s": []} for side in sides}
    for side in sides:  # warm-up both
        gen(select(side), [w2_prompt], 8)
    for r in range(repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            llm = select(side)
            ttft = gen(llm, [w2_prompt], 1)
            res[side]["tpot_ms"].append(round(1000 * (gen(llm, [w2_prompt], 128) - ttft) / 127, 3))
            if w1:
                res[side]["w1_tok_s"].append(round(64 * 128 / gen(llm, w1_prompts, 128), 1))
    out: dict = {"repeats": res}
    new, base, *others = sides
    for key in ("tpot_ms", "w1_tok_s"):
        if res[new][key]:
            med = {side: statistics.median(res[side][key]) for side in sides}
            ratio = {o: round(med[o] / med[new] if key == "tpot_ms" else med[new] / med[o], 3) for o in sides}
            out[key] = {**med, "speedup": ratio[base], **{f"speedup_vs_{o}": ratio[o] for o in others}}
    return out
