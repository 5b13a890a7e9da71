"""LoRA adapters served beside their base model: `LoRARequest` names the adapter a request runs with (as in
vLLM); the engine loads it (engine/lora_manager.py) and applies it to the rows that use it (model/layers/lora.py)."""

from servelm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
