"""Embedding models made as their sentence-transformers modules say (model/loading/st_config.py,
runtimes/encoder_runner.py): every pooling mode, normalization or none, max_seq_length and lower-casing, encoders
and decoders (Qwen3-Embedding's shape: a causal model pooled at its last token, padded on the left), checked
against sentence-transformers itself; vLLM's defaults for a folder without modules, checked against
transformers; modules servelm does not run refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_encoders import DOCS, QUERY, save_encoder, st_vectors, write_st_modules

from servelm.runtimes.encoder_runner import EncoderRunner

# texts of different lengths, so that a batch pads them
TEXTS = [QUERY, *DOCS, "Cats SLEEP on the Warm Mat, and the dog naps beside them in the afternoon sun"]


def _embed(folder, texts=TEXTS) -> np.ndarray:
    runner = EncoderRunner(folder)
    return np.asarray(runner.embed([(t, None, None, "right") for t in texts]).rows, dtype=np.float64)


def _decoder(folder, tokenizer_dir, causal_lm: bool = True, **modules) -> None:
    """A tiny random-weight Qwen3 saved as Qwen3-Embedding is (a causal LM's checkpoint), with the SmolLM2
    tokenizer padding on the left, and sentence-transformers' files where `modules` names a pooling."""
    import transformers
    from tiny_models import COMMON

    torch.manual_seed(3)
    config = transformers.Qwen3Config(**{**COMMON, "num_hidden_layers": 1}, head_dim=16)
    cls = transformers.Qwen3ForCausalLM if causal_lm else transformers.Qwen3Model
    cls(config).eval().save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "padding_side": "left"}))
    if modules.get("pooling") is not None:
        write_st_modules(folder, COMMON["hidden_size"], **modules)


@pytest.mark.parametrize("pooling, normalize", [("cls", True), ("mean", False), ("max", True),
                                                ("mean_sqrt_len_tokens", False), ("weightedmean", True),
                                                ("lasttoken", True), (["cls", "mean"], True)])
def test_each_pooling_mode_of_an_encoder_as_sentence_transformers_computes_it(tmp_path, pooling, normalize):
    save_encoder(tmp_path, pooling=pooling, normalize=normalize)
    got = _embed(tmp_path)
    want = st_vectors(tmp_path, TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 32 * (2 if isinstance(pooling, list) else 1))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0) == normalize


def test_max_seq_length_cuts_inputs_as_sentence_transformers_does(tmp_path):
    save_encoder(tmp_path, max_seq_length=8)
    runner = EncoderRunner(tmp_path)
    assert runner.max_length == 8
    out = runner.embed([(t, None, None, "right") for t in TEXTS])
    assert max(len(ids) for ids in out.token_ids) == 8
    np.testing.assert_allclose(out.rows, st_vectors(tmp_path, TEXTS), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal_lm", [True, False])
def test_a_decoder_embedding_model_pools_its_last_token_padded_on_the_left(tmp_path, tokenizer_dir, causal_lm):
    """Qwen3-Embedding's recipe: last token, normalized. The batch is padded on the left (the tokenizer's side)
    and every row's positions count its own tokens, so each vector equals sentence-transformers' for the text
    alone."""
    _decoder(tmp_path, tokenizer_dir, causal_lm, pooling="lasttoken", normalize=True, max_seq_length=None)
    runner = EncoderRunner(tmp_path)
    assert runner.causal and runner.recipe.pooling == ("lasttoken",) and runner.tokenizer.padding_side == "left"
    assert runner.max_length == 1024  # no max_seq_length: the model's own limit
    np.testing.assert_allclose(_embed(tmp_path), st_vectors(tmp_path, TEXTS), atol=2e-5, rtol=1e-4)


def test_lower_case_as_the_folder_says(tmp_path, tokenizer_dir):
    _decoder(tmp_path, tokenizer_dir, pooling="mean", normalize=True, max_seq_length=64, lower_case=True)
    got = _embed(tmp_path, ["Cats SLEEP", "cats sleep"])
    np.testing.assert_allclose(got[0], got[1], atol=1e-6)  # the tokenizer is cased: only lower-casing makes them one
    np.testing.assert_allclose(got, st_vectors(tmp_path, ["Cats SLEEP", "cats sleep"]), atol=2e-5, rtol=1e-4)
    cased = tmp_path / "cased"
    cased.mkdir()
    _decoder(cased, tokenizer_dir, pooling="mean", normalize=True, max_seq_length=64, lower_case=False)
    got = _embed(cased, ["Cats SLEEP", "cats sleep"])
    assert not np.allclose(got[0], got[1], atol=1e-3)


def test_a_folder_without_modules_gets_vllms_defaults(tmp_path, tokenizer_dir):
    """An encoder: its first token ([CLS]), normalized, up to the model's own limit (512 positions here, no
    256-token cap); a decoder: its last token, normalized."""
    from transformers import AutoModel, AutoTokenizer

    enc = tmp_path / "encoder"
    enc.mkdir()
    save_encoder(enc, modules=False)
    long = " ".join(["cats sleep on warm mats"] * 80)  # about 400 tokens
    texts = [QUERY, long]
    model, tok = AutoModel.from_pretrained(enc).eval(), AutoTokenizer.from_pretrained(enc)
    with torch.inference_mode():
        want = [torch.nn.functional.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0, 0], dim=-1)
                for t in texts]
    assert len(tok(long)["input_ids"]) > 256
    np.testing.assert_allclose(_embed(enc, texts), torch.stack(want).numpy(), atol=2e-5, rtol=1e-4)

    dec = tmp_path / "decoder"
    dec.mkdir()
    _decoder(dec, tokenizer_dir, causal_lm=False)
    model, tok = AutoModel.from_pretrained(dec).eval(), AutoTokenizer.from_pretrained(dec)
    with torch.inference_mode():
        want = [torch.nn.functional.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1], dim=-1)
                for t in TEXTS]
    np.testing.assert_allclose(_embed(dec), torch.stack(want).numpy(), atol=2e-5, rtol=1e-4)


def test_modules_it_does_not_run_are_refused_by_name(tmp_path):
    from servelm.runtimes.embedder import Embedder

    save_encoder(tmp_path)
    write_st_modules(tmp_path, 32, extra=("Dense",))
    with pytest.raises(ValueError, match=r"Dense \(3_Dense\)"):
        EncoderRunner(tmp_path)
    with pytest.raises(ValueError, match=r"Dense \(3_Dense\)"):  # the server's start, before any process
        Embedder(tmp_path)
    write_st_modules(tmp_path, 32, pooling="median")
    with pytest.raises(ValueError, match="median"):
        EncoderRunner(tmp_path)


def test_an_older_pooling_config_of_booleans(tmp_path):
    """all-MiniLM-era configs name the modes with pooling_mode_*_token booleans."""
    save_encoder(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": True}))
    assert EncoderRunner(tmp_path).recipe.pooling == ("cls", "max")
    np.testing.assert_allclose(_embed(tmp_path), st_vectors(tmp_path, TEXTS), atol=2e-5, rtol=1e-4)


def test_a_sentence_transformers_decoder_is_a_pooling_model_everywhere(tmp_path, tokenizer_dir):
    """Its config names Qwen3ForCausalLM, as Qwen3-Embedding's does; its modules make it an embedding model, as
    in vLLM: the offline API embeds with it, the registry takes it as one, and `servelm serve` says where it
    goes."""
    from servelm import LLM
    from servelm.control.checkpoint import Kind, describe
    from servelm.model.loading import metadata
    from servelm.model.loading.hf_files import is_embedding_folder, read_json

    _decoder(tmp_path, tokenizer_dir, pooling="lasttoken", normalize=True, max_seq_length=None)
    assert is_embedding_folder(tmp_path, read_json(tmp_path / "config.json"))
    out = LLM(str(tmp_path)).embed(TEXTS[:2])
    np.testing.assert_allclose([o.outputs.embedding for o in out], st_vectors(tmp_path, TEXTS[:2]), atol=2e-5,
                               rtol=1e-4)
    assert describe(tmp_path).kind == Kind.EMBED
    with pytest.raises(ValueError, match="is an embedding model.*--embedding-model"):
        metadata.check_model(str(tmp_path))
    (tmp_path / "modules.json").unlink()  # the same checkpoint without the modules: a generation model
    assert not is_embedding_folder(tmp_path, read_json(tmp_path / "config.json"))
    assert describe(tmp_path).kind == Kind.GENERATE


def test_matryoshka_dimensions_cut_and_normalize_as_vllm_does(tmp_path):
    """A model whose config lists matryoshka_dimensions: `dimensions` keeps a vector's first values and
    normalizes them again, offline and in the server's embedding process alike; other cuts are refused."""
    import asyncio

    from servelm import LLM, PoolingParams
    from servelm.runtimes.embedder import BadDimensions, Embedder

    save_encoder(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16, 32]}))
    full = st_vectors(tmp_path, TEXTS)
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    llm = LLM(str(tmp_path))
    got = [o.outputs.embedding for o in llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=16), use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="trained for dimensions 8, 16, 32, not 12"):
        llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=12))
    with pytest.raises(ValueError, match="embed"):
        llm.score(TEXTS[0], TEXTS[1], pooling_params=PoolingParams(dimensions=16))

    async def serve() -> list:
        emb = Embedder(tmp_path)
        try:
            await emb.wait_ready()
            with pytest.raises(BadDimensions, match="not 12"):
                await emb.embed(TEXTS, dimensions=12)
            vectors, _ = await emb.embed(TEXTS, dimensions=16)
            return vectors
        finally:
            emb.close()

    np.testing.assert_allclose(asyncio.run(serve()), want, atol=2e-5, rtol=1e-4)
    config["is_matryoshka"] = True  # any cut, up to the width
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert len(LLM(str(tmp_path)).embed("hi", pooling_params=PoolingParams(dimensions=5))[0].outputs.embedding) == 5
    with pytest.raises(ValueError, match="from 1 to 32"):
        LLM(str(tmp_path)).embed("hi", pooling_params=PoolingParams(dimensions=33))
