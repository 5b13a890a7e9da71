"""The `servelm` command line as a new user meets it: help that tells the truth, --version, and errors that
are one clear line with exit code 2."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def _subparser(name: str) -> argparse.ArgumentParser:
    from servelm.entrypoints.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _help_entries(text: str) -> dict[str, str]:
    """'--flag METAVAR' -> its help text (wrapped lines joined), from an argparse --help page."""
    entries: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            key = m.group(1).strip()
            entries[key] = (m.group(2) or "").strip()
        elif key is not None and line.startswith("    ") and line.strip():
            entries[key] = (entries[key] + " " + line.strip()).strip()
        else:
            key = None
    return entries


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_shows_the_defaults_the_command_uses_once_each(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    sub = _subparser(command)
    used = vars(sub.parse_args(["x"] if command == "generate" else []))
    entries = _help_entries(sub.format_help())
    sampling = next(g for g in sub._action_groups if g.title == "sampling")
    for action in sampling._group_actions:
        flag = action.option_strings[0]
        entry = next(v for k, v in entries.items() if k.split()[0].rstrip(",") == flag)
        assert entry and not entry.startswith("(default"), f"{flag} has no description"
    for key, text in entries.items():
        shown = re.findall(r"\(default: ([^)]*)\)", text)
        assert len(shown) <= 1, f"{key}: default printed {len(shown)} times: {text}"
        dest = next((a.dest for a in sub._actions if key.split()[0].rstrip(",") in a.option_strings), None)
        if shown and dest in used and used[dest] is not None:  # None: the help may say what it derives
            assert shown[0] == str(used[dest]), f"{key}: help says {shown[0]}, the command uses {used[dest]}"


def test_chat_defaults_are_the_chat_ones():
    from servelm.entrypoints.cli import CHAT_DEFAULTS, sampling_params_from_args

    params = sampling_params_from_args(_subparser("chat").parse_args([]))
    assert {k: getattr(params, k) for k in CHAT_DEFAULTS} == CHAT_DEFAULTS == {"max_tokens": 512, "temperature": 0.7}
    assert "(default: 0.7)" in _help_entries(_subparser("chat").format_help())["--temperature TEMPERATURE"]


def test_a_flag_left_out_takes_the_models_default_and_a_flag_given_wins():
    from servelm.entrypoints.cli import sampling_params_from_args

    model = {"temperature": 0.2, "top_k": 20, "max_tokens": 64}
    params = sampling_params_from_args(_subparser("generate").parse_args(["hi"]), model)
    assert (params.temperature, params.top_k, params.max_tokens, params.top_p) == (0.2, 20, 64, 1.0)
    given = _subparser("generate").parse_args(["hi", "--temperature", "0", "--max-tokens", "8"])
    params = sampling_params_from_args(given, model)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 20, 8)


def test_version_is_the_package_metadata_version():
    from importlib.metadata import version

    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"servelm {version('servelm')}"


QUIET = {"SERVELM_CPU_KERNELS": "0"}  # no kernel build: these starts must fail long before one matters


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_on_a_port_in_use_fails_at_once_before_the_model_loads():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _cli("serve", "--port", str(port), "--embedding-model", "none", env=QUIET)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    # one line, naming the address; nothing else ran (no engine process, no model load logged)
    assert len(lines) == 1, lines
    assert lines[0].startswith("servelm: error:") and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]


def _unsupported(tmp_path):
    bad = tmp_path / "gpt-foo"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    return [(str(bad), "'FooForCausalLM'"), (str(tmp_path / "missing"), "not found")]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_unsupported_or_missing_model_is_one_line_exit_2(command, tmp_path):
    for model, says in _unsupported(tmp_path):
        args = ["generate", "hi", "--model", model] if command == "generate" else \
            ["serve", model, "--port", str(_free_port()), "--embedding-model", "none"]
        r = _cli(*args, env=QUIET)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, r.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("servelm: error:") and says in lines[0], lines


def test_serve_model_the_engine_refuses_is_one_error_line_exit_2(tmp_path, tokenizer_dir):
    """A model that passes the file checks but that the engine process refuses (here: an activation servelm
    has no kernel for): the engine's reason as the last line, no traceback from either process."""
    import json

    from tiny_models import COMMON

    model = tmp_path / "gelu-llama"
    model.mkdir()
    for f in tokenizer_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text(json.dumps({**COMMON, "architectures": ["LlamaForCausalLM"],
                                                   "model_type": "llama", "hidden_act": "gelu",
                                                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
    r = _cli("serve", str(model), "--port", str(_free_port()), "--embedding-model", "none", "--dtype", "float32",
             env=QUIET, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("servelm: error: the engine could not start:") and "hidden_act 'gelu'" in last


@pytest.mark.parametrize("where", ["before", "after"])
def test_models_options_go_before_or_after_the_subcommand(where):
    """`servelm models --url X list` and `servelm models list --url X` are the same call: the one here reaches
    for X (a port nothing listens on) and says so, exit 1; not argparse's 'unrecognized arguments', exit 2."""
    url = f"http://127.0.0.1:{_free_port()}"
    opts = ["--url", url, "--timeout", "5"]
    r = _cli("models", *opts, "list") if where == "before" else _cli("models", "list", *opts)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("servelm: error: cannot reach") and url in r.stderr, r.stderr


def test_models_options_after_the_subcommand_win_and_left_out_ones_keep_their_value():
    from servelm.entrypoints.cli import build_parser

    parser = build_parser()
    a = parser.parse_args(["models", "--url", "http://a:1", "--json", "deployments", "--url", "http://b:2"])
    assert (a.url, a.json, a.timeout) == ("http://b:2", True, 600.0)
    a = parser.parse_args(["models", "--timeout", "7", "canary", "status", "m", "--json"])
    assert (a.timeout, a.json) == (7.0, True)
