"""servelm on an NVIDIA GPU beside transformers on the same GPU, on the shared workloads W1 and W2, with the
device's own ceilings (copy bandwidth, bf16 matmul rate) measured in the same run.

  python bench/gpu_bench.py --tokenizer DIR --models 60m,smollm2,1b --modes graphs,eager --peers hf

Models are random-weight checkpoints with the shapes of llama-rand-60m, SmolLM2-135M, Llama-3.2-1B and
Llama-3-8B, written once under --work (speed does not depend on the weights' values). W1: 64 prompts of
128 tokens, 128 greedy output tokens each, output tok/s; W2: one 512-token prompt, TTFT from a one-token
request and TPOT from a 128-token one (medians of --reps). TPOT is set against the bandwidth bound (the weights and
the context's KV read once per step at the measured copy rate). Prints one JSON line per measurement and
a table last. A benchmark, not a test: CI has no GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peers" / "workers"))
from common import prompts  # noqa: E402  (the shared workloads' token ids)

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings
    "60m": (512, 8, 8, 4, 1408, 32000, False),
    "smollm2": (576, 30, 9, 3, 1536, 49152, True),
    "1b": (2048, 16, 32, 8, 8192, 128256, True),
    "8b": (4096, 32, 32, 8, 14336, 128256, False),
}


def make_model(name: str, work: Path, tokenizer: Path) -> Path:
    out = work / name
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, LlamaConfig

    h, n, heads, kv, inter, vocab, tied = SHAPES[name]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=tied,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # made in bf16: no float32 copy of 8b
    model.save_pretrained(out)
    del model
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    return out


def ceilings() -> dict:
    """Device-to-device copy rate (bytes read + written) and a large bf16 matmul's rate, on random data."""
    from triton.testing import do_bench

    x = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_gb_s": round(2 * 2**29 / ms / 1e6, 1), "bf16_tflop_s": round(2 * 8192**3 / mm / 1e9, 1)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    walls = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def measure(run_batch, vocab: int, reps: int) -> dict:
    """run_batch(list of prompts, max_tokens) generates greedily without stopping early."""
    w1 = prompts("W1", vocab)
    run_batch(w1[:2], 4)
    run_batch(w1, 8)  # warm-up at the full batch (compilation, graph capture, allocator)
    tps = len(w1) * 128 / timed(lambda: run_batch(w1, 128), reps)
    w2 = prompts("W2", vocab)[0]
    run_batch([w2], 2)
    ttft = timed(lambda: run_batch([w2], 1), reps)
    e2e = timed(lambda: run_batch([w2], 128), reps)
    return {"w1_tok_s": round(tps, 1), "w2_ttft_ms": round(1000 * ttft, 2),
            "w2_tpot_ms": round(1000 * (e2e - ttft) / 127, 3)}


def run_servelm(path: Path, mode: str, reps: int, vocab: int, device: str) -> dict:
    from servelm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(str(path), dtype="bfloat16", device=device, enforce_eager=mode == "eager",
              kv_cache_memory_gb=4, enable_prefix_caching=False)
    load_s = time.perf_counter() - t

    def run(batch, n):
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    row = {"system": f"servelm-{mode}", "load_s": round(load_s, 2), **measure(run, vocab, reps)}
    row["peak_gpu_gb"] = peak_gb()
    return row  # the engine and its KV cache are freed when `run` and `llm` go (before the next system)


def run_hf(path: Path, reps: int, vocab: int, device: str) -> dict:
    """transformers' own generate, a static padded batch (W1's prompts are all one length: no padding)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    load_s = time.perf_counter() - t

    def run(batch, n):
        gen = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=2)
        with torch.no_grad():
            model.generate(torch.tensor(batch, device=device), generation_config=gen)

    row = {"system": "transformers", "load_s": round(load_s, 2), **measure(run, vocab, reps)}
    row["peak_gpu_gb"] = peak_gb()
    return row


def weight_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118  (safe_open has no items())
                s = st.get_slice(k)
                total += torch.Size(s.get_shape()).numel() * 2
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, type=Path, help="a tokenizer folder copied into each model")
    p.add_argument("--work", type=Path, default=Path("/tmp/servelm-gpu-models"))
    p.add_argument("--models", default="60m,smollm2", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--modes", default="graphs,eager", help="servelm modes: graphs (CUDA graphs) and/or eager")
    p.add_argument("--peers", default="hf", help="'hf' for transformers, or '' for none")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    a = p.parse_args()
    on_gpu = a.device.startswith("cuda")
    ceil = ceilings() if on_gpu else {"copy_gb_s": float("nan")}
    print("CEILINGS " + json.dumps({"device": torch.cuda.get_device_name() if on_gpu else "cpu", **ceil}), flush=True)
    rows = []
    for name in a.models.split(","):
        path = make_model(name, a.work, a.tokenizer)
        vocab = SHAPES[name][5]
        h, n, heads, kv, *_ = SHAPES[name]
        kv_bytes = 2 * n * kv * (h // heads) * 2 * (512 + 64)  # W2's mean context, K and V, bf16
        bound_ms = (weight_bytes(path) + kv_bytes) / (ceil["copy_gb_s"] * 1e9) * 1e3
        systems = [f"servelm-{m}" for m in a.modes.split(",") if m]
        systems += ["transformers"] if "hf" in a.peers.split(",") else []
        for system in systems:
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            fig = run_hf(path, a.reps, vocab, a.device) if system == "transformers" else \
                run_servelm(path, system.removeprefix("servelm-"), a.reps, vocab, a.device)
            gc.collect()  # the last system's weights and KV cache go before the next one loads
            if on_gpu:
                torch.cuda.empty_cache()
            row = {"model": name, **fig, "tpot_bound_ms": round(bound_ms, 3)}
            row["tpot_vs_bound"] = round(row["w2_tpot_ms"] / bound_ms, 2)
            print("RESULT " + json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'model':8} {'system':16} {'W1 tok/s':>10} {'TTFT ms':>8} {'TPOT ms':>8} {'xbound':>7} {'GPU GB':>7}")
    for r in rows:
        print(f"{r['model']:8} {r['system']:16} {r['w1_tok_s']:>10} {r['w2_ttft_ms']:>8} {r['w2_tpot_ms']:>8} "
              f"{r['tpot_vs_bound']:>7} {r['peak_gpu_gb']!s:>7}")


if __name__ == "__main__":
    main()
