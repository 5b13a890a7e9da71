"""The engine's typed configuration, validated once at start-up."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DEFAULT_KV_CACHE_GB = 1.0


@dataclass
class EngineConfig:
    """Everything `LLM(...)` and `servelm serve` accept about the engine. `None` means "derive it"."""

    model: str | None = None  # HF folder, .gguf file, or None for the default model
    gguf_file: str | None = None  # a GGUF file name inside `model` (a folder)
    tokenizer: str | None = None  # a tokenizer folder other than the model's
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    swap_space_gb: float = 4.0
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
             "one of auto, float32, bfloat16, float16")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size", "a power of two in [1, 256]")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1 or None")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "> 0 or None")
        need(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1 or None")
        need(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "recompute or swap")
        need(self.swap_space_gb >= 0, "swap_space_gb", ">= 0")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1 or None")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
