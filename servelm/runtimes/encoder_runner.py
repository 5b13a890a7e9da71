"""A pooling model loaded and run on batches of text: sentence embeddings for embedding models (encoders such as
all-MiniLM and bge, decoders such as Qwen3-Embedding), pooled and normalized as the folder's sentence-transformers
modules say (model/loading/st_config.py), per-label logits for sequence classifiers (cross-encoder rerankers and
text classifiers). The server's embedding process (runtimes/embedder.py) holds one; so does the offline `LLM` of
a pooling model. Also the arithmetic both make of the results: scores and probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# An input: (its text, or its token ids as they are, with no special tokens added; the text read with it as a pair
# or None; the most tokens it keeps or None (-1: the model's limit); which side a cut takes tokens from: "right"
# keeps the first ones, "left" the last ones, "none" cuts nothing and refuses an input over the model's limit)
Input = tuple[str | list[int], str | None, int | None, str]


def model_config(path: Path) -> dict:
    from servelm.model.loading.hf_files import read_json

    return read_json(Path(path) / "config.json") or {}


def model_task(path: Path) -> str:
    """"classify" for a sequence classifier's folder, else "embed" (no torch: the API process asks)."""
    from servelm.model.loading.hf_files import is_classifier

    return "classify" if is_classifier(model_config(path)) else "embed"


def model_labels(path: Path) -> list[str]:
    """A classifier's label names in output order (transformers' LABEL_i where id2label names none)."""
    config = model_config(path)
    id2label = config.get("id2label") or {}
    n = len(id2label) or int(config.get("num_labels", 2))
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def model_recipe(path: Path):
    """How an embedding model's vectors are made (model/loading/st_config.py's EmbeddingRecipe; no torch: the
    API process checks it before the embedding process starts). Raises ValueError for a folder whose modules
    servelm does not run."""
    from servelm.model.loading.hf_files import is_encoder
    from servelm.model.loading.st_config import read_recipe

    return read_recipe(Path(path), decoder=not is_encoder(model_config(path)))


def model_matryoshka(path: Path) -> tuple[int, ...] | None:
    """The dimensions an embedding model's vectors may be cut to, read from config.json as vLLM reads it: a
    model trained for Matryoshka embeddings lists them (`matryoshka_dimensions`) or says any (`is_matryoshka`:
    an empty tuple); None where it is not one, whose cut vectors would be poor."""
    config = model_config(path)
    listed = config.get("matryoshka_dimensions")
    if listed:
        return tuple(int(d) for d in listed)
    return () if config.get("is_matryoshka") else None


def check_dimensions(dimensions: int, allowed: tuple[int, ...] | None, width: int, name: str) -> None:
    """Raises ValueError unless an embedding of `width` values may be cut to `dimensions` (vLLM's rules)."""
    if allowed is None:
        raise ValueError(f"{name} is not a Matryoshka embedding model (its config.json names no "
                         "matryoshka_dimensions): its vectors cut to fewer dimensions would be poor; leave "
                         "dimensions out")
    if allowed and dimensions not in allowed:
        raise ValueError(f"{name} is trained for dimensions {', '.join(map(str, allowed))}, not {dimensions}")
    if not 1 <= dimensions <= width:
        raise ValueError(f"dimensions must be from 1 to {width} (the model's), got {dimensions}")


def cut_dimensions(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """A vector's first `dimensions` values, normalized again where the model normalizes (as vLLM cuts a
    Matryoshka embedding: before normalization)."""
    if dimensions is None:
        return vector
    cut = np.asarray(vector[:dimensions], dtype=np.float32)
    if normalize:
        norm = float(np.linalg.norm(cut))
        cut = cut / norm if norm > 0 else cut
    return cut


def embedding_width(path: Path, recipe) -> int:
    """How many values an embedding model's vectors have: its hidden size once per mode of its `recipe`."""
    return int(model_config(path).get("hidden_size", 0)) * len(recipe.pooling)


# the torch.nn activations a cross-encoder's config may name, as what `activate` does for each
_NAMED_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "classify", "Softmax": "classify", "Tanh": "tanh"}


def model_activation(path: Path) -> str:
    """How a classifier's logits become its scores and probabilities, read from its config as vLLM reads it:
    transformers' problem_type (regression: the raw value; multi-label: a sigmoid per label), else the
    activation a sentence-transformers CrossEncoder saved (sentence_transformers.activation_fn, or the older
    sbert_ce_default_activation_function: ms-marco-MiniLM's is Identity, its scores are logits), else a sigmoid
    of one label's logit or a softmax over several. Raises ValueError for an activation it does not know."""
    config = model_config(path)
    problem = config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem == "single_label_classification":
        return "classify"
    named = (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    if not named:
        return "classify"
    module, _, cls = str(named).rpartition(".")
    if not module.startswith("torch.nn.modules") or cls not in _NAMED_ACTIVATIONS:
        raise ValueError(f"{path}: the activation {named!r} its config names is not one servelm applies (torch.nn's "
                         f"{', '.join(_NAMED_ACTIVATIONS)})")
    return _NAMED_ACTIVATIONS[cls]


def _positions(config: dict) -> int:
    """How many positions the model's table holds (RoBERTa's family numbers them from padding_idx + 1, so two
    fewer than its size)."""
    positions = int(config.get("max_position_embeddings", 512))
    return positions - 2 if config.get("model_type") in ("roberta", "xlm-roberta", "camembert") else positions


def _max_length(tokenizer, config: dict, cap: int | None) -> int:
    """The longest input the model reads: `cap` (an embedding model's sentence-transformers max_seq_length, or
    the caller's), else the tokenizer's model_max_length where it states one; never more than the position
    table holds (a longer input would index past it)."""
    stated = getattr(tokenizer, "model_max_length", None)
    want = cap if cap is not None else stated if isinstance(stated, int) and 0 < stated < 1_000_000 else None
    return min(want, _positions(config)) if want is not None else _positions(config)


@dataclass
class Pooled:
    """A batch's results: one row per input (a vector or logits), each input's token ids, the padded size."""

    rows: np.ndarray
    token_ids: list[list[int]]
    padded: int


class EncoderRunner:
    """The tokenizer and model of one pooling model's folder, loaded now; `task` says which of `embed` and
    `classify` it does. An embedding model pools and normalizes as its `recipe` says; `max_length` caps its
    inputs below the recipe's max_seq_length (None: the recipe's, else the model's own limit)."""

    def __init__(self, path: Path, max_length: int | None = None) -> None:
        from servelm.model.families.encoder import load_classifier, load_encoder
        from servelm.model.loading.hf_files import is_encoder, tokenizer_from_folder

        path = Path(path)
        config = model_config(path)
        self.task = model_task(path)
        self.causal = not is_encoder(config)  # a decoder: positions follow each row's own tokens
        self.recipe = model_recipe(path) if self.task == "embed" else None
        self.tokenizer = tokenizer_from_folder(path)
        if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token  # a decoder's batches need one to pad with
        self.model = load_classifier(path, self.tokenizer) if self.task == "classify" else load_encoder(path)
        cap = self.recipe.max_seq_length if self.recipe is not None else None
        if max_length is not None:
            cap = max_length if cap is None else min(cap, max_length)
        self.max_length = _max_length(self.tokenizer, config, cap)
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer))  # the ids token inputs may hold

    def run(self, items: list) -> Pooled:
        """`embed` or `classify`, whichever the model does."""
        return self.classify(items) if self.task == "classify" else self.embed(items)

    def _cap(self, k: int | None, pair: bool) -> int:
        """The most tokens an input keeps: k, within the model's limit (-1 or None: the limit), and never fewer
        than its special tokens and one token of each text (below that a tokenizer does not cut at all)."""
        cap = self.max_length if k is None or k == -1 else min(k, self.max_length)
        return max(cap, min(self.tokenizer.num_special_tokens_to_add(pair=pair) + 1 + pair, self.max_length))

    def _tokenize(self, items: list[Input]):
        """The batch's input tensors. An input is cut to its cap (`_cap`) from its side, its special tokens kept
        (BERT's [CLS] ... [SEP]); a pair is tokenized as the model was trained to read one (BERT's [CLS] a [SEP]
        b [SEP] with segment ids, RoBERTa's <s> a </s></s> b </s>) and loses tokens from its longer text first,
        as sentence-transformers' CrossEncoder cuts it."""
        tokenizer = self.tokenizer
        if self.recipe is not None and self.recipe.lower_case:  # as sentence-transformers' do_lower_case
            items = [(text.lower() if isinstance(text, str) else text, pair, k, side) for text, pair, k, side in items]
        texts, pairs, caps, sides = zip(*items, strict=True)
        plain = all(isinstance(t, str) for t in texts) and all(c is None for c in caps) and "none" not in sides
        if plain and (all(p is None for p in pairs) or all(p is not None for p in pairs)):
            second = None if pairs[0] is None else list(pairs)  # the usual batch: one call
            return tokenizer(list(texts), second, padding=True, truncation=True,
                             max_length=self._cap(None, second is not None), return_tensors="pt")
        encs = []
        try:
            for text, pair, k, side in items:
                if not isinstance(text, str):
                    encs.append(self._given_ids(text, k, side))
                elif side == "none":
                    encs.append(self._whole(tokenizer(text, pair)))
                else:
                    tokenizer.truncation_side = side
                    encs.append(tokenizer(text, pair, truncation=True, max_length=self._cap(k, pair is not None)))
        finally:
            tokenizer.truncation_side = "right"
        return tokenizer.pad(encs, return_tensors="pt")

    def _whole(self, enc):
        """An input that may not be cut (side "none"), refused where it is over the model's limit."""
        n = len(enc["input_ids"])
        if n > self.max_length:
            raise ValueError(f"the input has {n} tokens, more than this model's limit of {self.max_length}")
        return enc

    def _given_ids(self, ids: list[int], k: int | None, side: str) -> dict:
        """An input given as token ids, as the tokenizer's output for it would be: the ids as they are (no special
        tokens added, as vLLM takes them), cut like a text to k or the model's limit from `side`."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary (ids 0 to {self.vocab_size - 1})")
        cap = self.max_length if k is None or k == -1 else min(k, self.max_length)
        if side == "none":
            self._whole({"input_ids": ids})
        ids = list(ids[:cap] if side in ("right", "none") else ids[-cap:])
        enc = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if "token_type_ids" in self.tokenizer.model_input_names:  # one segment, as the tokenizer marks a text
            enc["token_type_ids"] = [0] * len(ids)
        return enc

    def _decoder_inputs(self, enc) -> dict:
        """A decoder's extra inputs: its rows' positions from their own tokens, so that padding (on the
        tokenizer's side) changes no result; and no segment ids, which some tokenizers return anyway."""
        if not self.causal:
            return {}
        enc.pop("token_type_ids", None)
        return {"position_ids": (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)}

    def embed(self, items: list[Input]) -> Pooled:
        """The last hidden states pooled (and normalized) as the model's recipe says."""
        import torch

        from servelm.model.families.encoder import pool

        enc = self._tokenize(items)
        mask = enc["attention_mask"]
        extra = self._decoder_inputs(enc)
        hidden = self.model(**enc, **extra)
        pooled = pool(hidden, mask, self.recipe.pooling)
        if self.recipe.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return Pooled(pooled.numpy(), _ids(enc), mask.numel())

    def classify(self, items: list[Input]) -> Pooled:
        """Each text's (or pair's) logits (a decoder's: at its last token)."""
        enc = self._tokenize(items)
        extra = self._decoder_inputs(enc)
        logits = self.model(**enc, **extra)
        return Pooled(logits.float().numpy(), _ids(enc), enc["attention_mask"].numel())


def _ids(enc) -> list[list[int]]:
    """Each row's real token ids (padding left out)."""
    mask = enc["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(enc["input_ids"], mask, strict=True)]


def activate(logits: np.ndarray, activation: str = "classify", use_activation: bool | None = None) -> np.ndarray:
    """A classifier's logits [n, labels] as scores or probabilities (`model_activation` says which):
    "classify" is vLLM's default, one label's logit through a sigmoid (a relevance in [0, 1]) and several
    labels' through a softmax; "sigmoid" is one per label (multi-label); "identity" keeps the logits. vLLM's
    use_activation False keeps the logits whatever the model's activation."""
    logits = np.asarray(logits, dtype=np.float64)
    if activation == "identity" or use_activation is False:
        return logits
    if activation == "tanh":
        return np.tanh(logits)
    if activation == "sigmoid" or logits.shape[-1] == 1:
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine similarity of each row of `a` with the same row of `b` (a row of zeros scores 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.divide((a * b).sum(axis=1), norms, out=np.zeros(len(a)), where=norms > 0)
