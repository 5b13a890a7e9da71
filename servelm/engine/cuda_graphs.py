"""CUDA graphs for decode steps: the model's forward pass and its logits, captured once per batch size.

A decode step of a small model on a GPU is mostly kernel launches (a few hundred per step, each a few
microseconds of CPU time); replaying a captured graph issues them all at once. Graphs replay fixed
addresses and shapes, so every input of a captured step lives in a static buffer: token ids, positions, the
attention metadata (block tables padded to the longest context) and whatever the attention backend derives
from it. A step of n decodes runs the graph of the smallest captured size >= n; the padding rows decode a
dummy token whose key and value land in a spare KV block that no sequence owns.

With tensor parallelism every rank captures the same sizes in the same order (the all-reduces inside the
graphs are NCCL collectives that must pair up across ranks) and each step replays the same size on every
rank: the worker ranks get the driver's unpadded decode inputs and pad them here as the driver does.

The same padded static-buffer path runs without capture on the CPU (`capture=False`), which is how CI
checks its padding and metadata against the eager path; on the GPU `tests/gpu/test_gpu.py` checks replays.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from servelm.model.attention import AttentionMetadata
from servelm.model.decoder import DecoderLM

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: every power of two to 16, then steps of 16 to 256 (as vLLM does, coarser)."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, 256)]


class DecodeGraphs:
    def __init__(self, model: DecoderLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks: int, spare_block: int, sizes: list[int], capture: bool, with_logits: bool = True
                 ) -> None:
        """`with_logits` False: the graphs end at the hidden states (a tensor-parallel worker rank, whose
        logits nobody reads: the driver alone samples)."""
        self.model = model
        self.with_logits = with_logits
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.spare_block = spare_block
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.device = model.embed.device
        n = self.max_size
        # the largest size's buffers; each size's graph reads a leading slice of them
        self.ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.long, device=self.device)
        self.meta = self._padded_meta([], [], [], n).to(self.device)  # on the CPU, the host tensors
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        if capture:
            self._capture()

    # -- metadata ----------------------------------------------------------------------------------------
    def _padded_meta(self, slots: list[int], tables: list[list[int]], lens: list[int], size: int
                     ) -> AttentionMetadata:
        """A step's decode metadata padded to `size` rows (tables to `max_blocks` columns); rows n..size-1
        are dummy decodes of one token in the spare block. Then the backend derives its own rows."""
        n, pad = len(tables), size - len(tables)
        bt = np.zeros((size, self.max_blocks), dtype=np.int64)
        for r, t in enumerate(tables):
            bt[r, : len(t)] = t
        bt[n:, 0] = self.spare_block
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots + [self.spare_block * self.block_size] * pad, dtype=torch.long),
            decode_idx=torch.arange(size),
            decode_block_tables=torch.from_numpy(bt),
            decode_seq_lens=torch.tensor(lens + [1] * pad, dtype=torch.long),
            prefills=[], block_size=self.block_size)
        meta.derived = self.model.attn.derive(meta)
        return meta

    def _static_meta(self, size: int) -> AttentionMetadata:
        """The leading `size` rows of the static buffers, as the metadata a graph of that size reads."""
        m = self.meta
        derived = {k: tuple(t[:size] for t in v) if isinstance(v, tuple) else v[:size] for k, v in m.derived.items()}
        return AttentionMetadata(m.slot_mapping[:size], m.decode_idx[:size], m.decode_block_tables[:size],
                                 m.decode_seq_lens[:size], [], self.block_size, derived)

    # -- running -----------------------------------------------------------------------------------------
    def can_run(self, num_decodes: int, longest_table: int) -> bool:
        return 0 < num_decodes <= self.max_size and longest_table <= self.max_blocks

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int]) -> torch.Tensor:
        """Logits [n, vocab] of a step of n decodes (the last row of each is its only token); hidden states
        [n, hidden] without `with_logits`."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        host = self._padded_meta(slots, tables, lens, size)
        pad = [0] * (size - n)
        self.ids[:size].copy_(torch.tensor(ids + pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + pad), non_blocking=True)
        for dst, src in zip(self._static_meta(size).tensors(), host.tensors(), strict=True):
            dst.copy_(src, non_blocking=True)
        graph, logits = self.graphs.get(size, (None, None))
        if graph is None:  # not captured (the CPU)
            return self._forward(size)[:n]
        graph.replay()
        return logits[:n]

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._static_meta(size)
        hidden = self.model.forward(self.ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.logits(hidden) if self.with_logits else hidden

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest size first, so that the smaller graphs reuse the memory pool the largest one allocated."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles the Triton kernels, creates the cuBLAS handles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

