"""The documentation site builds with `mkdocs build --strict` (a broken link, anchor or page fails), and its
generated references (docs/gen_reference.py) cover every flag of `servelm serve`."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen_reference():
    spec = importlib.util.spec_from_file_location("servelm_docs_gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve_flags() -> set[str]:
    from servelm.entrypoints.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings if s.startswith("--")}


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _listed(text: str, flag: str) -> bool:
    return re.search(rf"`{re.escape(flag)}[ `]", text) is not None


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: `pip install -e '.[test]'` brings mkdocs-material and mkdocstrings")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index.html", "reference/cli/index.html", "reference/configuration/index.html",
                 "reference/metrics/index.html", "python-api/reference/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    api = (site / "python-api/reference/index.html").read_text()
    assert "servelm.LLM.generate" in api and "Generate completions" in api and "SamplingParams" in api


def test_references_list_every_serve_flag():
    pages = _gen_reference().pages()
    flags = _serve_flags()
    assert "--max-num-seqs" in flags and "--api-keys-file" in flags and "--no-log-requests" in flags
    cli = _section(pages["reference/cli.md"], "## servelm serve")
    assert not sorted(f for f in flags if not _listed(cli, f)), "flags missing from the CLI reference"
    config = pages["reference/configuration.md"]
    settings = flags - {"--help", "--config", "--print-config"}
    assert not sorted(f for f in settings if not _listed(config, f)), "flags missing from the configuration keys"


def test_metrics_reference_lists_the_registered_metrics():
    text = _gen_reference().pages()["reference/metrics.md"]
    for name in ("servelm:num_requests_running", "servelm:time_to_first_token_seconds", "servelm:requests_total",
                 "servelm:canary_rollbacks_total", "servelm:drift_psi", "servelm:oip_queue_depth"):
        assert f"`{name}`" in text, name
