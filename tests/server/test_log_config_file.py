"""--log-config-file (vLLM's): the operator's logging configuration, applied in the server, its engine process and
uvicorn. A real server whose file sends servelm's lines to one file in its own format, the request log to
another, and uvicorn's start line to the first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from serving import _wait, start_server, stop_server

from servelm.config.engine import ConfigError
from servelm.config.settings import load


def _config(tmp_path: Path) -> Path:
    lines, requests = tmp_path / "servelm.log", tmp_path / "requests.log"
    cfg = {
        "version": 1,
        "formatters": {"tagged": {"format": "TAGGED pid=%(process)d %(name)s: %(message)s"},
                       "bare": {"format": "%(message)s"}},
        "handlers": {"lines": {"class": "logging.FileHandler", "filename": str(lines), "formatter": "tagged"},
                     "requests": {"class": "logging.FileHandler", "filename": str(requests), "formatter": "bare"}},
        "loggers": {"servelm": {"handlers": ["lines"], "level": "INFO", "propagate": False},
                    "servelm.requests": {"handlers": ["requests"], "level": "INFO", "propagate": False},
                    "uvicorn.error": {"handlers": ["lines"], "level": "INFO", "propagate": False}},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(cfg))
    return path


def test_every_process_logs_where_the_file_says(llama_dir, tmp_path):
    path = _config(tmp_path)
    proc, url = start_server(llama_dir, "--embedding-model", "none", "--log-config-file", str(path))
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       headers={"x-request-id": "logged-1"}, timeout=60)
        assert r.status_code == 200
        requests = tmp_path / "requests.log"
        line = _wait(lambda: [json.loads(x) for x in requests.read_text().splitlines() if "logged-1" in x]
                     if requests.exists() else [], 30, "the request's log line")[0]
        assert line["request_id"] == "logged-1" and line["status"] == 200
    finally:
        assert stop_server(proc) == 0
    text = (tmp_path / "servelm.log").read_text().splitlines()
    assert all(x.startswith("TAGGED pid=") for x in text)
    pids = {x.split()[1] for x in text}
    assert f"pid={proc.pid}" in pids and len(pids) >= 2, text  # the server's lines and the engine process's
    assert any("servelm.server: ready in" in x for x in text)
    assert any("uvicorn.error:" in x for x in text)  # uvicorn's own start line, at the file's INFO level
    stderr = Path(proc.log_path).read_text()
    assert "logged-1" not in stderr and "ready in" not in stderr  # nothing of it went the default way


@pytest.mark.parametrize("content, why", [("{not json", "not valid JSON"), ('{"loggers": {}}', "version"),
                                          (None, "cannot be read")])
def test_a_file_that_is_no_logging_config_stops_the_start(tmp_path, content, why):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=why):
        load({"log_config_file": str(path)}, env={})


def test_an_unusable_handler_is_one_line_at_start(llama_dir, tmp_path):
    """A configuration logging.config cannot apply (an unknown handler class) ends `serve` with exit 2 and one
    line, before any model loads."""
    import subprocess
    import sys

    path = tmp_path / "logging.json"
    path.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}},
                                "root": {"handlers": ["h"]}}))
    out = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "serve", str(llama_dir),
                          "--log-config-file", str(path), "--port", "0"], capture_output=True, text=True,
                         timeout=120, env={**os.environ})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "log config file" in out.stderr and "Traceback" not in out.stderr
