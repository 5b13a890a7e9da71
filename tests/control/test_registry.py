"""The model registry: lifecycle state machine, audit chain, content-addressed store, gc, persistence,
concurrent writers, and validation with a real worker."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from servelm.control import lifecycle
from servelm.control.audit import GENESIS
from servelm.control.errors import Conflict, ControlError, InvalidRequest, NotFound
from servelm.control.registry import Registry
from servelm.control.types import Kind, State

S = State
# The issue's table, written out again here so that a change to lifecycle.ALLOWED must be deliberate.
ISSUE_TRANSITIONS = {
    S.REGISTERED: {S.VALIDATING}, S.VALIDATING: {S.VALIDATED, S.FAILED}, S.FAILED: {S.REGISTERED},
    S.VALIDATED: {S.STAGING}, S.STAGING: {S.STAGING_TESTED}, S.STAGING_TESTED: {S.CANARY},
    S.CANARY: {S.PRODUCTION, S.ROLLBACK}, S.ROLLBACK: {S.VALIDATED}, S.PRODUCTION: {S.DEPRECATED},
    S.DEPRECATED: {S.ARCHIVED}, S.ARCHIVED: set(),
}
TO_PRODUCTION = [S.VALIDATING, S.VALIDATED, S.STAGING, S.STAGING_TESTED, S.CANARY, S.PRODUCTION]


def fake_model(folder: Path, seed: int = 0, arch: str = "LlamaForCausalLM") -> Path:
    """A model folder whose files are what the registry reads (config.json, a safetensors header): 4x8 + 8
    float32 parameters; `seed` changes the weight bytes, hence the digest."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "llama",
                                                    "torch_dtype": "float32"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]},
                         "b": {"dtype": "F32", "shape": [8], "data_offsets": [128, 160]}}).encode()
    body = bytes((seed * 7 + i) % 256 for i in range(160))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + body)
    return folder


@pytest.fixture
def reg(tmp_path, database_url):
    """A registry on each database servelm supports (SQLite, PostgreSQL): the same tests hold on both."""
    r = Registry(database_url, tmp_path / "data")
    yield r
    r.close()


# the validation tests start real workers: what they check does not depend on the database
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def walk(reg: Registry, name: str, version: int, states, actor: str = "ops"):
    for s in states:
        mv = reg.transition(name, version, s, actor)
    return mv


# -- lifecycle --------------------------------------------------------------------------------------
def test_allowed_is_exactly_the_issues_table():
    assert {k: set(v) for k, v in lifecycle.ALLOWED.items()} == ISSUE_TRANSITIONS
    assert set(lifecycle.ALLOWED) == set(State)


@pytest.mark.parametrize("current", list(State))
def test_check_refuses_every_illegal_transition_naming_current_and_allowed(current):
    for to in State:
        if to in ISSUE_TRANSITIONS[current]:
            lifecycle.check(current, to)  # legal: no error
            continue
        with pytest.raises(ControlError) as e:
            lifecycle.check(current, to)
        err = e.value
        assert isinstance(err, Conflict) and err.code == "illegal_transition"
        assert f"is {current.value};" in err.message
        allowed = err.message.split("allowed next: ")[1]
        named = set() if current == S.ARCHIVED else {State(a) for a in allowed.split(", ")}
        assert named == ISSUE_TRANSITIONS[current]


def test_registry_walks_every_state_refusing_illegal_moves_and_taking_legal_ones(reg, tmp_path):
    """Every state reached through the registry; at each, every illegal target refused (state unchanged),
    then the legal ones taken: the main path, the FAILED loop and the ROLLBACK loop."""
    mv = reg.register("m", fake_model(tmp_path / "m"), actor="alice")
    assert (mv.version, mv.state) == (1, S.REGISTERED)

    def refuse_illegal(state: State) -> None:
        for to in set(State) - ISSUE_TRANSITIONS[state]:
            with pytest.raises(ControlError) as e:
                reg.transition("m", 1, to, "alice")
            assert isinstance(e.value, Conflict) and state.value in e.value.message
            assert reg.get("m", 1).state == state

    seen = set()
    for path in ([S.VALIDATING, S.FAILED, S.REGISTERED],
                 [S.VALIDATING, S.VALIDATED, S.STAGING, S.STAGING_TESTED, S.CANARY, S.ROLLBACK, S.VALIDATED],
                 [S.STAGING, S.STAGING_TESTED, S.CANARY, S.PRODUCTION, S.DEPRECATED, S.ARCHIVED]):
        for to in path:
            refuse_illegal(reg.get("m", 1).state)
            seen.add(reg.get("m", 1).state)
            assert reg.transition("m", 1, to, "alice", reason="by hand").state == to
    refuse_illegal(S.ARCHIVED)
    assert seen | {S.ARCHIVED} == set(State)
    with pytest.raises(ControlError) as e:
        reg.transition("m", 1, "NOT_A_STATE", "alice")
    assert isinstance(e.value, InvalidRequest)


def test_failed_records_the_reason_and_validating_clears_it(reg, tmp_path):
    reg.register("m", fake_model(tmp_path / "m"), actor="a")
    walk(reg, "m", 1, [S.VALIDATING])
    assert reg.transition("m", 1, S.FAILED, "a", reason="boom").failure == "boom"
    walk(reg, "m", 1, [S.REGISTERED])
    mv = walk(reg, "m", 1, [S.VALIDATING])
    assert mv.failure is None
    mv = reg.transition("m", 1, S.VALIDATED, "a", outputs=["x", "y"])
    assert mv.golden_outputs == ["x", "y"] and reg.get("m", 1).golden_outputs == ["x", "y"]


def test_promotion_demotes_the_old_production_and_rollback_restores_it(reg, tmp_path):
    for i in range(3):
        reg.register("m", fake_model(tmp_path / f"v{i}", seed=i), actor="a")
    assert reg.production("m") is None and reg.previous_production("m") is None
    walk(reg, "m", 1, TO_PRODUCTION)
    assert reg.production("m").version == 1 and reg.previous_production("m") is None
    walk(reg, "m", 2, TO_PRODUCTION)
    assert reg.get("m", 1).state == S.DEPRECATED  # exactly one PRODUCTION per model
    assert reg.production("m").version == 2 and reg.previous_production("m").version == 1
    walk(reg, "m", 3, TO_PRODUCTION)
    assert [v.state for v in reg.versions("m")] == [S.DEPRECATED, S.DEPRECATED, S.PRODUCTION]

    restored = reg.rollback("m", actor="bob", reason="bad outputs")
    assert restored.version == 2 and reg.production("m").version == 2
    assert reg.get("m", 3).state == S.DEPRECATED
    assert reg.rollback("m", actor="bob").version == 1  # and again, one further back
    with pytest.raises(ControlError) as e:
        reg.rollback("m", actor="bob")
    assert isinstance(e.value, Conflict) and reg.production("m").version == 1
    last = reg.audit.entries()[-1]  # the refused rollback left no entry
    assert (last["action"], last["actor"], last["before"], last["after"]["production"]) == (
        "rollback", "bob", {"production": "m:2"}, "m:1")


def test_an_archived_previous_version_is_no_rollback_target(reg, tmp_path):
    for i in range(2):
        reg.register("m", fake_model(tmp_path / f"v{i}", seed=i), actor="a")
        walk(reg, "m", i + 1, TO_PRODUCTION)
    walk(reg, "m", 1, [S.ARCHIVED])
    assert reg.previous_production("m") is None
    with pytest.raises(ControlError):
        reg.rollback("m", actor="a")


# -- audit ------------------------------------------------------------------------------------------
def test_audit_chain_records_every_change_and_detects_tampering(reg, tmp_path):
    reg.register("m", fake_model(tmp_path / "m"), actor="alice")
    walk(reg, "m", 1, [S.VALIDATING, S.VALIDATED], actor="bob")
    reg.audit.record("carol", "scale", "dep-1", {"workers": 1}, {"workers": 3})
    entries = reg.audit.entries()
    assert [(e["actor"], e["action"], e["target"]) for e in entries] == [
        ("alice", "register", "m:1"), ("bob", "transition", "m:1"), ("bob", "transition", "m:1"),
        ("carol", "scale", "dep-1")]
    assert entries[1]["before"] == {"state": "REGISTERED"} and entries[1]["after"]["state"] == "VALIDATING"
    assert entries[0]["prev_hash"] == GENESIS
    assert all(b["prev_hash"] == a["hash"] for a, b in zip(entries, entries[1:], strict=False))
    assert reg.audit.verify() == (True, None)

    with reg.engine.begin() as c:  # an edit of a middle entry's content
        c.execute(text("UPDATE audit SET after = :a WHERE id = 2"), {"a": json.dumps({"state": "PRODUCTION"})})
    assert reg.audit.verify() == (False, 2)
    with reg.engine.begin() as c:
        c.execute(text("UPDATE audit SET after = :a WHERE id = 2"), {"a": json.dumps(entries[1]["after"])})
    assert reg.audit.verify() == (True, None)  # the same values in any JSON spelling verify again
    with reg.engine.begin() as c:  # an entry removed from the middle
        c.execute(text("DELETE FROM audit WHERE id = 2"))
    assert reg.audit.verify() == (False, 3)


def test_the_database_refuses_a_fork_of_the_chain_and_writers_retry(reg):
    """Where the database cannot serialize writers (PostgreSQL), two entries extending the same tip collide
    on the unique prev_hash; the loser's whole operation runs again."""
    from sqlalchemy.exc import IntegrityError

    from servelm.control import db
    from servelm.control.audit import entries_table

    first = reg.audit.record("a", "x", "t")
    with pytest.raises(IntegrityError), reg.engine.begin() as c:
        c.execute(entries_table.insert().values(**{**first, "id": 99, "hash": "f" * 64}))
    assert reg.audit.verify() == (True, None)

    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise IntegrityError("INSERT", {}, Exception("unique"))
        return "done"

    assert db.retrying(flaky) == "done" and len(tries) == 3

    def always():
        tries.append(1)
        raise IntegrityError("INSERT", {}, Exception("unique"))

    tries.clear()
    with pytest.raises(IntegrityError):
        db.retrying(always)
    assert len(tries) == db.RETRIES


def test_a_connection_refused_the_switch_to_wal_looks_again(tmp_path, monkeypatch):
    """SQLite refuses the switch to WAL at once, without its busy wait, while another connection holds the
    database (as when several threads or servers create it together): the refused connection waits its turn."""
    import sqlite3
    import time
    from types import SimpleNamespace

    from servelm.control import db

    path = tmp_path / "control.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")  # a writer holds the database, in rollback-journal mode
    refused = threading.Event()

    def pause(seconds: float) -> None:  # the retry's pause: the switch was refused
        refused.set()
        time.sleep(seconds)

    monkeypatch.setattr(db, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pause))
    engine = db.open_engine(f"sqlite:///{path}")
    got: dict = {}

    def connect() -> None:
        try:
            with engine.connect() as c:
                got["mode"] = c.exec_driver_sql("PRAGMA journal_mode").scalar()
        except Exception as e:  # noqa: BLE001 (reported below)
            got["error"] = e

    t = threading.Thread(target=connect)
    t.start()
    assert refused.wait(30), got
    holder.execute("COMMIT")
    t.join(30)
    holder.close()
    assert got == {"mode": "wal"}
    engine.dispose()


def test_concurrent_writers_get_distinct_versions_and_one_unbroken_chain(tmp_path, database_url):
    """Threads with their own Registry on one database: each register is one transaction, so version
    numbers never collide and the audit chain never forks (SQLite serializes the writers; on PostgreSQL the
    loser of a race on a unique key runs again)."""
    data = tmp_path / "data"
    src = fake_model(tmp_path / "m")
    regs: list[Registry] = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            r = Registry(database_url, data)  # all four create (migrate) the new database at once too
            regs.append(r)
            for _ in range(5):
                mv = r.register("m", src, actor=f"w{k}")
                r.transition("m", mv.version, S.VALIDATING, f"w{k}")
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [v.version for v in regs[0].versions("m")] == list(range(1, 21))
    assert all(v.state == S.VALIDATING for v in regs[0].versions("m"))
    assert len(regs[0].audit.entries()) == 40 and regs[0].audit.verify() == (True, None)
    for r in regs:
        r.close()


# -- store ------------------------------------------------------------------------------------------
def test_store_dedups_identical_artifacts_links_and_makes_them_read_only(reg, tmp_path):
    src = fake_model(tmp_path / "m")
    a = reg.register("a", src, actor="x")
    assert reg.store.last_mode == "link"
    assert os.stat(Path(a.artifact) / "model.safetensors").st_ino == os.stat(src / "model.safetensors").st_ino
    copy = shutil.copytree(src, tmp_path / "elsewhere" / "m")
    b = reg.register("b", copy, actor="x")
    assert reg.store.last_mode == "dedup" and (b.sha256, b.artifact) == (a.sha256, a.artifact)
    assert reg.store.digests() == {a.sha256}
    for p in [Path(a.artifact), *Path(a.artifact).rglob("*")]:
        assert p.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) == 0, p
    c = reg.register("c", fake_model(tmp_path / "other", seed=1), actor="x")
    assert c.sha256 != a.sha256 and reg.store.digests() == {a.sha256, c.sha256}

    reg.store.check(Path(a.artifact), a.sha256)
    weights = Path(a.artifact) / "model.safetensors"
    weights.chmod(0o644)  # (root ignores the mode; anyone else must force it like this)
    with open(weights, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    with pytest.raises(ControlError) as e:
        reg.store.check(Path(a.artifact), a.sha256)
    assert isinstance(e.value, Conflict) and e.value.code == "artifact_changed"


def test_store_copies_across_filesystems(reg, tmp_path, monkeypatch):
    src = fake_model(tmp_path / "m")

    def no_link(a, b):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    mv = reg.register("m", src, actor="x")
    assert reg.store.last_mode == "copy"
    stored = Path(mv.artifact) / "model.safetensors"
    assert stored.read_bytes() == (src / "model.safetensors").read_bytes()
    assert os.stat(stored).st_ino != os.stat(src / "model.safetensors").st_ino
    assert os.access(src / "model.safetensors", os.W_OK) or os.geteuid() == 0  # the source is left as it was
    assert (src / "model.safetensors").stat().st_mode & stat.S_IWUSR


def test_gc_keeps_the_last_n_and_whatever_is_live(reg, tmp_path):
    for i in range(7):
        reg.register("m", fake_model(tmp_path / f"v{i}", seed=i), actor="a")
    other = reg.register("other", fake_model(tmp_path / "o", seed=99), actor="a")
    for v in (1, 2, 3):
        walk(reg, "m", v, TO_PRODUCTION)  # 3 PRODUCTION, 2 DEPRECATED (its rollback target), 1 DEPRECATED
    reg.save_deployment({"id": "d4", "name": "m", "version": 4, "workers": 1})
    shas = {v.version: v.sha256 for v in reg.versions("m")}

    assert reg.gc(keep_last=2, actor="janitor") == ["m:5", "m:1"]
    assert [v.version for v in reg.versions("m")] == [2, 3, 4, 6, 7]
    assert reg.store.digests() == {shas[v] for v in (2, 3, 4, 6, 7)} | {other.sha256}
    assert not (reg.store.root / shas[1]).exists() and not (reg.store.root / shas[5]).exists()
    entry = reg.audit.entries()[-1]
    assert (entry["action"], entry["actor"], entry["after"]["removed"]) == ("gc", "janitor", ["m:5", "m:1"])
    assert reg.register("m", tmp_path / "v0", actor="a").version == 8  # numbers are never reused
    with pytest.raises(ControlError):
        reg.gc(keep_last=0, actor="janitor")


def test_delete_refuses_active_or_deployed_versions(reg, tmp_path):
    src = fake_model(tmp_path / "m")
    reg.register("m", src, actor="a")
    reg.register("m", src, actor="a")  # same content: one artifact, two versions
    walk(reg, "m", 1, TO_PRODUCTION)
    with pytest.raises(ControlError) as e:
        reg.delete("m", 1, actor="a")
    assert isinstance(e.value, Conflict) and "PRODUCTION" in e.value.message
    reg.save_deployment({"id": "dep", "name": "m", "version": 2})
    with pytest.raises(ControlError) as e:
        reg.delete("m", 2, actor="a")
    assert isinstance(e.value, Conflict) and "dep" in e.value.message
    assert reg.delete_deployment("dep") and not reg.delete_deployment("dep")
    sha = reg.get("m", 2).sha256
    reg.delete("m", 2, actor="a")
    assert (reg.store.root / sha).exists()  # still version 1's
    with pytest.raises(ControlError) as e:
        reg.get("m", 2)
    assert isinstance(e.value, NotFound) and "1" in e.value.message
    assert reg.audit.entries()[-1]["action"] == "delete"


# -- registration, persistence ----------------------------------------------------------------------
def test_register_records_metadata(reg, tmp_path):
    src = fake_model(tmp_path / "m")
    mv = reg.register("m", src, labels={"team": "x"}, engine={"max_num_seqs": 8}, golden_prompts=["Hi"],
                      actor="alice")
    assert (mv.kind, mv.architecture, mv.dtype, mv.num_params) == (Kind.GENERATE, "LlamaForCausalLM", "float32", 40)
    assert mv.size_bytes == sum(f.stat().st_size for f in src.iterdir())
    assert (mv.created_by, mv.labels, mv.engine, mv.golden_prompts) == ("alice", {"team": "x"},
                                                                         {"max_num_seqs": 8}, ["Hi"])
    assert mv.source == str(src.resolve()) and Path(mv.artifact).parent.name == mv.sha256
    assert reg.get("m", 1) == mv and reg.models() == ["m"]


def test_register_reads_gguf_and_encoder_checkpoints(reg, tmp_path):
    from servelm.model.loading.source import default_model_path
    from servelm.runtimes.embedder import default_embedding_path

    gguf = tmp_path / "smol.gguf"
    shutil.copy(default_model_path(), gguf)  # a copy: the store would make the installed file read-only
    mv = reg.register("smol", gguf, actor="a")
    assert (mv.kind, mv.architecture, mv.dtype) == (Kind.GENERATE, "LlamaForCausalLM", "Q4_1")
    assert mv.num_params > 100_000_000 and Path(mv.artifact).name == "smol.gguf"
    emb = default_embedding_path()
    if emb is not None:
        e = reg.register("mini", shutil.copytree(emb, tmp_path / "mini"), actor="a")
        assert (e.kind, e.architecture) == (Kind.EMBED, "BertModel") and e.num_params > 20_000_000


@pytest.mark.parametrize("kwargs, param", [
    (dict(name="m:1"), "name"), (dict(name=""), "name"), (dict(path="/nonexistent/x"), "path"),
    (dict(arch="GPT2LMHeadModel"), "path"), (dict(engine={"no_such_setting": 1}), "engine"),
    (dict(engine={"max_num_seqs": 0}), "engine"), (dict(labels={"a": 1}), "labels"),
    (dict(golden_prompts=[""]), "golden_prompts"),
])
def test_register_refuses_bad_input_and_records_nothing(reg, tmp_path, kwargs, param):
    kwargs = dict(kwargs)  # the parameter's dict is shared by its runs on each database
    src = fake_model(tmp_path / "m", arch=kwargs.pop("arch", "LlamaForCausalLM"))
    args = dict(name="m", path=src) | kwargs
    with pytest.raises(ControlError) as e:
        reg.register(args.pop("name"), args.pop("path"), actor="a", **args)
    assert isinstance(e.value, InvalidRequest) and e.value.param == param
    assert reg.models() == [] and reg.audit.entries() == []


def test_state_survives_reopening(tmp_path):
    data = tmp_path / "data"
    r = Registry(None, data)
    r.register("m", fake_model(tmp_path / "m"), actor="a")
    walk(r, "m", 1, TO_PRODUCTION)
    r.save_deployment({"id": "d1", "name": "m", "version": 1, "workers": 2, "strategy": "round_robin"})
    r.save_deployment({"id": "d0", "name": "m", "version": 1, "workers": 1})
    r.save_deployment({"id": "d1", "name": "m", "version": 1, "workers": 3, "strategy": "round_robin"})
    before = r.versions("m")
    r.close()
    assert (data / "registry.db").is_file()

    again = Registry(f"sqlite:///{data / 'registry.db'}", data)
    assert again.versions("m") == before and again.production("m").version == 1
    assert [d["id"] for d in again.deployments()] == ["d1", "d0"]  # in creation order, updated in place
    assert again.deployments()[0]["workers"] == 3
    assert again.audit.verify() == (True, None) and len(again.audit.entries()) == 1 + len(TO_PRODUCTION)
    again.close()


# -- validation with a real worker ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random Llama of this module's own (the store makes registered files read-only)."""
    from tiny_models import build_model

    return build_model("llama", tmp_path_factory.mktemp("registry-models") / "tiny", tokenizer_dir, seed=3)


BASE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)


def _validate(reg: Registry, name: str, version: int, **kw):
    import asyncio

    from servelm.config.engine import EngineConfig
    from servelm.control.validation import validate

    return asyncio.run(validate(reg, name, version, EngineConfig(**BASE), "validator", **kw))


@sqlite_only
def test_validation_runs_golden_prompts_in_a_worker_and_records_greedy_outputs(reg, tiny_dir, tokenizer):
    import multiprocessing

    from servelm import LLM, SamplingParams

    prompts = ["Hello, my name is", "The sky is"]
    reg.register("tiny", tiny_dir, golden_prompts=prompts, actor="a")
    mv = _validate(reg, "tiny", 1)
    assert mv.state == S.VALIDATED and mv.failure is None and reg.get("tiny", 1) == mv
    assert multiprocessing.active_children() == []  # the worker was shut down

    llm = LLM(mv.artifact, **BASE)
    ids = [tokenizer(p).input_ids for p in prompts]
    ref = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert mv.golden_outputs == [r.outputs[0].text for r in ref]
    actions = [(e["actor"], e["after"]["state"]) for e in reg.audit.entries()[1:]]
    assert actions == [("validator", "VALIDATING"), ("validator", "VALIDATED")]
    assert reg.audit.entries()[-1]["after"]["outputs"] == mv.golden_outputs


@sqlite_only
def test_validation_fails_a_changed_artifact_before_starting_a_worker(reg, tmp_path, tiny_dir):
    reg.register("tiny", shutil.copytree(tiny_dir, tmp_path / "copy"), actor="a")
    cfg = Path(reg.get("tiny", 1).artifact) / "config.json"
    cfg.chmod(0o644)
    cfg.write_text(cfg.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1'))
    mv = _validate(reg, "tiny", 1)
    assert mv.state == S.FAILED and "changed" in mv.failure and mv.sha256 in mv.failure
    assert reg.audit.entries()[-1]["after"] == {"state": "FAILED", "reason": mv.failure}


@sqlite_only
def test_validation_fails_with_the_reason_when_the_worker_cannot_load(reg, tmp_path, tiny_dir):
    import multiprocessing

    broken = shutil.copytree(tiny_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # header intact, tensors cut short
    reg.register("broken", broken, actor="a")
    mv = _validate(reg, "broken", 1)
    assert mv.state == S.FAILED and mv.golden_outputs == []
    assert "SafetensorError" in mv.failure, mv.failure  # the worker's own reason, as it reported it
    assert multiprocessing.active_children() == []
    assert reg.transition("broken", 1, S.REGISTERED, "a").state == S.REGISTERED  # FAILED -> REGISTERED, retry


@sqlite_only
def test_validation_of_an_embedding_version_runs_the_encoder(reg, tmp_path):
    from servelm.runtimes.embedder import default_embedding_path

    src = default_embedding_path()
    if src is None:
        pytest.skip("the default embedding model is not installed")
    reg.register("mini", shutil.copytree(src, tmp_path / "mini"), golden_prompts=["a cat", "a dog"], actor="a")
    mv = _validate(reg, "mini", 1)
    assert mv.state == S.VALIDATED, mv.failure
    rec = [json.loads(o) for o in mv.golden_outputs]
    assert [r["dim"] for r in rec] == [384, 384] and rec[0]["head"] != rec[1]["head"]


@sqlite_only
def test_validation_uses_the_embedder_it_is_given(reg, tmp_path):
    """The server's seam: its own embedding worker is used, and one that fails makes the version FAILED."""
    from servelm.runtimes.embedder import default_embedding_path

    src = default_embedding_path()
    if src is None:
        pytest.skip("the default embedding model is not installed")
    reg.register("mini", shutil.copytree(src, tmp_path / "mini"), actor="a")
    seen = []

    class Fake:
        def __init__(self, path):
            seen.append(path)

        async def wait_ready(self):
            pass

        async def embed(self, texts):
            return [[float(len(t)), 0.5] for t in texts], 0

        def close(self):
            seen.append("closed")

    mv = _validate(reg, "mini", 1, embedder_factory=Fake)
    assert mv.state == S.VALIDATED and seen == [Path(mv.artifact), "closed"]
    from servelm.control.validation import DEFAULT_PROMPTS

    assert [json.loads(o)["head"][0] for o in mv.golden_outputs] == [float(len(p)) for p in DEFAULT_PROMPTS]

    class Broken(Fake):
        async def wait_ready(self):
            raise RuntimeError("the embedding model failed to load")

    reg.transition("mini", 1, S.STAGING, "a")  # VALIDATED cannot be validated again: register anew
    reg.register("mini", src, actor="a")
    mv = _validate(reg, "mini", 2, embedder_factory=Broken)
    assert mv.state == S.FAILED and "failed to load" in mv.failure and seen[-1] == "closed"
