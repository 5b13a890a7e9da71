"""Non-LLM models (scikit-learn, XGBoost, ONNX) over the Open Inference Protocol, driven by tritonclient over
REST and gRPC against a real server: registry versions, metadata, readiness, inference equal to the model's
own predictions, dynamic batching, keys and errors."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

KEY, ADMIN = "sk-alice-000001", "sk-rpc-admin-01"  # conftest.RPC_KEYS, RPC_ADMIN
F = 20  # features


def _data(seed: int, n: int = 64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, F))
    return x, (x[:, 0] + x[:, 1] - x[:, 2] > 0).astype(np.int64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models trained here, saved as artifacts, with the models themselves (the oracle)."""
    import joblib
    import onnx
    import xgboost
    from onnx import TensorProto, helper
    from sklearn.linear_model import LogisticRegression
    from sklearn.tree import DecisionTreeClassifier

    d = tmp_path_factory.mktemp("oip")
    x, y = _data(0, 200)
    out = {}
    for version, model in ((1, LogisticRegression().fit(x, y)), (2, DecisionTreeClassifier(max_depth=3).fit(x, y))):
        (d / f"sk{version}").mkdir()
        joblib.dump(model, d / f"sk{version}" / "model.joblib")
        out[f"sk{version}"] = model
    booster = xgboost.train({"objective": "binary:logistic", "max_depth": 2, "nthread": 1},
                            xgboost.DMatrix(x, label=y), num_boost_round=4)
    booster.save_model(str(d / "gbt.ubj"))
    out["gbt"] = booster
    w = np.random.default_rng(1).normal(size=(F, 2)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, F])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [F, 2], w.reshape(-1).tolist())])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(d / "linear.onnx"))
    out["w"] = w
    return d, out


@pytest.fixture(scope="module")
def srv(rpc_server, models):
    """The shared gRPC server (conftest.rpc_server) with the models registered: (HTTP url, gRPC address)."""
    d, _ = models
    _, url, address = rpc_server
    admin = {"x-api-key": ADMIN}
    for name, path, labels in [("iris", d / "sk1", None), ("iris", d / "sk2", None), ("gbt", d / "gbt.ubj", None),
                               ("linear", d / "linear.onnx", None),
                               # a batch runs only once it has 2 rows: the window (100 s) never ends one first
                               ("batched", d / "linear.onnx", {"batch_window_ms": "100000", "max_batch_size": "2"})]:
        r = httpx.post(url + "/admin/models", json={"name": name, "path": str(path), "labels": labels,
                                                    "validate": True}, headers=admin, timeout=60)
        assert r.status_code == 201 and r.json()["state"] == "VALIDATED" and r.json()["kind"] == "predict", r.text
    return url, address


def _http(srv):
    return httpclient.InferenceServerClient(srv[0].removeprefix("http://"))


def _grpc(srv):
    return grpcclient.InferenceServerClient(srv[1])


AUTH_HTTP = {"Authorization": f"Bearer {KEY}"}
AUTH_GRPC = {"authorization": f"Bearer {KEY}"}


def _infer(client, mod, name: str, x: np.ndarray, outputs=(), version: str = "", headers=None, binary=True):
    inp = mod.InferInput("input-0", list(x.shape), "FP64" if x.dtype == np.float64 else "FP32")
    if mod is httpclient:
        inp.set_data_from_numpy(x, binary_data=binary)
        outs = [mod.InferRequestedOutput(o, binary_data=binary) for o in outputs]
    else:
        inp.set_data_from_numpy(x)
        outs = [mod.InferRequestedOutput(o) for o in outputs]
    if headers is None:  # a copy: tritonclient.http writes its binary-extension header into the dict
        headers = dict(AUTH_HTTP if mod is httpclient else AUTH_GRPC)
    return client.infer(name, [inp], model_version=version, outputs=outs or None, headers=headers)


def test_health_and_metadata_over_both_protocols(srv):
    h, g = _http(srv), _grpc(srv)
    assert h.is_server_live() and h.is_server_ready() and g.is_server_live() and g.is_server_ready()  # open
    assert h.is_model_ready("iris", headers=AUTH_HTTP) and g.is_model_ready("gbt", "1", headers=AUTH_GRPC)
    meta = h.get_model_metadata("iris", headers=AUTH_HTTP)
    assert meta["versions"] == ["1", "2"] and meta["platform"] == "sklearn"
    assert meta["inputs"] == [{"name": "input-0", "datatype": "FP64", "shape": [-1, F]}]
    gm = g.get_model_metadata("linear", headers=AUTH_GRPC)
    assert gm.platform == "onnx" and [(t.name, t.datatype, list(t.shape)) for t in gm.inputs] == [("x", "FP32",
                                                                                                     [-1, F])]
    # an LLM is no OIP model, nor is a name the registry does not have
    for name in ("tiny", "nope"):
        with pytest.raises(InferenceServerException, match="404|not"):
            h.get_model_metadata(name, headers=AUTH_HTTP)


def test_infer_equals_the_models_own_predictions(srv, models):
    _, m = models
    x, _ = _data(7, 9)
    h, g = _http(srv), _grpc(srv)
    # iris: the newest servable version by default, any servable version by number
    for client, mod in ((h, httpclient), (g, grpcclient)):
        r = _infer(client, mod, "iris", x, ["predict", "predict_proba"])
        np.testing.assert_array_equal(r.as_numpy("predict"), m["sk2"].predict(x))
        np.testing.assert_allclose(r.as_numpy("predict_proba"), m["sk2"].predict_proba(x))
        r1 = _infer(client, mod, "iris", x, ["predict"], version="1")
        np.testing.assert_array_equal(r1.as_numpy("predict"), m["sk1"].predict(x))
        xf = x.astype(np.float32)
        import xgboost

        np.testing.assert_allclose(_infer(client, mod, "gbt", xf).as_numpy("predict"),
                                   m["gbt"].predict(xgboost.DMatrix(xf)), rtol=1e-6)
        np.testing.assert_allclose(_infer(client, mod, "linear", xf).as_numpy("y"), xf @ m["w"], rtol=1e-5)
    # plain JSON (no binary extension) too
    r = _infer(h, httpclient, "iris", x, ["predict_proba"], binary=False)
    np.testing.assert_allclose(r.as_numpy("predict_proba"), m["sk2"].predict_proba(x))


def _hist(url: str, name: str, model: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    got = {s.name: s.value for f in text_string_to_metric_families(text) if f.name == name
           for s in f.samples if s.labels.get("model_name") == model}
    return got.get(name + "_count", 0.0), got.get(name + "_sum", 0.0)


def test_concurrent_requests_are_batched(srv, models):
    url = srv[0]
    _, m = models
    before = _hist(url, "servelm:oip_batch_requests", "batched:1")
    xs = [_data(20 + i, 1)[0].astype(np.float32) for i in range(4)]
    barrier = threading.Barrier(4)

    def one(i):
        barrier.wait()
        mod = httpclient if i % 2 else grpcclient  # both protocols feed the same batcher
        return _infer(_http(srv) if mod is httpclient else _grpc(srv), mod, "batched", xs[i]).as_numpy("y")

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for x, y in zip(xs, results, strict=True):
        np.testing.assert_allclose(y, x @ m["w"], rtol=1e-5)
    # a batch of "batched" runs only with 2 rows (its window never ends first): 4 requests in 2 predictor calls
    count, total = _hist(url, "servelm:oip_batch_requests", "batched:1")
    assert (count - before[0], total - before[1]) == (2, 4)


def test_errors_and_keys(srv):
    h, g = _http(srv), _grpc(srv)
    x = np.zeros((2, F + 1))
    with pytest.raises(InferenceServerException, match="shape"):  # 21 features for a 20-feature model: 400
        _infer(h, httpclient, "iris", x)
    with pytest.raises(InferenceServerException, match="shape"):
        _infer(g, grpcclient, "iris", x)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        _infer(g, grpcclient, "iris", np.zeros((1, F)), headers={"authorization": "Bearer sk-wrong-key"})
    r = httpx.post(srv[0] + "/v2/models/iris/infer", json={"inputs": [{"name": "a", "datatype": "FP64",
                                                                        "shape": [1, F], "data": [0] * F}]})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)  # the protocol's error shape
    r = httpx.get(srv[0] + "/v2")  # the server metadata route too (it had OpenAI's shape)
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = httpx.post(srv[0] + "/v2/models/iris/versions/3/infer", headers=AUTH_HTTP,
                   json={"inputs": [{"name": "a", "datatype": "FP64", "shape": [1, F], "data": [0] * F}]})
    assert r.status_code == 404 and r.json()["code"] == "model_not_found"  # the protocol's error shape
    assert "iris" in r.json()["error"]
    r = httpx.post(srv[0] + "/v2/models/iris/infer", headers=AUTH_HTTP,
                   json={"inputs": [{"name": "a", "datatype": "FP64", "shape": [2, F], "data": [0] * F}]})
    assert r.status_code == 400 and "values for shape" in r.json()["error"]
    # a PREDICT version needs no deployment; deploying one is refused with the reason
    r = httpx.post(srv[0] + "/admin/deployments", json={"model": "iris:1"}, headers={"x-api-key": ADMIN})
    assert r.status_code == 400 and "Open Inference Protocol" in r.json()["error"]["message"]  # OpenAI shape


def test_the_servers_embedding_model_over_both_protocols(srv):
    """The embedding model /v1/embeddings serves is also an OIP model (version 1): texts in as BYTES, the same
    vectors out, over REST and gRPC; other versions are 404 and a numeric input is 400."""
    name = httpx.get(srv[0] + "/v1/models", headers=AUTH_HTTP).json()["data"][-1]["id"]
    texts = ["the cat sat on the mat", "servelm serves models"]
    ref = httpx.post(srv[0] + "/v1/embeddings", json={"model": name, "input": texts}, headers=AUTH_HTTP).json()
    want = np.array([d["embedding"] for d in ref["data"]], dtype=np.float32)
    for client, mod in ((_http(srv), httpclient), (_grpc(srv), grpcclient)):
        inp = mod.InferInput("text", [len(texts)], "BYTES")
        inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        headers = dict(AUTH_HTTP if mod is httpclient else AUTH_GRPC)
        got = client.infer(name, [inp], headers=headers).as_numpy("embedding")
        assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)
        meta = client.get_model_metadata(name, headers=headers)
        versions = meta["versions"] if isinstance(meta, dict) else list(meta.versions)
        assert versions == ["1"]
    r = httpx.post(srv[0] + f"/v2/models/{name}/versions/2/infer", headers=AUTH_HTTP,
                   json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]})
    assert r.status_code == 404
    r = httpx.post(srv[0] + f"/v2/models/{name}/infer", headers=AUTH_HTTP,
                   json={"inputs": [{"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]})
    assert r.status_code == 400 and "BYTES" in r.json()["error"]
