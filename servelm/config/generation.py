"""The model's default sampling parameters: vLLM's --generation-config and --override-generation-config.

A checkpoint's generation_config.json states how its authors meant it to be sampled (Qwen's instruct models:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). As vLLM does, servelm uses those values for every
field a request leaves unset, instead of OpenAI's neutral defaults. The rules follow vLLM's so that the same
request gets the same parameters from either server:

- only the fields below are taken (do_sample, num_beams and the rest are not sampling defaults of a request);
- a value equal to transformers' own default is not a default of the model (transformers' `to_diff_dict`, which
  vLLM reads): an explicit `"top_k": 50` changes nothing;
- `max_new_tokens` becomes the default max_tokens of a request that gives none.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

from servelm.config.json_object import parse_json_object

logger = logging.getLogger(__name__)

# generation_config.json's name -> the request field it is the default of
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file's value equal to one of these is no default of the model's
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
SETTINGS = ("auto", "vllm")  # besides a folder holding a generation_config.json
FILE = "generation_config.json"


def check_setting(value: str) -> None:
    """`--generation-config`: auto, vllm, or a folder with a generation_config.json (ValueError otherwise)."""
    if value in SETTINGS:
        return
    folder = Path(value).expanduser()
    if not (folder / FILE).is_file():
        raise ValueError(f"auto, vllm, or a folder holding a {FILE} ({folder / FILE} is not a file)")


def parse_overrides(value: str | dict | None) -> dict[str, float | int]:
    """`--override-generation-config`: a JSON object of generation_config.json's sampling fields (ValueError
    naming what is wrong). Its values win over the model's file and apply with `--generation-config vllm` too."""
    if value is None:
        return {}
    value = parse_json_object(value, '{"temperature": 0.6}')
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    out = {k: v for k, v in value.items() if v is not None}
    check_values(out)
    return out


def check_values(values: dict) -> None:
    """ValueError unless `values` (generation_config.json's names) make valid sampling parameters."""
    from servelm.sampling_params import SamplingParams

    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{k} must be a finite number, got {v!r}")
        if k in ("top_k", "max_new_tokens") and v != int(v):
            raise ValueError(f"{k} must be a whole number, got {v!r}")
    fields = to_request_fields(values)
    if fields.get("max_tokens", 1) < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {fields['max_tokens']}")
    SamplingParams(**fields)  # its own ranges, with its own message


def to_request_fields(values: dict) -> dict[str, float | int]:
    """generation_config.json's names -> the request fields they are the defaults of (top_k and max_tokens as
    integers)."""
    return {FIELDS[k]: int(v) if k in ("top_k", "max_new_tokens") else v for k, v in values.items()}


def read_file(folder: Path) -> dict[str, float | int]:
    """The sampling defaults a folder's generation_config.json states (its names), leaving out values equal to
    transformers' defaults; a value that makes no valid request is dropped with a warning, not a failed start."""
    path = folder / FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("%s is not readable JSON (%s): no sampling defaults taken from it", path, e)
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for k in FIELDS:
        v = data.get(k)
        if v is None or _TRANSFORMERS_DEFAULTS.get(k) == v:
            continue
        try:
            check_values({k: v})
        except (ValueError, TypeError) as e:
            logger.warning("%s: %s=%r is not used as a default (%s)", path, k, v, e)
            continue
        out[k] = v
    return out


def sampling_defaults(setting: str, model_folder: Path | None, overrides: str | dict | None) -> dict[str, float | int]:
    """The default of each request field the model (or `setting`'s folder) and the overrides state, under the
    request's own names (`max_tokens`, not `max_new_tokens`); {} means OpenAI's defaults. `model_folder`: the
    Hugging Face folder the model came from (None for a GGUF file, whose generation settings are not kept)."""
    if setting == "vllm":
        values = {}
    elif setting == "auto":
        values = read_file(model_folder) if model_folder is not None else {}
    else:
        values = read_file(Path(setting).expanduser())
    values.update(parse_overrides(overrides))
    return to_request_fields(values)


# OpenAI's (and vLLM's) values of the fields a model's defaults may set, where neither the request nor the model
# sets them: each samples from the model's distribution as it is
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}


def request_values(defaults: Mapping[str, float | int] | None, **given: float | int | None) -> dict[str, float | int]:
    """Each of NEUTRAL's fields for one request: the value it gives, else the model's default (`defaults`, as
    `sampling_defaults` returns), else the neutral one. A field an API has no place for is not in `given` and
    takes the model's default: the request said nothing about it."""
    defaults = defaults or {}
    return {name: v if (v := given.get(name)) is not None else defaults.get(name, neutral)
            for name, neutral in NEUTRAL.items()}


def default_max_tokens(defaults: Mapping[str, float | int] | None, room: int) -> int:
    """max_tokens for a request that gives none: the model's max_new_tokens where it states one, never more than
    `room` (what the context and the server's per-request cap leave)."""
    return min(room, int((defaults or {}).get("max_tokens", room)))
