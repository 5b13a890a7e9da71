"""Sequence classifiers in the embedding model's place: a cross-encoder serves /score and /rerank by reading each
pair together, a classifier serves /classify, each as transformers' AutoModelForSequenceClassification computes
them (with vLLM's activation: the sigmoid of one logit, the softmax of several)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from fakes import IdleEngine
from tiny_encoders import DOCS, LABELS, QUERY, bert_tokenizer, classifier_logits, save_classifier, sigmoid


def _client(tokenizer, folder):
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.runtimes.embedder import Embedder
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    embedder = Embedder(folder)
    state = build_state(load({}), tokenizer, IdleEngine(), "tiny", embedder=embedder, embed_name=folder.name)
    return TestClient(build_app(state)), embedder


@pytest.fixture(scope="module")
def cross(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ms-marco-tiny")
    save_classifier(folder, "bert", 1)
    client, embedder = _client(tokenizer, folder)
    with client:
        yield client, folder
    embedder.close()


@pytest.fixture(scope="module")
def classifier(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentiment-tiny")
    save_classifier(folder, "bert", 3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    client, embedder = _client(tokenizer, folder)
    with client:
        yield client, folder
    embedder.close()


def test_a_cross_encoder_scores_each_pair_read_together(cross):
    client, folder = cross
    want = sigmoid(classifier_logits(folder, [QUERY] * len(DOCS), DOCS)[:, 0])
    for path, body in (("/score", {"text_1": QUERY, "text_2": DOCS}),
                       ("/v1/score", {"queries": [QUERY] * len(DOCS), "documents": DOCS})):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert r.json()["model"] == folder.name and r.json()["usage"]["prompt_tokens"] > 0
    raw = client.post("/score", json={"text_1": QUERY, "text_2": DOCS, "use_activation": False}).json()
    np.testing.assert_allclose([d["score"] for d in raw["data"]], np.log(want / (1 - want)), rtol=1e-3, atol=1e-5)


def test_rerank_orders_by_the_cross_encoders_scores(cross):
    client, folder = cross
    want = sigmoid(classifier_logits(folder, [QUERY] * len(DOCS), DOCS)[:, 0])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = client.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable")[:3])
        for x in results:
            assert x["relevance_score"] == pytest.approx(want[x["index"]], rel=1e-4)
            assert x["document"]["text"] == DOCS[x["index"]]


def test_a_cross_encoders_truncation_caps_each_pair(cross):
    client, folder = cross
    long_doc = "the cat " * 40
    want = sigmoid(classifier_logits(folder, [QUERY], [long_doc], max_length=12)[:, 0])
    r = client.post("/score", json={"text_1": QUERY, "text_2": long_doc, "truncate_prompt_tokens": 12}).json()
    assert r["usage"]["prompt_tokens"] == 12
    assert r["data"][0]["score"] == pytest.approx(want[0], rel=1e-4)
    # past the model's position table (128 here; its tokenizer says 512): cut to fit, longest side first
    longer = "the cat " * 100
    want = sigmoid(classifier_logits(folder, [QUERY], [longer], max_length=128)[:, 0])
    r = client.post("/score", json={"text_1": QUERY, "text_2": longer}).json()
    assert r["usage"]["prompt_tokens"] == 128 and r["data"][0]["score"] == pytest.approx(want[0], rel=1e-4)
    r = client.post("/score", json={"text_1": QUERY, "text_2": long_doc, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_a_classifier_refuses_embeddings_and_an_embedding_model_refuses_classify(cross, tmp_path, tokenizer):
    client, _ = cross
    r = client.post("/v1/embeddings", json={"input": "a cat"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "wrong_model_task" and "/rerank" in err["message"]
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=64)).save_pretrained(tmp_path)
    bert_tokenizer(tmp_path)
    encoder, embedder = _client(tokenizer, tmp_path)
    try:
        with encoder:
            r = encoder.post("/classify", json={"input": "a cat"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_task"
            assert encoder.post("/v1/embeddings", json={"input": "a cat"}).status_code == 200
    finally:
        embedder.close()


def test_classify_gives_each_labels_probability(classifier):
    client, folder = classifier
    texts = ["what a lovely day", "this is awful", "ok"]
    logits = classifier_logits(folder, texts)
    want = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    r = client.post("/classify", json={"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    for i, d in enumerate(body["data"]):
        assert d["index"] == i and d["num_classes"] == 3
        np.testing.assert_allclose(d["probs"], want[i], rtol=1e-4, atol=1e-6)
        assert d["label"] == LABELS[int(np.argmax(want[i]))]
    invoked = client.post("/invocations", json={"input": texts}).json()  # SageMaker's: a classifier classifies
    assert [d["probs"] for d in invoked["data"]] == [d["probs"] for d in body["data"]]
    raw = client.post("/classify", json={"input": texts[0], "use_activation": False}).json()
    np.testing.assert_allclose(raw["data"][0]["probs"], logits[0], rtol=1e-4, atol=1e-5)
    # scores need one output: a three-label classifier says so rather than picking a column
    r = client.post("/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_task"


def test_the_open_inference_protocol_gives_a_classifiers_probabilities(classifier):
    client, folder = classifier
    texts = ["what a lovely day", "this is awful"]
    logits = classifier_logits(folder, texts)
    want = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    meta = client.get(f"/v2/models/{folder.name}").json()
    assert [o["name"] for o in meta["outputs"]] == ["probs"]
    r = client.post(f"/v2/models/{folder.name}/infer",
                    json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "probs" and out["shape"] == [2, 3]
    np.testing.assert_allclose(np.reshape(out["data"], (2, 3)), want, rtol=1e-4, atol=1e-6)


def test_xlm_roberta_rerankers_run_through_transformers(tmp_path):
    """bge-reranker's family: not the built-in BERT, so transformers' own model runs in the embedding process."""
    import asyncio

    from servelm.runtimes.embedder import Embedder

    save_classifier(tmp_path, "xlm-roberta", 1)
    want = classifier_logits(tmp_path, [QUERY] * len(DOCS), DOCS)

    async def run():
        emb = Embedder(tmp_path)
        try:
            await emb.wait_ready()
            return await emb.classify([QUERY] * len(DOCS), DOCS)
        finally:
            emb.close()

    logits, tokens = asyncio.run(run())
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-5)
    assert tokens > len(DOCS) * 4


def test_validation_records_a_classifiers_logits(tmp_path):
    import asyncio
    import json

    from servelm.control.checkpoint import describe
    from servelm.control.types import Kind
    from servelm.control.validation import _default_embedder, _run_embed

    save_classifier(tmp_path, "bert", 3, id2label=LABELS)
    info = describe(tmp_path)  # the registry takes it as an embedding-process version
    assert info.kind == Kind.EMBED and info.architecture == "BertForSequenceClassification"
    prompts = ["good", "bad"]
    out = asyncio.run(_run_embed(SimpleNamespace(artifact=str(tmp_path)), prompts, _default_embedder))
    want = classifier_logits(tmp_path, prompts)
    for line, row in zip(out, want, strict=True):
        rec = json.loads(line)
        assert rec["labels"] == 3
        np.testing.assert_allclose(rec["head"], row, atol=2e-4)


def test_a_registry_deployment_of_a_cross_encoder_scores_pairs(tmp_path):
    """An embedding version that is a cross-encoder: its deployment says so and scores pairs (what /rerank
    with `model` naming it runs)."""
    import asyncio

    from servelm.control.embed_deployment import EmbedDeployment
    from servelm.control.types import Kind, ModelVersion, State

    save_classifier(tmp_path, "bert", 1)
    want = classifier_logits(tmp_path, [QUERY] * 2, DOCS[:2])
    mv = ModelVersion("reranker", 1, State.PRODUCTION, Kind.EMBED, artifact=str(tmp_path), sha256="", source="t")

    async def run():
        dep = EmbedDeployment(mv)
        await dep.start()
        try:
            return dep.task, await dep.classify([QUERY] * 2, DOCS[:2]), dep.num_in_flight()
        finally:
            await dep.shutdown()

    task, (logits, _), in_flight = asyncio.run(run())
    assert task == "classify" and in_flight == 0
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-5)


def test_the_embedding_model_may_be_a_hugging_face_repo_id(tmp_path, monkeypatch):
    """--embedding-model cross-encoder/ms-marco-MiniLM-L-6-v2: taken from the Hugging Face cache (here offline),
    served under the repo id, and a cross-encoder for /rerank."""
    from hub_cache import add_folder, use_cache

    from servelm.config.settings import load
    from servelm.server.serve import _embedder

    folder = tmp_path / "model"
    folder.mkdir()
    save_classifier(folder, "bert", 1)
    add_folder(use_cache(monkeypatch, tmp_path / "hf"), "cross-encoder/ms-marco-tiny", folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    embedder, name = _embedder(load({"embedding_model": "cross-encoder/ms-marco-tiny"}))
    try:
        assert name == "cross-encoder/ms-marco-tiny" and embedder.task == "classify"  # named as vLLM names it
        assert (embedder.path / "config.json").read_bytes() == (folder / "config.json").read_bytes()
        assert embedder.path.is_relative_to(tmp_path / "hf")
    finally:
        embedder.close()
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        _embedder(load({"embedding_model": "cross-encoder/not-cached"}))


@pytest.mark.parametrize(("config", "activation"), [
    ({}, "classify"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "identity"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "classify"),
    ({"problem_type": "regression"}, "identity"),
    ({"problem_type": "multi_label_classification"}, "sigmoid"),
])
def test_a_classifiers_activation_is_the_one_its_config_names(tmp_path, config, activation):
    """As vLLM reads it: transformers' problem_type, else the activation sentence-transformers saved, else a
    sigmoid of one logit and a softmax of several."""
    from servelm.runtimes.encoder_runner import activate, model_activation

    save_classifier(tmp_path, "bert", 3, **config)
    assert model_activation(tmp_path) == activation
    logits = np.array([[0.5, -1.0, 2.0]])
    want = {"identity": logits, "sigmoid": sigmoid(logits),
            "classify": np.exp(logits) / np.exp(logits).sum()}[activation]
    np.testing.assert_allclose(activate(logits, activation), want)
    np.testing.assert_allclose(activate(logits[:, :1], "classify"), sigmoid(logits[:, :1]))  # one label: sigmoid


def test_an_activation_outside_torch_nn_stops_the_start(tmp_path):
    from servelm.runtimes.embedder import Embedder

    save_classifier(tmp_path, "bert", 1, sbert_ce_default_activation_function="mypackage.CustomActivation")
    with pytest.raises(ValueError, match="CustomActivation"):
        Embedder(tmp_path)


def test_ms_marco_style_cross_encoders_score_with_raw_logits(tokenizer, tmp_path):
    """ms-marco-MiniLM's config names Identity: its scores are its logits, as vLLM and CrossEncoder give them,
    and /classify's labels fall back to transformers' LABEL_i names."""
    save_classifier(tmp_path, "bert", 1, sbert_ce_default_activation_function="torch.nn.modules.linear.Identity")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("id2label", None), cfg.pop("label2id", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_labels": 1}))  # no label names
    want = classifier_logits(tmp_path, [QUERY] * len(DOCS), DOCS)[:, 0]
    client, embedder = _client(tokenizer, tmp_path)
    try:
        with client:
            r = client.post("/rerank", json={"query": QUERY, "documents": DOCS}).json()
            got = {x["index"]: x["relevance_score"] for x in r["results"]}
            np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, rtol=1e-4, atol=1e-5)
            assert client.post("/classify", json={"input": "a"}).json()["data"][0]["label"] == "LABEL_0"
    finally:
        embedder.close()


def test_a_decoders_sequence_classifier_is_a_classifier_not_an_encoder():
    from servelm.model.loading.hf_files import is_classifier, is_encoder

    reward = {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}
    assert is_classifier(reward) and not is_encoder(reward)
    assert is_classifier({"model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"]})
    assert not is_classifier({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})


@pytest.fixture(scope="module")
def decoder_reranker(tokenizer_dir, tokenizer, tmp_path_factory):
    """A tiny Qwen3ForSequenceClassification with one label, as a Qwen3-Reranker converted to a sequence
    classifier is, its config naming no pad token (the tokenizer's stands in), its tokenizer padding on the left."""
    import shutil

    import torch
    import transformers

    folder = tmp_path_factory.mktemp("qwen3-reranker-tiny")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_labels=1, pad_token_id=None)
    transformers.Qwen3ForSequenceClassification(config).eval().save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tc, "padding_side": "left"}))  # as Qwen3's pads
    client, embedder = _client(tokenizer, folder)
    with client:
        yield client, folder
    embedder.close()


def test_a_decoder_reranker_scores_each_pair_at_its_last_token(decoder_reranker):
    """/score and /rerank over a decoder's sequence classifier, batched and padded, give what transformers gives
    each pair alone (the logit at its last token, through a sigmoid): its positions and its last token do not
    move with the padding the batch adds."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    client, folder = decoder_reranker
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = [model(**tok(QUERY, doc, return_tensors="pt")).logits[0, 0].item() for doc in DOCS]
    want = sigmoid(np.array(logits))
    assert len({len(tok(QUERY, doc)["input_ids"]) for doc in DOCS}) > 1  # the batch pads some pairs
    r = client.post("/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, rtol=1e-4, atol=1e-6)
    r = client.post("/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == list(np.argsort(-want))
    # in one padded batch (the server would run a batch that fails one input at a time)
    from servelm.runtimes.encoder_runner import EncoderRunner

    batch = EncoderRunner(folder).classify([(QUERY, doc, None, "right") for doc in DOCS])
    assert batch.padded > sum(len(ids) for ids in batch.token_ids)
    np.testing.assert_allclose(batch.rows[:, 0], logits, rtol=1e-4, atol=1e-5)


def test_one_input_the_encoder_fails_on_fails_alone(monkeypatch):
    """In the embedding process: a batch that fails runs its inputs one by one, so only the bad one fails."""
    from servelm.runtimes import embedder as E
    from servelm.runtimes.encoder_runner import Pooled

    class Runner:
        def run(self, items):
            if any(text == "bad" for text, *_ in items):
                raise RuntimeError("index out of range")
            return Pooled(np.ones((len(items), 2)), [[1, 2, 3]] * len(items), 3 * len(items))

    monkeypatch.setattr(E, "_worker", Runner())
    rows, lens, _ = E._encode([("ok", None, None, "right"), ("bad", None, None, "right"),
                               ("fine", None, None, "right")])
    assert isinstance(rows[1], E.EncodeFailed) and "index out of range" in str(rows[1])
    assert rows[0].tolist() == rows[2].tolist() == [1.0, 1.0] and lens == [3, 0, 3]


QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}  # vLLM's --hf-overrides for Qwen3-Reranker


def test_a_causal_reranker_scores_by_its_yes_and_no_tokens_with_hf_overrides(tokenizer_dir, tokenizer, tmp_path):
    """`servelm serve Qwen/Qwen3-Reranker-0.6B --hf-overrides '{...}'`: a Qwen3ForCausalLM read as a one-label
    classifier whose logit is the "yes" token's minus the "no" token's at the last token, so that its score
    is P(yes) / (P(yes) + P(no)) as the model's card computes it; without the overrides it is a generation
    model, and a generation model refuses them."""
    import shutil

    import torch
    import transformers
    from starlette.testclient import TestClient

    from servelm.config.engine import ConfigError
    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.launch import fixed_models, pooling_model
    from servelm.server.serve import _embedder, build_state

    folder = tmp_path / "qwen3-reranker-causal"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        last = [model(**tokenizer(QUERY, doc, return_tensors="pt")).logits[0, -1] for doc in DOCS]
    want = sigmoid(np.array([(x[yes] - x[no]).item() for x in last]))

    assert pooling_model(load({"model": str(folder)})) is None  # a causal LM: generation, as it stands
    served = load({"model": str(folder), "hf_overrides": json.dumps(QWEN3_RERANKER)})
    assert pooling_model(served) is not None and fixed_models(served) == []
    embedder, name = _embedder(served)
    try:
        assert name == folder.name and embedder.task == "classify" and embedder.labels == ["score"]
        client = TestClient(build_app(build_state(load({}), tokenizer, IdleEngine(), "tiny", embedder=embedder,
                                                  embed_name=name)))
        with client:
            r = client.post("/score", json={"text_1": QUERY, "text_2": DOCS})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, rtol=1e-4, atol=1e-6)
    finally:
        embedder.close()
    assert "classifier_from_token" not in (folder / "config.json").read_text()  # the original is left as it was
    # --runner generate: the same overrides go to a generation engine's loader (tests/model/test_hf_overrides.py)
    [launch] = fixed_models(load({"model": str(folder), "hf_overrides": json.dumps(QWEN3_RERANKER),
                                  "runner": "generate"}))
    assert json.loads(launch.engine.model_config.hf_overrides) == QWEN3_RERANKER
    with pytest.raises(ConfigError, match="hf_overrides"):
        load({"hf_overrides": '{"is_original_qwen3_reranker": true}'})
