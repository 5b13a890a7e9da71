"""Multimodal checkpoints served by their language model alone: Gemma 3 (4B and up), Mistral Small 3.1/3.2 and
Ministral 3 (Mistral3), LLaVA, Qwen2-VL, Qwen2.5-VL and Qwen3-VL folders, as vLLM serves them with no images allowed.

Their config nests the language model's under `text_config` and their weights put its tensors under a prefix
(`language_model.model.`, or `model.language_model.` as newer transformers saves them) beside a vision tower and
a projector. The language model is one of servelm's families, so it is read as that family: its config is the
text config, its tensors renamed to a causal LM's and the vision tensors left unread. On text, the language model
computes exactly what the whole model does: image tokens are the only thing the vision part adds, and the Qwen VL
models' multimodal RoPE, given one position per token as text is, is the usual RoPE.
"""

from __future__ import annotations

import copy

# architectures -> the causal LM class their language model is served as (None: read from its model_type)
MULTIMODAL_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": None,
    "LlavaForConditionalGeneration": None,
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
}
# where the language model's tensors lie, and the names a causal LM gives them
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."))
# the vision tower and the projector, left unread
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.",
                   "model.vision_tower.", "model.multi_modal_projector.", "model.visual.")


def language_architecture(arch: str | None, text_model_type: str | None, by_model_type: dict[str, str]) -> str | None:
    """The causal LM class a multimodal checkpoint of class `arch` is served as (its language model of
    `text_model_type`), or None where it is no multimodal class servelm reads or its language model no family."""
    if arch not in MULTIMODAL_ARCHITECTURES:
        return None
    return MULTIMODAL_ARCHITECTURES[arch] or by_model_type.get(text_model_type)


def language_config(config, by_model_type: dict[str, str]):
    """The config a multimodal checkpoint's language model is served with (`config` itself for any other):
    its text config, named as its causal LM class, with the whole model's tied-embedding setting (which
    transformers reads from the outer config) and token ids. `language_of` names the checkpoint's class."""
    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in MULTIMODAL_ARCHITECTURES or getattr(config, "text_config", None) is None:
        return config
    text = copy.deepcopy(config.text_config)
    arch = language_architecture(archs[0], getattr(text, "model_type", None), by_model_type)
    if arch is None:
        raise ValueError(f"{archs[0]}: its language model ({getattr(text, 'model_type', None)!r}) is not one of "
                         "servelm's families")
    text.architectures = [arch]
    text.language_of = archs[0]
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def language_tensors(tensors):
    """A multimodal checkpoint's (name, tensor) pairs: the language model's under a causal LM's names; the vision
    tower's and the projector's are skipped."""
    for name, t in tensors:
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, to in _RENAMES:
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        yield name, t
