"""The shared benchmark workloads (see shared/workloads.md): prompts are token ids, drawn reproducibly.

Every prompt is `[BOS] + uniform random ids in [4, vocab)` from numpy's PCG64(seed), request by request.
W4 draws, per request, its prompt length, then its output length, then its ids.

Beside them, `servelm bench serve` reads text prompts from a dataset file (load_dataset): JSONL lines of
{"prompt": ...}, or a ShareGPT JSON file, sampled as vLLM's benchmark samples it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Workload:
    name: str
    prompts: list[list[int]] | list[str]  # token ids (the synthetic workloads), or text (a dataset)
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def _ids(rng, n: int, vocab: int) -> list[int]:
    return [int(i) for i in rng.integers(4, vocab, size=n)]


def make_workload(name: str, vocab: int, bos: int = 1, scale: float = 1.0) -> Workload:
    """`scale` < 1 shrinks the request count (for quick runs); lengths stay as specified."""
    def count(n: int) -> int:
        return max(1, int(round(n * scale)))

    name = name.upper()
    if name == "W1":
        rng = np.random.Generator(np.random.PCG64(0))
        prompts = [[bos] + _ids(rng, 127, vocab) for _ in range(count(64))]
        return Workload("W1", prompts, [128] * len(prompts))
    if name == "W2":
        rng = np.random.Generator(np.random.PCG64(1))
        return Workload("W2", [[bos] + _ids(rng, 511, vocab)], [128])
    if name == "W3":
        rng = np.random.Generator(np.random.PCG64(2))
        shared = [bos] + _ids(rng, 447, vocab)
        prompts = [shared + _ids(rng, 64, vocab) for _ in range(count(64))]
        return Workload("W3", prompts, [64] * len(prompts))
    if name == "W4":
        rng = np.random.Generator(np.random.PCG64(3))
        prompts, outs = [], []
        for _ in range(count(128)):
            plen, olen = int(rng.integers(32, 1025)), int(rng.integers(16, 257))
            prompts.append([bos] + _ids(rng, plen - 1, vocab))
            outs.append(olen)
        return Workload("W4", prompts, outs)
    raise ValueError(f"unknown workload {name!r}: choose W1, W2, W3 or W4")


def make_serving_workload(vocab: int, num_requests: int = 200, seed: int = 4, bos: int = 1) -> Workload:
    """S1: prompts of uniform 64..512 tokens, outputs of uniform 32..256 (arrival times are drawn by the
    load generator from the request rate)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    prompts, outs = [], []
    for _ in range(num_requests):
        plen, olen = int(rng.integers(64, 513)), int(rng.integers(32, 257))
        prompts.append([bos] + _ids(rng, plen - 1, vocab))
        outs.append(olen)
    return Workload("S1", prompts, outs)


# -- dataset files --------------------------------------------------------------------------------------------

DATASETS = ("jsonl", "custom", "sharegpt")  # "custom" is vLLM's name for the JSONL format
DEFAULT_OUTPUT_LEN = 128
# vLLM's ShareGPT filter: at least 4 prompt and 4 output tokens, at most 1024 prompt and 2048 tokens in all
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
OUTPUT_LEN_KEYS = ("output_len", "max_tokens")


def dataset_name_for(path: str | Path, name: str | None) -> str:
    """The dataset's format: as given, else from the file name (.jsonl: jsonl, anything else: sharegpt)."""
    if name is not None:
        if name not in DATASETS:
            raise ValueError(f"unknown dataset name {name!r}: choose one of {', '.join(DATASETS)}")
        return "jsonl" if name == "custom" else name
    return "jsonl" if str(path).endswith(".jsonl") else "sharegpt"


def _fill(prompts: list[str], outs: list[int], num_requests: int, seed: int) -> tuple[list[str], list[int]]:
    """Exactly num_requests: the first ones, or all of them and random repeats (vLLM oversamples so too)."""
    if len(prompts) >= num_requests:
        return prompts[:num_requests], outs[:num_requests]
    rng = random.Random(seed)
    extra = rng.choices(range(len(prompts)), k=num_requests - len(prompts))
    return prompts + [prompts[i] for i in extra], outs + [outs[i] for i in extra]


def load_jsonl(path: str | Path, num_requests: int, seed: int = 0, output_len: int | None = None) -> Workload:
    """One {"prompt": "..."} object per line, in file order, with an optional output length ("output_len" or
    "max_tokens"); lines without one get output_len (default 128). Blank lines are skipped."""
    prompts, outs = [], []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f'{path}:{n}: each line needs a "prompt" string')
            own = next((row[k] for k in OUTPUT_LEN_KEYS if row.get(k) is not None), None)
            if own is not None and (not isinstance(own, int) or isinstance(own, bool) or own < 1):
                raise ValueError(f"{path}:{n}: the output length must be a positive integer, not {own!r}")
            prompts.append(row["prompt"])
            outs.append(own or output_len or DEFAULT_OUTPUT_LEN)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    prompts, outs = _fill(prompts, outs, num_requests, seed)
    return Workload("jsonl", prompts, outs)


def _sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the gpt turn after it) of every conversation that has both."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f'{path}: a ShareGPT file is a JSON list of {{"conversations": [...]}} objects')
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        roles = [t.get("from") if isinstance(t, dict) else None for t in turns]
        if "human" not in roles:
            continue
        i = roles.index("human")
        j = next((k for k in range(i + 1, len(turns)) if roles[k] == "gpt"), None)
        prompt = turns[i].get("value")
        reply = turns[j].get("value") if j is not None else None
        if isinstance(prompt, str) and prompt and isinstance(reply, str):
            pairs.append((prompt, reply))
    return pairs


def load_sharegpt(path: str | Path, num_requests: int, count_tokens: Callable[[list[str], bool], list[int]],
                  seed: int = 0, output_len: int | None = None, max_model_len: int | None = None) -> Workload:
    """The ShareGPT JSON list, as vLLM's benchmark samples it: conversations shuffled with the seed, each one's
    first human turn the prompt and the gpt reply's token count its max_tokens (output_len replaces that
    count), kept while the prompt has 4 to 1024 tokens, the reply at least 4 and both at most 2048 (and at most
    max_model_len, where known), until num_requests are taken. count_tokens(texts, special) counts each text's
    tokens, with or without the special tokens the tokenizer adds."""
    pairs = _sharegpt_pairs(path)
    if not pairs:
        raise ValueError(f'{path}: no conversation with a "human" turn followed by a "gpt" turn')
    random.Random(seed).shuffle(pairs)
    limit = MAX_TOTAL_LEN if max_model_len is None else min(MAX_TOTAL_LEN, max_model_len)
    prompts: list[str] = []
    outs: list[int] = []
    chunk = 64
    for start in range(0, len(pairs), chunk):
        part = pairs[start:start + chunk]
        plens = count_tokens([p for p, _ in part], True)
        olens = [output_len] * len(part) if output_len else count_tokens([r for _, r in part], False)
        for (prompt, _), plen, olen in zip(part, plens, olens, strict=True):
            if plen < MIN_LEN or (olen < MIN_LEN and not output_len) or plen > MAX_PROMPT_LEN or plen + olen > limit:
                continue
            prompts.append(prompt)
            outs.append(olen)
            if len(prompts) == num_requests:
                return Workload("sharegpt", prompts, outs)
    if not prompts:
        raise ValueError(f"{path}: no conversation fits the length limits (prompt 4-{MAX_PROMPT_LEN} tokens, "
                         f"reply at least 4, both at most {limit})")
    prompts, outs = _fill(prompts, outs, num_requests, seed)
    return Workload("sharegpt", prompts, outs)
