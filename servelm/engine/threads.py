"""Where the engine's compute runs: torch's thread count and the CPUs it is bound to."""

from __future__ import annotations

import os

import torch

from servelm.config.engine import EngineConfig, cpu_list


def configure_threads(config: EngineConfig) -> None:
    """Binds this process to `cpu_bind` (one thread per CPU unless `num_threads` says otherwise), then
    sets torch's thread count. Binding keeps a compute thread off a CPU that another process or a slow
    neighbour holds: on a shared host the vCPUs slow down at different times (BENCHMARKS.md)."""
    threads = config.num_threads
    if config.cpu_bind is not None:
        cpus = cpu_list(config.cpu_bind)
        os.sched_setaffinity(0, cpus)
        threads = threads or len(cpus)
    if threads is not None:
        torch.set_num_threads(threads)
