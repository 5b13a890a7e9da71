"""What this CPU can do, read from /proc/cpuinfo without importing torch (the control plane sizes workers
with it before any engine starts)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature names as Linux reports them (`flags` on x86, `Features` on ARM); empty if unknown."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX), so bf16 is the fast dtype and what
    dtype "auto" picks."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
