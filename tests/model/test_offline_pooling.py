"""The offline API of encoder models, as vLLM's pooling models answer it: `LLM.embed`, `LLM.score` and
`LLM.classify`, each against transformers, with inputs of many lengths batched together and answers in the
inputs' order."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_encoders import (
    DOCS,
    LABELS,
    QUERY,
    classifier_logits,
    mean_pooled,
    save_classifier,
    save_encoder,
    sigmoid,
)

from servelm import LLM, LoRARequest, PoolingParams

# 40 texts of many lengths: more than one batch, each batch mixing short and long ones before sorting
TEXTS = [" ".join(["word"] * (1 + (7 * i) % 23) + [f"number {i}"]) for i in range(40)]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("minilm-tiny")
    save_encoder(folder)
    return folder


def test_embed_gives_transformers_mean_pooled_vectors_in_order(encoder_dir):
    llm = LLM(str(encoder_dir))
    out = llm.embed(TEXTS, use_tqdm=False)
    want = mean_pooled(encoder_dir, TEXTS)
    np.testing.assert_allclose([o.outputs.embedding for o in out], want, rtol=1e-4, atol=1e-5)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in out] == [tok(t).input_ids for t in TEXTS]
    assert out[0].outputs.hidden_size == 32 and out[0].finished
    assert len({o.request_id for o in out}) == len(TEXTS)
    # vLLM's tokenization_kwargs: truncate_prompt_tokens keeps each text's first k tokens, the special tokens
    # among them (truncation_side "left": its last ones), as /v1/embeddings does
    ids = tok(TEXTS[5]).input_ids
    for side, kept in (("right", ids[1:3]), ("left", ids[-3:-1])):
        short = llm.embed({"prompt": TEXTS[5]}, use_tqdm=False,
                          tokenization_kwargs={"truncate_prompt_tokens": 4, "truncation_side": side})[0]
        assert short.prompt_token_ids == [ids[0], *kept, ids[-1]]  # [CLS], two words' tokens, [SEP]
        np.testing.assert_allclose(short.outputs.embedding, llm.embed(  # as embedding those tokens' text
            tok.decode(kept), use_tqdm=False)[0].outputs.embedding, rtol=1e-4, atol=1e-5)
    # vLLM's TokensPrompt: ids run as they are, batched with texts
    given = llm.embed([{"prompt_token_ids": tok(TEXTS[3]).input_ids}, TEXTS[4]], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.embedding for o in given], want[3:5], rtol=1e-4, atol=1e-5)
    assert given[0].prompt_token_ids == tok(TEXTS[3]).input_ids
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.embed({"prompt_token_ids": [len(tok) + 1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids must be"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenization_kwargs takes"):
        llm.embed("a", tokenization_kwargs={"padding": "max_length"})
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("a", pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        llm.embed("a", lora_request=LoRARequest("x", 1))


def test_score_with_an_embedding_model_is_the_cosine_of_its_vectors(encoder_dir):
    llm = LLM(str(encoder_dir))
    vec = mean_pooled(encoder_dir, [QUERY, *DOCS])
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    np.testing.assert_allclose(got, vec[1:] @ vec[0], rtol=1e-4, atol=1e-5)
    pairs = llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)  # one to one
    np.testing.assert_allclose([o.outputs.score for o in pairs], (vec[1:3] * vec[3:5]).sum(1), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="data_1 has 2 texts"):
        llm.score(DOCS[:2], DOCS[:3])
    with pytest.raises(TypeError):  # data_1 and data_2 are positional-only, as vLLM's
        llm.score(data_1=QUERY, data_2=DOCS)
    with pytest.raises(ValueError, match="needs a sequence classifier"):
        llm.classify("a cat")
    with pytest.raises(ValueError, match="an encoder model"):  # no generation on an encoder
        llm.generate("a cat")


def test_a_cross_encoder_scores_pairs_and_a_classifier_classifies(tmp_path):
    cross, clf = tmp_path / "cross", tmp_path / "clf"
    save_classifier(cross, "bert", 1)
    save_classifier(clf, "bert", 3, id2label=LABELS)
    queries = [QUERY] * len(DOCS)
    out = LLM(str(cross)).score(QUERY, DOCS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in out], sigmoid(classifier_logits(cross, queries, DOCS)[:, 0]),
                               rtol=1e-4, atol=1e-6)
    llm = LLM(str(clf))
    logits = classifier_logits(clf, TEXTS)
    want = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    got = llm.classify(TEXTS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.probs for o in got], want, rtol=1e-4, atol=1e-6)
    assert got[0].outputs.num_classes == 3
    raw = llm.classify(TEXTS[:3], use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose([o.outputs.probs for o in raw], logits[:3], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="scores need a cross-encoder"):
        llm.score(QUERY, DOCS)
    with pytest.raises(ValueError, match="needs an embedding model"):
        llm.embed("a cat")


def test_a_generation_model_refuses_the_pooling_calls(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=16)
    for call in (lambda: llm.embed("a cat"), lambda: llm.score("a", "b"), lambda: llm.classify("a")):
        with pytest.raises(ValueError, match="needs an encoder model"):
            call()
