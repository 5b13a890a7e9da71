"""An embedding model as the server's MODEL (vLLM's pooling runner): `servelm serve EMBEDDING_FOLDER` runs it in
the embedder, in place of a generation engine, serves /v1/embeddings under MODEL's name, and answers generation
requests with a 400 that says why; `--runner` forces either reading of MODEL, and what would leave two
embedding models is refused before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving import start_server, stop_server
from tiny_encoders import DOCS, save_encoder, st_vectors


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-minilm")
    save_encoder(folder)
    return folder


def _config(**values):
    from servelm.config.settings import load

    return load(values)


@pytest.mark.server
def test_an_embedding_model_served_as_model_answers_embeddings_and_refuses_generation(encoder_dir):
    proc, url = start_server(encoder_dir)  # served as "tiny"
    try:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
        want = st_vectors(encoder_dir, DOCS[:2])
        for body in ({"model": "tiny", "input": DOCS[:2]}, {"input": DOCS[:2]}):
            r = httpx.post(url + "/v1/embeddings", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "tiny"
            got = [d["embedding"] for d in r.json()["data"]]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"model": "tiny", "prompt": "hi"})):
            r = httpx.post(url + path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "model_not_supported" and err["param"] == "model"
            assert "'tiny' is an embedding model" in err["message"] and "no generation model" in err["message"]
        assert httpx.get(url + "/ready").json()["models"] == ["tiny"]
    finally:
        assert stop_server(proc) == 0
    log = Path(proc.log_path).read_text()
    assert "serving tiny (embeddings)" in log
    assert "engine" not in log.split("ready in")[0].lower()  # no generation engine was started


def test_runner_auto_reads_the_folder_and_runner_generate_refuses_an_embedding_model(encoder_dir, llama_dir):
    from servelm.model.loading.metadata import check_model, pooling_folder
    from servelm.server.launch import fixed_models, pooling_model

    assert pooling_folder(str(encoder_dir)) == encoder_dir
    assert pooling_folder(str(llama_dir)) is None
    assert pooling_folder(str(encoder_dir), runner="generate") is None
    config = _config(model=str(encoder_dir))
    assert pooling_model(config) == encoder_dir and fixed_models(config) == []
    generate = _config(model=str(encoder_dir), runner="generate")
    assert pooling_model(generate) is None and [launch.name for launch in fixed_models(generate)] == ["tiny-minilm0"]
    with pytest.raises(ValueError, match="is an encoder.*--runner pooling"):
        check_model(str(encoder_dir))
    assert [launch.name for launch in fixed_models(_config(model=str(llama_dir)))] == [llama_dir.name]


def test_runner_pooling_needs_a_folder_and_one_embedding_model(encoder_dir, tmp_path):
    from servelm.config.engine import ConfigError
    from servelm.server.launch import pooling_model

    assert pooling_model(_config(model=str(encoder_dir), runner="pooling")) == encoder_dir
    with pytest.raises(ValueError, match="is a GGUF file"):  # the packaged default model
        pooling_model(_config(runner="pooling"))
    with pytest.raises(ConfigError, match="embedding_model"):
        pooling_model(_config(model=str(encoder_dir), embedding_model=str(tmp_path)))
    with pytest.raises(ConfigError, match="one name"):
        pooling_model(_config(model=str(encoder_dir), served_model_name=["a", "b"]))
    # the command line says so in one line and exits 2 before anything loads
    run = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "serve", "--runner", "pooling", "--port",
                          "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("servelm: error: --runner pooling:")


def test_runner_pooling_embeds_with_a_generation_model_as_vllm_converts_it(llama_dir):
    """`--runner pooling` on a generation model's folder (vLLM's --convert embed): its last token's final hidden
    state, normalized, as transformers' base model computes it for each text alone, whatever the padding of
    the batch."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from servelm.runtimes.encoder_runner import EncoderRunner
    from servelm.server.launch import fixed_models, pooling_model

    config = _config(model=str(llama_dir), runner="pooling")
    assert pooling_model(config) == llama_dir and fixed_models(config) == []
    assert pooling_model(_config(model=str(llama_dir))) is None  # auto: a generation model, served as one
    model = AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(llama_dir)
    with torch.no_grad():
        want = [torch.nn.functional.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1], dim=-1)
                for t in DOCS]
    runner = EncoderRunner(llama_dir)
    assert runner.task == "embed" and runner.recipe.pooling == ("lasttoken",) and runner.recipe.normalize
    got = runner.embed([(t, None, None, "right") for t in DOCS])
    assert got.padded > sum(len(ids) for ids in got.token_ids)  # the texts' lengths differ: the batch pads
    np.testing.assert_allclose(got.rows, torch.stack(want).numpy(), rtol=1e-4, atol=2e-5)


def test_the_offline_api_follows_the_runner(encoder_dir):
    from servelm import LLM

    llm = LLM(str(encoder_dir))
    np.testing.assert_allclose([o.outputs.embedding for o in llm.embed(DOCS[:1], use_tqdm=False)],
                               st_vectors(encoder_dir, DOCS[:1]), rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="is an encoder.*--runner pooling"):
        LLM(str(encoder_dir), runner="generate")  # the server's words: serve it with --runner pooling



@pytest.mark.server
def test_a_hugging_face_repo_id_as_model_is_downloaded_read_and_served_under_it(encoder_dir, tmp_path):
    """`servelm serve org/tiny-embed`, from a stand-in for the Hub: the model is downloaded before it is read
    (so that its files can say it is a pooling model), its modules' settings in their folders with it (the
    Pooling module's 1_Pooling/config.json) but no other folder's files, and it is served under the repo id."""
    from hub_cache import StubHub

    repo = "org/tiny-embed"
    files = {str(p.relative_to(encoder_dir)): p.read_bytes() for p in encoder_dir.rglob("*") if p.is_file()}
    assert "1_Pooling/config.json" in files
    files |= {"onnx/model.onnx": b"not needed", "onnx/config.json": b"{}"}
    with StubHub({repo: files}) as hub:
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}
        proc, url = start_server(None, repo, env=env)
        try:
            assert f"{repo}/1_Pooling/config.json" in hub.downloads
            assert not any("onnx/" in d for d in hub.downloads)
            r = httpx.post(url + "/v1/embeddings", json={"model": repo, "input": DOCS[:1]})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], st_vectors(encoder_dir, DOCS[:1]),
                                       rtol=1e-4, atol=2e-5)
        finally:
            assert stop_server(proc) == 0


def test_generation_models_beside_a_pooling_model_take_only_their_own_overrides(encoder_dir, llama_dir, tmp_path):
    """A config file's `models:` list beside an embedding MODEL: its entries are generation models, which do not
    inherit MODEL's --hf-overrides; an entry's own (in its `engine` settings) are its engine's."""
    import json

    from servelm.config.engine import ConfigError
    from servelm.config.settings import load
    from servelm.server.launch import fixed_models, pooling_model

    def with_models(*entries, **cli):
        f = tmp_path / "serve.json"
        f.write_text(json.dumps({"models": list(entries)}))
        return load({"model": str(encoder_dir), **cli}, env={}, file=str(f))

    chat = {"name": "chat", "path": str(llama_dir)}
    config = with_models(chat, hf_overrides='{"max_position_embeddings": 512}')
    assert pooling_model(config) is not None
    [launch] = fixed_models(config)
    assert launch.name == "chat" and launch.engine.model_config.hf_overrides is None
    [launch] = fixed_models(with_models({**chat, "engine": {"hf_overrides": '{"max_position_embeddings": 256}'}}))
    assert json.loads(launch.engine.model_config.hf_overrides) == {"max_position_embeddings": 256}
    with pytest.raises(ConfigError, match="hf_overrides"):
        fixed_models(with_models({**chat, "engine": {"hf_overrides": '["not", "an", "object"]'}}))
