"""vLLM command-line flags whose values servelm keeps under other settings: each is translated into those
settings before the config is loaded, so that a `vllm serve` command line runs unchanged and means the same."""

from __future__ import annotations

import json

from servelm.config.engine import ConfigError, token_count

# flag -> what it becomes (the configuration reference lists these)
VLLM_TRANSLATED = {
    "--speculative-config JSON": "vLLM's speculative decoding settings: method ngram with num_speculative_tokens, "
                                 "prompt_lookup_max and prompt_lookup_min (vLLM's defaults: both 5, or one given "
                                 "for both), or a draft model (model, with method draft_model or none) and "
                                 "num_speculative_tokens; they set speculative_method, speculative_model, "
                                 "num_speculative_tokens, ngram_lookup_max and ngram_lookup_min",
    "--kv-cache-memory-bytes N": "kv_cache_memory_gb, N / 2^30 (N as vLLM writes it: 8G or 8589934592)",
    "--num-gpu-blocks-override N": "num_kv_blocks",
    "--task TASK": "runner, as vLLM's older flag meant it: generate, embed (embedding), classify and score are "
                   "the generate and pooling runners; auto reads the model",
    "--guided-decoding-backend NAME": "structured_output_backend, as vLLM's older flag named the grammar engine: "
                                      "auto, xgrammar, guidance or llguidance (both llguidance)",
    "--enable-log-outputs": "log_prompts: the request log carries the completion's text (and the prompt's)",
}
# --guided-decoding-backend's values -> the grammar engine (outlines, lm-format-enforcer: not served)
_GUIDED_BACKENDS = {"auto": "auto", "xgrammar": "xgrammar", "guidance": "llguidance", "llguidance": "llguidance"}
# --task's values -> the runner they ask for (reward, transcription and draft models are not served)
_TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
                 "classify": "pooling", "score": "pooling"}

# flag -> (the values that name the one way servelm does it, that way): accepted with one of those values (the
# start says it is not needed), refused with any other, so that a pasted command line never means something else
VLLM_ONE_WAY = {
    "--load-format": (("auto", "safetensors", "gguf"), "servelm loads MODEL's safetensors (a Hugging Face folder) "
                      "or its GGUF file, whichever MODEL is"),
    "--config-format": (("auto", "hf"), "servelm reads the model's config.json (or a GGUF file's header)"),
    "--tokenizer-mode": (("auto", "hf"), "servelm runs the model's Hugging Face tokenizer (tokenizer.json, or a GGUF "
                         "file's), as transformers' AutoTokenizer loads it"),
    "--chat-template-content-format": (("auto", "string"), "servelm gives the chat template a message's text parts "
                                       "as one string"),
    "--pipeline-parallel-size": (("1",), "servelm splits a model over devices by tensor parallelism "
                                 "(--tensor-parallel-size), not into pipeline stages"),
    "--data-parallel-size": (("1",), "one servelm server runs one engine; more replicas are a deployment's workers "
                             "(servelm models deploy), Ray Serve replicas or Kubernetes pods"),
    "--distributed-executor-backend": (("mp", "uni"), "servelm runs tensor-parallel ranks as processes of one host "
                                       "(one process with --tensor-parallel-size 1)"),
}
# the short forms vLLM gives some of them
VLLM_ONE_WAY_SHORT = {"--pipeline-parallel-size": "-pp", "--data-parallel-size": "-dp"}


def one_way(dest: str, value: str) -> str:
    """A VLLM_ONE_WAY flag's value: the note for the start (it is not needed), or ConfigError for a value that
    asks for something servelm does not do."""
    flag = "--" + dest.replace("_", "-")
    allowed, what = VLLM_ONE_WAY[flag]
    if value not in allowed:
        raise ConfigError(dest, value, f"{' or '.join(allowed)} (vLLM's values for what servelm does: {what})")
    return f"{flag} {value} is not needed: {what}"


# --speculative-config's keys -> servelm's settings
_SPECULATIVE_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "ngram_lookup_max",
                     "prompt_lookup_min": "ngram_lookup_min", "model": "speculative_model"}
_DRAFT_METHODS = ("draft_model", "draft")


def speculative_settings(text: str) -> dict:
    """The settings --speculative-config's JSON stands for. Raises ConfigError for what servelm does not run
    (EAGLE, Medusa, MTP heads) or keys it would have to ignore."""
    name = "speculative_config"
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(name, text, f"a JSON object ({e})") from None
    if not isinstance(spec, dict):
        raise ConfigError(name, text, "a JSON object")
    method = spec.get("method")
    if method is None and spec.get("model") in ("ngram", "[ngram]"):  # vLLM's other way to say it
        spec = {k: v for k, v in spec.items() if k != "model"}
        method = "ngram"
    elif method is None:
        method = "draft" if "model" in spec else None
    if method == "[ngram]":
        method = "ngram"
    if method not in ("ngram", *_DRAFT_METHODS):
        raise ConfigError(name, text, "a method servelm runs: ngram, or a draft model (\"model\": DRAFT, method "
                                      "draft_model); EAGLE, Medusa, MLP speculators and MTP heads are not supported")
    unknown = sorted(set(spec) - set(_SPECULATIVE_KEYS) - {"method"})
    if unknown:
        raise ConfigError(name, text, f"keys among method, {', '.join(_SPECULATIVE_KEYS)} (not {', '.join(unknown)})")
    if method == "ngram" and "model" in spec:
        raise ConfigError(name, text, "no model with method ngram (the prompt is the draft)")
    if method != "ngram" and "model" not in spec:
        raise ConfigError(name, text, "a \"model\" (the draft model) with a draft method")
    out = {"speculative_method": "ngram" if method == "ngram" else "draft"}
    out.update({_SPECULATIVE_KEYS[k]: v for k, v in spec.items() if k != "method"})
    if method == "ngram":  # vLLM's lookup defaults: both 5, or one given for both
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        out["ngram_lookup_min"], out["ngram_lookup_max"] = (5, 5) if lo is None and hi is None else \
            (hi if lo is None else lo, lo if hi is None else hi)
    return out


def kv_cache_bytes_settings(text: str) -> dict:
    try:
        n = token_count(text)
    except ValueError as e:
        raise ConfigError("kv_cache_memory_bytes", text, f"a number of bytes ({e})") from None
    if n is None or n <= 0:
        raise ConfigError("kv_cache_memory_bytes", text, "a number of bytes above 0")
    return {"kv_cache_memory_gb": n / 2**30}


def translate(flags: dict[str, str], given: dict) -> dict:
    """The settings the vLLM flags given (dest -> value) stand for; a setting also given as servelm's own flag
    is a conflict (ConfigError) rather than a silent choice."""
    out: dict = {}
    origin: dict[str, str] = {}
    for dest, value in flags.items():
        if dest == "speculative_config":
            settings = speculative_settings(value)
        elif dest == "kv_cache_memory_bytes":
            settings = kv_cache_bytes_settings(value)
        elif dest == "num_gpu_blocks_override":
            settings = {"num_kv_blocks": value}
        elif dest == "task":
            if value not in _TASK_RUNNERS:
                raise ConfigError("task", value, f"one of {', '.join(_TASK_RUNNERS)} (vLLM's tasks servelm serves)")
            settings = {"runner": _TASK_RUNNERS[value]}
        elif dest == "guided_decoding_backend":
            if value not in _GUIDED_BACKENDS:
                raise ConfigError("guided_decoding_backend", value, f"one of {', '.join(_GUIDED_BACKENDS)} (the "
                                  "grammar engines servelm runs)")
            settings = {"structured_output_backend": _GUIDED_BACKENDS[value]}
        elif dest == "enable_log_outputs":
            settings = {"log_prompts": True}
        else:
            raise KeyError(dest)
        out.update(settings)
        origin.update(dict.fromkeys(settings, "--" + dest.replace("_", "-")))
    for key in out:
        if key in given:
            raise ConfigError(key, given[key], f"given once (vLLM's {origin[key]} sets it too)")
    return out
