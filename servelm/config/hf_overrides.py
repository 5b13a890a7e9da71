"""The `--hf-overrides` setting: a JSON object of config.json fields (model/loading/hf_overrides.py applies it)."""

from __future__ import annotations

from servelm.config.json_object import parse_json_object


def parse_hf_overrides(value: str | dict | None) -> dict:
    """`--hf-overrides`: a JSON object of config.json fields (ValueError saying what is wrong)."""
    if value is None:
        return {}
    value = parse_json_object(value, '{"architectures": ["Qwen3ForSequenceClassification"]}')
    tokens = value.get("classifier_from_token")
    if tokens is not None and (not isinstance(tokens, list) or not tokens
                               or not all(isinstance(t, str) for t in tokens)):
        raise ValueError("classifier_from_token must be a list of token strings, such as [\"no\", \"yes\"]")
    if value.get("is_original_qwen3_reranker") and (tokens is None or len(tokens) != 2):
        raise ValueError("is_original_qwen3_reranker needs classifier_from_token of two tokens: [\"no\", \"yes\"]")
    return value
