"""LLMEngine: the in-process step API (EngineCore for tokens + OutputProcessor for text)."""

from __future__ import annotations

import copy
import logging
import time

from servelm.config.engine import EngineConfig
from servelm.engine.core import EngineCore, EngineStats
from servelm.engine.output_processor import OutputProcessor
from servelm.engine.sequence import Priority, Request
from servelm.engine.threads import configure_threads
from servelm.lora import LoRARequest
from servelm.model.loading.loader import LoadedModel, load_engine_model
from servelm.model.loading.metadata import sampling_defaults
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """add_request / abort_request / step / has_unfinished_requests / get_stats, as in vLLM."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        configure_threads(config)
        self.loaded = loaded or load_engine_model(config, with_tokenizer=True)
        self.tokenizer = self.loaded.tokenizer
        if config.model_config.chat_template is not None and self.tokenizer is not None:
            from servelm.config.engine import read_chat_template

            self.tokenizer.chat_template = read_chat_template(config.model_config.chat_template)
        self.eos_token_ids = self.loaded.eos_token_ids
        mc = config.model_config
        self.sampling_defaults = sampling_defaults(self.loaded.source, mc.generation_config,
                                                   mc.override_generation_config)
        self.core = EngineCore(config, self.loaded.model, tokenizer_loader=lambda: self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """A private copy with the model's EOS ids and the bad words' tokens filled in (the caller's object is
        left alone)."""
        params = copy.copy(params)
        params._eos_token_ids = self.eos_token_ids
        if params.bad_words:
            params.tokenize_bad_words(lambda text: self.tokenize(text, add_special_tokens=False))
        return params

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = Priority.NORMAL, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        """`cache_salt`: requests share prefix-cache blocks only with requests of the same salt. `lora_request`:
        the LoRA adapter to run it with (the engine needs enable_lora)."""
        params = self.prepare_params(params or SamplingParams())
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        ids = params.truncate_prompt(ids, self.max_model_len)  # the output still names the prompt as given
        if params.structured_outputs is not None:  # compile now: a bad grammar raises ValueError here
            self.core.grammars.compile(params.structured_outputs, params._eos_token_ids)
        req = Request(request_id, ids, params, arrival_time or time.monotonic(), priority, cache_salt=cache_salt,
                      lora=lora_request)
        self.core.add_request(req)  # validates; raises ValueError before anything is recorded
        self.output_processor.add_request(request_id, text, ids, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.core.abort_request(request_id)
        return self.output_processor.abort(request_id)

    def step(self) -> list[RequestOutput]:
        seq_outputs, decodes = self.core.step()
        outputs, stopped = self.output_processor.process(seq_outputs, decodes)
        for request_id, index, stop in stopped:
            self.core.finish_seq(request_id, index, "stop", stop)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (vLLM's add_lora); raises ValueError if it does not fit the base
        model. True once it is loaded."""
        if self.core.loras is None:
            raise ValueError("LoRA is not enabled (LLM(..., enable_lora=True))")
        return self.core.loras.add(lora_request).loaded

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter (False if unknown); ValueError while requests use it."""
        return self.core.loras is not None and self.core.loras.remove(name)

    def list_loras(self) -> list[str]:
        return [] if self.core.loras is None else [a.name for a in self.core.loras.adapters()]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while requests are in flight (vLLM's)."""
        return self.core.reset_prefix_cache() is not None

    def update_weights(self, source, partial: bool = False) -> bool:
        """New weights in place (EngineCore.update_weights); False, changing nothing, while requests are in
        flight."""
        return self.core.update_weights(source, partial) is not None

    def sleep(self, level: int = 1) -> int | None:
        """EngineCore.sleep: the bytes given back, or None, changing nothing, while requests are in flight."""
        return self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping

    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def close(self) -> None:
        """Release what outlives the engine object: the tensor-parallel ranks' processes."""
        self.core.close()
