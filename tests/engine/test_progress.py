"""Progress bars only on a terminal: server logs and CI get occasional plain log lines, never `\\r` noise."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import servelm


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_no_terminal_gives_plain_log_lines_every_interval(caplog):
    from servelm.progress import LogProgress, progress

    stream = io.StringIO()
    assert isinstance(progress(range(3), desc="x", file=stream), LogProgress)
    clock = _Clock()
    bar = LogProgress(None, desc="Loading model.safetensors", total=100, unit="tensor", every_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="servelm.progress"):
        for i in range(100):
            clock.t = i * 0.5  # 50 s in all: a line at 10, 20, 30 and 40 s, then the closing one
            bar.update(1)
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    assert lines[0].startswith("Loading model.safetensors: 21/100 tensor (21%)")
    assert lines[-1].startswith("Loading model.safetensors: done, 100 tensor in 49.5s")
    assert stream.getvalue() == "" and not any("\r" in x for x in lines)


def test_iterating_logs_once_at_the_end_and_disable_is_silent(caplog):
    from servelm.progress import progress

    with caplog.at_level(logging.INFO, logger="servelm.progress"):
        assert list(progress(range(4), desc="Generating", unit="req", file=io.StringIO())) == [0, 1, 2, 3]
        assert list(progress(range(4), desc="quiet", disable=True, file=io.StringIO())) == [0, 1, 2, 3]
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["Generating: done, 4 req"]


def test_a_terminal_gets_a_tqdm_bar():
    import os
    import pty

    from tqdm import tqdm

    from servelm.progress import progress

    primary, secondary = pty.openpty()
    with os.fdopen(secondary, "w") as term:
        bar = progress(total=2, desc="x", file=term)
        assert isinstance(bar, tqdm)
        bar.close()
    os.close(primary)


def test_every_bar_goes_through_the_helper():
    root = Path(servelm.__file__).parent
    users = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
             if re.search(r"^\s*(from tqdm|import tqdm)", p.read_text(), re.M)]
    assert users == ["progress.py"]


def test_generate_into_a_pipe_writes_log_lines_not_carriage_returns(tmp_path, tokenizer_dir):
    from tiny_models import build_model

    model = build_model("llama", tmp_path / "llama", tokenizer_dir)
    env = {"SERVELM_CPU_KERNELS": "0", "PYTHONPATH": str(Path(servelm.__file__).parent.parent)}
    import os

    r = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "generate", "a", "b", "--model", str(model),
                        "--dtype", "float32", "--max-tokens", "4", "--temperature", "0"],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stderr
    assert re.search(r"Loading model\.safetensors: done, \d+ tensor in", r.stderr)
    assert "Generating: done, 2 req in" in r.stderr
