"""servelm: a fast LLM inference engine and OpenAI-compatible server."""

from servelm.model.source import set_offline_env

set_offline_env()

from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.llm_engine import LLMEngine  # noqa: E402
from servelm.entrypoints.llm import LLM  # noqa: E402
from servelm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from servelm.sampling_params import OutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "Logprob", "OutputKind", "RequestOutput",
           "SamplingParams", "__version__"]
