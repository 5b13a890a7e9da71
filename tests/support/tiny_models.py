"""Tiny random-weight models of each supported family, built from transformers configs, and the oracle
(transformers' own greedy generate) that servelm's outputs are held to."""

from __future__ import annotations

from pathlib import Path

try:
    import torch
except ImportError:  # the torch-free smoke subset (API side, config, scheduler) imports none of this
    torch = None

VOCAB = 49152  # the SmolLM2 tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
              # Wide weights give peaked logits, so greedy choices never hinge on float rounding noise.
              initializer_range=0.2)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**COMMON),
        "llama3rope": LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        # Built only where a test asks for it (not in ARCHS): the GGUF tests' YaRN model.
        "llama_yarn": LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 64,
            "beta_fast": 16.0, "beta_slow": 2.0}),
        "mistral": MistralConfig(**COMMON, sliding_window=24),
        "qwen2": Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=24, max_window_layers=1),
        "qwen3": Qwen3Config(**COMMON, head_dim=32),
    }


ARCHS = ["llama", "llama3rope", "mistral", "qwen2", "qwen3"]



def build_gemma(config, out: Path, tokenizer_dir: Path, seed: int = 0):
    """A random Gemma from a transformers config, saved with the test tokenizer: (folder, model). Its norm
    weights are randomised: Gemma initialises them to zero, which would hide whether (1 + w) is applied."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out, model


def build_model(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[arch], dtype=torch.float32)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' own greedy generate, never stopping early."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None  # else generate() merges it back in and stops at EOS
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, "the oracle must not stop early"
    return new


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(4, VOCAB, (k - 1,), generator=g).tolist() for k in lens]


_refs: dict = {}


def reference(hf_models, arch: str, prompts: list[list[int]], max_new: int = 16) -> list[list[int]]:
    """The oracle's greedy continuations, each computed once per session."""
    out = []
    for p in prompts:
        key = (arch, tuple(p), max_new)
        if key not in _refs:
            _refs[key] = hf_greedy(hf_models[arch], p, max_new)
        out.append(_refs[key])
    return out


def run(llm, prompts, params=None) -> list[list[int]]:
    """servelm's token ids for each prompt (16 greedy tokens unless `params` says otherwise)."""
    from servelm import SamplingParams

    params = params or SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def cpu_vendor() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return next((line.split(":")[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
