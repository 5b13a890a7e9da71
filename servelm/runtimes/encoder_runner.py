"""An encoder checkpoint loaded and run on batches of text: sentence embeddings (mean pooling, L2
normalisation) for embedding models, per-label logits for sequence classifiers (cross-encoder rerankers and
text classifiers). The server's embedding process (runtimes/embedder.py) holds one; so does the offline
`LLM` of an encoder model. Also the arithmetic both make of the results: scores and probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# A text to embed, or (text, k): keep its last k tokens (truncate_prompt_tokens)
EmbedInput = str | tuple[str, int]
# A text to classify, or a pair read together (query, document), and the most tokens it may keep (None: the model's)
ClassifyInput = tuple[str, str | None, int | None]
DEFAULT_EMBED_MAX_LENGTH = 256  # all-MiniLM-L6-v2's own limit (sentence-transformers' max_seq_length)


def model_config(path: Path) -> dict:
    from servelm.model.loading.hf_files import read_json

    return read_json(Path(path) / "config.json") or {}


def model_task(path: Path) -> str:
    """"classify" for a sequence classifier's folder, else "embed" (no torch: the API process asks)."""
    from servelm.model.loading.hf_files import is_classifier

    return "classify" if is_classifier(model_config(path)) else "embed"


def model_labels(path: Path) -> list[str]:
    """A classifier's label names in output order (a missing name is the label's index)."""
    config = model_config(path)
    id2label = config.get("id2label") or {}
    return [str(id2label.get(str(i), id2label.get(i, i))) for i in range(len(id2label) or int(config.get("num_labels", 2)))]


def _positions(config: dict) -> int:
    """How many positions the model's table holds (RoBERTa's family numbers them from padding_idx + 1, so two
    fewer than its size)."""
    positions = int(config.get("max_position_embeddings", 512))
    return positions - 2 if config.get("model_type") in ("roberta", "xlm-roberta", "camembert") else positions


def _max_length(tokenizer, config: dict, task: str, embed_cap: int) -> int:
    """The longest input the model reads: an embedding model's cap (sentence-transformers' max_seq_length), a
    classifier's tokenizer's model_max_length where it states one; never more than the position table holds
    (a longer input would index past it)."""
    stated = getattr(tokenizer, "model_max_length", None)
    want = embed_cap if task == "embed" else stated if isinstance(stated, int) and 0 < stated < 1_000_000 else None
    return min(want, _positions(config)) if want is not None else _positions(config)


@dataclass
class Pooled:
    """A batch's results: one row per input (a vector or logits), each input's token ids, the padded size."""

    rows: np.ndarray
    token_ids: list[list[int]]
    padded: int


class EncoderRunner:
    """The tokenizer and model of one encoder folder, loaded now; `task` says which of `embed` and `classify`
    it does. `max_length` caps an embedding model's inputs (a classifier reads up to its own limit)."""

    def __init__(self, path: Path, max_length: int = DEFAULT_EMBED_MAX_LENGTH) -> None:
        from servelm.model.families.encoder import load_classifier, load_encoder
        from servelm.model.loading.hf_files import tokenizer_from_folder

        path = Path(path)
        config = model_config(path)
        self.task = model_task(path)
        self.tokenizer = tokenizer_from_folder(path)
        self.model = load_classifier(path) if self.task == "classify" else load_encoder(path)
        self.max_length = _max_length(self.tokenizer, config, self.task, max_length)

    def run(self, items: list) -> Pooled:
        """`embed` or `classify`, whichever the model does."""
        return self.classify(items) if self.task == "classify" else self.embed(items)

    def _tokenize(self, texts: list[EmbedInput]):
        """The batch's input tensors. A text alone is cut at max_length from the end (the tokenizer's default);
        a (text, k) pair keeps its last k tokens with the special tokens around them (vLLM's
        truncate_prompt_tokens on embeddings: k -1 or above max_length means max_length)."""
        tokenizer, max_length = self.tokenizer, self.max_length
        if all(isinstance(t, str) for t in texts):  # the usual batch: one call
            return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        encs = []
        try:
            for item in texts:
                text, k = (item, None) if isinstance(item, str) else item
                tokenizer.truncation_side = "right" if k is None else "left"
                cap = max_length if k is None or k == -1 else min(k, max_length)
                encs.append(tokenizer(text, truncation=True, max_length=cap))
        finally:
            tokenizer.truncation_side = "right"
        return tokenizer.pad(encs, return_tensors="pt")

    def embed(self, texts: list[EmbedInput]) -> Pooled:
        """L2-normalised, mean-pooled last hidden states."""
        import torch

        enc = self._tokenize(texts)
        mask = enc["attention_mask"]
        hidden = self.model(**enc)
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return Pooled(torch.nn.functional.normalize(pooled, dim=-1).numpy(), _ids(enc), mask.numel())

    def classify(self, items: list[ClassifyInput]) -> Pooled:
        """Each text's (or pair's) logits. A pair is tokenized as the model was trained to read one (BERT's
        [CLS] a [SEP] b [SEP] with segment ids, RoBERTa's <s> a </s></s> b </s>); one too long loses tokens from
        its longer side first, as sentence-transformers' CrossEncoder cuts it."""
        tokenizer, max_length = self.tokenizer, self.max_length
        texts, pairs, caps = zip(*items, strict=True)
        if all(c is None for c in caps) and (all(p is None for p in pairs) or all(p is not None for p in pairs)):
            second = None if pairs[0] is None else list(pairs)
            enc = tokenizer(list(texts), second, padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt")
        else:  # a mixed batch, or inputs with their own caps: one at a time, padded together
            enc = tokenizer.pad([tokenizer(t, p, truncation=True, max_length=max_length if c is None or c == -1
                                           else min(c, max_length)) for t, p, c in items], return_tensors="pt")
        logits = self.model(**enc)
        return Pooled(logits.float().numpy(), _ids(enc), enc["attention_mask"].numel())


def _ids(enc) -> list[list[int]]:
    """Each row's real token ids (padding left out)."""
    mask = enc["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(enc["input_ids"], mask, strict=True)]


def probabilities(logits: np.ndarray) -> np.ndarray:
    """A classifier's logits [n, labels] as vLLM's pooler activates them: one label's logit through a sigmoid
    (a cross-encoder's relevance in [0, 1]), several labels' through a softmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.shape[-1] == 1:
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine similarity of each row of `a` with the same row of `b` (a row of zeros scores 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.divide((a * b).sum(axis=1), norms, out=np.zeros(len(a)), where=norms > 0)
