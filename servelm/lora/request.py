"""What a request says about its adapter: vLLM's `LoRARequest`, field for field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: `lora_name` identifies it (the `model` name clients send),
    `lora_int_id` is a positive integer unique to it, `lora_path` is a local PEFT adapter folder
    (`adapter_config.json` + `adapter_model.safetensors`). An adapter the engine already holds may be named
    with an empty path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRARequest needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
