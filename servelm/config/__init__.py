"""One typed config tree in sections: the engine's (`engine`: model, cache, scheduler, parallel, device,
speculative, lora, structured_outputs), the server's and admission (`settings`), and the helpers that turn them
into command-line flags (`args`). Users give settings by flat names; code reads them in their sections
(`config.cache_config.block_size`). Everything above the model layer reads its settings from here."""

from servelm.config.engine import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)

__all__ = ["CacheConfig", "ConfigError", "DeviceConfig", "EngineConfig", "LoraConfig", "ModelConfig",
           "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "StructuredOutputsConfig"]
