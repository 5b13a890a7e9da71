"""GGUF files written by llama.cpp's converter run as the model they were converted from.

Each tiny random-weight Hugging Face model is converted to a float32 GGUF with llama.cpp's own converter
(tests/support/llama_cpp.py fetches it), and servelm's greedy tokens on the GGUF are matched against transformers
on the original folder: not against transformers' GGUF loader, which drops the same metadata.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from family_parity import (
    GRANITE_SCALARS,
    GREEDY8,
    cohere_config,
    exaone4_config,
    glm4_config,
    granite_config,
    mixed_prompts,
    moe_config,
    olmo_config,
    phi3_config,
    references,
    save_tiny,
    seed_oss_config,
    smollm3_config,
)
from llama_cpp import ConverterUnavailable, convert
from tiny_models import build_model, hf_greedy, random_prompts, run

from servelm import LLM
from servelm.model.loading.gguf_config import read_gguf_config
from servelm.model.loading.metadata import load_config_and_tokenizer

# Longer than the Mistral model's 24-token window, and past the scaled models' original context (64).
PROMPTS = random_prompts(3, 60, 90, seed=7)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dir, model_dirs) -> dict[str, tuple[Path, Path]]:
    """{name: (HF folder, GGUF file)} for the Llama-3-scaled, YaRN, Qwen3 (head_dim 32) and Mistral models."""
    folders = {a: model_dirs[a] for a in ("llama3rope", "qwen3", "mistral")}
    folders["llama_yarn"] = build_model("llama_yarn", tmp_path_factory.mktemp("yarn") / "llama_yarn", tokenizer_dir)
    folders.update(_family_folders(tmp_path_factory.mktemp("families"), tokenizer_dir))  # one converter run for all
    _name_glm_special_tokens(folders["glm4"])
    tc = folders["phi3"] / "tokenizer_config.json"  # the converter's Phi-3 path reads a BPE vocabulary only so
    original = tc.read_text()
    tc.write_text(json.dumps({**json.loads(original), "tokenizer_class": "GPT2Tokenizer"}))
    try:
        files = convert(folders, tmp_path_factory.mktemp("gguf"))
    except ConverterUnavailable as e:
        pytest.skip(str(e))
    finally:
        tc.write_text(original)
    return {a: (folders[a], files[a]) for a in folders}


# (qwen3moe's file differs from qwen2moe's by q/k norms, which the qwen3 file covers, and no shared expert)
FAMILIES = {"phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
            "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
            "olmo3": "Olmo3ForCausalLM", "exaone4": "Exaone4ForCausalLM", "seed_oss": "SeedOssForCausalLM",
            "glm4": "Glm4ForCausalLM", "command_r_plus": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}


def _name_glm_special_tokens(folder: Path) -> None:
    """The converter's GLM-4 path reads the ids of GLM's <|endoftext|> and <|user|> from the tokenizer: one of
    SmolLM2's special tokens takes the second name (the ids, and so the tokens compared, stay the same)."""
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    for added in tok["added_tokens"]:
        if added["content"] == "<issue_start>":
            added["content"] = "<|user|>"
    tok["model"]["vocab"]["<|user|>"] = tok["model"]["vocab"].pop("<issue_start>")
    path.write_text(json.dumps(tok))


def _family_folders(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """Phi-3 with LongRoPE and partial RoPE, and the MoE families as llama.cpp's converter takes them (every
    layer sparse; Mixtral without a window, which a llama-arch file cannot state; OLMo 3 with one RoPE for
    both kinds of layer, all an olmo2 file states)."""
    one_rope = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("full_attention", "sliding_attention")}
    configs = {"phi3": phi3_config(longrope=True), "qwen2_moe": moe_config("qwen2_moe", dense_layers=()),
               "mixtral": moe_config("mixtral", window=None), "granite": granite_config(),
               "smollm3": smollm3_config(), "olmo2": olmo_config(2), "olmo3": olmo_config(3, rope_parameters=one_rope),
               "exaone4": exaone4_config(), "seed_oss": seed_oss_config(), "glm4": glm4_config(),
               "command_r_plus": cohere_config(1, use_qk_norm=True), "cohere2": cohere_config(2)}
    return {n: save_tiny(c, root / n, tokenizer_dir, seed=1) for n, c in configs.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_family_gguf_matches_its_folder(converted, name):
    """phi3: fused attn_qkv and ffn_up, the rope_factors_long/short tensors, attn factor and original context
    (LongRoPE), rope.dimension_count below the head size; qwen2moe: stacked ffn_*_exps experts, the shared
    expert; Mixtral: a llama file with experts (Q/K rows permuted); Granite: its four multipliers under
    llama.cpp's names; SmolLM3: no RoPE on every fourth layer, which the file does not state; OLMo 2: norms after
    the sublayers only, whole-projection q/k norms; OLMo 3: an olmo2 file with a window and its layer pattern;
    EXAONE 4: post-sublayer norms, per-head q/k norms, global layers without RoPE by the window's pattern;
    Seed-OSS: q/k/v and output biases, the norm before the MLP under llama.cpp's post_attention_norm; GLM-4:
    interleaved RoPE on half of each head (rows as the folder's, reordered as they load), sandwich norms, gate and
    up in ffn_up; Command R+: a command-r file's LayerNorm epsilon and logit scale, per-head q/k norms, interleaved
    RoPE; Cohere2: its window on llama.cpp's fixed pattern (three local layers, then a global one without RoPE)."""
    folder, gguf = converted[name]
    assert read_gguf_config(gguf).architectures == [FAMILIES[name]]
    prompts = mixed_prompts()
    llm = LLM(str(gguf), tokenizer=str(folder), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    assert run(llm, prompts, GREEDY8) == references(folder, "float32", prompts)


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
def test_converted_gguf_matches_its_hf_folder(converted, name, caplog):
    """Llama-3 RoPE scaling (the rope_freqs tensor), YaRN metadata, Qwen3's head_dim (key_length)."""
    folder, gguf = converted[name]
    with caplog.at_level(logging.WARNING, logger="servelm"):
        assert _gguf_tokens(folder, gguf) == _hf_tokens(folder)
    # Only families that may have had a window hear about it (Qwen3's config has use_sliding_window).
    assert ("sliding_window" in caplog.text) == (name == "qwen3")


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


def test_granite_and_smollm3_files_read_as_their_folders_configs(converted):
    """What the parity above rests on, named: Granite's multipliers, and SmolLM3's NoPE layers by llama.cpp's
    every-fourth-layer rule (HF's default no_rope_layers, here layer 4 of 4)."""
    granite = read_gguf_config(converted["granite"][1])
    assert {k: getattr(granite, k) for k in GRANITE_SCALARS} == pytest.approx(GRANITE_SCALARS)
    smollm3 = read_gguf_config(converted["smollm3"][1])
    folder = json.loads((converted["smollm3"][0] / "config.json").read_text())
    assert smollm3.no_rope_layers == folder["no_rope_layers"] == [1, 1, 1, 0]


@pytest.mark.parametrize("name", ["qwen3", "llama3rope", "granite", "smollm3"])
def test_gguf_tokenizer_and_eos_match_the_folder(converted, name):
    """The GGUF's tokenizer, on the first start (converted) and on later ones (read from the cache); for
    Granite and SmolLM3, whose files transformers' GGUF reader refuses, built from the vocabulary alone."""
    folder, gguf = converted[name]
    _, ref_cfg, ref, ref_eos = load_config_and_tokenizer(str(folder))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for start in ("first", "cached"):
        _, cfg, tok, eos = load_config_and_tokenizer(str(gguf))
        for text in ["Hello world", "  spaces and émojis 🙂", "def f(x):\n    return x"]:
            assert tok(text).input_ids == ref(text).input_ids, (start, text)
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), start
        assert (tok.bos_token_id, tok.eos_token_id, eos) == (ref.bos_token_id, ref.eos_token_id, ref_eos), start
        assert (_head_dim(cfg), cfg.tie_word_embeddings) == (_head_dim(ref_cfg), ref_cfg.tie_word_embeddings)


def _head_dim(config) -> int:
    """A config's head size (Granite's config class has no head_dim)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# --- files servelm cannot honour ------------------------------------------------------------------
# Tiny files written with gguf's writer: refusal happens at the header, so no vocabulary is needed.


def _tiny_gguf(path: Path, arch: str = "llama", extra: dict | None = None, tensors: dict | None = None,
               drop: tuple[str, ...] = ()) -> Path:
    """A one-block GGUF of `arch`, plus metadata `extra` ("{arch}" filled in; float -> float32, int -> uint32,
    str -> string) and `tensors` (name -> shape), less the tensors named in `drop`."""
    import gguf as g
    import numpy as np

    w = g.GGUFWriter(str(path), arch)
    values = {"{arch}.block_count": 1, "{arch}.context_length": 64, "{arch}.embedding_length": 8,
              "{arch}.feed_forward_length": 16, "{arch}.attention.head_count": 2,
              "{arch}.attention.head_count_kv": 1, "{arch}.attention.layer_norm_rms_epsilon": 1e-6,
              "{arch}.rope.freq_base": 10000.0, **(extra or {})}
    for key, value in values.items():
        add = w.add_float32 if isinstance(value, float) else w.add_string if isinstance(value, str) \
            else w.add_array if isinstance(value, list) else w.add_uint32
        add(key.format(arch=arch), value)
    shapes = {"token_embd.weight": (32, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    if arch.startswith("qwen3"):
        shapes |= {"blk.0.attn_q_norm.weight": (4,), "blk.0.attn_k_norm.weight": (4,)}
    for name, shape in (shapes | (tensors or {})).items():
        if name not in drop:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_is_accepted(tmp_path):
    """The control for the refusals below: the same files without the bad part read as configs."""
    cfg = read_gguf_config(_tiny_gguf(tmp_path / "ok.gguf"))
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads, cfg.rms_norm_eps) == (1, 4, 1, 1e-6)
    assert cfg.tie_word_embeddings and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert read_gguf_config(_tiny_gguf(tmp_path / "q.gguf", arch="qwen3")).architectures == ["Qwen3ForCausalLM"]


def test_unsupported_architecture_is_refused_before_the_tokenizer(tmp_path, private_cache, monkeypatch):
    """A file transformers can read but servelm cannot run is refused from its header: no tokenizer
    conversion (seconds to a minute on real vocabularies), no cache folder left behind."""
    import transformers

    bad = _tiny_gguf(tmp_path / "phi2.gguf", arch="phi2")

    def no_tokenizer(*a, **k):
        raise AssertionError("the tokenizer was converted before the architecture was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported") as err:
        load_config_and_tokenizer(str(bad))
    assert "\n" not in str(err.value)
    assert not private_cache.exists() or not any(private_cache.rglob("*"))


@pytest.mark.parametrize("extra", [
    {"{arch}.attn_logit_softcapping": 30.0}, {"{arch}.final_logit_softcapping": 30.0},
    {"{arch}.logit_scale": 2.0}, {"{arch}.attention.scale": 0.5}, {"{arch}.expert_count": 8},
    {"{arch}.rope.scaling.yarn_log_multiplier": 0.1, "{arch}.rope.scaling.type": "yarn",
     "{arch}.rope.scaling.factor": 4.0, "{arch}.rope.scaling.original_context_length": 16},
    {"{arch}.rope.scaling.type": "longrope", "{arch}.rope.scaling.factor": 4.0},
    {"{arch}.rope.dimension_count": 2},  # partial rotary
    {"{arch}.attention.value_length": 8},  # value heads of another size than key heads
])
def test_metadata_it_cannot_honour_is_refused(tmp_path, extra):
    """Each refusal is one line naming the first key in `extra`."""
    bad = _tiny_gguf(tmp_path / "bad.gguf", extra=extra)
    key = next(iter(extra)).format(arch="llama")
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        load_config_and_tokenizer(str(bad))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("arch", "tensors", "drop", "named"), [
    ("llama", {"blk.0.post_attention_norm.weight": (8,)}, (), r"blk\.0\.post_attention_norm\.weight"),
    ("llama", {"blk.0.ffn_up.bias": (16,)}, (), r"blk\.0\.ffn_up\.bias"),
    ("llama", {"blk.0.attn_q_norm.weight": (4,)}, (), r"blk\.0\.attn_q_norm\.weight"),  # not a llama part
    ("qwen3", {}, ("blk.0.attn_q_norm.weight",), "attn_q_norm"),  # Qwen3 without its q/k norms
])
def test_tensors_it_cannot_honour_are_refused(tmp_path, arch, tensors, drop, named):
    """A tensor the decoder would skip, or one it needs and would silently run without."""
    bad = _tiny_gguf(tmp_path / "bad.gguf", arch=arch, tensors=tensors, drop=drop)
    with pytest.raises(ValueError, match=named):
        load_config_and_tokenizer(str(bad))


def test_window_and_layer_pattern_are_read(tmp_path):
    """`sliding_window` with no pattern windows every layer; a per-layer pattern marks the windowed ones."""
    every = read_gguf_config(_tiny_gguf(tmp_path / "a.gguf", extra={"{arch}.attention.sliding_window": 24}))
    assert every.layer_types == ["sliding_attention"] and every.sliding_window == 24
    assert not getattr(every, "gguf_sliding_window_unstated", False)
    three = {"{arch}.block_count": 3, "{arch}.attention.sliding_window": 8}
    listed = read_gguf_config(_tiny_gguf(tmp_path / "c.gguf", extra={
        **three, "{arch}.attention.sliding_window_pattern": [False, True, True]}))
    assert listed.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    every_third_full = read_gguf_config(_tiny_gguf(tmp_path / "d.gguf", extra={
        **three, "{arch}.attention.sliding_window_pattern": 3}))  # llama.cpp's integer form (Gemma-3 style)
    assert every_third_full.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert read_gguf_config(_tiny_gguf(tmp_path / "b.gguf", arch="qwen2")).gguf_sliding_window_unstated
