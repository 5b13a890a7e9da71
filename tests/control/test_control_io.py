"""The control plane keeps database work off the event loop: a request's resolution reads the PRODUCTION
version from the registry's memory (no query), kept current by every lifecycle write; admin writes run on the
registry's writer thread. A validation run's worker counts in the memory budget and loads its tokenizer under
the deployments' tokenizer lock. Stand-in engine workers (tests/support/fakes.py), a real registry (SQLite)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from fakes import StubEngine, stub_deployment_workers
from sqlalchemy import event

from servelm.config.engine import EngineConfig
from servelm.control.budget import MemoryBudget, worker_footprint
from servelm.control.deployments import DeploymentManager
from servelm.control.errors import ControlError, InsufficientMemory
from servelm.control.plane import ControlPlane
from servelm.control.registry import Registry
from servelm.control.types import State
from servelm.server.directory import ModelDirectory
from servelm.worker.handle import HealthSettings

BASE = EngineConfig(dtype="float32", num_kv_blocks=None, kv_cache_memory_gb=0.01, max_model_len=256)
TO_STAGING_TESTED = (State.VALIDATING, State.VALIDATED, State.STAGING, State.STAGING_TESTED)


def _plane(tmp_path, budget: int = 2**40) -> ControlPlane:
    reg = Registry(None, tmp_path / "data")
    manager = DeploymentManager(BASE, MemoryBudget(budget), health=HealthSettings(interval_s=3600.0),
                                reap_every_s=3600)
    plane = ControlPlane(reg, manager, BASE)
    manager.on_change, manager.production_of = plane._on_change, plane._production_of
    return plane


def test_resolution_reads_no_database_and_admin_writes_run_off_the_event_loop(llama_dir, tmp_path, monkeypatch):
    stub_deployment_workers(monkeypatch)
    plane = _plane(tmp_path)
    reg = plane.registry
    for v in (1, 2):
        reg.register("m", str(llama_dir), actor="t")
        for to in TO_STAGING_TESTED:
            reg.transition("m", v, to, "t")
    for to in (State.CANARY, State.PRODUCTION):
        reg.transition("m", 1, to, "t")
    directory = ModelDirectory()
    directory.deployments = plane.deployments
    queries: list[tuple[threading.Thread, str]] = []
    event.listen(reg.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: queries.append((threading.current_thread(), statement)))

    async def main():
        loop_thread = threading.current_thread()
        try:
            await plane.deploy("m:1", workers=1, strategy="round_robin", actor="t")
            await plane.deploy("m:2", workers=1, strategy="round_robin", actor="t")
            queries.clear()
            assert directory.resolve("m").version.version == 1  # two deployments: the PRODUCTION one
            assert queries == []  # no query per request
            await plane.transition("m", 2, "CANARY", "t")
            await plane.transition("m", 2, "PRODUCTION", "t")
            assert directory.resolve("m").version.version == 2 and reg.production("m").version == 2
            await plane.rollback("m", "t", "test")
            await plane.scale("m-v1", 2, "t")
            await plane.unload("m-v2", "t")
            writes = [s for t, s in queries if t is loop_thread and s.lstrip().upper().startswith(
                ("INSERT", "UPDATE", "DELETE"))]
            assert writes == []  # deployment records, audit entries, transitions: none on the event loop
            await plane.deploy("m:1", workers=1, strategy="round_robin", actor="t", deployment_id="m-v1-b")
            queries.clear()
            assert directory.resolve("m").version.version == 1 and reg.production("m").version == 1
            assert queries == []
        finally:
            await plane.close()

    asyncio.run(main())
    again = Registry(None, tmp_path / "data")  # what it cached is what the database says
    assert again.production("m").version == 1 and again.versions("m")[1].state == State.DEPRECATED
    again.close()


def test_validation_counts_in_the_budget_and_loads_its_tokenizer_under_the_lock(llama_dir, tmp_path, monkeypatch):
    from servelm.control import deployment
    from servelm.model.loading import metadata
    from servelm.worker import client

    monkeypatch.setattr(client, "AsyncEngine", StubEngine)
    seen: dict = {}
    plane = _plane(tmp_path)

    def load_tokenizer(path, tokenizer=None, chat_template=None):
        seen.update(locked=deployment._TOKENIZER_LOCK.locked(), in_use=plane.deployments.in_use())
        return lambda text: SimpleNamespace(input_ids=[1, 2, 3])
    monkeypatch.setattr(metadata, "load_tokenizer", load_tokenizer)
    reg = plane.registry
    mv = reg.register("m", str(llama_dir), actor="t")
    reg.register("m", str(llama_dir), actor="t")
    per_worker = worker_footprint(mv, mv.engine_config(BASE)).total

    async def main():
        try:
            done = await plane.validate("m", 1, "t")
            assert done.state == State.VALIDATED, done.failure
            assert seen == {"locked": True, "in_use": per_worker} and plane.deployments.in_use() == 0
            plane.deployments.budget.total = per_worker // 2
            with pytest.raises(ControlError) as e:
                await plane.validate("m", 2, "t")
            assert isinstance(e.value, InsufficientMemory) and "validating m:2" in e.value.message
            assert reg.get("m", 2).state == State.REGISTERED and plane.deployments.in_use() == 0
        finally:
            await plane.close()

    asyncio.run(main())
