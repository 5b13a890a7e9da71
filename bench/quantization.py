"""Weight formats side by side on the real SmolLM2-135M (its Q4_1 GGUF): weight memory, mean log-likelihood
(and perplexity) of a fixed text, batch-1 decode TPOT and the text's prefill time (one request, prefix
caching off), one engine per format, one after another.
Prints one JSON object.

  nice python bench/quantization.py --formats bf16,int8,int4,gguf --tokens 64 --threads 2
  nice python bench/quantization.py --formats bf16,gguf --gguf /tmp/smollm2-q8_0.gguf   # bench/gguf_requant.py

Each row also gives the bytes a batch-1 decode step reads (the linears as their kernels keep them, plus the
LM head) and the bandwidth bound of that step: those bytes over the plain read speed measured first (a
512 MB buffer summed on --threads threads).

Formats: bf16 (quantization none: the file dequantized to bfloat16, today's path), int8 / int4 (the
linears of that bf16 model requantized at load; int4 in groups of --group-size), gguf (the file's Q4_1
linears kept as they are), gguf_f32 / none_f32 (the same two in float32: the kept format's
reference). Embeddings and the tied LM head stay in bf16 everywhere (Q8_0 in the file: dequantized).
A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from servelm import LLM, SamplingParams
from servelm.model.loading.source import default_model_path

# A fixed English text (written for this benchmark), about 300 tokens.
TEXT = (
    "The river town woke slowly in the winter. Before dawn the baker lit his ovens, and the smell of bread "
    "drifted down the narrow streets toward the harbour, where fishermen were already checking their nets. "
    "Most of the boats had been built by the same family for three generations, and every captain knew the "
    "names of the men who had shaped their hulls. When the first light reached the water, the gulls began "
    "to circle above the market square. Children walked to school in pairs, carrying their books in cloth "
    "bags, and the teacher waited at the door with a list of names. In the afternoon the wind turned to the "
    "north and the sky filled with heavy clouds. The old lighthouse keeper climbed the spiral stairs to "
    "check the lamp, as he had done every evening for forty years. He wrote in his logbook that the sea was "
    "calm, the visibility was good, and that a single ship had passed to the east carrying timber from the "
    "northern forests. At night the town grew quiet again. A few windows glowed with candlelight, a dog "
    "barked somewhere near the mill, and the river continued its long journey to the sea, carrying the "
    "melted snow of the mountains past sleeping houses and empty fields."
)
FORMATS = {  # name: (dtype, quantization)
    "bf16": ("bfloat16", "none"), "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4"),
    "gguf": ("bfloat16", "gguf"), "gguf_f32": ("float32", "gguf"), "none_f32": ("float32", "none"),
}


def weight_bytes(model) -> dict[str, int]:
    """Bytes the model keeps for its weights: the linears in whatever layout their kernel reads, the embedding
    and norms, and the LM head where it is not the embedding tensor itself (a tied head packed for a bf16
    kernel is a second copy)."""
    def lin_bytes(lin) -> int:
        if hasattr(lin, "parts"):  # a fused weight whose parts keep different formats (layers.PartsLinear)
            return sum(lin_bytes(p) for p in lin.parts)
        if getattr(lin, "quant", None) is not None:
            bias = getattr(lin, "bias", None)  # a fused gate/up has none
            return lin.quant.nbytes + (0 if bias is None else bias.nbytes)
        ts = [getattr(lin, n, None) for n in ("tiled", "packed", "weight", "bias")]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    linears = sum(lin_bytes(lin) for lw in model.layers
                  for lin in (lw.qkv, lw.o_proj, lw.down, lw.gate_up.linear or lw.gate_up))
    other = model.embed.nbytes + model.norm.nbytes + sum(
        t.nbytes for lw in model.layers for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm) if t is not None)
    head = 0 if model.lm_head.weight is model.embed else lin_bytes(model.lm_head)
    return {"linears": linears, "embedding_norms": other, "lm_head_copy": head, "total": linears + other + head}


def read_gb_s(threads: int | None) -> float:
    """Plain read speed: the best of 5 sums over a 512 MB buffer (float32, memory-bound)."""
    if threads:
        torch.set_num_threads(threads)
    buf = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def measure(name: str, args) -> dict:
    dtype, quant = FORMATS[name]
    path = Path(args.gguf) if args.gguf else default_model_path()
    t0 = time.perf_counter()
    llm = LLM(str(path.parent), gguf_file=path.name, dtype=dtype, quantization=quant,
              quantization_group_size=args.group_size, kv_cache_memory_gb=0.25, num_threads=args.threads,
              enable_prefix_caching=False)  # every timed prompt runs its prefill
    load_s = time.perf_counter() - t0
    model = llm.engine.core.model
    ids = llm.get_tokenizer()(TEXT).input_ids
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
    mean_ll = sum(lps) / len(lps)
    prompt = llm.get_tokenizer()("Once upon a time").input_ids
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)  # warm-up
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t_prefill = _timed(llm, ids, one)
    t_first = _timed(llm, prompt, one)
    t_all = _timed(llm, prompt, greedy)
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    wb = weight_bytes(model)
    step = wb["linears"] + (wb["lm_head_copy"] or model.embed.nbytes)  # what a batch-1 step streams
    bound_ms = step / args.read_gb_s / 1e6
    return {"format": name, "dtype": dtype, "quantization": quant, "load_s": round(load_s, 2),
            "weight_bytes": wb, "step_read_mb": round(step / 1e6, 1), "bandwidth_bound_ms": round(bound_ms, 3),
            "decode_tapes": model.tapes is not None and model.tapes.active,
            "text_tokens": len(ids), "mean_loglik": round(mean_ll, 5), "perplexity": round(math.exp(-mean_ll), 4),
            "tpot_ms": round((t_all - t_first) / args.tokens * 1e3, 3),
            "prefill_ms": round(t_prefill * 1e3, 1), "greedy_16": text}


def _timed(llm, prompt, params) -> float:
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="bf16,int8,int4,gguf")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed (batch 1)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M's Q4_1)")
    args = p.parse_args()
    args.read_gb_s = read_gb_s(args.threads)
    rows = [measure(f, args) for f in args.formats.split(",")]
    for r in rows:
        r["tpot_vs_bound"] = round(r["tpot_ms"] / r["bandwidth_bound_ms"], 2)
    print(json.dumps({"model": str(args.gguf or default_model_path().name), "torch": torch.__version__,
                      "threads": args.threads or torch.get_num_threads(), "group_size": args.group_size,
                      "read_gb_s": round(args.read_gb_s, 1), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
