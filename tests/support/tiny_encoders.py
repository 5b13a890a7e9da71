"""Tiny random-weight encoder checkpoints with a real BERT tokenizer (the packaged all-MiniLM-L6-v2's), and
transformers' answers for them: the oracle of the embedding, scoring and classification tests."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from servelm.runtimes.embedder import default_embedding_path

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
QUERY = "where do cats sleep"
DOCS = ["a cat sleeps on the warm mat", "stock prices fell sharply today", "kittens nap in sunny spots",
        "the recipe needs two eggs"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def bert_tokenizer(folder) -> None:
    src = default_embedding_path()
    if src is None:
        pytest.skip("the packaged all-MiniLM-L6-v2 (its BERT tokenizer) is not installed")
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, folder / name)


def save_classifier(folder, family: str, num_labels: int, **extra):
    """A tiny random-weight *ForSequenceClassification checkpoint with a BERT tokenizer; returns the model."""
    import transformers

    torch.manual_seed(num_labels + len(family))
    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=128, num_labels=num_labels, **extra)
    if family == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**common))
    else:  # XLM-RoBERTa, bge-reranker's family: transformers runs it
        model = transformers.XLMRobertaForSequenceClassification(
            transformers.XLMRobertaConfig(**{**common, "max_position_embeddings": 130}, pad_token_id=0))
    model.eval().save_pretrained(folder)
    bert_tokenizer(folder)
    return model


def classifier_logits(folder, texts, pairs=None, max_length=None) -> np.ndarray:
    """transformers' logits, one input at a time (no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    rows = []
    for i, t in enumerate(texts):
        enc = tok(t, None if pairs is None else pairs[i], truncation=max_length is not None, max_length=max_length,
                  return_tensors="pt")
        with torch.inference_mode():
            rows.append(model(**enc).logits[0].numpy())
    return np.asarray(rows, dtype=np.float64)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def save_encoder(folder, layers: int = 1, pooling="mean", normalize: bool = True, max_seq_length: int | None = 256,
                 lower_case: bool = False, modules: bool = True):
    """A tiny random-weight BertModel (an embedding model) with a BERT tokenizer and, with `modules`, the
    sentence-transformers files all-MiniLM-L6-v2 has (by default its recipe: mean pooling, normalized, 256
    tokens)."""
    import transformers

    torch.manual_seed(layers)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=64)).eval().save_pretrained(folder)
    bert_tokenizer(folder)
    if modules:
        write_st_modules(folder, 32, pooling, normalize, max_seq_length, lower_case)


def write_st_modules(folder, hidden: int, pooling="mean", normalize: bool = True, max_seq_length: int | None = 256,
                     lower_case: bool = False, extra: tuple[str, ...] = ()) -> None:
    """sentence-transformers' files for a folder holding a transformer: modules.json (Transformer, Pooling,
    Normalize where `normalize`, then `extra` module class names), the Pooling module's config (`pooling`: a
    mode or a list of them) and sentence_bert_config.json."""
    import json
    from pathlib import Path

    folder = Path(folder)
    names = ["Transformer", "Pooling"] + (["Normalize"] if normalize else []) + list(extra)
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    listed = [{"idx": i, "name": str(i), "path": paths.get(n, f"{i}_{n}"), "type": f"sentence_transformers.models.{n}"}
              for i, n in enumerate(names)]
    (folder / "modules.json").write_text(json.dumps(listed))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": hidden,
                                                                   "pooling_mode": pooling}))
    if normalize:
        (folder / "2_Normalize").mkdir(exist_ok=True)
    settings = {"do_lower_case": lower_case} | ({"max_seq_length": max_seq_length} if max_seq_length else {})
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))


def st_vectors(folder, texts) -> np.ndarray:
    """sentence-transformers' own embeddings of the texts, one at a time (no padding), float64."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(folder), device="cpu")
    return np.asarray([model.encode([t], convert_to_numpy=True)[0] for t in texts], dtype=np.float64)


def mean_pooled(folder, texts, max_length: int = 256) -> np.ndarray:
    """transformers' L2-normalised mean-pooled sentence vectors, one text at a time."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    rows = []
    for t in texts:
        enc = tok(t, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.inference_mode():
            v = model(**enc).last_hidden_state[0].mean(0)
        rows.append(torch.nn.functional.normalize(v, dim=-1).numpy())
    return np.asarray(rows, dtype=np.float64)
