"""llama.cpp's Hugging Face -> GGUF converter, fetched at test time (never copied into this repository).

Its source ships in the `llama-cpp-python` source package on PyPI. The first use on a machine runs
`pip download` for the pinned version (a 77 MB archive, about 30 s) into a cache folder
($SERVELM_TEST_CACHE, default ~/.cache/servelm-tests) and unpacks only the converter's Python files;
later sessions reuse them. The converter needs torch, transformers, numpy and sentencepiece (the test
extra) and its own bundled `gguf-py`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
# What the converter imports, relative to the sdist's vendor/llama.cpp.
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")


class ConverterUnavailable(RuntimeError):
    """pip could not fetch the source package (no registry reachable): tests using it skip."""


def cache_root() -> Path:
    return Path(os.environ.get("SERVELM_TEST_CACHE") or Path.home() / ".cache" / "servelm-tests")


def converter_dir() -> Path:
    """The folder holding convert_hf_to_gguf.py, fetched and unpacked once per machine."""
    root = cache_root()
    dest = root / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".llama.cpp-{LLAMA_CPP_PYTHON}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per machine, whatever runs tests beside us
        if (dest / "convert_hf_to_gguf.py").is_file():
            return dest
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            sdist = _download(Path(tmp))
            unpacked = Path(tmp) / "llama.cpp"
            _extract(sdist, unpacked)
            shutil.rmtree(dest, ignore_errors=True)
            unpacked.rename(dest)
    return dest


def _download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--retries", "2",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConverterUnavailable(f"pip could not fetch llama-cpp-python=={LLAMA_CPP_PYTHON} (the source of "
                                   f"llama.cpp's GGUF converter): {last[0]}")
    return found[0]


def _extract(sdist: Path, into: Path) -> None:
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for m in tar:
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel and m.isfile() and rel.endswith(".py") and rel.startswith(_MEMBERS):
                target = into / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(m).read())


# Runs in a child process: converts each (HF folder, output file) pair with one import of the converter.
_DRIVER = """
import sys
import convert_hf_to_gguf as c
pairs = sys.argv[1:]
for src, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", "f32"]
    c.main()
"""


def convert(folders: dict[str, Path], out_dir: Path) -> dict[str, Path]:
    """{name: HF folder} -> {name: float32 GGUF written by llama.cpp's converter}."""
    tool = converter_dir()
    out = {name: out_dir / f"{name}.gguf" for name in folders}
    args = [str(p) for name in folders for p in (folders[name], out[name])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tool), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *args], cwd=tool, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed:\n{proc.stderr[-3000:]}")
    return out
