"""What LoRA adapters cost: W1 (64 requests of 128 prompt / 128 output tokens, greedy) on the base model alone
beside W1 with N adapters spread over its requests (request i uses adapter i mod N), in one process, repeats
alternating; plus the memory of one loaded adapter and the time to load one. Prints one JSON object.

  nice python bench/lora_cost.py --adapters 8 --rank 16 --threads 2 --repeats 2
  nice python bench/lora_cost.py --model /path/to/hf-folder --dtype bfloat16 --targets q_proj,v_proj

The adapters are random PEFT-format folders (adapter_config.json + adapter_model.safetensors) of rank --rank on
--targets of every layer, written for the model's shapes; their values do not matter to the cost. The default
model is the packaged SmolLM2-135M. A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from servelm import LLM, LoRARequest, SamplingParams
from servelm.bench.workloads import make_workload

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def write_adapter(out: Path, spec, rank: int, targets: list[str], seed: int) -> Path:
    from safetensors.torch import save_file

    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {"q_proj": (h, spec.num_heads * hd), "k_proj": (h, spec.num_kv_heads * hd),
              "v_proj": (h, spec.num_kv_heads * hd), "o_proj": (spec.num_heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for t in targets:
            k_in, n_out = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}.lora_{{}}.weight"
            tensors[key.format("A")] = torch.randn(rank, k_in, generator=g) * 0.01
            tensors[key.format("B")] = torch.randn(n_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": targets}))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2-135M)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=ALL, help=f"comma-separated PEFT module names (default: {ALL})")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2, help="repeats of (base, adapters), alternating")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, device=args.device, enable_lora=True,
              max_loras=args.adapters, num_kv_blocks=None)
    spec = llm.engine.loaded.model.spec
    w1 = make_workload("W1", spec.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="servelm-lora-bench-"))
    targets = args.targets.split(",")
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", spec, args.rank, targets, i)))
             for i in range(args.adapters)]
    t0 = time.perf_counter()
    llm.engine.add_lora(loras[0])
    first_load_s = time.perf_counter() - t0
    for lr in loras[1:]:
        llm.engine.add_lora(lr)
    info = llm.engine.core.loras.info("a0")
    per_request = [loras[i % len(loras)] for i in range(len(w1.prompts))]
    llm.generate(w1.prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=per_request[:4])  # warm
    tok_s: dict[str, list[float]] = {"base": [], "adapters": []}
    for _ in range(args.repeats):
        for name, lora in (("base", None), ("adapters", per_request)):
            t = time.perf_counter()
            outs = llm.generate(w1.prompts, params, use_tqdm=False, lora_request=lora)
            s = time.perf_counter() - t
            tok_s[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / s)
    base, lora_rate = statistics.median(tok_s["base"]), statistics.median(tok_s["adapters"])
    print(json.dumps({
        "bench": "lora_cost", "model": args.model or "SmolLM2-135M (packaged)", "dtype": str(llm.engine.loaded.model.dtype),
        "device": args.device, "threads": args.threads, "adapters": args.adapters, "rank": args.rank,
        "targets": targets, "workload": "W1 (64 x 128/128, greedy)", "repeats": args.repeats,
        "base_tok_s": round(base, 1), "adapters_tok_s": round(lora_rate, 1),
        "base_over_adapters": round(base / lora_rate, 3),
        "rounds_tok_s": {k: [round(v, 1) for v in vs] for k, vs in tok_s.items()},
        "adapter_mib": round(info.nbytes / 2**20, 3), "adapter_load_s": round(first_load_s, 4),
    }, indent=1))


if __name__ == "__main__":
    main()
