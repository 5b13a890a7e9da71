"""`servelm serve` starts its engine process before anything heavy: the API side's imports up to the
engine launch must not pull in torch or transformers (each costs seconds of start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from serving import pid_alive


def test_api_side_imports_stay_light():
    code = ("import sys, servelm, servelm.entrypoints.cli, servelm.server.serve, servelm.worker.client; "
            "servelm.entrypoints.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_package_exports_still_resolve():
    import servelm

    assert servelm.LLM.__name__ == "LLM" and servelm.SamplingParams.__name__ == "SamplingParams"
    assert set(servelm.__all__) <= set(dir(servelm)) | set(servelm._LAZY) | {"__version__"}


_ORPHAN_SCRIPT = """
import multiprocessing, time

def child(started):
    from servelm.worker.process import _exit_with_parent
    _exit_with_parent(0.05)
    started.set()
    time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    p = ctx.Process(target=child, args=(started,))
    p.start()
    print(p.pid, started.wait(60), flush=True)
    time.sleep(120)
"""


def test_engine_process_exits_when_its_parent_is_killed(tmp_path):
    """SIGKILL of the API process must not leave the engine process running on its own."""
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT)
    import servelm

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(servelm.__file__))}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid, started = parent.stdout.readline().split()
        child = int(pid)
        assert started == "True", "the child did not start"
        assert pid_alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()


def _modules_after(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code + "; import sys; print(sorted(m for m in "
                          "('torch', 'torch._dynamo', 'transformers', 'transformers.modeling_utils') if m in sys.modules))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_api_side_tokenizer_needs_neither_torch_nor_model_classes(llama_dir):
    # SmolLM2-style folder (llama, TokenizersBackend): the API process builds the tokenizer only.
    code = (f"from servelm.model.loading.metadata import load_tokenizer, resolve_model; "
            f"load_tokenizer(resolve_model({str(llama_dir)!r}))")
    assert _modules_after(code) == "['transformers']"


def test_engine_side_load_skips_transformers(llama_dir):
    # The engine process loads weights, config and EOS ids; transformers (2-4 s of imports) stays out.
    code = (f"from servelm.model.loading.loader import load_model; "
            f"m = load_model({str(llama_dir)!r}, dtype='float32', with_tokenizer=False); "
            f"assert m.tokenizer is None and m.eos_token_ids")
    assert _modules_after(code) == "['torch']"
