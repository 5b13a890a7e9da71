"""Native GGUF loading with the `gguf` package: metadata, dequantized tensors, HF-style names."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from servelm.model.source import cache_dir

# GGUF tensor name (per block) -> Hugging Face name suffix.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's converter permutes Q/K rows for rotary only for these architectures.
_PERMUTED_ARCHS = {"llama", "mistral"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving (its converter pairs rotary halves for ggml's rope)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def iter_gguf_tensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every tensor of a GGUF file, dequantized to `dtype`."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    for t in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", leave=False):
        name = hf_name(t.name)
        if name is None:
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = unpermute_rotary(arr, n_head if "q_proj" in name else n_kv)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype)


def converted_dir(path: Path) -> Path:
    """A cache folder holding the HF config and tokenizer that transformers derives from a GGUF file."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def load_gguf_config_and_tokenizer(path: Path):
    """Config and tokenizer from GGUF metadata via transformers' GGUF support, cached after the first time."""
    from transformers import AutoConfig, AutoTokenizer

    out = converted_dir(path)
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        out.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError:
        pass  # a read-only cache only costs speed
    return config, tokenizer
