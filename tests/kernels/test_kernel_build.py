"""The C++ kernels are built at install time, one library per instruction-set variant, and the loader picks
the best one the CPU can execute: no compile at start, no variant this CPU lacks, no `-march=native` in
an artefact, and a clear PyTorch fallback where nothing fits. The kernel tests themselves run against
each variant this CPU can execute (test_each_variant_passes_the_kernel_tests)."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servelm.model.kernels import build as kernel_build
from servelm.model.kernels import cpu as cpu_kernels

X86 = platform.machine() in ("x86_64", "AMD64")
FLAGS = cpu_kernels.cpu_flags()
MANIFEST = cpu_kernels.manifest()
needs_build = pytest.mark.skipif(MANIFEST is None, reason="kernels not built (install servelm first)")
V4 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "avx512f", "avx512bw", "avx512cd", "avx512dq",
      "avx512vl"}
ALL = ["amx", "avx512bf16", "avx2", "portable"]


@pytest.mark.parametrize(("flags", "expected"), [
    (V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),  # Sapphire Rapids and later
    (V4 | {"avx512_bf16"}, "avx512bf16"),  # Zen 4/5, Cooper Lake
    (V4, "avx2"),  # Skylake-X: AVX512 but no bf16 dot products
    ({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}, "avx2"),
    ({"avx", "avx2", "fma"}, "portable"),  # an AVX2 CPU missing part of x86-64-v3
    (set(), "portable"),
])
def test_dispatcher_takes_the_best_variant_the_cpu_has_every_feature_of(flags, expected):
    assert cpu_kernels.choose_variant(ALL, frozenset(flags), machine="x86_64")[0] == expected


def test_dispatcher_refuses_a_variant_the_cpu_lacks_and_skips_unbuilt_ones():
    name, why = cpu_kernels.choose_variant(ALL, frozenset(V4), "amx", machine="x86_64")
    assert name is None and "amx_bf16" in why and "avx512_bf16" in why
    name, why = cpu_kernels.choose_variant(["avx2", "portable"], frozenset(V4 | {"avx512_bf16"}), machine="x86_64")
    assert name == "avx2"  # a variant that failed to build is passed over
    assert cpu_kernels.choose_variant([], frozenset(V4), machine="x86_64")[0] is None
    assert cpu_kernels.choose_variant(ALL, frozenset(), "sse9", machine="x86_64")[0] is None
    # ARM: the portable build only, whatever the CPU reports
    assert cpu_kernels.choose_variant(["portable"], frozenset({"asimd"}), machine="aarch64")[0] == "portable"


def test_no_variant_is_tuned_to_the_build_machine():
    for v in (*kernel_build.X86_64, *kernel_build.OTHER):
        assert not any("native" in f for f in (*v.flags, *kernel_build.COMMON_FLAGS)), v


def test_build_key_covers_sources_compiler_and_flags(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(kernel_build.SRC_DIR, src)
    key = kernel_build.build_key(src)
    assert kernel_build.build_key(src) == key  # stable: two installs of the same build share it
    (src / "argmax.cpp").write_text((src / "argmax.cpp").read_text() + "\n// changed\n")
    assert kernel_build.build_key(src) != key
    changed = kernel_build.build_key(src)
    monkeypatch.setattr(kernel_build, "COMMON_FLAGS", [*kernel_build.COMMON_FLAGS, "-DSOMETHING"])
    assert kernel_build.build_key(src) != changed
    monkeypatch.setattr(kernel_build, "compiler", lambda: "/usr/bin/false")
    assert kernel_build.build_key(src) != changed


@pytest.fixture
def fresh_loader(monkeypatch):
    """cpu_kernels.load() as in a new process; compiling at run time fails the test."""
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(kernel_build, "build", lambda *a, **k: pytest.fail("load() must never compile"))
    return monkeypatch


def test_an_unbuilt_checkout_runs_on_the_pytorch_path_and_says_so(fresh_loader, tmp_path, caplog):
    fresh_loader.setattr(kernel_build, "OUT_DIR", tmp_path / "none")
    fresh_loader.setattr(cpu_kernels, "manifest", lambda lib_dir=tmp_path / "none": None)
    with caplog.at_level(logging.WARNING, logger="servelm.model.kernels.cpu"):
        assert cpu_kernels.load() is None
        assert cpu_kernels.load() is None  # decided once
    assert len(caplog.records) == 1 and "servelm.model.kernels.build" in caplog.text and "PyTorch path" in caplog.text


@needs_build
def test_libraries_built_from_other_sources_are_not_loaded(fresh_loader, caplog):
    fresh_loader.setattr(kernel_build, "source_digest", lambda src_dir=None: "something-else")
    with caplog.at_level(logging.WARNING, logger="servelm.model.kernels.cpu"):
        assert cpu_kernels.load() is None
    assert "other sources" in caplog.text


@needs_build
def test_env_var_picks_a_variant_and_refuses_one_the_cpu_lacks(fresh_loader, caplog):
    fresh_loader.setenv("SERVELM_CPU_KERNELS", "portable")
    assert cpu_kernels.load().variant == "portable"
    if X86 and not {"amx_tile", "amx_bf16"} <= FLAGS:
        fresh_loader.setattr(cpu_kernels, "_tried", False)
        fresh_loader.setenv("SERVELM_CPU_KERNELS", "amx")
        with caplog.at_level(logging.WARNING, logger="servelm.model.kernels.cpu"):
            assert cpu_kernels.load() is None
        assert "lacks" in caplog.text


@needs_build
@pytest.mark.skipif(MANIFEST is None or "avx512bf16" not in MANIFEST["built"] or "avx512_bf16" not in FLAGS,
                    reason="needs the AVX512-BF16 build and a CPU that runs it")
def test_env_var_picks_how_bf16_pairs_multiply(fresh_loader):
    """SERVELM_CPU_BF16_DOT forces either vendor's form on this CPU (the library's switch is per process)."""
    before = cpu_kernels.load_variant("avx512bf16").bf16_dot()
    fresh_loader.setenv("SERVELM_CPU_KERNELS", "avx512bf16")
    try:
        for mode in ("fma", "bf16", "fma"):
            fresh_loader.setattr(cpu_kernels, "_tried", False)
            fresh_loader.setenv("SERVELM_CPU_BF16_DOT", mode)
            assert cpu_kernels.load().bf16_dot() == mode
        fresh_loader.setattr(cpu_kernels, "_tried", False)
        fresh_loader.setenv("SERVELM_CPU_BF16_DOT", "fp16")
        for _ in range(2):  # refused at every load
            with pytest.raises(ValueError, match="auto, bf16 or fma"):
                cpu_kernels.load()
    finally:
        cpu_kernels.load_variant("avx512bf16").set_bf16_dot(before)


@needs_build
@pytest.mark.skipif(not X86 or kernel_build.compiler() is None, reason="needs an x86-64 C++ toolchain")
def test_every_x86_variant_builds_here():
    """On x86-64 with a compiler, the install builds every variant (a failure would silently move the engine
    onto the PyTorch path, as happened once when an AMX-only constant leaked into shared code)."""
    assert MANIFEST["built"] == [v.name for v in kernel_build.X86_64], MANIFEST["failed"]


@needs_build
def test_each_variant_reports_the_paths_it_offers():
    for name in MANIFEST["built"]:
        k = cpu_kernels.load_variant(name)
        avx512 = name in ("amx", "avx512bf16")
        assert k.avx512_bf16 == avx512 and k.avx512_linear_supported(64) == avx512, name
        assert k.amx_linear_supported(64) == (name == "amx" and {"amx_tile", "amx_bf16"} <= FLAGS), name
        assert k.bf16_dot() in (("fma", "bf16") if avx512 else ("none",))


@needs_build
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_lower_variants_hold_no_instructions_beyond_their_level():
    """A library for CPUs without AVX512 holds no AVX512 instruction (zmm registers), and the portable one
    no AVX at all (ymm): on another CPU it can never die of SIGILL."""
    for name, banned in (("avx2", ("%zmm",)), ("portable", ("%ymm", "%zmm"))):
        if name not in MANIFEST["built"]:
            continue
        lib = kernel_build.OUT_DIR / kernel_build.library_name(name)
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                             check=True).stdout
        bad = [line for line in asm.splitlines() if any(b in line for b in banned)]
        assert not bad, f"{name}: {bad[:3]}"


@needs_build
def test_each_variant_passes_the_kernel_tests():
    """The kernel test files, and the mixed-schedule invariance test on the default paths and one format of
    each kernel family (tests marked every_variant), once per variant this CPU can execute other than the
    default one (which the rest of the suite runs): the AVX512-without-AMX (AMD Zen 4/5) and AVX2 paths get
    tested on AMX machines too."""
    default, _ = cpu_kernels.choose_variant(MANIFEST["built"], FLAGS)
    others = [v for v in MANIFEST["built"] if v != default and cpu_kernels.choose_variant([v], FLAGS, v)[0]]
    if not others:
        pytest.skip("this CPU runs only the default variant")
    tests = [str(Path(__file__).parents[1] / f) for f in ("kernels/test_cpu_kernels.py", "kernels/test_fused_kernels.py",
                                                          "model/test_attention.py", "engine/test_invariance.py",
                                                          "engine/test_sampler_distribution.py")]
    for name in others:
        env = {**os.environ, "SERVELM_CPU_KERNELS": name}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests,
                               "-k", "not without_kernels and (not test_invariance or every_variant)"],
                              env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"variant {name}:\n{proc.stdout[-3000:]}"
        assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]


def test_a_machine_without_a_compiler_installs_and_runs_the_pytorch_path(monkeypatch, tmp_path, caplog):
    """No compiler: the build records every variant as failed (the install goes on), and the loader says
    once why it runs the PyTorch path, naming the failure."""
    monkeypatch.setattr(kernel_build, "compiler", lambda: None)
    manifest = kernel_build.build(tmp_path, log=lambda *_: None)
    assert manifest["built"] == [] and all("no C++ compiler" in why for why in manifest["failed"].values())
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(kernel_build, "build", lambda *a, **k: pytest.fail("load() must never compile"))
    monkeypatch.setattr(cpu_kernels, "manifest", lambda lib_dir=None: manifest)
    with caplog.at_level(logging.WARNING, logger="servelm.model.kernels.cpu"):
        assert cpu_kernels.load() is None
    assert "no C++ compiler" in caplog.text and "PyTorch path" in caplog.text


@needs_build
def test_a_build_with_the_installed_key_copies_the_installed_libraries(tmp_path, monkeypatch):
    """`pip wheel .` after `pip install -e .`: nothing to compile, the same libraries; a build whose key
    differs (other sources, compiler or flags) compiles."""
    if MANIFEST["failed"] or MANIFEST["key"] != kernel_build.build_key():
        pytest.skip("the installed kernels are not a complete build of these sources")
    monkeypatch.setattr(kernel_build, "_run", lambda cmd: pytest.fail(f"compiled: {cmd}"))
    manifest = kernel_build.build(tmp_path / "a", log=lambda *_: None)
    assert manifest["built"] == MANIFEST["built"] and manifest["reused"]
    for name in manifest["built"]:
        lib = kernel_build.library_name(name)
        assert (tmp_path / "a" / lib).read_bytes() == (kernel_build.OUT_DIR / lib).read_bytes()
    monkeypatch.setattr(kernel_build, "COMMON_FLAGS", [*kernel_build.COMMON_FLAGS, "-DSOMETHING"])
    with pytest.raises(pytest.fail.Exception, match="compiled"):
        kernel_build.build(tmp_path / "b", log=lambda *_: None)


@pytest.mark.skipif(not X86 or kernel_build.compiler() is None, reason="needs an x86-64 C++ toolchain")
def test_the_wheel_carries_every_variant_and_is_a_platform_wheel(tmp_path):
    """`pip wheel .` builds the kernels into the wheel (no compile left for the first start), tagged for the
    platform since it holds native libraries."""
    import zipfile

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, text=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = tmp_path.glob("servelm-*.whl")
    assert not wheel.name.endswith("-none-any.whl") and "linux_x86_64" in wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for v in kernel_build.X86_64:
        assert f"servelm/model/kernels/lib/{kernel_build.library_name(v.name)}" in names
    assert "servelm/model/kernels/lib/manifest.json" in names
