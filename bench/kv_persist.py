#!/usr/bin/env python3
"""Prefix-cache persistence on W3 (448 shared + 64 own prompt tokens, 64 output; shared/workloads.md):
serve W3 cold, save the prefix cache, restore it into an emptied cache, serve W3 again. Prints one JSON
object: file size, save and restore times (median of --repeats), the model-hash time (reading the weight
files once), prefix-cache hit rates cold and after the restore, and whether the outputs are identical.

    python bench/kv_persist.py                          # SmolLM2-135M, the whole W3
    python bench/kv_persist.py --scale 0.05 --max-tokens 4 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of W3's 64 requests")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (W3: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed saves and restores; the median is kept")
    p.add_argument("--dir", default=None, help="where the file is written (default: a temporary directory)")
    p.add_argument("--output", default=None, help="also append the JSON line to this file")
    a = p.parse_args()

    import torch

    from servelm import LLM, SamplingParams
    from servelm.bench.workloads import make_workload
    from servelm.engine import kv_persist
    from servelm.model.loading.source import resolve_model

    llm = LLM(a.model, dtype=a.dtype)
    core = llm.engine.core
    wl = make_workload("W3", core.model.spec.vocab_size, scale=a.scale)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)

    def serve() -> tuple[list[list[int]], float]:
        q0, h0 = core.kv.prefix_queries, core.kv.prefix_hits
        outs = [o.outputs[0].token_ids for o in llm.generate(wl.prompts, params, use_tqdm=False)]
        q, h = core.kv.prefix_queries - q0, core.kv.prefix_hits - h0
        return outs, h / q if q else 0.0

    cold, cold_rate = serve()
    t = time.perf_counter()
    digest = kv_persist.model_hash(resolve_model(a.model), core.model.spec)
    hash_s = time.perf_counter() - t
    folder = Path(a.dir or tempfile.mkdtemp(prefix="servelm-kv-bench-"))
    path = kv_persist.default_file(folder, digest)
    saves, loads = [], []
    for _ in range(a.repeats):
        saved = kv_persist.save(core, path, digest)
        saves.append(saved.seconds)
        core.kv.pool.reset_prefix_cache()
        restored = kv_persist.load(core, path, digest)
        loads.append(restored.seconds)
    warm, warm_rate = serve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    out = {
        "system": "servelm", "bench": "kv_persist", "commit": commit, "workload": "W3",
        "model": str(a.model or "smollm2-135m"), "dtype": str(core.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "requests": wl.num_requests, "max_tokens": a.max_tokens,
        "block_size": core.config.cache_config.block_size, "blocks": saved.num_blocks, "blocks_restored": restored.num_blocks,
        "file_bytes": saved.size_bytes, "bytes_per_block": saved.size_bytes // max(1, saved.num_blocks),
        "save_s": round(statistics.median(saves), 4), "restore_s": round(statistics.median(loads), 4),
        "save_MBps": round(saved.size_bytes / statistics.median(saves) / 1e6, 1),
        "restore_MBps": round(saved.size_bytes / statistics.median(loads) / 1e6, 1),
        "model_hash_s": round(hash_s, 3), "repeats": a.repeats,
        "hit_rate_cold": round(cold_rate, 4), "hit_rate_restored": round(warm_rate, 4),
        "outputs_identical": cold == warm,
    }
    line = json.dumps(out)
    print(line)
    if a.output:
        with open(a.output, "a") as f:
            f.write(line + "\n")
    if not a.dir:
        path.unlink(missing_ok=True)
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
