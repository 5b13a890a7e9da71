"""The engine's typed configuration, validated once at start-up."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args, get_origin

DEFAULT_KV_CACHE_GB = 1.0  # the KV cache on the CPU unless sized
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's: the share of a GPU's memory an engine sizes itself to


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """(name, path, base model name or None) from vLLM's --lora-modules forms: NAME=PATH, or a JSON object
    {"name": ..., "path": ..., "base_model_name": ...}. Raises ValueError."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
            raise ValueError("the JSON form needs 'name' and 'path'")
        return str(d["name"]), str(d["path"]), d.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError("expected NAME=PATH")
    return name.strip(), path.strip(), None


class ConfigError(ValueError):
    """An invalid configuration value: names the key, the value and what is allowed."""

    def __init__(self, key: str, value, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key} must be {allowed}, got {value!r}")


def _f(default, help: str, runtime: bool = False, token_count: bool = False):
    """A config field; `runtime` marks it changeable while serving (PATCH /admin/config); `token_count` marks an
    integer that also takes vLLM's human-readable forms (32k, 1K, 2.5m: see `token_count`)."""
    return field(default=default, metadata={"help": help, "runtime": runtime, "token_count": token_count})


# The choices of the fields that take one of a few names: the one place each set is written. Validation, the
# config file and env readers, and the OpenAPI document of PATCH /admin/config read them from the annotation.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "gguf", "int8", "int4", "fp8"]
Runner = Literal["auto", "generate", "pooling"]
PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["priority", "fcfs"]
StructuredOutputBackend = Literal["auto", "llguidance", "xgrammar"]
SpeculativeMethod = Literal["ngram", "draft"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def choices(tp) -> tuple[str, ...] | None:
    """The names a Literal annotation allows (None for any other type)."""
    return get_args(tp) if get_origin(tp) is Literal else None


def one_of(tp) -> str:
    """'a, b or c' for a Literal annotation: what an error message says is allowed."""
    names = choices(tp)
    return ", ".join(names[:-1]) + " or " + names[-1]


# vLLM's --dtype spellings that name one of servelm's dtypes (vLLM: half = float16, float = float32)
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}
DTYPES = choices(Dtype)

_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def token_count(value: str, auto: bool = False) -> int | None:
    """An integer as vLLM's --max-model-len and --max-num-batched-tokens read it: plain digits, or a number
    with a suffix, lower case decimal (1k = 1000, 25.6k = 25600, m, g, t) and upper case binary (1K = 1024,
    M, G, T; whole numbers only). With `auto`, 'auto' and -1 stand for None (derive it), as in vLLM's
    --max-model-len. Raises ValueError."""
    text = str(value).strip()
    if auto and (text == "-1" or text.lower() == "auto"):
        return None
    m = _TOKEN_COUNT.fullmatch(text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer (nor one like 32k = 32000 or 32K = 32768)") from None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if not number.isdigit():
        raise ValueError(f"{text!r}: no decimals with a binary suffix like {suffix}; did you mean "
                         f"{number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: the contents of the file it names, else the value itself as an inline
    Jinja template when it holds '{', '}' or a line break. Raises ValueError for a value that looks like a
    path (none of those characters) but cannot be read."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the "path"
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"chat template {value!r} looks like a file path, but it cannot be read ({e})") from e
        return value


def cpu_list(spec: str) -> list[int] | None:
    """'0-3,6' -> [0, 1, 2, 3, 6]; None unless every CPU named is one this process may run on."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first > last:
                return None
            cpus.update(range(first, last + 1))
    except ValueError:
        return None
    return sorted(cpus) if cpus and cpus <= os.sched_getaffinity(0) else None


def require(obj, ok: bool, name: str, allowed: str) -> None:
    """Raise ConfigError for obj.name unless ok."""
    if not ok:
        raise ConfigError(name, getattr(obj, name), allowed)


@dataclass
class ModelConfig:
    """What is served: the checkpoint, its tokenizer and chat template, the weights' types, the context."""

    model: str | None = _f(None, "a Hugging Face folder, a .gguf file, a Hugging Face repo id (ORG/NAME, "
                           "ORG/NAME@REVISION, ORG/NAME:FILE.gguf or ORG/NAME:QUANT: from the Hugging Face cache, "
                           "downloaded first if missing unless HF_HUB_OFFLINE is set), or omitted for the default "
                           "SmolLM2-135M-Instruct")
    gguf_file: str | None = _f(None, "a GGUF file name inside the MODEL folder or repo")
    revision: str | None = _f(None, "the branch, tag or commit of a Hugging Face repo id MODEL (as vLLM's "
                              "--revision; the same as MODEL@REVISION); default: main")
    download_dir: str | None = _f(None, "where Hugging Face repo ids are downloaded to and looked up, as vLLM's "
                                  "--download-dir: a Hugging Face cache folder (its models--ORG--NAME layout) in "
                                  "place of HF_HUB_CACHE's; every process servelm starts uses it")
    hf_token: str | None = _f(None, "the Hugging Face token that downloads gated or private repo ids, as vLLM's "
                              "--hf-token, in place of HF_TOKEN (never printed; HF_TOKEN or `hf auth login` keep "
                              "it off the command line)")
    tokenizer: str | None = _f(None, "a tokenizer folder to use instead of the model's own")
    chat_template: str | None = _f(None, "a Jinja chat template to use instead of the tokenizer's: a file, or the "
                                   "template itself inline (as vLLM's --chat-template: a value holding '{', '}' "
                                   "or a line break that names no file is the template); default: the "
                                   "tokenizer's own")
    runner: Runner = _f("auto", "what MODEL runs for, as vLLM's --runner: generate (a generation engine), pooling "
                        "(embeddings, scores and classes: the server's embedding model, for /v1/embeddings, "
                        "/v1/score, /v1/rerank and /classify, in place of a generation engine), or auto (the "
                        "default): pooling for an embedding model, cross-encoder or classifier folder (a "
                        "sentence-transformers modules.json with a pooling module, or an encoder architecture), "
                        "else generate; with pooling, a generation model's folder embeds (the last token's final "
                        "hidden state, normalized, as vLLM's --convert embed)")
    hf_overrides: str | None = _f(None, "a JSON object of config.json fields merged over MODEL's before it loads, "
                                  "as vLLM's --hf-overrides (not for a GGUF file): RoPE scaling for a longer context, "
                                  "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                  "\"original_max_position_embeddings\": 32768}}', or a Qwen3-Reranker scored by "
                                  "its yes and no tokens: '{\"architectures\": "
                                  "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", "
                                  "\"yes\"], \"is_original_qwen3_reranker\": true}'")
    trust_remote_code: bool = _f(False, "accepted for vLLM command lines and changes nothing: servelm runs only "
                                 "its built-in architectures and never executes code from a model folder")
    dtype: Dtype = _f("auto", "auto | float32 | bfloat16 | float16 (vLLM's half and float, and bf16, name the same "
                    "types); auto picks bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), else float32")
    quantization: Quantization = _f("auto", "auto | none | gguf | int8 | int4 | fp8: linear weights kept quantized in "
                           "memory (README: Quantization). gguf keeps a GGUF "
                           "file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K linears as they are (servelm's CPU kernels) "
                           "and dequantizes its other types; int8 (per output channel) and int4 (group-wise) quantize "
                           "the linears at load (PyTorch's CPU kernels, Triton on a GPU); fp8 keeps an FP8 "
                           "checkpoint's e4m3 linears or quantizes any other's at load (per output channel), run by "
                           "torch._scaled_mm with activations scaled per token on GPUs of compute capability >= 8.9 "
                           "in bfloat16, else dequantized each call (an exact reference, slow on the CPU); none "
                           "dequantizes everything to --dtype; auto (default) is fp8 for an FP8 checkpoint, gguf for "
                           "a GGUF file in bfloat16 on a CPU that runs servelm's GGUF kernels, else none")
    quantization_group_size: int = _f(32, "int4: weights sharing one scale and zero point, 32, 64, 128 or 256; "
                                      "it must divide every linear's input width (SmolLM2's 576: 32 or 64)")
    max_model_len: int | None = _f(None, "context length; as vLLM's it takes 32k (32000), 32K (32768) and auto or "
                                   "-1 (the default: the model's, capped by the KV cache)", token_count=True)
    sliding_window: int | None = _f(None, "an attention window (tokens) for every layer, overriding the model's: "
                                    "for GGUF files that do not state the window the model was trained with "
                                    "(llama.cpp's converter drops Mistral's and Qwen's)")
    seed: int = _f(0, "seed of the sampler's random generator for unseeded requests")
    max_logprobs: int = _f(20, "the most logprobs (and prompt_logprobs, top_logprobs) a request may ask for, as "
                           "vLLM's --max-logprobs; -1: the whole vocabulary")
    logprobs_mode: LogprobsMode = _f("raw_logprobs", "what a sampled token's logprobs and top_logprobs hold, as "
                                     "vLLM's: raw_logprobs, the model's distribution; processed_logprobs, the one "
                                     "the token was drawn from (after logit_bias, allowed tokens, bad words, "
                                     "min_tokens, penalties, the grammar, temperature, min_p, top_k and top_p); "
                                     "raw_logits and processed_logits, the same before the softmax")
    generation_config: str = _f("auto", "where a request's unset sampling fields take their defaults from, as "
                                "vLLM's: auto reads the model's generation_config.json (temperature, top_p, top_k, "
                                "min_p, repetition_penalty, presence_penalty, frequency_penalty, and max_new_tokens "
                                "as max_tokens), vllm uses OpenAI's neutral defaults, a folder reads its "
                                "generation_config.json")
    override_generation_config: str | None = _f(None, "a JSON object of generation_config.json sampling fields that "
                                                "win over the model's, e.g. '{\"temperature\": 0.6}' (as vLLM's; it "
                                                "applies with --generation-config vllm too)")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        from servelm.config import generation

        need(isinstance(self.max_logprobs, int) and self.max_logprobs >= -1, "max_logprobs",
             "an integer >= 0, or -1 for the whole vocabulary")
        need(self.logprobs_mode in choices(LogprobsMode), "logprobs_mode", one_of(LogprobsMode))
        need(self.download_dir is None or not Path(self.download_dir).expanduser().is_file(), "download_dir",
             "a folder (a Hugging Face cache), not a file")
        if self.hf_token is not None and (not self.hf_token or any(c.isspace() for c in self.hf_token)):
            raise ConfigError("hf_token", "<redacted>", "a token with no spaces or line breaks")
        try:
            generation.check_setting(self.generation_config)
        except ValueError as e:
            raise ConfigError("generation_config", self.generation_config, str(e)) from None
        from servelm.config.hf_overrides import parse_hf_overrides

        if isinstance(self.hf_overrides, dict):  # from Python or a config file's mapping
            self.hf_overrides = json.dumps(self.hf_overrides)
        try:
            parse_hf_overrides(self.hf_overrides)
        except ValueError as e:
            raise ConfigError("hf_overrides", self.hf_overrides, str(e)) from None
        if isinstance(self.override_generation_config, dict):  # from Python or a config file's mapping
            self.override_generation_config = json.dumps(self.override_generation_config)
        try:
            generation.parse_overrides(self.override_generation_config)
        except ValueError as e:
            raise ConfigError("override_generation_config", self.override_generation_config,
                              f"a JSON object of sampling fields ({e})") from None

        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.revision is not None:  # folded into the model string every process resolves
            from servelm.config.model_ref import with_revision

            try:
                self.model = with_revision(self.model, self.revision)
            except ValueError as e:
                raise ConfigError("revision", self.revision, f"the revision MODEL names ({e})") from None
        need(self.dtype in DTYPES, "dtype", "one of auto, float32, bfloat16, float16 (or vLLM's half, float, "
             "and bf16)")
        if self.chat_template is not None:
            try:
                read_chat_template(self.chat_template)
            except ValueError as e:
                raise ConfigError("chat_template", self.chat_template, "a readable file or an inline Jinja "
                                  f"template ({e})") from None
        need(self.quantization in choices(Quantization), "quantization", one_of(Quantization))
        need(self.runner in choices(Runner), "runner", one_of(Runner))
        need(self.quantization_group_size in (32, 64, 128, 256), "quantization_group_size", "32, 64, 128 or 256")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1 or None")
        need(self.sliding_window is None or self.sliding_window >= 1, "sliding_window", ">= 1 or None")


@dataclass
class CacheConfig:
    """The KV cache: its blocks, its size and element type, prefix caching, swap space."""

    block_size: int = _f(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _f(None, "KV cache blocks; overrides --kv-cache-memory-gb and "
                                   "--gpu-memory-utilization")
    kv_cache_memory_gb: float | None = _f(None, f"KV cache budget in GiB (default on the CPU {DEFAULT_KV_CACHE_GB}; "
                                          "on a GPU it overrides --gpu-memory-utilization)")
    gpu_memory_utilization: float | None = _f(None, "CUDA: the share of the GPU's memory this engine may use for "
                                              "weights, activations and KV cache, in (0, 1] (default 0.9, as "
                                              "vLLM); the KV cache gets what a profile run of the largest step "
                                              "leaves. Not used on the CPU")
    kv_cache_dtype: KVCacheDtype = _f("auto", "auto | fp8 | fp8_e4m3: the KV cache's element type, as vLLM's "
                                      "--kv-cache-dtype. auto is the model's dtype; fp8 (= fp8_e4m3) stores keys and "
                                      "values as float8_e4m3fn with a per-layer scale (1.0, or the checkpoint's "
                                      "k_scale/v_scale), half the bytes of bfloat16, so the same memory holds "
                                      "twice the blocks. Attention reads it through PyTorch on the CPU (not the "
                                      "C++ kernels) and through the Triton kernels on a GPU of compute "
                                      "capability 8.9 or newer (docs: Quantization, FP8 KV cache)")
    enable_prefix_caching: bool = _f(True, "reuse the KV cache of shared prompt prefixes")
    kv_cache_persist: str | None = _f(None, "a directory where `servelm serve` saves the prefix cache's blocks on "
                                      "graceful shutdown and restores them from on start, so a restarted server "
                                      "keeps its prefix hits (one file per model; README: KV cache persistence)")
    swap_space_gb: float = _f(4.0, "CPU swap space for preempted requests in GiB (swap mode)")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size", "a power of two in [1, 256]")
        need(self.kv_cache_dtype in choices(KVCacheDtype), "kv_cache_dtype", one_of(KVCacheDtype))
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1 or None")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "> 0 or None")
        need(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
             "in (0, 1] or None")
        need(self.kv_cache_persist is None or (self.enable_prefix_caching and bool(self.kv_cache_persist)),
             "kv_cache_persist", "a directory, with prefix caching on (or None)")
        need(self.swap_space_gb >= 0, "swap_space_gb", ">= 0")


@dataclass
class SchedulerConfig:
    """What each engine step runs: batch limits, chunked prefill, latency targets, preemption and priorities."""

    max_num_seqs: int = _f(256, "most sequences in one batch", runtime=True)
    max_num_batched_tokens: int = _f(2048, "token budget of one engine step (prefill chunks + decodes); as vLLM's, "
                                     "it takes 8k (8000) or 8K (8192)", token_count=True)
    enable_chunked_prefill: bool = _f(True, "split long prompts over several steps, mixed with decodes")
    itl_target_ms: float = _f(0.0, "a target inter-token latency (ms) for streams that are decoding: while any "
                              "request decodes, prompt chunks are cut to what an online model of step cost "
                              "predicts fits in this time beside the decodes (at least 32 tokens), so a long "
                              "prompt does not stall every stream; 0 fills max_num_batched_tokens (README: "
                              "Latency under load)")
    ttft_target_ms: float = _f(500.0, "with --itl-target-ms: the time within which the prompt tokens waiting "
                               "should still be computed; prompt chunks are never cut below the backlog's share "
                               "of it, so the cut cannot grow the queue without bound (0: no floor)")
    preemption_mode: PreemptionMode = _f("recompute", "recompute | swap: what happens to a request preempted "
                              "when the KV cache is full")
    scheduling_policy: SchedulingPolicy = _f("priority", "priority | fcfs: admit and preempt by priority class "
                                "(high, normal, low) with aging, or purely by arrival", runtime=True)
    priority_aging_s: float = _f(10.0, "seconds of waiting that lift a request one priority class, so "
                                 "low priority is never starved (0 disables aging)", runtime=True)
    async_scheduling: bool | None = _f(None, "while a step of decodes runs, schedule and launch the next one "
                                       "behind it, its input tokens taken on the device from the step in flight, so "
                                       "that the host's work hides behind the GPU's (vLLM's --async-scheduling; "
                                       "docs: GPU, Asynchronous scheduling). Steps overlap only while every running "
                                       "request is a plain decode (one sample, no logprobs, penalties, min_tokens "
                                       "or grammar) and no waiting request could be admitted. Default (None): on "
                                       "with a CUDA device unless speculative decoding or tensor_parallel_size > 1 "
                                       "rules it out, as in vLLM; off on the CPU, whose forward pass runs in the "
                                       "host's own thread, so nothing overlaps")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        need(self.itl_target_ms >= 0, "itl_target_ms", ">= 0 (0: off)")
        need(self.ttft_target_ms >= 0, "ttft_target_ms", ">= 0 (0: no floor)")
        need(self.itl_target_ms == 0 or self.enable_chunked_prefill, "itl_target_ms", "0 without chunked prefill "
             "(the target works by cutting prompt chunks)")
        need(self.preemption_mode in choices(PreemptionMode), "preemption_mode", one_of(PreemptionMode))
        need(self.scheduling_policy in choices(SchedulingPolicy), "scheduling_policy", one_of(SchedulingPolicy))
        need(self.priority_aging_s >= 0, "priority_aging_s", ">= 0")


@dataclass
class ParallelConfig:
    """How the model is split over processes."""

    tensor_parallel_size: int = _f(1, "processes that split the model's attention heads and MLP columns "
                                   "(README: Tensor parallelism): on the CPU all-reducing over gloo on the "
                                   "loopback, on CUDA one GPU each (cuda:N is the first) over NCCL; it must "
                                   "divide the attention heads and the MLP size")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1")


@dataclass
class DeviceConfig:
    """Where and how the engine runs: the device, CUDA graphs, batch invariance, and the engine process's threads, CPUs, niceness, garbage collector and logging."""

    device: str = _f("cpu", "device to run on: cpu, or cuda (NVIDIA GPUs: Triton attention, CUDA graphs)")
    enforce_eager: bool = _f(False, "on CUDA, run decode steps eagerly instead of replaying CUDA graphs "
                             "captured per batch size (as vLLM's --enforce-eager)")
    cuda_graph_mixed_tokens: int = _f(0, "on CUDA with Triton attention, also capture graphs for steps with "
                                      "prompt chunks of up to this many tokens (16, 32, 64, ... up to it; 0: off, "
                                      "those steps run eagerly). A step with prompt logprobs, n > 1, drafts or "
                                      "LoRA runs eagerly anyway")
    batch_invariant: bool = _f(False, "CPU only: refuse to start unless every token gets the same bits whatever "
                               "it is batched with, however its prompt is chunked, cached or preempted. servelm's "
                               "C++ CPU kernels give that on every CPU by default; this refuses what they do not "
                               "run (kernels off, int8/int4, float16, Gemma, MoE) instead of serving with it")
    num_threads: int | None = _f(None, "torch compute threads (default: torch's choice, or one per "
                                 "--cpu-bind CPU)")
    cpu_bind: str | None = _f(None, "CPUs the engine's compute threads run on, e.g. '0-3' or '0,2' (like "
                              "vLLM's VLLM_CPU_OMP_THREADS_BIND); default: wherever the OS schedules them")
    cpu_nice: int = _f(0, "raise the engine process's niceness by this much (0-19): a lower CPU priority, so "
                       "a shadow or batch deployment takes only CPU the others leave idle")
    log_config_file: str | None = _f(None, "a logging configuration (Python's logging.config dictionary schema, "
                                     "as a JSON or YAML file) for every servelm process: the server, its engine "
                                     "processes and tensor-parallel ranks, and uvicorn's loggers, as vLLM's "
                                     "--log-config-file; servelm.requests is the request log")
    enable_sleep_mode: bool = _f(False, "let the engine be put to sleep while idle (vLLM's --enable-sleep-mode): "
                                 "it gives back its KV cache's memory and its weights' (level 1 keeps them in host "
                                 "memory, level 2 discards them) and takes them again when woken; POST /sleep, "
                                 "/wake_up and GET /is_sleeping with the admin key, LLM.sleep() and wake_up() "
                                 "(docs: Weight updates and sleep mode)")
    gc_young_threshold: int = _f(10000, "the engine process's young-generation garbage collection threshold "
                                 "(Python's default is 700): a step with hundreds of sequences allocates more "
                                 "than 700 objects, so the default collects in nearly every step (README: "
                                 "Configuration); the offline LLM(...) leaves its own process's collector alone")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.device == "cpu" or self.device.startswith("cuda"), "device", "cpu, cuda or cuda:N")
        need(not self.batch_invariant or self.device == "cpu", "batch_invariant", "false on a GPU (CPU only)")
        need(0 <= self.cuda_graph_mixed_tokens <= 2048, "cuda_graph_mixed_tokens", "0 (off) to 2048")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1 or None")
        need(self.gc_young_threshold >= 1, "gc_young_threshold", ">= 1")
        need(0 <= self.cpu_nice <= 19, "cpu_nice", "0 to 19 (only lowering the priority needs no privilege)")
        if self.log_config_file is not None:
            from servelm.logs import read_config

            try:
                read_config(self.log_config_file)
            except ValueError as e:
                raise ConfigError("log_config_file", self.log_config_file, str(e).split(": ", 1)[-1]) from None
        need(self.cpu_bind is None or cpu_list(self.cpu_bind) is not None, "cpu_bind",
             f"a list of this process's CPUs {sorted(os.sched_getaffinity(0))} like '0-3' or '0,2'")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: the proposer and when a request falls back."""

    speculative_method: SpeculativeMethod | None = _f(None, "ngram | draft: speculative decoding by n-gram prompt lookup, or "
                                        "by a draft model (--speculative-model, which implies draft); off when "
                                        "omitted (README: Speculative decoding)")
    speculative_model: str | None = _f(None, "a draft model (folder or .gguf) sharing the target's tokenizer, "
                                       "or 'self:N' for the target's own first N layers")
    num_speculative_tokens: int = _f(4, "draft tokens proposed per step and verified in one target forward")
    ngram_lookup_max: int = _f(4, "longest suffix n-gram matched against earlier tokens (ngram method)")
    ngram_lookup_min: int = _f(1, "shortest suffix n-gram tried before giving up (ngram method)")
    spec_fallback_threshold: float = _f(0.5, "a request's rolling draft acceptance rate below which speculation "
                                        "is switched off for it (0 never switches off)")
    spec_fallback_window: int = _f(16, "draft tokens in the rolling acceptance window")
    spec_cooldown_steps: int = _f(32, "decode steps a request runs without speculation after falling back")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        need(self.speculative_method is None or self.speculative_method in choices(SpeculativeMethod),
             "speculative_method", one_of(SpeculativeMethod) + " (or None)")
        need(self.speculative_method != "draft" or self.speculative_model is not None, "speculative_method",
             "draft only together with --speculative-model")
        need(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", "in [1, 16]")
        need(1 <= self.ngram_lookup_min <= self.ngram_lookup_max, "ngram_lookup_min", "in [1, ngram_lookup_max]")
        need(0 <= self.spec_fallback_threshold <= 1, "spec_fallback_threshold", "in [0, 1]")
        need(self.spec_fallback_window >= 1, "spec_fallback_window", ">= 1")
        need(self.spec_cooldown_steps >= 0, "spec_cooldown_steps", ">= 0")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None


@dataclass
class LoraConfig:
    """LoRA adapters served beside the base model."""

    enable_lora: bool = _f(False, "serve LoRA adapters beside the base model (implied by --lora-modules)")
    lora_modules: tuple[str, ...] | None = _f(None, "LoRA adapters loaded at start, as NAME=PATH (a PEFT adapter folder) or "
                                       "vLLM's JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                                       "clients select one by sending its NAME as the model")
    max_lora_rank: int = _f(64, "the largest adapter rank accepted (adapters are stored at their own rank, so "
                                "this bounds nothing else)")
    max_loras: int = _f(8, "most distinct adapters in one batch; a request for one more waits for a slot")
    max_cpu_loras: int | None = _f(None, "most adapters held loaded (least recently used ones are unloaded and "
                                   "read again from their path when next needed; default: max(max_loras, 32)); "
                                   "on a GPU the ones not in a batch wait in CPU memory")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        self.lora_modules = tuple(self.lora_modules or ())  # None (the flag's default) is none
        if self.lora_modules:
            self.enable_lora = True
            for m in self.lora_modules:
                try:
                    parse_lora_module(m)
                except ValueError as e:
                    raise ConfigError("lora_modules", m, f"NAME=PATH or a JSON object with name and path ({e})") from None
        need(1 <= self.max_lora_rank <= 1024, "max_lora_rank", "in [1, 1024]")
        need(self.max_loras >= 1, "max_loras", ">= 1")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             f">= max_loras ({self.max_loras}) or None")


@dataclass
class StructuredOutputsConfig:
    """Structured output and tool calling: the grammar engine."""

    structured_output_backend: StructuredOutputBackend = _f("auto", "auto | llguidance | xgrammar: the grammar engine of structured "
                                        "output and tool calling (vLLM's --structured-outputs-config.backend); "
                                        "auto is llguidance, xgrammar needs the structured extra")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.structured_output_backend in choices(StructuredOutputBackend), "structured_output_backend",
             one_of(StructuredOutputBackend))
        need(self.structured_output_backend != "xgrammar" or importlib.util.find_spec("xgrammar") is not None,
             "structured_output_backend", "auto or llguidance unless xgrammar is installed (pip install "
             "'servelm[structured]')")


# The engine's sections: name (in the config file, --help and "section.field" source keys) -> class. EngineConfig
# holds each as `<name>_config`, vLLM's convention (config.cache_config.block_size): `config.model` would read as
# the model path, which is `config.model_config.model`.
ENGINE_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
    "device": DeviceConfig, "speculative": SpeculativeConfig, "lora": LoraConfig,
    "structured_outputs": StructuredOutputsConfig,
}


def section_map(sections: dict[str, type]) -> dict[str, str]:
    """Each field's flat name -> the name of the section that holds it. A flat name (a keyword of LLM(...), a
    --flag, SERVELM_<FIELD>) must say which section it sets, so a name in two sections refuses to import."""
    out: dict[str, str] = {}
    for sec, cls in sections.items():
        for f in fields(cls):
            if f.name in out:
                raise TypeError(f"config field {f.name!r} is in both {out[f.name]} and {sec}: flat names must be "
                                "unique across sections")
            out[f.name] = sec
    return out


ENGINE_FIELDS: dict[str, str] = section_map(ENGINE_SECTIONS)  # flat name -> section name


def engine_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) for every engine field, section by section."""
    return [(sec, f) for sec, cls in ENGINE_SECTIONS.items() for f in fields(cls)]


class SectionedConfig:
    """A config made of sections (dataclasses named in SECTIONS, held as `<name>_config`), built from the flat
    names users give, each of which belongs to exactly one section (`EngineConfig(model=..., block_size=32)`),
    from section objects (`EngineConfig(cache_config=CacheConfig(block_size=32))`), or both (the flat names then
    change the given sections). Code reads the sections; there is no flat attribute access. Each section
    validates its own fields; `check()` what spans sections."""

    SECTIONS: typing.ClassVar[dict[str, type]] = {}
    FIELDS: typing.ClassVar[dict[str, str]] = {}  # flat name -> section name

    def __init__(self, **kwargs) -> None:
        flat: dict[str, dict] = {sec: {} for sec in self.SECTIONS}
        given: dict[str, object] = {}
        kind = type(self).__name__
        for name, value in kwargs.items():
            sec = name.removesuffix("_config")
            if name.endswith("_config") and sec in self.SECTIONS:
                if not isinstance(value, self.SECTIONS[sec]):
                    raise TypeError(f"{kind}'s {name} must be a {self.SECTIONS[sec].__name__}, got "
                                    f"{type(value).__name__}")
                given[sec] = value
            elif name in self.FIELDS:
                flat[self.FIELDS[name]][name] = value
            else:
                raise TypeError(f"{kind} got an unknown setting {name!r}")
        for sec, cls in self.SECTIONS.items():
            base = given.get(sec)
            setattr(self, sec + "_config", dataclasses.replace(base, **flat[sec]) if base is not None
                    else cls(**flat[sec]))
        self.validate()

    def __setattr__(self, name: str, value) -> None:
        # only the sections: a flat name set here (config.block_size = 8) would be read by nothing
        if not (name.endswith("_config") and name.removesuffix("_config") in self.SECTIONS):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}: set it on its section "
                                 f"({self.FIELDS.get(name, '?')}_config)")
        super().__setattr__(name, value)

    def section(self, name: str):
        """The section called `name`."""
        if name not in self.SECTIONS:
            raise KeyError(f"{name!r} is not a section of {type(self).__name__} ({', '.join(self.SECTIONS)})")
        return getattr(self, name + "_config")

    def replace(self, **changes):
        """A new config with `changes` (flat names or whole sections) applied, validated; `self` is left as it is
        (the new one holds copies of its sections)."""
        copies = {sec + "_config": dataclasses.replace(self.section(sec)) for sec in self.SECTIONS}
        return type(self)(**{**copies, **changes})

    def value(self, name: str):
        """The field with this flat name, for code that handles every field alike (describe, RuntimeSettings);
        code that reads a setting reads its section."""
        return getattr(self.section(self.FIELDS[name]), name)

    def validate(self) -> None:
        """Each section's own checks, then those across sections."""
        for sec in self.SECTIONS:
            self.section(sec).validate()
        self.check()

    def check(self) -> None:
        """The checks across sections."""

    def need(self, ok: bool, name: str, allowed: str) -> None:
        """Raise ConfigError for the field `name` (in whichever section) unless ok."""
        if not ok:
            raise ConfigError(name, self.value(name), allowed)

    def to_dict(self) -> dict:
        """Every field by its flat name: the form users give, which the constructor reads back."""
        return {name: value for sec in self.SECTIONS for name, value in asdict(self.section(sec)).items()}

    def sections(self) -> dict[str, dict]:
        """{section: {field: value}}: the config as code reads it."""
        return {sec: asdict(self.section(sec)) for sec in self.SECTIONS}


@dataclass(init=False)
class EngineConfig(SectionedConfig):
    """Everything `LLM(...)` and `servelm serve` accept about the engine, in sections: code reads
    `config.cache_config.block_size`, users give flat names (`LLM(model=..., block_size=32)`, `--block-size`,
    SERVELM_BLOCK_SIZE) as SectionedConfig says. `None` means "derive it"."""

    SECTIONS: typing.ClassVar[dict[str, type]] = ENGINE_SECTIONS
    FIELDS: typing.ClassVar[dict[str, str]] = ENGINE_FIELDS

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig
    lora_config: LoraConfig
    structured_outputs_config: StructuredOutputsConfig

    def check(self) -> None:
        need = self.need
        model, cache, device = self.model_config, self.cache_config, self.device_config
        need(model.quantization != "gguf" or device.device == "cpu", "quantization", "none, int8, int4 or fp8 on a "
             "GPU (gguf keeps a file's blocks for the CPU kernels; int8/int4 run Triton kernels on a GPU)")
        need(model.quantization in ("auto", "none", "gguf") or not device.batch_invariant, "quantization",
             "auto, none or gguf with batch_invariant (PyTorch's int8/int4 kernels and the fp8 matmuls promise no "
             "fixed order)")
        need(cache.kv_cache_dtype == "auto" or not device.batch_invariant, "kv_cache_dtype", "auto with "
             "batch_invariant (an fp8 cache is read through PyTorch, not the C++ kernels that fix the order)")
        need(not device.enable_sleep_mode or self.speculative_config.speculative_model is None, "enable_sleep_mode",
             "false with a draft model (its weights and KV cache would stay awake)")
        tp = self.parallel_config.tensor_parallel_size
        overlap = self.scheduler_config.async_scheduling  # as given: None is decided by async_scheduling_on()
        need(not overlap or not self._speculates(), "async_scheduling", "false with speculative decoding (a "
             "verification needs the tokens before it is scheduled)")
        need(not overlap or tp == 1, "async_scheduling", "false with tensor_parallel_size > 1 (the other ranks "
             "take each step's input tokens from the host)")
        if tp > 1 and device.device != "cpu":
            self._need_gpus(tp)
        for ok, why in ((not self._speculates(),
                         "no speculative decoding"),
                        (not device.batch_invariant, "no batch_invariant"),
                        (cache.kv_cache_persist is None, "no kv_cache_persist (each rank holds part of every block)"),
                        (model.quantization != "gguf", "quantization none, int8 or int4 (GGUF's quantized tensors "
                         "are not split)"),
                        (model.quantization != "fp8", "quantization none, int8 or int4 (fp8 weights are not split; "
                         "an fp8 checkpoint is dequantized under none)"),
                        (not self.lora_config.enable_lora, "no LoRA adapters (they are not sharded)"),
                        (not device.enable_sleep_mode, "no sleep mode (each rank holds its own shard)")):
            need(tp == 1 or ok, "tensor_parallel_size", f"1, or run with {why}")

    def _speculates(self) -> bool:
        return self.speculative_config.enabled or self.speculative_config.speculative_model is not None

    def async_scheduling_on(self) -> bool:
        """Whether decode steps may be launched behind one another: async_scheduling as given, or where it is
        None, on a CUDA device unless speculative decoding or tensor parallelism rules it out."""
        given = self.scheduler_config.async_scheduling
        if given is not None:
            return given
        return (self.device_config.device.startswith("cuda") and not self._speculates()
                and self.parallel_config.tensor_parallel_size == 1)

    def _need_gpus(self, tp: int) -> None:
        """tensor_parallel_size ranks on CUDA take one GPU each, from the device's index up: they must exist."""
        import torch

        device = self.device_config.device
        m = re.fullmatch(r"cuda(?::(\d+))?", device)
        first = int(m.group(1) or 0) if m else 0
        visible = torch.cuda.device_count()
        if first + tp > visible:
            raise ConfigError("tensor_parallel_size", tp, f"at most {max(0, visible - first)} on {device}: "
                              f"{tp} ranks need GPUs cuda:{first}..cuda:{first + tp - 1}, and {visible} "
                              f"{'is' if visible == 1 else 'are'} visible (torch.cuda.device_count(); "
                              "CUDA_VISIBLE_DEVICES chooses them)")

    def unused_vllm_settings(self) -> list[str]:
        """What to tell a user about vLLM settings given here that servelm accepts but does not use."""
        notes = []
        if self.model_config.trust_remote_code:
            notes.append("--trust-remote-code is not needed: servelm runs only its built-in architectures and "
                         "never executes code from a model folder")
        cache, device = self.cache_config, self.device_config.device
        sized = cache.num_kv_blocks is not None or cache.kv_cache_memory_gb is not None
        if cache.gpu_memory_utilization is not None and (device == "cpu" or sized):
            notes.append(f"--gpu-memory-utilization {cache.gpu_memory_utilization:g} is not used: "
                         + ("the CPU has no GPU memory; its KV cache is sized by --kv-cache-memory-gb or "
                            "--num-kv-blocks" if device == "cpu" else
                            "--kv-cache-memory-gb or --num-kv-blocks sizes the KV cache"))
        return notes

    def load_quantization(self) -> str:
        """The quantization the loader is asked for: auto stays auto (the loader picks fp8, gguf or none by the
        checkpoint, dtype and device; gguf only on the CPU) except with tensor parallelism, where neither fp8
        nor gguf weights are split."""
        quantization = self.model_config.quantization
        if quantization == "auto" and self.parallel_config.tensor_parallel_size > 1:
            return "none"
        return quantization


@dataclass(frozen=True)
class RuntimeSettings:
    """The engine config fields marked `runtime=True` (whichever sections hold them), which a serving engine takes
    while it runs (PATCH /admin/config). It is what every layer passes on, from the server to the engine process,
    so a new runtime field is added here and in its section, and nowhere between; the check below this class
    refuses to import when the two disagree."""

    max_num_seqs: int
    scheduling_policy: SchedulingPolicy
    priority_aging_s: float

    @classmethod
    def of(cls, config: EngineConfig) -> RuntimeSettings:
        """The runtime settings `config` holds."""
        return cls(**{name: config.value(name) for name in RUNTIME_FIELDS})

    def apply(self, config: EngineConfig) -> EngineConfig:
        """`config` with these settings (a new EngineConfig; `config` is left as it is)."""
        return config.replace(**asdict(self))


RUNTIME_FIELDS = tuple(f.name for _, f in engine_fields() if f.metadata.get("runtime"))
if tuple(f.name for f in fields(RuntimeSettings)) != RUNTIME_FIELDS:
    raise TypeError(f"RuntimeSettings must hold the engine config's runtime fields, in their order: {RUNTIME_FIELDS}")
