"""What quantization fp8 costs in quality: the same model run unquantized and with fp8 linears, one engine
after the other, on a fixed text. Prints one JSON object.

  nice python bench/fp8_quality.py --device cpu --dtype bfloat16   # the default SmolLM2-135M, reference path
  nice python bench/fp8_quality.py --model /path/to/hf-folder --device cpu --dtype bfloat16
  python bench/fp8_quality.py --model Qwen/Qwen3-0.6B --device cuda --tokens 64      # the scaled_mm path
  python bench/fp8_quality.py --model /path/to/fp8-checkpoint --base-quantization none   # an FP8 checkpoint
                                                                                       # against its dequantized self

Reported for each run: the perplexity of the text (teacher forced, chunks of --chunk tokens), and for fp8
against the base: the mean and largest absolute difference of the text tokens' log-probabilities, and greedy
agreement over --prompts prompts cut from the text (--tokens generated each): the share of positions where
both picked the same token, and the mean length of the common prefix (after the first divergence the two
continue from different texts). Which fp8 matmul ran (scaled_mm on GPUs with FP8 tensor cores in bfloat16,
else the reference path, where only the weights are rounded) is reported too.
A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import torch

from servelm import LLM, SamplingParams

# A fixed English text (written for this benchmark), about 250 tokens.
TEXT = (
    "The survey ship left the harbour an hour before sunrise, its deck still wet from the night's rain. The "
    "captain had planned the route for weeks: along the coast to the cape, then north across open water to "
    "the chain of small islands that no one had measured since the old charts were drawn. On board were two "
    "geologists, a cook, four sailors and a young cartographer who had never been to sea. She spent the first "
    "morning at the rail, sketching the shape of the cliffs and counting the seabirds that nested in them. By "
    "noon the wind had risen and the ship began to roll, and most of the crew went below to eat. The captain "
    "stayed at the wheel. He trusted the instruments, but he trusted his own eyes more, and he had learned "
    "long ago that the sea changes faster than any forecast. In the evening they anchored in a sheltered bay. "
    "The geologists went ashore with lanterns to collect samples of the dark rock, and the cartographer "
    "compared her drawings with the old charts by the light of the galley stove. Several of the islands were "
    "in the wrong place, and one of them did not seem to exist at all."
)


def _prompt_logprobs(llm: LLM, chunks: list[list[int]]) -> torch.Tensor:
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([d[t].logprob for o, c in zip(outs, chunks, strict=True)
                         for d, t in zip(o.prompt_logprobs[1:], c[1:], strict=True)])


def _paths(model) -> dict[str, int]:
    """How many linears run each fp8 matmul (scaled_mm, reference), or their other formats."""
    counts: dict[str, int] = {}
    for lw in model.layers:
        for lin in (lw.qkv, lw.o_proj, lw.down, getattr(lw.gate_up, "linear", None) or lw.gate_up):
            kernel = getattr(lin, "kernel", None)
            name = getattr(kernel, "path", None) or getattr(kernel, "name", type(lin).__name__)
            counts[name] = counts.get(name, 0) + 1
    return counts


def measure(args, quantization: str, chunks: list[list[int]], prompts: list[list[int]]) -> dict:
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantization=quantization,
              max_model_len=args.chunk + args.tokens + 8, num_kv_blocks=args.kv_blocks)
    load_s = time.perf_counter() - t0
    lps = _prompt_logprobs(llm, chunks)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    model = llm.engine.core.model
    row = {"quantization": model.quantization, "dtype": str(model.dtype).removeprefix("torch."),
           "linears": _paths(model), "load_s": round(load_s, 2),
           "perplexity": math.exp(-lps.mean().item()), "text_tokens": len(lps)}
    del llm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"row": row, "logprobs": lps, "greedy": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face folder, repo id or .gguf file (default: "
                    "servelm's default SmolLM2-135M-Instruct; a GGUF file's weights are dequantized first)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--base-quantization", default="none", help="what fp8 is compared with (default none)")
    ap.add_argument("--text-file", type=Path, help="the text to score instead of the built-in one")
    ap.add_argument("--chunk", type=int, default=128, help="tokens per teacher-forced chunk")
    ap.add_argument("--prompts", type=int, default=4, help="greedy prompts cut from the text")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--kv-blocks", type=int, default=None)
    args = ap.parse_args()

    from servelm.model.loading.metadata import load_config_and_tokenizer

    text = args.text_file.read_text() if args.text_file else TEXT
    tok = load_config_and_tokenizer(args.model, None, None)[2]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    chunks = [bos + ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]
    step = max(1, (len(ids) - args.prompt_len) // max(1, args.prompts))
    prompts = [bos + ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]

    base = measure(args, args.base_quantization, chunks, prompts)
    fp8 = measure(args, "fp8", chunks, prompts)
    diff = (fp8["logprobs"] - base["logprobs"]).abs()
    same = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(fp8["greedy"], base["greedy"], strict=True)]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
              for x, y in zip(fp8["greedy"], base["greedy"], strict=True)]
    print(json.dumps({
        "model": args.model, "device": args.device, "base": base["row"], "fp8": fp8["row"],
        "perplexity_ratio": fp8["row"]["perplexity"] / base["row"]["perplexity"],
        "logprob_abs_diff_mean": diff.mean().item(), "logprob_abs_diff_max": diff.max().item(),
        "greedy_token_agreement": sum(same) / sum(len(x) for x in base["greedy"]),
        "greedy_common_prefix_mean": sum(prefix) / len(prefix),
    }, indent=2))


if __name__ == "__main__":
    main()
