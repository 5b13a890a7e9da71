"""The server tests' own fixture: one server with gRPC, keys, an admin key and a registry, shared by
test_grpc.py and test_grpc_oip.py."""

from __future__ import annotations

import os

import pytest

RPC_KEYS = """keys:
  - {name: alice, key: sk-alice-000001}
  - {name: limited, key: sk-limited-0003, rpm: 2}
  - {name: bronze, key: sk-bronze-000006, priority: low}
  - {name: boxed, key: sk-boxed-000007, models: [another-model]}
"""
RPC_ADMIN = "sk-rpc-admin-01"


_rpc: dict = {}  # the shared gRPC server's process while it runs


@pytest.fixture(scope="session")
def rpc_server(long_llama_dir, tmp_path_factory):
    """One server with gRPC, keys, an admin key and a registry, shared by tests/server/test_grpc.py and
    tests/server/test_grpc_oip.py (one start instead of two): (process, HTTP url, gRPC address). It is stopped as
    soon as no later test needs it (pytest_runtest_teardown), not at the session's end. It serves the tiny Llama
    with the long context, so that a request the cancel test leaves is still running whenever the server notices.
    """
    from serving import HOLD_BLOCKS, HOLD_CONTEXT, _free_port, start_server, stop_server

    d = tmp_path_factory.mktemp("rpc")
    (d / "keys.yaml").write_text(RPC_KEYS)
    port = _free_port()
    proc, url = start_server(long_llama_dir, "--api-keys-file", str(d / "keys.yaml"), "--admin-key", RPC_ADMIN,
                             "--data-dir", str(d / "data"), "--num-kv-blocks", str(HOLD_BLOCKS + 64),
                             "--max-model-len", str(HOLD_CONTEXT),
                             "--model-roots", str(tmp_path_factory.getbasetemp()),  # test_grpc_oip.py models
                             env={"SERVELM_GRPC_PORT": str(port)})  # an env var: the config tree has it
    _rpc["proc"] = proc
    yield proc, url, f"127.0.0.1:{port}"
    if _rpc.pop("proc", None) is not None:
        assert stop_server(proc) == 0


def pytest_runtest_teardown(item, nextitem):
    proc = _rpc.get("proc")
    if proc is None or (nextitem is not None and "rpc_server" in nextitem.fixturenames):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under xdist a worker runs files in the order the scheduler hands them out, not the collection
        # order below, so "no later test needs it" cannot be known: the fixture stops it at the end.
        return
    items = item.session.items
    if not any("rpc_server" in later.fixturenames for later in items[items.index(item) + 1:]):
        from serving import stop_server

        del _rpc["proc"]
        assert stop_server(proc) == 0
