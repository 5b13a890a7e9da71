"""A GGUF model split into several files by llama.cpp (NAME-00001-of-0000N.gguf ...) loads as the one file it
was split from: named by any of its files or by its folder, its header the one file's, its greedy tokens the
one file's (the packaged SmolLM2 Q4_1, kept quantized). A missing, renamed or misnumbered file is one clear
error before anything loads."""

from __future__ import annotations

import shutil

import pytest
from gguf_split import split_gguf

from servelm import LLM, SamplingParams
from servelm.model.loading.gguf_header import read_gguf_file_header
from servelm.model.loading.metadata import check_model
from servelm.model.loading.source import default_model_path, resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    files = split_gguf(default_model_path(), folder / "smol.gguf", max_tensors=120)
    assert [f.name for f in files] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return files


def test_the_split_header_is_the_files(split):
    whole, parts = read_gguf_file_header(default_model_path()), read_gguf_file_header(split[1])
    assert [t[:3] for t in parts.tensors] == [t[:3] for t in whole.tensors]  # names, shapes, types
    assert {k: v for k, v in parts.fields.items() if not k.startswith("split.")} == whole.fields
    assert [p for p, _ in parts.shards] == split and sorted(set(parts.shard_of)) == [0, 1, 2]


def test_a_split_model_generates_as_the_file_it_was_split_from(split):
    want = LLM(str(default_model_path())).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    for named in (split[0], split[2], split[0].parent):  # its first file, another, its folder
        src = resolve_model(str(named))
        assert (src.kind, src.path, src.name) == ("gguf", split[0], "smol")
    got = LLM(str(split[2])).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text


def test_a_missing_renamed_or_misnumbered_file_is_one_error(split, tmp_path):
    copies = [shutil.copy(f, tmp_path / f.name) for f in split]
    (tmp_path / split[1].name).unlink()
    with pytest.raises(FileNotFoundError, match="smol-00002-of-00003.gguf is not beside it"):
        check_model(str(tmp_path / split[0].name))
    lone = tmp_path / "renamed.gguf"
    shutil.copy(split[0], lone)
    with pytest.raises(ValueError, match="file 1 of 3 of a split GGUF model.*restore llama.cpp's names"):
        check_model(str(lone))
    shutil.copy(split[2], copies[1])  # the third file named as the second
    with pytest.raises(ValueError, match="named as file 2 of 3.*says file 3 of 3"):
        check_model(str(copies[0]))


def test_a_split_model_in_the_cache_is_listed_served_and_removed_whole(split, tmp_path, monkeypatch, capsys):
    """In a repo's folder, as large quantized models are published: `servelm list` shows it once (its size all
    its files'), under a name `serve` takes, and `servelm rm` deletes every one of its files."""
    import json

    from hub_cache import add_snapshot, use_cache

    from servelm.entrypoints.cli import main

    cache = use_cache(monkeypatch, tmp_path / "hub")
    repo = "smol-org/SmolLM2-GGUF"
    snap = add_snapshot(cache, repo, {f"Q4_1/{f.name}": f for f in split})
    assert main(["list", "--json", "--data-dir", str(tmp_path / "data")]) == 0
    [row] = json.loads(capsys.readouterr().out)["models"]
    assert row["name"] == f"{repo}:{split[0].name}" and row["architecture"] == "LlamaForCausalLM"
    assert row["size_bytes"] == sum(f.stat().st_size for f in split)
    assert resolve_model(row["name"]).path == resolve_model(f"{repo}:Q4_1").path == snap / "Q4_1" / split[0].name
    assert main(["rm", f"{repo}:Q4_1"]) == 0
    assert not any((snap / "Q4_1" / f.name).exists() for f in split)
