"""Builds servelm's C++ CPU kernels: one shared library per instruction-set variant, compiled with plain
`c++` (no PyTorch headers, so a unit compiles in seconds), at install time by setup.py and by
`python -m servelm.model.kernels.build` in a source checkout. At run time `cpu_kernels` loads the best
variant this CPU can execute. Standard library only: setup.py imports this file in pip's bare build
environment.

Never `-march=native`: a library built on one machine must run on any other of its architecture, so each
variant names its instruction sets, and the loader checks the CPU has every one before it loads it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SRC_DIR = Path(__file__).parent / "csrc"
OUT_DIR = Path(__file__).parent / "lib"  # what setup.py and an in-place build write; shipped in the wheel
MANIFEST = "manifest.json"

# No -ffast-math: the kernels promise PyTorch's exact results, and fast-math turns x / y into an approximate
# reciprocal and folds NaN checks away. (A per-file `#pragma GCC optimize("no-fast-math")` instead stopped
# the vec.h helpers from inlining and made the elementwise kernels 3x slower.) `omp simd reduction` still
# vectorizes the attention kernel's sums. -fopenmp links libgomp.so.1, the soname of the copy PyTorch
# loads, so the kernels share PyTorch's thread pool and torch.set_num_threads applies to them.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"]

_X86_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")  # /proc/cpuinfo names of x86-64-v3
_X86_V4 = (*_X86_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its compiler flags and the CPU features (as /proc/cpuinfo names them) that
    a machine must have to run it. Variants are listed best first."""

    name: str
    flags: tuple[str, ...]
    requires: tuple[str, ...]


X86_64 = (
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
            (*_X86_V4, "avx512_bf16", "amx_tile", "amx_bf16")),
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), (*_X86_V4, "avx512_bf16")),
    Variant("avx2", ("-march=x86-64-v3",), _X86_V3),
    Variant("portable", ("-march=x86-64", "-mtune=generic"), ()),
)
OTHER = (Variant("portable", (), ()),)  # ARM and the rest: the compiler's baseline; the x86 code is guarded


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built for this machine architecture, best first."""
    machine = machine or platform.machine()
    return X86_64 if machine in ("x86_64", "AMD64") else OTHER


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++ / g++ / clang++ from PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def source_files(src_dir: Path = SRC_DIR) -> list[Path]:
    return sorted(src_dir.glob("*.cpp")) + sorted(src_dir.glob("*.h"))


def source_digest(src_dir: Path = SRC_DIR) -> str:
    """A hash of the kernel sources: the loader refuses libraries built from other sources (their C
    signatures may differ from kernels/ops.py's)."""
    digest = hashlib.sha256()
    for f in source_files(src_dir):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def build_key(src_dir: Path = SRC_DIR) -> str:
    """What determines a build: the sources, the compiler (path and version) and the flags of every
    variant. Two builds with the same key are interchangeable; anything else is rebuilt."""
    cxx = compiler() or ""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout if cxx else ""
    parts = [source_digest(src_dir), cxx, version, COMMON_FLAGS, [(v.name, v.flags) for v in variants()]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def library_name(variant: str) -> str:
    return f"libservelm_{variant}.so"


def _run(cmd: list[str]) -> str | None:
    """Runs a compiler command; None on success, else its last lines of output."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return "\n".join(lines[-15:]) or f"exit code {proc.returncode}"


def _link(variant: Variant, objs: list[Path], out_dir: Path, cxx: str) -> str | None:
    """Links one variant's objects into its library in out_dir; None on success, else why it failed."""
    target = out_dir / library_name(variant.name)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    err = _run([cxx, "-shared", "-fopenmp", *variant.flags, "-o", str(tmp), *map(str, objs)])
    if err is None:
        os.replace(tmp, target)  # atomic: a process loading it never sees half a file
    return err


def _reuse(out_dir: Path, manifest: dict) -> dict | None:
    """A build with the key of the one already in the package folder (`pip wheel .` after `pip install -e .`)
    copies its libraries instead of compiling them again: same sources, compiler and flags give the same
    libraries. None when there is nothing to reuse."""
    try:
        if out_dir.resolve() == OUT_DIR.resolve():
            return None
        have = json.loads((OUT_DIR / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    libs = [OUT_DIR / library_name(n) for n in have.get("built", [])]
    if (have.get("key"), have.get("machine")) != (manifest["key"], manifest["machine"]) or have.get("failed") \
            or not libs or not all(f.is_file() for f in libs):
        return None
    for f in libs:
        tmp = out_dir / f"{f.name}.{os.getpid()}.tmp"
        shutil.copyfile(f, tmp)
        os.replace(tmp, out_dir / f.name)
    reused = {**manifest, "built": list(have["built"]), "seconds": 0.0, "reused": True}
    (out_dir / MANIFEST).write_text(json.dumps(reused, indent=1))
    return reused


def build(out_dir: Path = OUT_DIR, src_dir: Path = SRC_DIR, names: list[str] | None = None,
          jobs: int | None = None, log=print, machine: str | None = None) -> dict:
    """Builds the variants (all of this architecture's, or `names`) into out_dir and writes its manifest:
    {key, sources, built: [names], failed: {name: reason}}. A variant that cannot build (an old compiler,
    another architecture) is recorded as failed, never retried at run time. `machine` (default: this one)
    with $CXX a cross compiler checks the build for another architecture."""
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine or platform.machine()
    chosen = [v for v in variants(machine) if names is None or v.name in names]
    manifest: dict = {"key": build_key(src_dir), "sources": source_digest(src_dir), "machine": machine,
                      "built": [], "failed": {}}
    if names is None and (reused := _reuse(out_dir, manifest)) is not None:
        log(f"servelm kernels: reused {', '.join(reused['built'])} from {OUT_DIR} (same build key)")
        return reused
    cxx = compiler()
    if cxx is None:
        manifest["failed"] = {v.name: "no C++ compiler (set CXX or install g++)" for v in chosen}
        chosen = []
    t0 = time.monotonic()
    units = sorted(src_dir.glob("*.cpp"))
    with tempfile.TemporaryDirectory(prefix="servelm-kernels-") as tmp:
        # every unit of every variant in one pool, largest first, so that the cores stay busy to the end
        jobs_list = [(v, u, Path(tmp) / f"{v.name}-{u.stem}.o") for v in chosen for u in units]
        jobs_list.sort(key=lambda j: -j[1].stat().st_size)
        with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            errors = list(pool.map(lambda j: _run([cxx, *COMMON_FLAGS, *j[0].flags, f"-I{src_dir}", "-c", str(j[1]),
                                                   "-o", str(j[2])]), jobs_list))
        for v in chosen:
            err = next((f"{u.name}: {e}" for (w, u, _), e in zip(jobs_list, errors, strict=True) if w is v and e), None)
            err = err or _link(v, [o for w, _, o in jobs_list if w is v], out_dir, cxx)
            if err:
                manifest["failed"][v.name] = err
                log(f"servelm kernels: variant {v.name} did not build:\n{err}")
            else:
                manifest["built"].append(v.name)
    manifest["seconds"] = round(time.monotonic() - t0, 1)
    log(f"servelm kernels: built {', '.join(manifest['built']) or 'no variant'} in {manifest['seconds']}s")
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build servelm's C++ CPU kernels (every variant of this "
                                 "architecture) into servelm/model/kernels/lib, as `pip install` does.")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output folder (default: %(default)s)")
    ap.add_argument("--variant", action="append", help="build only this variant (repeatable)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    args = ap.parse_args(argv)
    manifest = build(args.out, names=args.variant, jobs=args.jobs)
    print(json.dumps(manifest, indent=1))
    return 0 if manifest["built"] else 1


if __name__ == "__main__":
    sys.exit(main())
