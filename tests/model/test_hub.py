"""Models by Hugging Face repo id, without the network: a Hugging Face cache built in the test (the layout
huggingface_hub writes) holding a tiny random model, found by `serve`, `LLM(...)` and the model commands
(pull, list, ps, rm) under its repo id. Where a test needs the Hub "online", HF_ENDPOINT points at a port
nothing listens on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hub_cache import add_folder, add_snapshot, commit_of, use_cache

from servelm.config.engine import ConfigError, EngineConfig
from servelm.model.loading import hub
from servelm.model.loading.source import resolve_model

REPO = "tiny-org/tiny-llama"
GGUF_REPO = "tiny-org/tiny-llama-GGUF"
QUIET = {"SERVELM_CPU_KERNELS": "0"}  # starts that fail before any kernel matters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir) -> Path:
    from tiny_models import build_model

    return build_model("llama", tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer_dir)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return use_cache(monkeypatch, tmp_path / "hf")


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    from servelm.entrypoints.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _dead_endpoint() -> dict:
    """The environment of a servelm that may use the Hub, whose Hub is a port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}",
            "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}


def _fake_ggufs(*names: str) -> dict[str, bytes]:
    return {n: b"GGUF" + n.encode() for n in names}


# -- names ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "parsed"), [
    ("meta-llama/Llama-3.2-1B", ("meta-llama/Llama-3.2-1B", None, None)),
    ("Qwen/Qwen3-0.6B@v1.0", ("Qwen/Qwen3-0.6B", "v1.0", None)),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1", None)),
    ("org/name-GGUF:model-Q4_K_M.gguf", ("org/name-GGUF", None, "model-Q4_K_M.gguf")),
    ("org/name-GGUF@abc1234:Q4_K_M", ("org/name-GGUF", "abc1234", "Q4_K_M")),
    ("org/name-GGUF:Q4_K_M@main", ("org/name-GGUF", "main", "Q4_K_M")),
    ("hf.co/org/name-GGUF:Q8_0", ("org/name-GGUF", None, "Q8_0")),
    ("https://huggingface.co/org/name", ("org/name", None, None)),
    ("./org/name", None), ("/models/org/name", None), ("a/b/c", None), ("gpt2", None), ("org/name:", None),
    ("org/name@", None), ("org--x/name", None), ("org/.name", None), ("org/name:../x.gguf", None)])
def test_repo_ids_parse(text, parsed):
    ref = hub.parse_ref(text)
    assert (None if ref is None else (ref.repo_id, ref.revision, ref.file)) == parsed


# -- finding a cached model ---------------------------------------------------------------------------------

def test_a_cached_repo_id_resolves_offline_under_its_repo_id(cache, tiny, tmp_path, monkeypatch):
    from servelm.config.settings import load
    from servelm.model.loading.metadata import check_model
    from servelm.server.launch import fixed_models

    snap = add_folder(cache, REPO, tiny)
    src = resolve_model(REPO)
    assert (src.kind, src.path, src.name, src.repo_id, src.commit) == ("hf", snap, REPO, REPO, snap.name)
    assert check_model(REPO).path == snap
    assert resolve_model(f"hf.co/{REPO}").path == snap
    assert [launch.name for launch in fixed_models(load({"model": REPO}, env={}))] == [REPO]
    hub.fetch_model(REPO)  # cached: nothing to do, offline or not
    # a local folder of the same name wins
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)
    (tmp_path / REPO / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model(REPO).kind == "gguf"


def test_revisions_branch_tag_and_commit(cache, tiny, monkeypatch):
    main = add_folder(cache, REPO, tiny)
    tagged = add_snapshot(cache, REPO, {**{p.name: p for p in tiny.iterdir()}, "extra.txt": b"v2"}, ref="v2")
    detached = add_snapshot(cache, REPO, {**{p.name: p for p in tiny.iterdir()}, "extra.txt": b"old"},
                            commit=commit_of("old"), ref=None)
    assert resolve_model(f"{REPO}@main").path == main
    assert resolve_model(f"{REPO}@v2").path == tagged
    assert resolve_model(f"{REPO}@v2").name == REPO  # served as vLLM serves --model X --revision R: as X
    assert resolve_model(f"{REPO}@{detached.name}").path == detached
    assert resolve_model(f"{REPO}@{detached.name[:9]}").path == detached  # a unique prefix, as `list` shows
    with pytest.raises(FileNotFoundError, match=f"servelm pull {REPO}@v3"):
        resolve_model(f"{REPO}@v3")
    # --revision is folded into the model string every process resolves
    assert EngineConfig(model=REPO, revision="v2").model_config.model == f"{REPO}@v2"
    assert EngineConfig(model=f"{REPO}@v2", revision="v2").model_config.model == f"{REPO}@v2"
    assert EngineConfig(model=str(tiny), revision="v2").model_config.model == str(tiny)  # a local folder has no revisions
    with pytest.raises(ConfigError, match="revision"):
        EngineConfig(model=f"{REPO}@main", revision="v2")
    # vLLM's command line: `serve MODEL --revision R` serves MODEL at R, named MODEL
    from servelm.entrypoints.cli import build_parser
    from servelm.server import serve
    from servelm.server.launch import fixed_models

    for var in [v for v in os.environ if v.startswith("SERVELM_")]:
        monkeypatch.delenv(var)
    config = serve.load_config(build_parser().parse_args(["serve", REPO, "--revision", "v2"]))
    assert config.engine.model_config.model == f"{REPO}@v2" and [x.name for x in fixed_models(config)] == [REPO]
    assert resolve_model(config.engine.model_config.model).path == tagged


def test_gguf_files_in_a_repo_by_file_name_quantization_tag_or_default(cache):
    add_snapshot(cache, GGUF_REPO, {"README.md": b"#", **_fake_ggufs(
        "Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "mmproj-Tiny-f16.gguf")})
    snap = hub.find_cached(hub.parse_ref(GGUF_REPO)).path.parent

    def pick(model, gguf_file=None):
        src = resolve_model(model, gguf_file)
        return src.kind, src.path.name, src.name

    assert pick(f"{GGUF_REPO}:Tiny-Q8_0.gguf") == ("gguf", "Tiny-Q8_0.gguf", f"{GGUF_REPO}:Tiny-Q8_0.gguf")
    assert pick(f"{GGUF_REPO}:q8_0") == ("gguf", "Tiny-Q8_0.gguf", f"{GGUF_REPO}:q8_0")  # as Ollama's tags
    assert pick(GGUF_REPO, "Tiny-Q8_0.gguf") == ("gguf", "Tiny-Q8_0.gguf", GGUF_REPO)  # --gguf-file
    assert pick(GGUF_REPO) == ("gguf", "Tiny-Q4_K_M.gguf", GGUF_REPO)  # several: Ollama's default, Q4_K_M
    assert pick(f"{GGUF_REPO}:latest")[1] == "Tiny-Q4_K_M.gguf"
    with pytest.raises(FileNotFoundError, match="no .gguf file matches 'Q5_K_M'.*Tiny-Q8_0.gguf"):
        resolve_model(f"{GGUF_REPO}:Q5_K_M")
    with pytest.raises(FileNotFoundError, match="no file 'Tiny-Q2_K.gguf'"):
        resolve_model(f"{GGUF_REPO}:Tiny-Q2_K.gguf")
    (snap / "Tiny-Q4_K_M.gguf").unlink()
    assert pick(GGUF_REPO)[1] == "Tiny-Q8_0.gguf"  # the only one (projectors do not count)
    (snap / "Tiny-Q6_K.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=rf"several .gguf files.*{GGUF_REPO}:FILE.gguf"):
        resolve_model(GGUF_REPO)


SPLIT_REPO = "tiny-org/tiny-split-GGUF"
SPLIT_FILES = ("Q4_K_M/Tiny-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/Tiny-Q4_K_M-00002-of-00002.gguf")


def test_split_gguf_models_in_a_repo(cache):
    """A split model (in a folder of its own, as large quantized models are published, or at the top level)
    is one choice, named by its first file; a quantization tag matches its files' names or its folder's."""
    add_snapshot(cache, SPLIT_REPO, {"README.md": b"#", **_fake_ggufs(
        *SPLIT_FILES, "Tiny-Q8_0.gguf", "Tiny-F16-00001-of-00002.gguf")})
    snap = hub.find_cached(hub.parse_ref(f"{SPLIT_REPO}:Q8_0")).path.parent
    assert resolve_model(f"{SPLIT_REPO}:Q4_K_M").path == snap / SPLIT_FILES[0]
    assert resolve_model(SPLIT_REPO).path == snap / SPLIT_FILES[0]  # Ollama's default, Q4_K_M
    with pytest.raises(FileNotFoundError, match="lacks Tiny-F16-00002-of-00002.gguf of the split model Tiny-F16"):
        resolve_model(f"{SPLIT_REPO}:F16")
    assert hub.gguf_files(SPLIT_FILES[1]) == list(SPLIT_FILES)
    assert hub.pick_gguf(hub.parse_ref(SPLIT_REPO), [*SPLIT_FILES, "x.gguf"], SPLIT_FILES[1], "") == \
        SPLIT_FILES[0]  # --gguf-file naming any of its files


def test_a_model_not_in_the_cache_says_how_to_get_it(cache, tiny):
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache.*servelm pull nobody/nothing"):
        resolve_model("nobody/nothing")
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE is set"):
        hub.fetch_model("nobody/nothing")  # offline: never downloads
    # an interrupted download: the index names a shard that is not there
    snap = add_folder(cache, REPO, tiny)
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="lacks some of its safetensors weights.*servelm pull"):
        resolve_model(REPO)


def test_llm_runs_a_repo_id_from_the_cache_as_its_folder(cache, tiny):
    from tiny_models import run

    from servelm import LLM

    add_folder(cache, REPO, tiny)
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4, enable_prefix_caching=False)
    by_id = run(LLM(REPO, **kw), [[1, 5, 9, 13]])
    assert by_id == run(LLM(str(tiny), **kw), [[1, 5, 9, 13]])


# -- serve and ps -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hub_server(tmp_path_factory, tiny):
    from serving import start_server, stop_server

    home = tmp_path_factory.mktemp("hf-home")
    add_folder(home / "hub", REPO, tiny)
    key = tmp_path_factory.mktemp("key") / "api-key"
    key.write_text("sk-hub-test-0001\n")
    proc, url = start_server(None, REPO, "--embedding-model", "none", "--api-key-file", str(key),
                             env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    yield url, key
    stop_server(proc)


def test_serve_a_repo_id_from_the_cache_offline_named_by_it(hub_server):
    url, key = hub_server
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key.read_text().strip()}"})
    assert [c["id"] for c in r.json()["data"]] == [REPO]


def test_ps_shows_what_the_server_serves(hub_server, capsys):
    url, key = hub_server
    code, out, err = _main(capsys, "ps", "--url", url, "--api-key-file", str(key))
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split() == ["MODEL", "CONTEXT"] and row.split()[0] == REPO
    code, out, _ = _main(capsys, "ps", "--url", url, "--api-key-file", str(key), "--json")
    assert code == 0 and [m["model"] for m in json.loads(out)["models"]] == [REPO]
    code, _, err = _main(capsys, "ps", "--url", url)  # no key
    assert code == 1 and "API key" in err


def test_ps_without_a_server_is_one_line(capsys):
    code, _, err = _main(capsys, "ps", "--url", "http://127.0.0.1:9", "--timeout", "5")
    assert code == 1 and err.startswith("servelm: error: cannot reach http://127.0.0.1:9")


def test_serve_or_generate_a_model_missing_from_the_cache_is_one_line_exit_2(tmp_path):
    env = {**QUIET, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = _cli("serve", "nobody/nothing", "--port", "9", "--embedding-model", "none", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "servelm pull nobody/nothing" in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]
    # online, with a Hub that cannot be reached: the same one line, naming the cause
    r = _cli("generate", "hi", "--model", "nobody/nothing", env={**env, **_dead_endpoint()})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("servelm: error: cannot reach the Hugging Face Hub to download nobody/nothing")


# -- pull -------------------------------------------------------------------------------------------------

def test_pull_offline_keeps_a_cached_model_and_refuses_a_missing_one(cache, tiny, capsys):
    snap = add_folder(cache, REPO, tiny)
    code, out, _ = _main(capsys, "pull", REPO)
    assert code == 0 and out.startswith(f"{REPO} (commit {snap.name[:12]}") and "HF_HUB_OFFLINE" in out
    code, _, err = _main(capsys, "pull", "nobody/nothing")
    assert code == 1 and "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err
    code, _, err = _main(capsys, "pull", "./some/folder")
    assert code == 1 and "not a Hugging Face repo id" in err


def test_pull_with_the_hub_unreachable(tmp_path, tiny):
    home = tmp_path / "hf"
    add_folder(home / "hub", REPO, tiny)
    env = {"HF_HOME": str(home), **_dead_endpoint()}
    r = _cli("pull", REPO, env=env)  # cached: kept, and said so
    assert r.returncode == 0, r.stderr
    assert "could not be reached" in r.stdout and "not checked for updates" in r.stdout
    r = _cli("pull", "nobody/nothing", env=env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(
        "servelm: error: cannot reach the Hugging Face Hub to download nobody/nothing")


# -- list -------------------------------------------------------------------------------------------------

def test_list_shows_the_servable_cached_models_and_the_registry(cache, tiny, tmp_path, capsys):
    from servelm.model.loading.source import default_model_path

    add_folder(cache, REPO, tiny)
    add_snapshot(cache, REPO, {p.name: p for p in tiny.iterdir()}, commit=commit_of("v2"), ref="v2")
    add_snapshot(cache, "smol/SmolLM2-GGUF", {"SmolLM2.Q4_1.gguf": default_model_path(),
                                              **_fake_ggufs("broken-Q8_0.gguf")})
    add_snapshot(cache, "other/foo", {"config.json": b'{"architectures": ["FooForCausalLM"]}',
                                      "model.safetensors": b"x"})
    add_snapshot(cache, "other/notes", {"README.md": b"#"})
    (cache / "datasets--other--data" / "snapshots" / ("0" * 40)).mkdir(parents=True)
    data_dir = tmp_path / "data"
    code, out, err = _main(capsys, "list", "--json", "--data-dir", str(data_dir))
    assert code == 0, err
    listed = json.loads(out)
    assert listed["cache"] == str(cache) and listed["registry"] is None
    rows = {m["name"]: m for m in listed["models"]}
    assert list(rows) == ["smol/SmolLM2-GGUF:SmolLM2.Q4_1.gguf", REPO, f"{REPO}@v2"]
    assert rows[REPO]["kind"] == "safetensors" and rows[REPO]["architecture"] == "LlamaForCausalLM"
    assert rows[REPO]["size_bytes"] == sum(p.stat().st_size for p in tiny.iterdir())
    assert rows["smol/SmolLM2-GGUF:SmolLM2.Q4_1.gguf"]["architecture"] == "LlamaForCausalLM"
    for name in rows:  # every name listed is one `serve` takes
        assert resolve_model(name).path == Path(rows[name]["path"])
    code, out, _ = _main(capsys, "list", "--all", "--json", "--data-dir", str(data_dir))
    unservable = {m["name"]: m["unservable"] for m in json.loads(out)["models"] if "unservable" in m}
    assert "FooForCausalLM" in unservable["other/foo"] and "neither" in unservable["other/notes"]
    assert "smol/SmolLM2-GGUF:broken-Q8_0.gguf" in unservable

    from servelm.control.registry import Registry

    reg = Registry(None, data_dir)
    reg.register("tiny", str(tiny), actor="test")
    reg.close()
    code, out, _ = _main(capsys, "list", "--data-dir", str(data_dir))
    lines = out.splitlines()
    assert lines[0] == f"Hugging Face cache ({cache}):" and lines[1].split() == [
        "NAME", "KIND", "ARCHITECTURE", "SIZE", "MODIFIED"]
    assert lines[3].split()[:3] == [REPO, "safetensors", "LlamaForCausalLM"] and "MB" in lines[3]
    at = lines.index(f"model registry ({data_dir / 'registry.db'}):")
    assert lines[at + 2].split()[:4] == ["tiny:1", "REGISTERED", "generate", "LlamaForCausalLM"]


def test_list_with_no_cache(cache, tmp_path, capsys):
    code, out, _ = _main(capsys, "list", "--data-dir", str(tmp_path / "none"))
    assert code == 0 and "servelm pull" in out
    assert not (tmp_path / "none").exists()  # listing creates no registry


# -- rm ---------------------------------------------------------------------------------------------------

def test_rm_deletes_a_file_a_revision_or_a_repo(cache, tiny, capsys):
    add_snapshot(cache, GGUF_REPO, _fake_ggufs("Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf"))
    main = add_folder(cache, REPO, tiny)
    tagged = add_snapshot(cache, REPO, {**{p.name: p for p in tiny.iterdir()}, "extra.txt": b"v2"}, ref="v2")

    code, out, _ = _main(capsys, "rm", f"{GGUF_REPO}:Q8_0", "--dry-run")
    assert code == 0 and out.startswith(f"would delete {GGUF_REPO}:Q8_0")
    assert resolve_model(f"{GGUF_REPO}:Q8_0")
    code, out, _ = _main(capsys, "rm", f"{GGUF_REPO}:Q8_0")
    assert code == 0 and out.startswith(f"deleted {GGUF_REPO}:Q8_0")
    with pytest.raises(FileNotFoundError):
        resolve_model(f"{GGUF_REPO}:Q8_0")
    assert resolve_model(GGUF_REPO).path.name == "Tiny-Q4_K_M.gguf"

    code, out, _ = _main(capsys, "rm", f"{REPO}@v2")
    assert code == 0 and not tagged.exists() and resolve_model(REPO).path == main
    assert main.joinpath("model.safetensors").is_file()  # the blob the kept revision shares stays

    code, out, err = _main(capsys, "rm", REPO, "nobody/nothing")
    assert code == 1 and out.startswith(f"deleted {REPO}") and "nobody/nothing is not in" in err
    assert not hub.repo_folder(REPO).exists()


# -- downloading (from a stand-in for the Hub on 127.0.0.1) -------------------------------------------------

@pytest.fixture(scope="module")
def stub_hub(tiny):
    from hub_cache import StubHub

    files = {p.name: p.read_bytes() for p in tiny.iterdir()}
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    sharded = {**{k: v for k, v in files.items() if k != "model.safetensors"},
               "model-00001-of-00001.safetensors": files["model.safetensors"],
               "model.safetensors.index.json": json.dumps(index).encode(),
               "consolidated.safetensors": b"the original checkpoint"}
    repos = {REPO: {**files, "pytorch_model.bin": b"bin", "original/consolidated.00.pth": b"pth",
                    "README.md": b"# tiny"},
             "tiny-org/sharded": sharded,
             GGUF_REPO: {"README.md": b"#", **_fake_ggufs("Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf")},
             SPLIT_REPO: {"README.md": b"#", **_fake_ggufs(*SPLIT_FILES, "Tiny-Q8_0.gguf")}}
    with StubHub(repos) as stub:
        yield stub


def test_pull_downloads_what_servelm_needs_then_is_up_to_date(stub_hub, tiny, tmp_path, monkeypatch):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": stub_hub.url}
    stub_hub.downloads.clear()
    r = _cli("pull", REPO, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"pulled {REPO} (commit {commit_of(REPO)[:12]}")
    assert sorted(stub_hub.downloads) == sorted(f"{REPO}/{p.name}" for p in tiny.iterdir())  # no .bin, .pth, .md
    r = _cli("pull", REPO, env=env)
    assert r.returncode == 0 and r.stdout.startswith(f"{REPO} (commit") and "is up to date" in r.stdout
    assert len(stub_hub.downloads) == len(list(tiny.iterdir()))  # nothing fetched again

    stub_hub.downloads.clear()
    assert _cli("pull", "tiny-org/sharded", env=env).returncode == 0
    assert "tiny-org/sharded/consolidated.safetensors" not in stub_hub.downloads  # only what the index names
    assert "tiny-org/sharded/model-00001-of-00001.safetensors" in stub_hub.downloads
    stub_hub.downloads.clear()
    r = _cli("pull", f"{GGUF_REPO}:Q8_0", env=env)
    assert r.returncode == 0 and stub_hub.downloads == [f"{GGUF_REPO}/Tiny-Q8_0.gguf"], r.stderr
    stub_hub.downloads.clear()
    r = _cli("pull", f"{GGUF_REPO}:Q4_K_M", env=env)  # another file of a repo already cached
    assert r.returncode == 0 and stub_hub.downloads == [f"{GGUF_REPO}/Tiny-Q4_K_M.gguf"], r.stderr
    stub_hub.downloads.clear()
    r = _cli("pull", f"{SPLIT_REPO}:Q4_K_M", env=env)  # a split model: every one of its files
    assert r.returncode == 0 and sorted(stub_hub.downloads) == [f"{SPLIT_REPO}/{f}" for f in SPLIT_FILES], r.stderr
    r = _cli("pull", f"{GGUF_REPO}:Q5_K_M", env=env)
    assert r.returncode == 1 and "no .gguf file matches 'Q5_K_M' at main" in r.stderr
    r = _cli("pull", "nobody/nothing", env=env)
    assert r.returncode == 1 and "no model 'nobody/nothing' on the Hugging Face Hub" in r.stderr

    use_cache(monkeypatch, tmp_path / "hf")  # offline from here on (conftest), all of it found in the cache
    assert resolve_model(REPO).kind == "hf" and resolve_model("tiny-org/sharded").kind == "hf"
    assert resolve_model(GGUF_REPO).path.name == "Tiny-Q4_K_M.gguf"  # two cached now: Ollama's default
    assert resolve_model(f"{GGUF_REPO}:Q8_0").path.name == "Tiny-Q8_0.gguf"
    assert resolve_model(f"{SPLIT_REPO}:Q4_K_M").path.name == "Tiny-Q4_K_M-00001-of-00002.gguf"


def test_download_dir_and_hf_token_as_vllm_takes_them(stub_hub, tiny, tmp_path):
    """vLLM's --download-dir and --hf-token: `pull` downloads into that folder (a Hugging Face cache of its own)
    with that token, `list` and `rm` work on it, `generate` runs the model from it offline, with nothing in
    the default cache; the token is never printed."""
    d = tmp_path / "models"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": stub_hub.url, "HF_TOKEN": ""}
    stub_hub.tokens.clear()
    r = _cli("pull", REPO, "--download-dir", str(d), "--hf-token", "hf_test_token_1", env=env)
    assert r.returncode == 0, r.stderr
    assert (d / ("models--" + REPO.replace("/", "--"))).is_dir() and not (tmp_path / "hf").exists()
    assert stub_hub.tokens and set(stub_hub.tokens) == {"hf_test_token_1"}
    assert "hf_test_token_1" not in r.stdout + r.stderr
    listed = json.loads(_cli("list", "--json", "--download-dir", str(d), env=env).stdout)
    assert REPO in json.dumps(listed)
    assert REPO not in _cli("list", "--json", env=env).stdout  # the default cache has nothing
    offline = {**env, "HF_HUB_OFFLINE": "1", **QUIET}
    r = _cli("generate", "hello", "--model", REPO, "--download-dir", str(d), "--max-tokens", "3", "--temperature",
             "0", "--dtype", "float32", "--num-kv-blocks", "16", "--json", env=offline, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["completions"][0]["token_ids"]) == 3
    r = _cli("serve", REPO, "--download-dir", str(d), "--hf-token", "hf_test_token_1", "--print-config", env=offline)
    config = json.loads(r.stdout)["model"]
    assert config["hf_token"]["value"] == "<redacted>" and config["download_dir"]["value"] == str(d)
    assert "hf_test_token_1" not in r.stdout + r.stderr
    assert "--hf-token is visible to every user" in r.stderr  # HF_TOKEN keeps it out of the process list
    r = _cli("generate", "hello", "--model", REPO, "--hf-token", "two words", env=offline)
    assert r.returncode == 2 and "hf_token" in r.stderr and "two words" not in r.stderr
    assert _cli("rm", REPO, "--download-dir", str(d), env=env).returncode == 0
    assert not (d / ("models--" + REPO.replace("/", "--"))).exists()


def test_generate_downloads_a_missing_model_first(stub_hub, tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": stub_hub.url, **QUIET}
    r = _cli("generate", "hello", "--model", REPO, "--max-tokens", "4", "--temperature", "0", "--dtype", "float32",
             "--num-kv-blocks", "16", "--json", env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["completions"][0]["token_ids"]) == 4
    assert f"downloading {REPO}" in r.stderr
