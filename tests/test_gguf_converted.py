"""GGUF files written by llama.cpp's converter run as the model they were converted from.

Each tiny random-weight Hugging Face model is converted to a float32 GGUF with llama.cpp's own converter
(tests/llama_cpp.py fetches it), and servelm's greedy tokens on the GGUF are matched against transformers
on the original folder: not against transformers' GGUF loader, which drops the same metadata.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import build_model, hf_greedy, random_prompts, run
from llama_cpp import ConverterUnavailable, convert

from servelm import LLM
from servelm.model.metadata import load_config_and_tokenizer

# Longer than the Mistral model's 24-token window, and past the scaled models' original context (64).
PROMPTS = random_prompts(3, 60, 90, seed=7)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dir, model_dirs) -> dict[str, tuple[Path, Path]]:
    """{name: (HF folder, GGUF file)} for the Llama-3-scaled, YaRN, Qwen3 (head_dim 32) and Mistral models."""
    folders = {a: model_dirs[a] for a in ("llama", "llama3rope", "qwen3", "mistral")}
    folders["llama_yarn"] = build_model("llama_yarn", tmp_path_factory.mktemp("yarn") / "llama_yarn", tokenizer_dir)
    try:
        files = convert(folders, tmp_path_factory.mktemp("gguf"))
    except ConverterUnavailable as e:
        pytest.skip(str(e))
    return {a: (folders[a], files[a]) for a in folders}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    """Converted tokenizers go to a per-test cache, so a test sees exactly what loading left behind."""
    monkeypatch.setenv("SERVELM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _hf_tokens(folder: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def _gguf_tokens(folder: Path, gguf: Path, **kw) -> list[list[int]]:
    from servelm import SamplingParams

    # The folder's tokenizer: these tests are about the weights and the config (test_gguf_tokenizer covers
    # the GGUF's own tokenizer).
    llm = LLM(str(gguf), tokenizer=str(folder), dtype="float32", num_kv_blocks=64, **kw)
    return run(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))


@pytest.mark.parametrize("name", ["llama3rope", "llama_yarn", "qwen3"])
def test_converted_gguf_matches_its_hf_folder(converted, name):
    """Llama-3 RoPE scaling (the rope_freqs tensor), YaRN metadata, Qwen3's head_dim (key_length)."""
    folder, gguf = converted[name]
    assert _gguf_tokens(folder, gguf) == _hf_tokens(folder)


def test_mistral_gguf_warns_then_matches_with_the_window(converted, caplog):
    """llama.cpp's converter drops Mistral's sliding window: servelm says so and names the setting."""
    folder, gguf = converted["mistral"]
    want = _hf_tokens(folder)
    with caplog.at_level(logging.WARNING, logger="servelm"):
        full = _gguf_tokens(folder, gguf)
    warned = [r.getMessage() for r in caplog.records if "sliding_window" in r.getMessage()]
    assert len(warned) == 1 and "full attention" in warned[0], caplog.text
    assert full != want  # these prompts reach past the window: without it the model differs
    assert _gguf_tokens(folder, gguf, sliding_window=24) == want


def test_llama_gguf_does_not_warn_about_windows(converted, caplog):
    folder, gguf = converted["llama"]
    with caplog.at_level(logging.WARNING, logger="servelm"):
        assert _gguf_tokens(folder, gguf) == _hf_tokens(folder)
    assert "sliding_window" not in caplog.text


def test_gguf_tokenizer_and_eos_match_the_folder(converted):
    folder, gguf = converted["qwen3"]
    _, cfg, tok, eos = load_config_and_tokenizer(str(gguf))
    _, ref_cfg, ref, ref_eos = load_config_and_tokenizer(str(folder))
    for text in ["Hello world", "  spaces and émojis 🙂", "def f(x):\n    return x"]:
        assert tok(text).input_ids == ref(text).input_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token_id, tok.eos_token_id, eos) == (ref.bos_token_id, ref.eos_token_id, ref_eos)
    assert (cfg.head_dim, cfg.tie_word_embeddings) == (ref_cfg.head_dim, ref_cfg.tie_word_embeddings)


# --- files servelm cannot honour -------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, rename_arch: str | None = None, extra: dict | None = None,
             tensors: dict | None = None) -> Path:
    """A copy of a GGUF with its architecture renamed, and/or float32 metadata keys or tensors added."""
    import gguf as g

    reader = g.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    new_arch = rename_arch or arch
    writer = g.GGUFWriter(str(dst), new_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == g.GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{arch}.", f"{new_arch}.", 1), field.contents(), vtype, sub_type=sub)
    for key, value in (extra or {}).items():
        writer.add_float32(key.format(arch=new_arch), value)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture_is_refused_before_the_tokenizer(converted, tmp_path, private_cache, monkeypatch):
    """A file transformers can read but servelm cannot run is refused from its header: no tokenizer
    conversion (seconds to a minute on real vocabularies), no cache folder left behind."""
    import transformers

    bad = _rewrite(converted["qwen3"][1], tmp_path / "moe.gguf", rename_arch="qwen3moe")

    def no_tokenizer(*a, **k):
        raise AssertionError("the tokenizer was converted before the architecture was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    with pytest.raises(ValueError, match="qwen3moe") as err:
        load_config_and_tokenizer(str(bad))
    assert "\n" not in str(err.value)
    assert not private_cache.exists() or not any(private_cache.rglob("*"))


@pytest.mark.parametrize("key", ["{arch}.attn_logit_softcapping", "{arch}.logit_scale",
                                 "{arch}.rope.scaling.yarn_log_multiplier"])
def test_metadata_it_cannot_honour_is_refused(converted, tmp_path, key):
    bad = _rewrite(converted["llama"][1], tmp_path / "bad.gguf", extra={key: 30.0})
    with pytest.raises(ValueError, match=key.format(arch="llama").replace(".", r"\.")) as err:
        load_config_and_tokenizer(str(bad))
    assert "\n" not in str(err.value)


def test_unknown_tensor_is_refused(converted, tmp_path):
    """A tensor no supported architecture has (here a Gemma-style post-attention norm) is never skipped."""
    import numpy as np

    bad = _rewrite(converted["llama"][1], tmp_path / "extra.gguf",
                   tensors={"blk.0.post_attention_norm.weight": np.ones(64, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"blk\.0\.post_attention_norm\.weight"):
        load_config_and_tokenizer(str(bad))
