"""`servelm chat` in a real terminal (a pty): Ctrl-C during a reply stops it and returns to the prompt, as
Ollama does; Ctrl-C or Ctrl-D at the prompt quits with exit code 0 and no traceback."""

from __future__ import annotations

import os
import signal
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = "\r\n> "
STOPPED = "\r\n[stopped]\r\n> "  # a reply cut short, then the prompt (reply text may hold "> ")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tokenizer_dir):
    """A one-layer random Llama with a 64k context: a reply of 60000 tokens would run for minutes, so a
    test that gets its prompt back only did so because Ctrl-C stopped the reply."""
    import torch
    from tiny_models import COMMON
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 1 << 16})
    out = tmp_path_factory.mktemp("chat-model")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def _chat(model, sigint_ignored: bool = False) -> pexpect.spawn:
    args = ["-m", "servelm.entrypoints.cli", "chat", "--model", str(model), "--dtype", "float32",
            "--temperature", "0", "--max-tokens", "60000", "--ignore-eos"]
    env = {**os.environ, "SERVELM_CPU_KERNELS": "0"}
    # every expect waits for an event that comes (the prompt, the echo, the reply, the exit); the timeout only
    # ends a hang, so it sits far beyond how slow a loaded 2-core machine can be
    # started with SIGINT ignored, as a shell starts a background job (and as some test runners' workers are)
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=900, dimensions=(40, 200),
                          preexec_fn=ignore)
    child.expect_exact("> ")  # loaded, at the prompt
    return child


def _reply_started(child, message: str) -> None:
    child.sendline(message)
    child.expect_exact(message + "\r\n")  # the terminal's echo
    child.expect(r"\S{5}")  # the reply is streaming


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored-at-start"])
def test_ctrl_c_stops_a_reply_and_ctrl_c_at_the_prompt_quits(long_model, sigint_ignored):
    child = _chat(long_model, sigint_ignored)
    try:
        _reply_started(child, "hello")
        child.sendintr()
        child.expect_exact(STOPPED)  # back at the prompt, the reply cut short
        _reply_started(child, "and again")  # the engine serves the next message after the abort
        child.sendintr()
        child.expect_exact(STOPPED)
        child.sendintr()  # at the prompt: quit
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
    finally:
        child.close(force=True)


def test_ctrl_d_at_the_prompt_quits(long_model):
    child = _chat(long_model)
    try:
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
    finally:
        child.close(force=True)
