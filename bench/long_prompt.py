"""Long-prompt prefill: time to first token for prompts of 2k, 8k (and 32k) tokens, split into the time in
the linear layers and in attention, with the linears' rate against the machine's bf16 matmul rate.

    python bench/long_prompt.py                          # SmolLM2-135M: 2k and 8k
    python bench/long_prompt.py --rand-32k               # also a random-weight Llama (llama-rand-60m) at 32k
    python bench/long_prompt.py --quantization none gguf # the GGUF file dequantized to bf16, and kept as stored

Each length is one request of max_tokens=1, timed end to end (TTFT), after a warm-up request of the same
length. The model's linears (QKV, output, gate/up, down) and its attention calls are wrapped with timers
for the timed request, so the JSON says where the time went: `linear_gflop_s` is the linears' FLOPs (2 x
rows x in x out) over their time, `linear_vs_matmul` that rate over a 1024^3 bf16 matmul's measured in the
same run, and `attention_share` attention's part of the TTFT. One JSON line per (model, length, token budget).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from servelm import LLM, SamplingParams
from servelm.bench.throughput import hardware_bounds
from servelm.model.layers import blocks as layers


class Timers:
    """Wraps the linear kernels and the attention backend's forward with wall-clock timers while on."""

    def __init__(self) -> None:
        self.on = False
        self.linear_s = self.attn_s = 0.0
        self.linear_flop = 0.0

    def reset(self) -> None:
        self.linear_s = self.attn_s = self.linear_flop = 0.0

    def wrap_linears(self) -> None:
        for cls in (layers.Linear, layers.GateUpLinear):
            call = cls.__call__

            def timed(lin, x, *a, _call=call, **k):
                if not self.on:
                    return _call(lin, x, *a, **k)
                t = time.perf_counter()
                y = _call(lin, x, *a, **k)
                self.linear_s += time.perf_counter() - t
                self.linear_flop += 2.0 * x.shape[0] * x.shape[1] * lin.out_features
                return y

            cls.__call__ = timed

    def wrap_attention(self, model) -> None:
        forward = model.attn.forward

        def timed(*a, **k):
            if not self.on:
                return forward(*a, **k)
            t = time.perf_counter()
            y = forward(*a, **k)
            self.attn_s += time.perf_counter() - t
            return y

        model.attn.forward = timed


def rand_32k(tmp: Path) -> Path:
    """llama-rand-60m (bench/peers' seeded random Llama) with its context raised to 32k: same weights."""
    src = Path("~/.cache/servelm-bench/models/llama-rand-60m").expanduser()
    if not (src / "config.json").exists():
        raise SystemExit(f"{src} is missing: build it with python bench/peers/run_peers.py --models 60m first")
    out = tmp / "llama-rand-60m-32k"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 32768
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def measure(model: str, lengths: list[int], budget: int | None, timers: Timers, bounds: dict, name: str,
            quantization: str = "auto") -> None:
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(model, dtype="bfloat16", quantization=quantization, enable_prefix_caching=False, kv_cache_memory_gb=2.0,
              **kw)
    timers.wrap_attention(llm.engine.loaded.model)
    vocab = llm.engine.loaded.model.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1)
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        n = min(n, llm.engine.core.max_model_len - 1)  # the one output token must fit (an 8k model: 8191)
        prompt = torch.randint(10, vocab - 1, (n,), generator=g).tolist()
        llm.generate([prompt], params, use_tqdm=False)  # warm-up: page in, first-touch the KV blocks
        timers.reset()
        timers.on = True
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        ttft = time.perf_counter() - t
        timers.on = False
        rate = timers.linear_flop / timers.linear_s / 1e9
        print(json.dumps({
            "bench": "long_prompt", "model": name, "quantization": quantization, "prompt_tokens": n,
            "max_num_batched_tokens": budget or llm.engine.config.scheduler_config.max_num_batched_tokens,
            "threads": torch.get_num_threads(), "ttft_s": round(ttft, 3), "prefill_tok_per_s": round(n / ttft, 1),
            "linear_s": round(timers.linear_s, 3), "attention_s": round(timers.attn_s, 3),
            "other_s": round(ttft - timers.linear_s - timers.attn_s, 3),
            "linear_gflop_s": round(rate, 1), "matmul_bf16_gflop_s": bounds["matmul_bf16_gflop_s"],
            "linear_vs_matmul": round(rate / bounds["matmul_bf16_gflop_s"], 3),
            "attention_share": round(timers.attn_s / ttft, 3)}), flush=True)
    del llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--budgets", type=int, nargs="+", default=[0],
                   help="max_num_batched_tokens values to run (0: the engine's default)")
    p.add_argument("--rand-32k", action="store_true", help="also llama-rand-60m at 2k, 8k and 32k")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", nargs="+", default=["auto"],
                   help="quantization values to run side by side (e.g. none gguf: a GGUF file dequantized, and kept)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from servelm.model.loading.source import default_model_path

    timers = Timers()
    timers.wrap_linears()
    bounds = hardware_bounds()
    model = a.model or str(default_model_path())
    for b in a.budgets:
        for q in a.quantization:
            measure(model, a.lengths, b or None, timers, bounds, Path(model).name, q)
    if a.rand_32k:
        with tempfile.TemporaryDirectory() as tmp:
            folder = str(rand_32k(Path(tmp)))
            for b in a.budgets:
                measure(folder, [2048, 8192, 32768], b or None, timers, bounds, "llama-rand-60m-32k")


if __name__ == "__main__":
    main()
