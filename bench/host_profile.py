"""Where the host's time goes in `LLM.generate` on a device: cProfile over one greedy batch (W1's shape by
default: 64 prompts of 128 tokens, 128 out) of a random-weight bf16 Llama shape, after a warm-up, printed as
JSON (wall time, per-step time, and the functions with the most own time). Run it for two source trees
(PYTHONPATH) on the same machine to see which host work a change added or removed.

  PYTHONPATH=. python bench/host_profile.py --shape 60m --device cuda [--rows 64] [--out-tokens 128]

A benchmark, not a test; on the CPU it runs too (a smoke run: the model's own work then dominates).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import SHAPES  # noqa: E402


def build(shape: str, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    h, layers, heads, kv, inter, vocab, tied = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1").save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="60m", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--out-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    from servelm import LLM, SamplingParams

    path = build(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    llm = LLM(str(path), dtype="bfloat16", device=args.device, kv_cache_memory_gb=2.0, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [(7 * r + i) % 1000 + 2 for i in range(128)]} for r in range(args.rows)]
    params = SamplingParams(temperature=0.0, max_tokens=args.out_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    prof = cProfile.Profile()
    prof.runcall(llm.generate, prompts, params, use_tqdm=False)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
    top = [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "own_ms": round(tt * 1e3, 2),
            "cum_ms": round(ct * 1e3, 2)} for (f, line, name), (_, nc, tt, ct, _) in rows]
    print(json.dumps({"shape": args.shape, "device": args.device, "rows": args.rows, "wall_s": round(wall, 4),
                      "step_ms": round(wall / args.out_tokens * 1e3, 3), "top": top}))


if __name__ == "__main__":
    main()
