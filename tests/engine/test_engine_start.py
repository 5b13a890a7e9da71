"""A slow engine start is reported, not waited on in silence, and its limit is a setting
(`engine_start_timeout_s`: flag, env var, config file)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest
import zmq

from servelm.worker import messages as m


def test_start_timeout_is_a_setting_with_every_source(tmp_path):
    from servelm.config.engine import ConfigError
    from servelm.config.settings import load

    assert load({}, env={}).server.lifecycle_config.engine_start_timeout_s == 600.0
    f = tmp_path / "c.yaml"
    f.write_text("server:\n  engine_start_timeout_s: 900\n")
    assert load({}, env={}, file=str(f)).server.lifecycle_config.engine_start_timeout_s == 900.0
    cfg = load({}, env={"SERVELM_ENGINE_START_TIMEOUT_S": "0"}, file=str(f))
    assert cfg.server.lifecycle_config.engine_start_timeout_s == 0.0 and cfg.sources["lifecycle.engine_start_timeout_s"] == "env"
    assert load({"engine_start_timeout_s": 30.0}, env={"SERVELM_ENGINE_START_TIMEOUT_S": "0"}).server \
        .lifecycle_config.engine_start_timeout_s == 30.0
    with pytest.raises(ConfigError, match="engine_start_timeout_s"):
        load({"engine_start_timeout_s": -1.0}, env={})


class _Loading:
    """An engine process that is alive and never gets ready (as one stuck on a lock or a long build)."""

    pid = 4242
    exitcode = None

    def __init__(self) -> None:
        self._never, self._w = os.pipe()  # the exit sentinel: never readable, as a live process's

    @property
    def sentinel(self) -> int:
        return self._never

    def start(self) -> None: ...
    def is_alive(self) -> bool: return True
    def join(self, timeout=None) -> None: ...
    def kill(self) -> None: ...


def test_a_slow_start_logs_what_the_engine_is_doing_then_gives_up_naming_the_setting(caplog):
    from servelm.config.engine import EngineConfig
    from servelm.worker.client import AsyncEngine, EngineStartError

    class Engine(AsyncEngine):
        def _new_process(self):
            return _Loading()

    async def scenario():
        t0 = time.monotonic()
        engine = Engine(EngineConfig(), start_timeout=600.0, progress_every_s=0.05)
        engine.launch()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(engine._out_addr)
        push.send(m.encoder.encode(m.Starting("loading the model tiny")))
        for _ in range(500):  # the output loop picks the phase up
            if engine.phase == "loading the model tiny":
                break
            await asyncio.sleep(0.01)
        engine.start_timeout = time.monotonic() - t0 + 1.0  # counted from the launch: about 1 s from now
        try:
            with pytest.raises(EngineStartError) as err:
                await engine.wait_ready()
        finally:
            push.close(0)
            await engine.shutdown()
        return str(err.value)

    with caplog.at_level(logging.INFO, logger="servelm.server"):
        message = asyncio.run(scenario())
    assert "did not become ready within" in message and "loading the model tiny" in message
    assert "--engine-start-timeout-s" in message and "SERVELM_ENGINE_START_TIMEOUT_S" in message
    progress = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert progress and all("pid 4242" in p and "loading the model tiny for" in p for p in progress)


def test_serve_gives_up_in_one_line_after_the_start_timeout():
    r = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "serve", "--port", "0",
                        "--embedding-model", "none", "--engine-start-timeout-s", "0.01"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "SERVELM_CPU_KERNELS": "0"})
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("servelm: error:") and "did not become ready within 0.01s" in last
    assert "--engine-start-timeout-s" in last
