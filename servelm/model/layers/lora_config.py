"""A PEFT LoRA adapter's `adapter_config.json`, read and checked without torch: the engine reads it before
loading an adapter's weights (model/layers/lora.py), and the model registry reads it in the API process (which never
imports torch) when an adapter is registered."""

from __future__ import annotations

import json
from pathlib import Path


class LoraError(ValueError):
    """An adapter that cannot be used with this base model (the message says why)."""


def read_adapter_config(path: str | Path) -> dict:
    """The adapter folder's config; LoraError naming why servelm cannot serve it (no config, not LoRA, a
    variant the engine does not implement)."""
    p = Path(path)
    cfg_file = p / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError(f"{p} is not a PEFT LoRA adapter folder (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_file} is not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoraError(f"{p}: peft_type {kind} is not LoRA")
    for key, bad, why in (("use_dora", True, "DoRA adapters are not supported"),
                          ("bias", None, "adapters that train biases are not supported"),
                          ("modules_to_save", None, "adapters with modules_to_save (full copies of base modules) "
                                                    "are not supported"),
                          ("fan_in_fan_out", True, "fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported")):
        v = cfg.get(key)
        if (bad is True and v is True) or (bad is None and v not in (None, "none", [], False)):
            raise LoraError(f"{p}: {why}")
    return cfg
