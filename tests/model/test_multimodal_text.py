"""Multimodal checkpoints (Gemma 3, Mistral3 with Mistral's or Ministral 3's language model, LLaVA, Qwen2.5-VL,
Qwen3-VL) served by their language model alone:
on text, tiny random-weight models give the whole transformers model's greedy tokens, token for token, alone and
batched with prefix caching and chunked prefill; the vision tensors are never read, and a trainer's state dict
of the whole model updates the language model in place."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from family_parity import GREEDY8, mixed_prompts, multimodal_model  # noqa: E402
from tiny_models import hf_greedy, run  # noqa: E402

from servelm import LLM  # noqa: E402

KINDS = {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM",
         "llava": "LlamaForCausalLM",
         "qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM"}


def _save(model, folder, tokenizer_dir):
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.fixture(scope="module", params=list(KINDS))
def multimodal(request, tmp_path_factory, tokenizer_dir):
    model = multimodal_model(request.param)
    return request.param, model, _save(model, tmp_path_factory.mktemp(request.param), tokenizer_dir)


def test_text_matches_the_whole_model(multimodal):
    kind, hf, folder = multimodal
    assert json.loads((folder / "config.json").read_text())["architectures"][0].endswith("ForConditionalGeneration")
    prompts = mixed_prompts()
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    outs = run(llm, prompts[:1], GREEDY8) + run(llm, prompts[1:], GREEDY8)
    assert llm.engine.get_stats().prefix_cache_hits >= 32
    assert outs == [hf_greedy(hf, p, 8) for p in prompts]
    assert llm.engine.core.model.spec.architecture == KINDS[kind]


def test_the_whole_models_state_dict_updates_the_language_model(multimodal, tokenizer_dir):
    """Names as the whole model has them (its vision tensors included): the language model takes its own."""
    kind, _, folder = multimodal
    other = multimodal_model(kind, seed=1)
    prompts = mixed_prompts()
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    before = run(llm, prompts, GREEDY8)
    llm.load_weights(other.state_dict().items())
    after = run(llm, prompts, GREEDY8)
    assert after == [hf_greedy(other, p, 8) for p in prompts] and after != before


def test_hf_overrides_reach_the_language_model(tmp_path, tokenizer_dir):
    """--hf-overrides of a field the outer config lacks (a window) is the language model's, as the whole model reads
    it from its text config; the tokens follow transformers' model built with it."""
    folder = _save(multimodal_model("gemma3"), tmp_path / "gemma3", tokenizer_dir)
    want = multimodal_model("gemma3", sliding_window=8)  # the same weights (seed 0), the window in text_config
    prompts = mixed_prompts()
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, hf_overrides={"sliding_window": 8})
    assert llm.engine.core.model.spec.sliding_windows[0] == 8
    assert run(llm, prompts, GREEDY8) == [hf_greedy(want, p, 8) for p in prompts]


def test_a_template_kept_with_the_processor_serves_chat(tmp_path, tokenizer_dir):
    """Multimodal checkpoints may keep the chat template in their processor's chat_template.json only."""
    import json

    from servelm.model.loading.metadata import load_tokenizer
    from servelm.model.loading.source import resolve_model

    folder = _save(multimodal_model("qwen2_5_vl"), tmp_path / "vl", tokenizer_dir)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(resolve_model(str(folder), None))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi<|assistant|>"


def test_a_qwen_vl_config_in_its_original_flat_form(tmp_path, tokenizer_dir):
    """Qwen2-VL and Qwen2.5-VL repos keep the language model's fields at the top of config.json (no text_config) and
    its RoPE as rope_scaling {"type": "mrope"}: read as transformers reads them."""
    import json

    hf = multimodal_model("qwen2_5_vl")
    folder = _save(hf, tmp_path / "flat", tokenizer_dir)
    config = json.loads((folder / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update({k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (folder / "config.json").write_text(json.dumps(config))
    prompts = mixed_prompts()
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    assert run(llm, prompts, GREEDY8) == [hf_greedy(hf, p, 8) for p in prompts]
