"""Weights in transparent huge pages (the default) against weights in 4 KB pages, alternating in one
process so that a noisy minute hits both alike: two engines over the same checkpoint, one built with
`servelm.model.memory.WEIGHTS_IN_HUGE_PAGES` off. Per repeat: W2's TPOT (one 512-token prompt, 128
tokens) and optionally W1's throughput. Prints one JSON object with each side's repeats, medians and ratios.

  python bench/huge_pages_ab.py --model ~/.cache/servelm-bench/models/smollm2-135m --threads 1 --repeats 5

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ab_repeats import alternate, parser  # bench/ is on sys.path when run


def anon_huge_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    a = parser(__doc__).parse_args()
    from servelm import LLM
    from servelm.model import memory

    engines = {}
    for side in ("small", "huge"):  # 4 KB first, so AnonHugePages' growth is the huge side's
        memory.WEIGHTS_IN_HUGE_PAGES = side == "huge"
        before = anon_huge_kb()
        engines[side] = LLM(a.model, dtype="bfloat16", num_threads=a.threads, enable_prefix_caching=False)
        print(f"{side}: AnonHugePages +{anon_huge_kb() - before} kB", file=sys.stderr)
    out = {"model": a.model, "threads": a.threads,
           **alternate(engines.__getitem__, ("huge", "small"), engines["huge"].engine.core.model.spec.vocab_size,
                       a.repeats, a.w1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
