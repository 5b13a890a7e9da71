"""Plain reads of config.json / tokenizer files give what transformers' classes give, or step aside."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields

import pytest
import torch

from servelm.model.loading import hf_files
from servelm.model.loading.metadata import load_config_and_eos, load_config_and_tokenizer
from servelm.model.spec import ModelSpec

TEXTS = ["Hello world", "  leading spaces and émojis 🙂", "def f(x):\n    return x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _same_spec(a: ModelSpec, b: ModelSpec) -> None:
    for f in fields(ModelSpec):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_plain_config_reads_as_transformers_does(model_dirs, arch):
    from transformers import AutoConfig

    plain = hf_files.plain_config(model_dirs[arch])
    assert plain is not None
    _same_spec(ModelSpec.from_hf_config(plain), ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dirs[arch])))


def test_plain_config_steps_aside_when_unsure(model_dirs, tmp_path):
    assert hf_files.plain_config(model_dirs["llama3rope"]) is None  # RoPE scaling: transformers' initialiser
    cfg = json.loads((model_dirs["llama"] / "config.json").read_text())
    for edit in ({"rms_norm_eps": None}, {"num_key_value_heads": None}, {"model_type": "gemma"}, {"rope_scaling": {"rope_type": "linear"}},
                 {"rope_parameters": None, "rope_theta": None}):
        d = {k: v for k, v in {**cfg, **edit}.items() if v is not None}
        (tmp_path / "config.json").write_text(json.dumps(d))
        assert hf_files.plain_config(tmp_path) is None, edit
    qwen = json.loads((model_dirs["qwen2"] / "config.json").read_text())
    qwen.pop("layer_types")  # the class would derive the windows itself
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    assert hf_files.plain_config(tmp_path) is None


def _check_same_tokenizer(ours, ref) -> None:
    assert type(ours) is type(ref)
    for t in TEXTS:
        assert ours(t).input_ids == ref(t).input_ids
        assert ours.decode(ref(t).input_ids) == ref.decode(ref(t).input_ids)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == ref.eos_token_id and ours.all_special_ids == ref.all_special_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("named", ["TokenizersBackend", "PreTrainedTokenizerFast", None])
def test_tokenizer_matches_autotokenizer(model_dirs, tmp_path, arch, named):
    from transformers import AutoTokenizer

    folder = tmp_path / arch
    shutil.copytree(model_dirs[arch], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    if named is None:
        tc.pop("tokenizer_class", None)
    else:
        tc["tokenizer_class"] = named
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    _check_same_tokenizer(hf_files.tokenizer_from_folder(folder), AutoTokenizer.from_pretrained(folder))


def test_eos_without_the_tokenizer_matches(model_dirs):
    for arch in ("llama", "llama3rope", "qwen3"):
        src, cfg, tok, eos = load_config_and_tokenizer(str(model_dirs[arch]))
        assert hf_files.tokenizer_eos_id(model_dirs[arch]) == tok.eos_token_id
        assert load_config_and_eos(str(model_dirs[arch]))[2] == eos


def test_eos_falls_back_to_the_tokenizer(model_dirs, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(model_dirs["llama"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.pop("eos_token")  # stated elsewhere (special_tokens_map.json in older folders): build the tokenizer
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    assert hf_files.tokenizer_eos_id(folder) is None
    assert load_config_and_eos(str(folder))[2] == load_config_and_tokenizer(str(folder))[3]
