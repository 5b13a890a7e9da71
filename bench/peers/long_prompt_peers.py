"""Long-prompt TTFT through each system's server: `servelm serve`, `vllm serve` and llama.cpp's `llama-server`
on the same model (SmolLM2-135M bf16, llama.cpp reading the same weights as a bf16 GGUF; or, with `--model
smollm2-q8_0`, one Q8_0 GGUF file for servelm and llama.cpp, which runs it on its AMX int8 kernels), one after the other
with the same thread count. Each prompt is random token ids (a fresh draw per request, so no prefix cache
can help), sent as a /v1/completions request with max_tokens 1: its wall time is the TTFT. Per length one
warm-up request, then --reps timed ones; prints one JSON line per (system, length) and a summary with
each peer's TTFT over servelm's (above 1: servelm is faster).

    python bench/peers/long_prompt_peers.py --lengths 2048,8191 --threads 2

Setup (venvs, models, the llama.cpp build) is run_peers.py's: run `run_peers.py --setup-only` first or let
this script do it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_peers import (  # noqa: E402
    GGUF_FILE_MODELS,
    GGUF_READERS,
    ensure_models,
    ensure_venv,
    llama_server,
    llama_server_cpu_args,
    log,
    running_server,
)


def commands(cache: Path, paths: dict[str, Path], threads: int, ctx: int, systems: list[str]) -> dict:
    out = {}
    if "servelm" in systems:
        out["servelm"] = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", str(paths["hf"]), "--dtype",
                          "bfloat16", "--port", "{port}", "--num-threads", str(threads), "--embedding-model", "none",
                          "--no-enable-prefix-caching"]
    if "vllm" in systems:
        out["vllm"] = [str(ensure_venv(cache, "vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model",
                       str(paths["hf"]), "--dtype", "bfloat16", "--port", "{port}", "--max-model-len", str(ctx),
                       "--no-enable-prefix-caching"]
    if "llamacpp" in systems:
        out["llamacpp"] = [str(llama_server(cache)), "-m", str(paths["gguf"]), "--port", "{port}", "--host",
                           "127.0.0.1", "-np", "1", "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
                           "--no-webui", *llama_server_cpu_args()]
    return out


def ttft(url: str, model: str, prompt: list[int]) -> float:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/servelm-bench").expanduser())
    p.add_argument("--systems", default="servelm,vllm,llamacpp")
    p.add_argument("--model", default="smollm2", choices=["smollm2", *GGUF_FILE_MODELS],
                   help="smollm2 (bf16; llama.cpp reads it as a bf16 GGUF) or a GGUF file every system but vLLM "
                        "reads (smollm2-q8_0: llama.cpp's AMX int8 path)")
    p.add_argument("--lengths", default="2048,8191", help="prompt tokens, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    import httpx

    systems = [s for s in a.systems.split(",") if s]
    if a.model in GGUF_FILE_MODELS and (skipped := [s for s in systems if s not in GGUF_READERS]):
        log(f"{a.model} is a GGUF file, which {', '.join(skipped)} cannot read: left out for it")
        systems = [s for s in systems if s in GGUF_READERS]
    paths = ensure_models(a.cache, [a.model], "llamacpp" in systems)[a.model]
    lengths = [int(x) for x in a.lengths.split(",")]
    ctx = max(lengths) + 1  # prompt plus the one output token (SmolLM2 allows 8,192)
    rng = np.random.Generator(np.random.PCG64(5))
    rows: dict[str, dict[int, float]] = {}
    for name, cmd in commands(a.cache, paths, a.threads, ctx, systems).items():
        try:
            with running_server(name, cmd, a.threads) as (url, _ready, _peak):
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                for n in lengths:
                    prompts = [[1] + [int(i) for i in rng.integers(4, 49152, size=n - 1)] for _ in range(a.reps + 1)]
                    ttft(url, model, prompts[0])  # warm-up
                    times = [ttft(url, model, q) for q in prompts[1:]]
                    rows.setdefault(name, {})[n] = statistics.median(times)
                    print(json.dumps({"system": name, "prompt_tokens": n, "threads": a.threads,
                                      "ttft_s": [round(t, 3) for t in times]}), flush=True)
        except Exception as e:  # a peer that fails is reported, the others still run
            log(f"{name}: {e}")
    base = rows.get("servelm", {})
    summary = {s: {n: {"ttft_s": round(t, 3), **({"vs_servelm": round(t / base[n], 2)} if n in base else {})}
                   for n, t in r.items()} for s, r in rows.items()}
    print(json.dumps({"threads": a.threads, "median_ttft": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
