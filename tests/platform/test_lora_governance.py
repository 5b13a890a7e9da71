"""LoRA adapters under model governance: an adapter is a registry version of kind `lora` with its base version
recorded; deploying it starts no worker but loads it into the workers of its base's deployment (every worker, and
those started later); requests naming it run there with it; traffic splits, canaries with automatic rollback,
shadows and experiments work between two adapter versions; the audit trail records them all; a base cannot be
archived while a deployed adapter needs it; validation runs an adapter's golden prompts with the adapter.

The admin API tests run in-process (the real app, registry, control plane, deployment manager and traffic
service) with stand-in engine workers (tests/support/fakes.py StubEngine: it holds the adapters it was given and refuses
requests for others). The last test runs real engine workers of a tiny random model with a random PEFT adapter.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest
from fakes import StubEngine, stub_deployment_workers
from random_weights import make_adapter

from servelm.config.engine import EngineConfig
from servelm.control.errors import Conflict, ControlError
from servelm.control.types import Kind, State
from servelm.worker.handle import HealthSettings

pytest.importorskip("peft")

ADMIN = {"x-api-key": "sk-admin-lora-gov"}
BASE = EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256)
TO_TESTED = (State.VALIDATING, State.VALIDATED, State.STAGING, State.STAGING_TESTED)
TO_PRODUCTION = (*TO_TESTED, State.CANARY, State.PRODUCTION)
PROMPT = [1, 50, 60, 70]  # token ids below the stand-ins' vocabulary of 100


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two random PEFT adapters of the tiny llama (different weights: two versions of one adapter)."""
    root = tmp_path_factory.mktemp("lora-gov")
    for i in (1, 2):
        make_adapter(llama_dir, root / f"a{i}", 8, 16, False, ["q_proj", "v_proj"], seed=40 + i)
    return root


def _move(reg, name: str, version: int, states) -> None:
    for s in states:
        reg.transition(name, version, s, "t")


@pytest.fixture
def platform(tokenizer, llama_dir, adapters, tmp_path, monkeypatch):
    """The app over a real registry and deployment manager whose workers are stand-ins: `base:1` registered
    and VALIDATED, nothing deployed."""
    from starlette.testclient import TestClient
    from test_model_directory import FakeEngine

    from servelm.config.settings import load
    from servelm.control import deployment
    from servelm.control.budget import MemoryBudget
    from servelm.control.deployments import DeploymentManager
    from servelm.control.plane import ControlPlane
    from servelm.control.registry import Registry
    from servelm.server.api import build_app
    from servelm.server.serve import build_state
    from servelm.server.traffic import TrafficService

    stub_deployment_workers(monkeypatch)
    monkeypatch.setattr(deployment, "load_tokenizer", lambda version, config: tokenizer)
    monkeypatch.setenv("SERVELM_ALLOW_FAULTS", "1")
    config = load({"embedding_model": "none", "log_requests": False, "data_dir": str(tmp_path / "data"),
                   "admin_key": ADMIN["x-api-key"], "canary_interval_s": 0.01, "prediction_log": "metadata"}, env={})
    reg = Registry(None, tmp_path / "data")
    reg.register("base", str(llama_dir), actor="t")
    _move(reg, "base", 1, TO_TESTED[:2])
    state = build_state(config, tokenizer, FakeEngine("A"), "alpha")
    dm = DeploymentManager(BASE, MemoryBudget(2**40), health=HealthSettings(interval_s=3600.0), reap_every_s=3600)
    state.control = cp = ControlPlane(reg, dm, BASE)
    dm.on_change, dm.production_of = cp._on_change, cp._production_of
    state.models.deployments = dm
    state.traffic = TrafficService(cp, config.server, state.metrics.registry, state.models)
    with TestClient(build_app(state)) as client:
        yield client, state
        client.portal.call(state.traffic.close)
        client.portal.call(dm.shutdown)
    reg.close()


def call(client, method: str, path: str, body: dict | None = None, status: int = 200) -> dict:
    r = client.request(method, path, json=body, headers=ADMIN)
    assert r.status_code == status, r.text
    return r.json() if r.content else {}


def register_adapter(client, name: str, path, base: str = "base:1", **more) -> dict:
    return call(client, "POST", "/admin/models", {"name": name, "path": str(path), "base": base, **more}, 201)


def complete(client, model: str, **headers):
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1},
                       headers=headers)


def worker_engines(state, deployment_id: str) -> list[StubEngine]:
    return [w.engine for w in state.control.deployments.get(deployment_id).workers]


def test_an_adapter_version_records_its_base_and_is_checked_at_registration(platform, adapters, llama_dir):
    client, state = platform
    v = register_adapter(client, "ad", adapters / "a1", labels={"team": "x"}, golden_prompts=["Hello"])
    assert (v["ref"], v["kind"], v["base"], v["state"], v["architecture"]) == \
        ("ad:1", "lora", "base:1", "REGISTERED", "LoRA r=8")
    assert v["num_params"] > 0 and v["artifact"] != str(adapters / "a1")  # imported into the store
    assert state.control.registry.get("ad", 1).kind == Kind.LORA

    def refused(body: dict, status: int, param: str) -> str:
        err = call(client, "POST", "/admin/models", {"name": "ad", **body}, status)["error"]
        assert err["param"] == param, err
        return err["message"]

    assert "base" in refused({"path": str(adapters / "a1")}, 400, "base")  # an adapter folder names its base
    assert "base:9" in refused({"path": str(adapters / "a1"), "base": "base:9"}, 404, "base")
    assert "NAME:VERSION" in refused({"path": str(adapters / "a1"), "base": "base"}, 400, "base")
    assert "adapter_config.json" in refused({"path": str(llama_dir), "base": "base:1"}, 400, "path")
    assert "base version's workers" in refused({"path": str(adapters / "a1"), "base": "base:1",
                                        "engine": {"max_num_seqs": 4}}, 400, "engine")
    assert "generation model" in refused({"path": str(adapters / "a2"), "base": "ad:1"}, 400, "base")
    entry = next(e for e in call(client, "GET", "/admin/audit?target=ad:1")["entries"] if e["action"] == "register")
    assert entry["after"]["base"] == "base:1" and entry["after"]["kind"] == "lora"
    assert [x["ref"] for x in call(client, "GET", "/admin/models/ad")["versions"]] == ["ad:1"]  # refusals: none


def test_deploying_an_adapter_loads_it_into_every_worker_of_its_base_and_starts_none(platform, adapters):
    client, state = platform
    reg = state.control.registry
    register_adapter(client, "ad", adapters / "a1")
    _move(reg, "ad", 1, TO_TESTED[:2])
    err = call(client, "POST", "/admin/deployments", {"model": "ad:1"}, 409)["error"]
    assert err["code"] == "base_not_deployed" and "base:1" in err["message"]
    call(client, "POST", "/admin/deployments", {"model": "base:1"}, 201)
    err = call(client, "POST", "/admin/deployments", {"model": "ad:1"}, 409)["error"]
    assert err["code"] == "lora_disabled" and "enable_lora" in err["message"]  # the rule, with the ways out
    call(client, "DELETE", "/admin/deployments/base-v1", status=204)

    base = call(client, "POST", "/admin/deployments", {"model": "base:1", "workers": 2, "enable_lora": True}, 201)
    assert base["enable_lora"] is True and base["adapters"] == []
    started = len(StubEngine.made)
    dep = call(client, "POST", "/admin/deployments", {"model": "ad:1"}, 201)
    assert (dep["id"], dep["kind"], dep["base"], dep["base_deployment"], dep["workers"]) == \
        ("ad-v1", "lora", "base:1", "base-v1", 2)
    assert len(StubEngine.made) == started  # no worker of its own
    engines = worker_engines(state, "base-v1")
    assert [e.loras for e in engines] == [{"ad:1": reg.get("ad", 1).artifact}] * 2
    assert call(client, "GET", "/admin/deployments/base-v1")["adapters"] == ["ad:1"]

    for model in ("ad", "ad:1"):  # by name and pinned: the base's workers, with the adapter
        r = complete(client, model)
        assert r.status_code == 200, r.text
        assert (r.headers["x-servelm-model-version"], r.json()["model"]) == ("ad:1", "ad:1")
    assert complete(client, "base").headers["x-servelm-model-version"] == "base:1"
    assert sorted((u for e in engines for u in e.used), key=str) == [None, "ad:1", "ad:1"]
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["ad:1"]["parent"] == "base:1" and "parent" not in cards["base:1"]

    # a worker started later (scale-up) has it from its start; so does a restarted one (the same settings)
    call(client, "PATCH", "/admin/deployments/base-v1", {"workers": 3})
    engines = worker_engines(state, "base-v1")
    assert len(engines) == 3 and all("ad:1" in e.loras for e in engines)
    assert all(any(m.startswith("ad:1=") for m in e.config.lora_config.lora_modules) for e in engines)
    # a process that restarted without it (launched just before the adapter was added) loads it once ready
    d = state.control.deployments.get("base-v1")
    d.workers[0].engine.loras.clear()

    async def restarted():
        d._ready(d.workers[0], None, True)
        await asyncio.gather(*d._reloads)
    client.portal.call(restarted)
    assert "ad:1" in d.workers[0].engine.loras

    # the base stays as it is while the adapter runs on it
    err = call(client, "DELETE", "/admin/deployments/base-v1", status=409)["error"]
    assert err["code"] == "base_in_use" and "ad-v1" in err["message"]
    reg.register("base", reg.get("base", 1).source, actor="t")
    _move(reg, "base", 2, TO_TESTED[:2])
    err = call(client, "POST", "/admin/deployments/base-v1/swap", {"version": 2}, 409)["error"]
    assert err["code"] == "base_in_use" and "ad:1" in err["message"]
    assert call(client, "GET", "/admin/deployments/base-v1")["ref"] == "base:1"
    err = call(client, "PATCH", "/admin/deployments/ad-v1", {"workers": 2}, 400)["error"]
    assert "base-v1" in err["message"]

    call(client, "DELETE", "/admin/deployments/ad-v1", status=204)
    assert all(not e.loras and not e.config.lora_config.lora_modules for e in worker_engines(state, "base-v1"))
    assert complete(client, "ad").status_code == 404
    call(client, "DELETE", "/admin/deployments/base-v1", status=204)  # nothing runs on it now
    actions = [(e["action"], e["target"]) for e in call(client, "GET", "/admin/audit")["entries"]]
    assert ("deploy", "ad-v1") in actions and ("unload", "ad-v1") in actions
    deploy = next(e for e in call(client, "GET", "/admin/audit?target=ad-v1")["entries"] if e["action"] == "deploy")
    assert (deploy["after"]["ref"], deploy["after"]["base_deployment"]) == ("ad:1", "base-v1")


def test_a_base_cannot_be_archived_or_deleted_while_an_adapter_needs_it(platform, adapters):
    client, state = platform
    reg = state.control.registry
    register_adapter(client, "ad", adapters / "a1")
    _move(reg, "ad", 1, TO_TESTED[:2])
    _move(reg, "base", 1, TO_PRODUCTION[2:])
    call(client, "POST", "/admin/deployments", {"model": "base:1", "enable_lora": True}, 201)
    call(client, "POST", "/admin/deployments", {"model": "ad:1"}, 201)
    state.control.registry.transition("base", 1, State.DEPRECATED, "t")  # as when a newer base is promoted
    err = call(client, "POST", "/admin/models/base/versions/1/transition", {"state": "ARCHIVED"}, 409)["error"]
    assert err["code"] == "base_in_use" and "ad:1" in err["message"] and "ad-v1" in err["message"]
    call(client, "DELETE", "/admin/deployments/ad-v1", status=204)
    call(client, "DELETE", "/admin/deployments/base-v1", status=204)
    # deleting the base would leave the adapter nothing to run on: refused while the adapter version exists
    err = call(client, "DELETE", "/admin/models/base/versions/1", status=409)["error"]
    assert err["code"] == "base_in_use" and "ad:1" in err["message"]
    assert call(client, "POST", "/admin/models/base/versions/1/transition", {"state": "ARCHIVED"})["state"] == \
        "ARCHIVED"  # no deployed adapter needs it any more
    refused = call(client, "POST", "/admin/models", {"name": "ad", "path": str(adapters / "a2"), "base": "base:1"},
                   409)["error"]
    assert "ARCHIVED" in refused["message"]


def _two_adapter_versions(client, state, adapters, v2_labels=None) -> None:
    """base:1 deployed with LoRA; ad:1 PRODUCTION and ad:2 STAGING_TESTED (with `v2_labels`), both deployed."""
    reg = state.control.registry
    call(client, "POST", "/admin/deployments", {"model": "base:1", "enable_lora": True, "workers": 2}, 201)
    register_adapter(client, "ad", adapters / "a1")
    register_adapter(client, "ad", adapters / "a2", labels=v2_labels or {})
    _move(reg, "ad", 1, TO_PRODUCTION)
    _move(reg, "ad", 2, TO_TESTED)
    for v in (1, 2):
        call(client, "POST", "/admin/deployments", {"model": f"ad:{v}"}, 201)


def test_a_split_shadow_and_experiment_between_two_adapter_versions(platform, adapters):
    client, state = platform
    _two_adapter_versions(client, state, adapters)
    started = len(StubEngine.made)
    engines = worker_engines(state, "base-v1")
    assert all(set(e.loras) == {"ad:1", "ad:2"} for e in engines)

    call(client, "PUT", "/admin/models/ad/traffic", {"arms": [{"version": 1}, {"version": 2}]})
    served = [complete(client, "ad", **{"x-servelm-user": f"u{i}"}) for i in range(40)]
    assert all(r.status_code == 200 for r in served)
    versions = [r.headers["x-servelm-model-version"] for r in served]
    assert set(versions) == {"ad:1", "ad:2"}  # both versions answer, each response says which
    assert [r.json()["model"] for r in served] == versions
    used = [u for e in engines for u in e.used]
    assert used.count("ad:1") == versions.count("ad:1") and used.count("ad:2") == versions.count("ad:2")
    call(client, "DELETE", "/admin/models/ad/traffic", status=204)

    # shadow: ad:1 answers, ad:2 runs the same request on the base's workers with its adapter
    call(client, "PUT", "/admin/models/ad/shadow", {"version": 2, "fraction": 1.0})
    before = sum(e.used.count("ad:2") for e in engines)
    for _ in range(5):
        r = complete(client, "ad")
        assert r.headers["x-servelm-model-version"] == "ad:1"
    client.portal.call(state.traffic.mirrors["ad"].drain)
    assert sum(e.used.count("ad:2") for e in engines) == before + 5
    assert call(client, "GET", "/admin/models/ad/shadow")["stats"]["pairs"] == 5
    call(client, "DELETE", "/admin/models/ad/shadow", status=204)

    call(client, "POST", "/admin/experiments", {"name": "e1", "model": "ad", "sticky": True,
                                                "arms": [{"version": 1, "name": "a"}, {"version": 2, "name": "b"}]},
         201)
    arms = [complete(client, "ad", **{"x-servelm-user": f"e{i}"}).headers["x-servelm-arm"] for i in range(30)]
    report = call(client, "GET", "/admin/experiments/e1")
    assert report["arms"]["a"]["requests"] + report["arms"]["b"]["requests"] == 30 and set(arms) == {"a", "b"}
    assert len(StubEngine.made) == started  # none of it started a worker


def test_a_failing_adapter_canary_is_rolled_back_automatically(platform, adapters):
    from servelm.control.traffic_service import FAULT_LABEL

    client, state = platform
    _two_adapter_versions(client, state, adapters, {FAULT_LABEL: "error"})
    call(client, "POST", "/admin/models/ad/canary", {"version": 2, "steps": [50, 100], "min_requests": 1000,
                                                      "min_seconds": 0, "thresholds": {"min_samples": 10}}, 201)
    assert state.control.registry.get("ad", 2).state == State.CANARY
    rs = []
    for i in range(3000):
        rs.append(complete(client, "ad", **{"x-servelm-user": f"u{i}"}))
        if call(client, "GET", "/admin/models/ad/canary")["status"] == "rolled_back":
            break
    assert call(client, "GET", "/admin/models/ad/canary")["status"] == "rolled_back"
    for r in rs:  # the only failures are the canary version's injected ones
        if r.status_code != 200:
            assert (r.status_code, r.headers["x-servelm-model-version"]) == (503, "ad:2"), r.text
    assert any(r.status_code == 503 for r in rs)
    after = [complete(client, "ad", **{"x-servelm-user": f"v{i}"}) for i in range(20)]
    assert all(r.status_code == 200 and r.headers["x-servelm-model-version"] == "ad:1" for r in after)
    assert state.control.registry.get("ad", 2).state == State.ROLLBACK
    entries = call(client, "GET", "/admin/audit")["entries"]
    assert {"canary.start", "canary.rollback"} <= {e["action"] for e in entries}
    assert any(e["target"] == "ad:2" and (e["after"] or {}).get("state") == "ROLLBACK" for e in entries)


def test_promoting_an_adapter_version_swaps_the_adapter_deployment(platform, adapters):
    """A promotion of an adapter version that is not deployed swaps the model's adapter deployment to it (the
    zero-downtime swap, on the base's workers): the new adapter is loaded, the old one unloaded."""
    client, state = platform
    reg = state.control.registry
    call(client, "POST", "/admin/deployments", {"model": "base:1", "enable_lora": True}, 201)
    register_adapter(client, "ad", adapters / "a1")
    register_adapter(client, "ad", adapters / "a2")
    _move(reg, "ad", 1, TO_PRODUCTION)
    _move(reg, "ad", 2, (*TO_TESTED, State.CANARY))
    call(client, "POST", "/admin/deployments", {"model": "ad"}, 201)
    call(client, "POST", "/admin/models/ad/versions/2/transition", {"state": "PRODUCTION"})
    assert call(client, "GET", "/admin/deployments/ad-v1")["ref"] == "ad:2"
    assert [set(e.loras) for e in worker_engines(state, "base-v1")] == [{"ad:2"}]
    assert complete(client, "ad").headers["x-servelm-model-version"] == "ad:2"
    assert any(e["action"] == "swap" for e in call(client, "GET", "/admin/audit?target=ad-v1")["entries"])


def test_a_restarted_server_brings_back_the_base_with_lora_and_its_adapter(platform, adapters):
    from servelm.control.budget import MemoryBudget
    from servelm.control.deployments import DeploymentManager
    from servelm.control.plane import ControlPlane

    client, state = platform
    reg = state.control.registry
    register_adapter(client, "ad", adapters / "a1")
    _move(reg, "ad", 1, TO_TESTED[:2])
    call(client, "POST", "/admin/deployments", {"model": "base:1", "enable_lora": True}, 201)
    call(client, "POST", "/admin/deployments", {"model": "ad:1"}, 201)

    async def restart():
        dm = DeploymentManager(BASE, MemoryBudget(2**40), health=HealthSettings(interval_s=3600.0),
                               reap_every_s=3600)
        cp = ControlPlane(reg, dm, BASE)
        try:
            restored = await cp.restore()
            return restored, [set(w.engine.loras) for w in dm.get("base-v1").workers], dm.resolve("ad").id
        finally:
            await dm.shutdown()
    assert client.portal.call(restart) == (["base-v1", "ad-v1"], [{"ad:1"}], "ad-v1")


def test_an_old_registry_database_opens_and_gc_keeps_an_adapters_base(llama_dir, adapters, tmp_path):
    """A database made before adapters (schema revision 0001, no `base` column) is migrated when it opens: its rows
    read no base. gc never deletes a version an adapter is based on."""
    from servelm.control.registry import Registry

    reg = Registry(None, tmp_path / "old")
    reg.register("m", str(llama_dir), actor="t")
    reg.close()
    with sqlite3.connect(tmp_path / "old" / "registry.db") as db:  # as an older servelm left it
        db.execute("ALTER TABLE versions DROP COLUMN base")
        db.execute("DROP TABLE deployment_specs")  # revision 0003's
        db.execute("UPDATE alembic_version SET version_num = '0001'")
    reg = Registry(None, tmp_path / "old")
    try:
        assert reg.get("m", 1).base is None and reg.get("m", 1).kind == Kind.GENERATE
        reg.register("m", str(llama_dir), actor="t")
        ad = reg.register("ad", adapters / "a1", base="m:1", actor="t")
        assert (reg.get("ad", 1).base, ad.kind) == ("m:1", Kind.LORA)
        assert reg.gc(1, "t") == []  # m:1 is older than keep_last=1 but ad:1 needs it
        with pytest.raises(ControlError) as e:
            reg.delete("m", 1, "t")
        assert isinstance(e.value, Conflict) and "ad:1" in e.value.message
        reg.delete("ad", 1, "t")
        assert reg.gc(1, "t") == ["m:1"]
    finally:
        reg.close()


def test_validation_and_serving_with_real_workers_match_the_offline_adapter(llama_dir, adapters, tmp_path):
    """Real engine workers: validating an adapter version answers its golden prompt with the adapter (as the
    offline API does with it, not as the base does); deployed on a base deployment, a request naming it is
    answered with the adapter and tagged with its version, and the base's own requests are not."""
    from servelm import LLM, LoRARequest, SamplingParams
    from servelm.control.budget import MemoryBudget
    from servelm.control.deployments import DeploymentManager
    from servelm.control.plane import ControlPlane
    from servelm.control.registry import Registry

    prompt = "Hello there"
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True)
    ids = llm.engine.tokenize(prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want_base = llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].text
    want = llm.generate([ids], greedy, use_tqdm=False,
                        lora_request=LoRARequest("a1", 1, str(adapters / "a1")))[0].outputs[0].text
    del llm
    assert want != want_base  # the adapter changes the text: the checks below mean something

    reg = Registry(None, tmp_path / "data")
    reg.register("base", str(llama_dir), actor="t")
    _move(reg, "base", 1, TO_TESTED[:2])
    reg.register("ad", adapters / "a1", base="base:1", golden_prompts=[prompt], actor="t")
    dm = DeploymentManager(BASE, MemoryBudget(2**40), health=HealthSettings(interval_s=3600.0), reap_every_s=3600)
    cp = ControlPlane(reg, dm, BASE)

    async def main():
        try:
            done = await cp.validate("ad", 1, "t")
            assert done.state == State.VALIDATED, done.failure
            await cp.deploy("base:1", workers=1, strategy="round_robin", actor="t", enable_lora=True)
            await cp.deploy("ad:1", workers=1, strategy="round_robin", actor="t")
            texts = {}
            for model in ("ad", "base"):
                lease = dm.resolve(model).pin()
                try:
                    outs = [o async for o in lease.generate(f"r-{model}", ids, greedy)]
                finally:
                    lease.release()
                texts[model] = (outs[-1].outputs[0].text, outs[-1].model_version)
            return done, texts
        finally:
            await dm.shutdown()

    try:
        done, texts = asyncio.run(main())
    finally:
        reg.close()
    # greedy with max_tokens 16 in validation: its first tokens are the 8 asked for here
    assert done.golden_outputs[0].startswith(want), (done.golden_outputs, want)
    assert texts == {"ad": (want, "ad:1"), "base": (want_base, "base:1")}


def test_a_production_adapter_loads_on_demand_onto_its_deployed_base(platform, adapters):
    client, state = platform
    cp = state.control
    state.models.on_demand = lambda model, kind: cp.load_on_demand(model, kind, 300.0)
    register_adapter(client, "ad", adapters / "a1")
    _move(cp.registry, "ad", 1, TO_PRODUCTION)
    r = complete(client, "ad")
    assert r.status_code == 409 and "base:1" in r.json()["error"]["message"]  # no base deployment to run on
    call(client, "POST", "/admin/deployments", {"model": "base:1", "enable_lora": True}, 201)
    r = complete(client, "ad")
    assert r.status_code == 200 and r.headers["x-servelm-model-version"] == "ad:1", r.text
    assert call(client, "GET", "/admin/deployments/ad-v1")["keep_alive_s"] == 300.0
    assert any(e["action"] == "load_on_demand" for e in call(client, "GET", "/admin/audit?target=ad-v1")["entries"])


def test_the_cli_registers_an_adapter_with_its_base_and_deploys_it(platform, adapters, capsys):
    """`servelm models register --base` and `deploy --enable-lora` over the admin API (the CLI's HTTP client
    swapped for the in-process one)."""
    import argparse

    from servelm.entrypoints import models_cli

    client, state = platform
    parser = argparse.ArgumentParser()
    models_cli.add_args(parser)

    class Client(models_cli._Client):
        def __init__(self, args) -> None:
            self.json = args.json

        def call(self, method, path, body=None, params=None):
            r = client.request(method, path, json=body, params=params, headers=ADMIN)
            if r.status_code >= 400:
                raise models_cli.CliError(f"{r.json()['error']['message']} (HTTP {r.status_code})")
            return r.json() if r.content else None

    def run(*argv: str) -> tuple[int, str]:
        orig, models_cli._Client = models_cli._Client, Client
        try:
            code = models_cli.cmd_models(parser.parse_args(list(argv)))
        finally:
            models_cli._Client = orig
        return code, capsys.readouterr().out

    code, out = run("--json", "register", "ad", str(adapters / "a1"), "--base", "base:1")
    assert code == 0 and (json.loads(out)["kind"], json.loads(out)["base"]) == ("lora", "base:1")
    _move(state.control.registry, "ad", 1, TO_TESTED[:2])
    assert run("deploy", "base:1", "--enable-lora")[0] == 0
    code, out = run("deploy", "ad:1")
    assert code == 0 and "base-v1" in out.splitlines()[1]  # the BASE_DEPLOYMENT column
    code, out = run("show", "ad")
    assert code == 0 and "lora" in out and "base:1" in out
