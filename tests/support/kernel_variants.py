"""The C++ kernel builds this CPU can run, as pytest parameters: a test over them checks every build's code
path (AMX, AVX512-BF16, AVX2, portable) on one machine, where the process loads only the best one."""

from __future__ import annotations

import pytest

from servelm.model.kernels import build as kernel_build
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.kernels.cpu_features import cpu_flags


def runnable_variants() -> list:
    """Every built variant this CPU can run, best first."""
    found = cpu_kernels.manifest() or {}
    table = {v.name: v for v in kernel_build.variants()}
    return [pytest.param(name, id=name) for name in ("amx", "avx512bf16", "avx2", "portable")
            if name in found.get("built", []) and set(table[name].requires) <= cpu_flags()]
