"""Where the engine's compute runs: torch's thread count and the CPUs it is bound to."""

from __future__ import annotations

import os

import torch

from servelm.config.engine import EngineConfig, cpu_list


def configure_threads(config: EngineConfig, rank: int = 0) -> None:
    """Binds this process to `cpu_bind` (one thread per CPU unless `num_threads` says otherwise), then
    sets torch's thread count. Binding keeps a compute thread off a CPU that another process or a slow
    neighbour holds: on a shared host the vCPUs slow down at different times (BENCHMARKS.md). With tensor
    parallelism each rank (`rank` of them) takes its own equal share of the `cpu_bind` CPUs, or by default a
    thread count of its share of this process's CPUs: ranks that each ran one thread per CPU would fight over
    them."""
    threads = config.device_config.num_threads
    size = config.parallel_config.tensor_parallel_size
    if config.device_config.cpu_bind is not None:
        cpus = cpu_list(config.device_config.cpu_bind)
        if size > 1 and len(cpus) >= size:
            share = len(cpus) // size
            cpus = cpus[rank * share:(rank + 1) * share]
        os.sched_setaffinity(0, cpus)
        threads = threads or len(cpus)
    elif size > 1 and threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) // size)
    if threads is not None:
        torch.set_num_threads(threads)
