"""The C++ kernels compile on any x86-64 machine that has a compiler: a build failure would otherwise
only log a warning and silently move the engine (and every kernel test) onto the PyTorch path, as
happened on CPUs without AMX when an AMX-only constant leaked into shared code."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from servelm.model import cpu_kernels


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None
                    or shutil.which("ninja") is None, reason="needs an x86-64 C++ toolchain")
def test_kernels_compile_on_this_cpu_and_take_the_paths_it_offers():
    module = cpu_kernels.build()  # raises with the compiler's message when they do not
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    assert module.avx512_linear_supported(64) == ("avx512_bf16" in flags)
    assert module.amx_linear_supported(64) == ({"amx_tile", "amx_bf16"} <= flags)
