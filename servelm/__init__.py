"""servelm: a fast LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from servelm.model.loading.source import set_hf_env
from servelm.version import __version__

set_hf_env()

# Imported on first use: `import servelm` (and so `servelm serve`, which starts its engine process
# before anything heavy) must not pay for torch, which LLM and LLMEngine pull in.
_LAZY = {
    "AsyncLLM": "servelm.entrypoints.async_llm",
    "AsyncLLMEngine": "servelm.entrypoints.async_llm",
    "BeamSearchParams": "servelm.beam_search",
    "EngineConfig": "servelm.config.engine",
    "LLMEngine": "servelm.engine.llm_engine",
    "LLM": "servelm.entrypoints.llm",
    "CompletionOutput": "servelm.outputs",
    "Logprob": "servelm.outputs",
    "LoRARequest": "servelm.lora",
    "RequestOutput": "servelm.outputs",
    "EmbeddingRequestOutput": "servelm.outputs",
    "ScoringRequestOutput": "servelm.outputs",
    "ClassificationRequestOutput": "servelm.outputs",
    "OutputKind": "servelm.sampling_params",
    "PoolingParams": "servelm.pooling_params",
    "SamplingParams": "servelm.sampling_params",
}

if TYPE_CHECKING:
    from servelm.beam_search import BeamSearchParams
    from servelm.config.engine import EngineConfig
    from servelm.engine.llm_engine import LLMEngine
    from servelm.entrypoints.async_llm import AsyncLLM, AsyncLLMEngine
    from servelm.entrypoints.llm import LLM
    from servelm.lora import LoRARequest
    from servelm.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringRequestOutput,
    )
    from servelm.pooling_params import PoolingParams
    from servelm.sampling_params import OutputKind, SamplingParams


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'servelm' has no attribute {name!r}")


__all__ = ["LLM", "AsyncLLM", "AsyncLLMEngine", "BeamSearchParams", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingRequestOutput",
           "EngineConfig", "LLMEngine", "Logprob", "LoRARequest", "OutputKind", "PoolingParams", "RequestOutput", "SamplingParams",
           "ScoringRequestOutput", "__version__"]
