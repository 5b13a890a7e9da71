"""servelm on a real local Ray cluster (`ray start --head` on 127.0.0.1): `python -m servelm.ray` serves a tiny
model from Ray Serve replicas behind servelm's API process; a replica killed under load is replaced by Ray and
no request hangs (those not yet started are re-sent, streamed ones end with an error event); servelm's
autoscaling policy adds replicas under load and removes them when it ends.

Ray is in the `test` extra, so CI runs this module (about a minute and a half on 2 cores: Ray's start-up and
one engine process per replica, on one xdist worker beside the rest); elsewhere it is skipped without Ray
(`pip install servelm[ray]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

# Ray's single-machine mode, in which every component (GCS, raylet, agents, the client server) binds 127.0.0.1;
# otherwise Ray swaps a loopback --node-ip-address for the machine's routable address and binds its servers there
# and on 0.0.0.0. Ray reads it when it is imported (here, and in the server this module starts).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install servelm[ray]")
serve = pytest.importorskip("ray.serve")

from serving import _free_port, _ready, _wait, stop_server  # noqa: E402
from tiny_models import build_model  # noqa: E402

from servelm.ray.app import DEPLOYMENT_NAME  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]
APP = "servelm-test"


def stop_cluster(temp: str) -> None:
    """Stop this test's Ray processes only (`ray stop` would stop every Ray cluster on the machine): those whose
    command line names its temp dir (GCS, raylet, monitors) and their children (Ray's agents, the controller,
    the replicas). SIGKILL: the GCS and raylet catch SIGTERM and stay up while their peers are gone."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            procs[int(pid)] = (int(stat.rsplit(")", 1)[1].split()[1]), Path(f"/proc/{pid}/cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    doomed = {pid for pid, (_, cmd) in procs.items() if temp.encode() in cmd and pid != os.getpid()}
    grown = True
    while grown:  # and every descendant of those
        more = {pid for pid, (ppid, _) in procs.items() if ppid in doomed} - doomed
        doomed |= more
        grown = bool(more)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster on loopback for this module, stopped at the end."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit in 107 bytes
    # replicas report their load every 0.5 s (default 10 s), so the autoscaler reacts within the test; no token
    # auth on this loopback-only cluster (Ray turns it on for `ray start` once any ~/.ray/auth_token exists)
    settings = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)  # this process's ray.init and the server it starts see them too
    env = dict(os.environ)
    subprocess.run(["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "4", "--include-dashboard", "false", "--temp-dir", temp, "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=180)
    address = f"127.0.0.1:{port}"
    try:
        ray.init(address=address, namespace="servelm", log_to_driver=False)
        yield address
    finally:
        ray.shutdown()
        stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory, tokenizer_dir):
    model = build_model("llama", tmp_path_factory.mktemp("ray-model") / "llama", tokenizer_dir)
    port = _free_port()
    # 2 replicas, autoscaled to 3 when more than 2 sequences per replica run or wait; short delays for the test
    cmd = [sys.executable, "-m", "servelm.ray", str(model), "--served-model-name", "tiny", "--port", str(port),
           "--dtype", "float32", "--embedding-model", "none", "--ray-address", ray_cluster,
           "--ray-app-name", APP, "--replicas", "2", "--max-replicas", "3", "--target-ongoing-requests", "2",
           "--upscale-delay-s", "0", "--downscale-delay-s", "1", "--look-back-period-s", "12", "--replica-cpus", "1",
           "--max-num-seqs", "4", "--num-threads", "1", "--queue-timeout-s", "600"]
    log = tmp_path_factory.mktemp("ray-log") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: proc.poll() is not None or _ready(url), 300, "the Ray-backed server to become ready")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield url
    finally:
        stop_server(proc)
        serve.delete(APP)


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments[DEPLOYMENT_NAME]
    return status.replica_states.get("RUNNING", 0)


def replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and DEPLOYMENT_NAME in a["name"]]


async def stream(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, str]:
    """One streamed completion: (status, how it ended: 'done', 'error' or 'cut')."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "error"
        ended = "cut"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                ended = "done"
            elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                ended = "error"
        return 200, ended


def test_every_component_listens_on_loopback_only(server):
    """The cluster, its replicas and servelm's server accept connections from this machine only."""
    import ipaddress

    import psutil

    session = ray.get_runtime_context().gcs_address  # any Ray process of this cluster names its GCS port
    port = session.rsplit(":", 1)[1]
    ours = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if f":{port}" in line or f"={port}" in line or "servelm.ray" in line:
            ours.add(p.info["pid"])
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert listening, "found none of the cluster's listening sockets"
    exposed = [(c.laddr.ip, c.laddr.port) for c in listening
               if not ipaddress.ip_address(c.laddr.ip.removeprefix("::ffff:")).is_loopback]
    assert not exposed, exposed


def test_serves_from_two_replicas(server):
    assert running_replicas() == 2
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    models = httpx.get(server + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] > 0


def test_replica_killed_under_load_is_replaced_and_no_request_hangs(server):
    async def load():
        async with httpx.AsyncClient(base_url=server, timeout=None) as client:
            # 12 requests over 2 replicas of 4 sequences each: each replica runs 4 and queues the rest. Each asks
            # for nearly the whole context (1,024), so the load is still running when the poll below looks (64
            # tokens each could all finish between two polls on a fast engine, and the wait then never ended)
            tasks = [asyncio.create_task(stream(client, 960)) for _ in range(12)]
            await asyncio.sleep(0)  # the requests are on their way
            victim = replica_actors()[0]
            await asyncio.to_thread(lambda: _wait(lambda: httpx.get(server + "/server/stats").json()["running"] >= 4,
                                                  120, "the load to be running"))
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            # a hang would stop here: every request must end, one way or the other
            return victim, await asyncio.wait_for(asyncio.gather(*tasks), 240)

    victim, results = asyncio.run(load())
    assert all(status in (200, 503) for status, _ in results), results
    assert all(ended in ("done", "error") for _, ended in results), results  # none cut off without an end
    # only what was running on the lost replica fails (at most its max_num_seqs); its queued requests were
    # re-sent and completed with the rest
    assert sum(ended == "error" for _, ended in results) <= 4, results
    _wait(lambda: running_replicas() >= 2 and victim not in replica_actors(), 240, "Ray to replace the replica")
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                                     "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text


def test_scales_up_under_load_and_back_down(server):
    _wait(lambda: running_replicas() == 2, 240, "two replicas")

    async def load():
        results: list = []
        stop = asyncio.Event()

        # one client sending request after request until the third replica is up; 2,000 is only a bound (the
        # autoscaler looks back 10 s, and a fast engine had finished an earlier bound of 400 before it scaled)
        async def client_loop(client):
            while not stop.is_set() and len(results) < 2000:
                results.append(await stream(client, 64))

        async with httpx.AsyncClient(base_url=server, timeout=None) as client:
            # 10 sequences at 2 per replica: the policy wants 5, more than the 3 allowed, and gets 3
            tasks = [asyncio.create_task(client_loop(client)) for _ in range(10)]
            await asyncio.to_thread(lambda: _wait(lambda: running_replicas() == 3 or all(t.done() for t in tasks),
                                                  240, "a third replica"))
            scaled = running_replicas()
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
            return scaled, results

    scaled, results = asyncio.run(load())
    assert scaled == 3, f"no third replica after {len(results)} requests"
    assert results and all(r == (200, "done") for r in results), results
    _wait(lambda: running_replicas() == 2, 240, "the scale-down back to the floor of 2")
