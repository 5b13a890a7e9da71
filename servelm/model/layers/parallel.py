"""Tensor parallelism: which slice of each weight a rank keeps, and the all-reduce that joins the slices.

Megatron's split of a decoder layer over N ranks: Q/K/V and gate/up are split by output rows (each rank its
own attention heads and MLP columns: column-parallel), o_proj and down by input columns (row-parallel), so a
rank's attention and MLP need nothing from the others until their outputs, which one all-reduce each sums.
Embedding, norms and lm_head stay whole on every rank: after each all-reduce the residual stream is the same
on every rank. With fewer KV heads than ranks, each rank keeps the one KV head its query heads read (KV heads
replicated, as vLLM does).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch

from servelm.model.spec import ModelSpec

# a tensor-parallel step's collectives wait this long for a rank before failing (a dead rank fails them at once:
# its sockets close)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def backend_for(device: str | torch.device) -> str:
    """The collective backend for ranks on `device`: the one place it is chosen. NCCL on CUDA (device memory,
    NVLink/PCIe, capturable in CUDA graphs), gloo over the loopback on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Where `rank` runs: the CPU for every rank, or on CUDA the base device's index plus the rank (`cuda` is
    cuda:0), one GPU per rank."""
    d = torch.device(device)
    return "cpu" if d.type == "cpu" else f"cuda:{(d.index or 0) + rank}"


class TensorParallel:
    """This process's rank among `size` on `device`, and (once connected) the group that all-reduces over them:
    gloo on the CPU, NCCL on CUDA (`backend_for`)."""

    def __init__(self, rank: int, size: int, device: str = "cpu") -> None:
        self.rank, self.size = rank, size
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.group = None  # a ProcessGroupGloo or ProcessGroupNCCL, set by `connect`

    def connect(self, port: int, on_port: Callable[[int], None] | None = None, host: str = "127.0.0.1",
                rendezvous_timeout: timedelta = timedelta(minutes=2)) -> None:
        """Join the group whose rendezvous store rank 0 serves at host:port (rank 0 passes port 0 and gets a
        free one, which `on_port` tells the other ranks before the join). Blocks until every rank has joined."""
        import torch.distributed as dist

        store = dist.TCPStore(host, port, self.size, is_master=self.rank == 0, timeout=rendezvous_timeout,
                              wait_for_workers=False)
        if on_port is not None:
            on_port(store.port)
        if self.backend == "nccl":
            # NCCL and graph capture work on the current device: this rank's GPU from here on
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = COLLECTIVE_TIMEOUT
            self.group = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # loopback only
            opts._timeout = COLLECTIVE_TIMEOUT
            self.group = dist.ProcessGroupGloo(store, self.rank, self.size, opts)
        self._store = store  # rank 0 serves it: kept as long as the group
        # NCCL creates its communicator on the first collective, which must not be one inside a graph capture;
        # on either backend this also proves every rank can reach the others before any step runs
        self.all_reduce(torch.zeros(1, device=self.device))

    def abort(self) -> None:
        """Fail this rank's pending and later collectives (another rank is gone)."""
        if self.group is not None:
            self.group.abort()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (x itself on one rank).

        gloo (CPU): partial sums travel in float32: a bf16 sum of bf16 partials would round twice; widening
        first rounds once, at the end. NCCL (CUDA): in place in the model's dtype, as vLLM does, on the current
        stream, so that a CUDA graph captures it. NCCL does not carry a wider accumulator between ranks: each
        step of its ring adds two bf16 values and stores bf16, one rounding per step; at two ranks that is one
        add rounded once, the same value the float32 path gives."""
        if self.size == 1:
            return x
        if self.group is None:
            raise RuntimeError("tensor parallel group not connected")
        if self.backend == "nccl":
            self.group.allreduce([x]).wait()  # wait(): the current stream waits for NCCL's (captured as an edge)
            return x
        wide = x if x.dtype == torch.float32 else x.float()
        self.group.allreduce([wide]).wait()
        return wide if wide is x else wide.to(x.dtype)


def check_shardable(spec: ModelSpec, size: int) -> None:
    """Raise ValueError unless `size` ranks can split this model (the checks vLLM makes)."""
    if size == 1:
        return
    if spec.moe is not None:
        raise ValueError(f"tensor_parallel_size={size}: mixture-of-experts models ({spec.architecture}) are not "
                         "supported with tensor parallelism (their experts are not sharded)")
    if spec.whole_qk_norm:
        raise ValueError(f"tensor_parallel_size={size}: {spec.architecture}'s q/k norms span every head's "
                         "projection, which tensor-parallel ranks split; serve it on one rank")
    if spec.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv >= size and kv % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {kv} KV heads")
    if kv < size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} must be a multiple of the model's {kv} KV heads when it "
                         "exceeds them (each KV head is then replicated on size/num_kv_heads ranks)")
    if spec.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's MLP intermediate size "
                         f"{spec.intermediate_size}")


def local_spec(spec: ModelSpec, rank: int, size: int) -> ModelSpec:
    """The spec of one rank's shard: its heads, KV heads and MLP columns."""
    if size == 1:
        return spec
    return dataclasses.replace(spec, num_heads=spec.num_heads // size,
                               num_kv_heads=max(1, spec.num_kv_heads // size),
                               intermediate_size=spec.intermediate_size // size)


def kv_heads(spec: ModelSpec, rank: int, size: int) -> range:
    """The model's KV heads that rank keeps: those its query heads read."""
    per_rank = max(1, spec.num_kv_heads // size)
    group = spec.num_heads // spec.num_kv_heads  # query heads per KV head
    first = rank * (spec.num_heads // size) // group
    return range(first, first + per_rank)


_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t[lo:hi].clone()  # a copy: the whole tensor is freed as soon as the loader drops it


def shard_tensor(name: str, t: torch.Tensor, spec: ModelSpec, rank: int, size: int) -> torch.Tensor | None:
    """Rank's part of one checkpoint tensor (the whole tensor where it is replicated; None where this rank
    must not have it: a row-parallel bias, added once, on rank 0)."""
    m = _LAYER.fullmatch(name)
    if size == 1 or m is None:
        return t
    part = m.group(1)
    d = spec.head_dim
    q_rows = (rank * spec.num_heads // size * d, (rank + 1) * spec.num_heads // size * d)
    kvh = kv_heads(spec, rank, size)
    kv_rows = (kvh.start * d, kvh.stop * d)
    inter = spec.intermediate_size // size
    mlp_rows = (rank * inter, (rank + 1) * inter)
    if part.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
        return _rows(t, *(q_rows if part.startswith("self_attn.q_proj.") else kv_rows))
    if part.startswith("self_attn.qkv_proj."):  # Phi-3: [q; k; v] in one tensor
        q, k, v = t.split([spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d])
        return torch.cat([q[slice(*q_rows)], k[slice(*kv_rows)], v[slice(*kv_rows)]])
    if part.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return _rows(t, *mlp_rows)
    if part.startswith("mlp.gate_up_proj."):  # Phi-3: [gate; up]
        gate, up = t.chunk(2)
        return torch.cat([gate[slice(*mlp_rows)], up[slice(*mlp_rows)]])
    if part in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        lo, hi = q_rows if part.startswith("self_attn") else mlp_rows
        return t[:, lo:hi].contiguous()
    if part in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        return t if rank == 0 else None
    if part in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and t.numel() != d:
        raise ValueError(f"{name}: a q/k norm over whole projections ({t.numel()} wide) cannot be split over "
                         "tensor-parallel ranks")
    return t  # norms (per head or per hidden unit)


def shard_tensors(tensors: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, rank: int, size: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as rank keeps them, one at a time as they load."""
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: quantized GGUF tensors cannot be split over tensor-parallel ranks "
                             "(use quantization none, int8 or int4)")
        part = shard_tensor(name, t, spec, rank, size)
        if part is not None:
            yield name, part
