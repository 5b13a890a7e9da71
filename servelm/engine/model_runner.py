"""Turns a scheduler step into one forward pass: owns the KV cache tensors, builds the step's flattened tokens
from the running batch's columns, executes block copies, runs the model and samples."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from servelm.engine.cuda_graphs import DecodeGraphs
from servelm.engine.kv_cache_manager import BlockOps
from servelm.engine.mixed_graphs import MixedGraphs
from servelm.engine.rejection import verify
from servelm.engine.sampler import Sampler, SampleResult, draw, kept_weights, prompt_logprob_results
from servelm.engine.scheduler import SchedulerOutput
from servelm.engine.step_outputs import RunnerOutput
from servelm.engine.step_staging import StepStaging
from servelm.model.attention import AttentionMetadata, PrefillSpan
from servelm.model.attention.kv_quant import KVCache, cache_dtype, raw
from servelm.model.decoder import DecoderLM
from servelm.model.memory import lazy_zeros

_PROMPT_LOGPROB_ROWS = 256  # rows of full-vocabulary logits at a time: [256, 49152] float32 is 48 MiB


# Block copies as slices while the pairs form at most this many runs (a slice copy per run and layer is a Python
# call; past a few runs one gather and one scatter per layer cost less)
_MAX_SLICE_RUNS = 4


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) of each run of pairs whose source and destination both go up by
    one block at a time."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(a, b, n) for a, b, n in runs]


def kv_bytes_per_block(model: DecoderLM, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block over every layer's keys and values, in the cache's element type (fp8: half of
    bfloat16's, so the same memory holds twice the blocks)."""
    s = model.spec
    itemsize = cache_dtype(kv_cache_dtype, model.dtype).itemsize
    return 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * itemsize


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """Refuse an fp8 cache where its reader cannot run: Triton converts float8_e4m3fn on compute capability
    8.9 and newer only (the CPU reads it through PyTorch, which converts it everywhere)."""
    if kv_cache_dtype == "auto" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                         f"(Ada, Hopper); this one is {major}.{minor}: use kv_cache_dtype='auto'")


@dataclass
class InFlight:
    """A step launched and not yet collected (async scheduling): its sampled tokens stay where the logits are,
    with a copy to the host under way (`host`, done when `event` is; the same tensor on the CPU). `keep`: the
    rows of `out` as launched that are still wanted, once samples have ended since (None: all)."""

    out: SchedulerOutput
    start: float
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None = None
    keep: np.ndarray | None = None

    @classmethod
    def started(cls, out: SchedulerOutput, start: float, tokens: torch.Tensor) -> InFlight:
        if tokens.device.type != "cuda":
            return cls(out, start, tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(out, start, tokens, host, event)

    def narrow(self, out: SchedulerOutput, keep: np.ndarray) -> None:
        """Keep only rows `keep` of the current `out`, which `out` now is."""
        self.out = out
        self.keep = keep if self.keep is None else self.keep[keep]

    def next_inputs(self) -> torch.Tensor:
        """The tokens of the rows still wanted: the input tokens of the step behind this one, on the device."""
        if self.keep is None:
            return self.tokens
        return self.tokens[torch.from_numpy(self.keep).to(self.tokens.device)]

    def tokens_on_host(self) -> list[int]:
        """Waits for the copy; the rows still wanted."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host.tolist()
        return tokens if self.keep is None else [tokens[i] for i in self.keep.tolist()]


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, num_cpu_blocks: int, seed: int,
                 cuda_graph_sizes: list[int] | None = None, max_model_len: int = 0,
                 kv_cache_dtype: str = "auto", logprobs_mode: str = "raw_logprobs") -> None:
        """`cuda_graph_sizes`: on a CUDA device, decode batch sizes to capture (None: run eagerly).
        `kv_cache_dtype`: auto (the model's dtype) or fp8 (attention/kv_quant.py). `logprobs_mode`: what
        sampled tokens' logprobs hold (Sampler)."""
        self.model = model
        self.block_size = block_size
        self.device = model.embed.device
        s = model.spec
        check_kv_cache_dtype(kv_cache_dtype, self.device)
        self.kv_dtype = cache_dtype(kv_cache_dtype, model.dtype)
        # a spare block past the pool's end takes the padding rows' writes of graph replays
        self.spare_block = num_blocks
        shape = (num_blocks + 1, block_size, s.num_kv_heads, s.head_dim)

        def zeros() -> torch.Tensor:
            if self.device.type == "cpu":
                return lazy_zeros(shape, self.kv_dtype)
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

        # an fp8 cache carries each layer's scales (the checkpoint's k_scale/v_scale, else 1.0); a cache in the
        # model's dtype never scales, as in vLLM
        scales = [lw.kv_scales for lw in model.layers] if self.kv_dtype != model.dtype else [(1.0, 1.0)] * s.num_layers
        self.kv_caches = [KVCache(zeros(), zeros(), *ks) for ks in scales]
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.sampler = Sampler(seed, logprobs_mode)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None  # steps with prompt chunks in graphs, where enabled
        self._graph_pool = None  # the CUDA graphs' memory, one pool for decode and mixed-step graphs
        self._saved_graphs = (False, False)  # which of them drop_graphs forgot (sleep mode)
        # eager steps' inputs cross to a GPU in one copy from a pinned buffer (none needed on the CPU)
        self.staging = StepStaging(self.device) if self.device.type == "cuda" else None
        self.num_graph_steps = 0  # decode steps run through the static buffers (replays on a GPU)
        self.num_mixed_graph_steps = 0  # and steps with prompt chunks
        # filled by execute(): (request, first prompt position, results) for prompt-logprob requests
        if cuda_graph_sizes and self.device.type == "cuda":
            self.enable_decode_graphs(cuda_graph_sizes, capture=True)
        # tensor parallelism (engine/tp_workers.py): the other ranks, sent each step's block ops and inputs
        self.tp_workers = None
        self.loras = None  # the engine's LoRA adapters (engine/lora_manager.py), where enabled

    def enable_decode_graphs(self, sizes: list[int], capture: bool, with_logits: bool = True) -> None:
        """Run pure-decode steps of up to max(sizes) sequences through padded static buffers, replaying a
        CUDA graph per size when `capture` (without it, on any device, the same buffers run eagerly)."""
        self._graph_args = (sizes, capture, with_logits)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_blocks, self.spare_block,
                                   sizes, capture, with_logits, self._pool() if capture else None)

    def enable_mixed_graphs(self, sizes: list[int], max_rows: int, capture: bool) -> None:
        """Run steps with prompt chunks of up to max(sizes) tokens and `max_rows` rows through padded static
        buffers (engine/mixed_graphs.py), replaying a CUDA graph per size when `capture`."""
        if not self.model.attn.mixed_graphs:
            raise ValueError(f"the {type(self.model.attn).__name__} attention backend cannot run mixed steps in "
                             "CUDA graphs (the Triton backend can)")
        self._mixed_args = (sizes, max_rows, capture)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.mixed = MixedGraphs(self.model, self.kv_caches, self.block_size, max_blocks, self.spare_block, sizes,
                                 max_rows, capture, self._pool() if capture else None)

    def drop_graphs(self) -> None:
        """Forget the decode and mixed-step buffers and graphs, and the graphs' memory (sleep mode: the KV cache
        and weights they point into are about to move); recapture_graphs builds them again."""
        self._saved_graphs = (self.graphs is not None, self.mixed is not None)
        self.graphs = self.mixed = None
        self._graph_pool = None

    def recapture_graphs(self) -> None:
        """Build again the graphs drop_graphs forgot, over the KV cache and weights where they are now."""
        decode, mixed = self._saved_graphs
        if decode:
            self.enable_decode_graphs(*self._graph_args)
        if mixed:
            self.enable_mixed_graphs(*self._mixed_args)
        self._saved_graphs = (False, False)

    def drop_swap_space(self) -> None:
        """Forget the host swap space of preempted requests' blocks (none are swapped out while the engine is
        idle); it is allocated again at the next swap."""
        self._cpu_caches = None

    def _pool(self):
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    @property
    def cpu_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._cpu_caches is None:  # allocated on first swap: most runs never swap
            shape = (self.num_cpu_blocks, *self.kv_caches[0][0].shape[1:])
            dt = self.kv_dtype
            self._cpu_caches = [(lazy_zeros(shape, dt), lazy_zeros(shape, dt))
                                for _ in self.kv_caches]
        return self._cpu_caches

    def apply_block_ops(self, ops: BlockOps) -> None:
        for pairs, src_caches, dst_caches in (
            (ops.swap_out, self.kv_caches, None),
            (ops.swap_in, None, self.kv_caches),
            (ops.copy, self.kv_caches, self.kv_caches),
        ):
            if not pairs:
                continue
            src_caches = src_caches or self.cpu_caches
            dst_caches = dst_caches or self.cpu_caches
            runs = block_runs(pairs) if src_caches is not dst_caches else []  # (a swap: never overlapping)
            # as bytes where the cache is fp8: PyTorch has few float8 ops, and a copy of the bytes is the same
            src_caches = [tuple(map(raw, kv)) for kv in src_caches]
            dst_caches = [tuple(map(raw, kv)) for kv in dst_caches]
            if runs and len(runs) <= _MAX_SLICE_RUNS:  # one copy per run, no gather into a temporary then a scatter
                for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
                    for s0, d0, n in runs:
                        dk[d0:d0 + n].copy_(sk[s0:s0 + n])  # crosses devices on a GPU
                        dv[d0:d0 + n].copy_(sv[s0:s0 + n])
                continue
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs])
            for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
                dk[dst] = sk[src].to(dk.device)  # swaps cross devices on a GPU; no-ops on the CPU
                dv[dst] = sv[src].to(dv.device)

    def _prepare(self, out: SchedulerOutput):
        """The step's inputs, built from the running batch's columns: each row's tokens from its start position
        (its last token for a decode; its prompt chunk, or its last token and drafts, read from the sequence
        otherwise), their positions and KV slots, which of them take the decode path, the rows whose logits are
        sampled, and whether a request in it wants its prompt's logprobs."""
        b, rows, counts, start = out.batch, out.rows, out.num_tokens, out.start
        bs = self.block_size
        n_rows = len(rows)
        sel = slice(0, n_rows) if n_rows == len(b) else rows  # (every row: slices instead of gathers)
        tables = b.tables[sel]
        num_blocks = b.num_blocks[sel]
        prompt_len = b.prompt_len[sel]
        ends = np.cumsum(counts)
        offsets = ends - counts  # each row's first index in the step's tokens
        row_of = np.repeat(np.arange(n_rows), counts)
        positions = np.arange(int(ends[-1])) - offsets[row_of] + start[row_of]
        ids = b.last[sel][row_of]  # (a step behind the one in flight takes them on the device: see launch)
        # Rows that are not one decode token read their tokens from the sequence: prompt chunks (a recompute
        # after preemption included) and verifications, whose drafts follow the sequence's last token.
        for r in [] if out.behind else np.flatnonzero((counts != 1) | (start + 1 != b.length[sel])).tolist():
            seq, a, k = out.seqs[r], int(start[r]), int(counts[r])
            drafts = out.drafts.get(r, [])
            ids[offsets[r]:offsets[r] + k] = seq.token_ids[a:a + k - len(drafts)] + drafts
        slots = tables[row_of, positions // bs] * bs + positions % bs
        # Where a token's attention runs depends only on its position, never on the chunking: prompt positions
        # take the prefill path (one left after a prefix-cache hit included), generated ones the decode path,
        # one row each (a recompute after preemption included). The two kernels sum in different orders, so
        # choosing by chunk size made outputs depend on scheduling.
        prefills, want_prompt = [], False
        for r in out.prompt_rows:
            end = min(int(prompt_len[r]), int(start[r] + counts[r]))
            table = torch.from_numpy(tables[r, :num_blocks[r]].copy())
            prefills.append(PrefillSpan(int(offsets[r]), end - int(start[r]), end, table))
            want_prompt = want_prompt or out.seqs[r].request.needs_prompt_logprobs
        decode_idx = np.flatnonzero(positions >= prompt_len[row_of]) if prefills else np.arange(len(positions))
        decode_rows = row_of[decode_idx]
        decode_lens = positions[decode_idx] + 1
        max_blocks = int(num_blocks[decode_rows].max()) if len(decode_rows) else 1
        decode_tables = tables[decode_rows, :max_blocks]
        logits_idx, repeats = self._sampled_rows(out, ends)
        lora = self._lora_batch(out) if self.loras is not None and self.loras.active else None
        dev = self.device  # built on the host, copied once per step (no copy at all on the CPU)
        repeats_t = torch.from_numpy(repeats) if repeats is not None else None
        if not prefills and lora is None and self.graphs is not None and self.graphs.can_run(len(ids), max_blocks):
            graph_inputs = (ids, positions, slots, decode_tables, decode_lens)
            # each decode row sampled once, in order (the usual case): the replay's logits as they are
            every_sampled = len(logits_idx) == len(ids) and repeats is None
            logits_dev = None if every_sampled else torch.from_numpy(logits_idx).to(dev)
            rank_inputs = ("graph", self.graphs.sizes, graph_inputs)
            return None, None, None, logits_dev, repeats_t, (self.graphs, graph_inputs), False, None, rank_inputs
        if (prefills and self.mixed is not None and lora is None and not want_prompt and repeats is None
                and len(logits_idx) and self.tp_workers is None):
            width = int(num_blocks.max())
            if self.mixed.can_run(len(ids), n_rows, width):  # the sampled rows' logits, in order, from the graph
                inputs = (ids, positions, slots, offsets, counts, start + counts, logits_idx, tables[:, :width])
                return None, None, None, None, None, (self.mixed, inputs), False, None, None
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            decode_idx=torch.from_numpy(decode_idx),
            decode_block_tables=torch.from_numpy(np.ascontiguousarray(decode_tables)),
            decode_seq_lens=torch.from_numpy(decode_lens),
            prefills=prefills,
            block_size=bs,
        )
        meta.derived = self.model.attn.derive(meta)
        ids_t, positions_t = torch.from_numpy(ids), torch.from_numpy(positions)
        # the other tensor-parallel ranks get the host tensors and copy them to their own GPU
        rank_inputs = ("eager", ids_t, positions_t, meta)
        if self.staging is not None:  # one copy of everything from a pinned buffer
            ids_dev, positions_dev, logits_dev, meta_dev = self._staged(ids, positions, logits_idx, meta)
        else:
            ids_dev, positions_dev = ids_t.to(dev, non_blocking=True), positions_t.to(dev, non_blocking=True)
            logits_dev, meta_dev = torch.from_numpy(logits_idx).to(dev), meta.to(dev)
        return ids_dev, positions_dev, meta_dev, logits_dev, repeats_t, None, want_prompt, lora, rank_inputs

    def _staged(self, ids: np.ndarray, positions: np.ndarray, logits_idx: np.ndarray, meta: AttentionMetadata):
        """An eager step's inputs on the device in one copy (engine/step_staging.py): the token ids, positions,
        sampled rows and the attention metadata with what the backend derived from it (prompt chunks' block
        tables stay on the host: the backends read them there)."""
        derived = meta.derived
        names = [f.name for f in dataclasses.fields(derived)] if derived is not None else []
        moved = (meta.slot_mapping, meta.decode_idx, meta.decode_block_tables, meta.decode_seq_lens,
                 *(getattr(derived, n) for n in names))
        views = self.staging.stage([ids, positions, logits_idx, *(t.numpy() for t in moved)])
        slot_mapping, decode_idx, tables, lens, *rest = views[3:]
        on_dev = AttentionMetadata(slot_mapping, decode_idx, tables, lens, meta.prefills, meta.block_size,
                                   dataclasses.replace(derived, **dict(zip(names, rest, strict=True)))
                                   if derived is not None else None)
        return views[0], views[1], views[2], on_dev

    @staticmethod
    def _sampled_rows(out: SchedulerOutput, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The step's token indices whose logits are sampled: each sampling row's last token, or for a
        verification its last token and each draft; and how many samples take each (None: one each)."""
        sampled = out.sampled
        last = ends - 1 if sampled.all() else (ends - 1)[sampled]
        if not (out.drafts or out.forks):
            return last, None
        idx, repeats = [], []
        for r, e in zip(np.flatnonzero(sampled).tolist(), last.tolist(), strict=True):
            k = len(out.drafts.get(r, ()))
            idx.extend(range(e - k, e + 1))
            repeats.extend([1] * k + [1 + len(out.forks.get(r, ()))])
        return np.asarray(idx, np.int64), np.asarray(repeats, np.int64)

    def _lora_batch(self, out: SchedulerOutput):
        """The step's adapters and their rows (None where every row runs the base model): each row's tokens, in
        the order `_prepare` lays them out."""
        names = []
        for seq, k in zip(out.seqs, out.num_tokens.tolist(), strict=True):
            lora = seq.request.lora
            names += [lora.lora_name if lora is not None else None] * k
        return self.loras.batch(names)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: each row's tokens, then a token for each row that samples (with logprobs, forks and
        verified drafts as sparse extras), and the prompt logprobs the step's prompt chunks asked for."""
        self.apply_block_ops(out.ops)
        if not out:
            if self.tp_workers is not None and out.ops:
                self.tp_workers.step(out.ops, None)
            return RunnerOutput()
        input_ids, positions, meta, logits_idx, repeats, graph_step, want_prompt, lora, rank_inputs = \
            self._prepare(out)
        if self.tp_workers is not None:  # the ranks replay the block ops and run their shards with ours
            self.tp_workers.step(out.ops, rank_inputs)
        hidden, logits = self._forward(input_ids, positions, meta, graph_step, lora)
        prompt_lps = self._prompt_logprobs(out, hidden) if want_prompt else ()
        if logits_idx is not None and logits_idx.numel() == 0:  # a step of prompt chunks that sample nothing yet
            return RunnerOutput(prompt_logprobs=prompt_lps)
        logits = self._sampled_logits(hidden, logits, logits_idx)
        if repeats is not None and bool((repeats > 1).any()):
            logits = logits.repeat_interleave(repeats.to(logits.device), dim=0)
        if out.drafts:
            return self._sample_with_verifications(logits, out, prompt_lps)
        rows = np.flatnonzero(out.sampled).tolist()
        if not out.forks:
            seqs = out.seqs if len(rows) == len(out.seqs) else [out.seqs[r] for r in rows]
            tokens, lps = self.sampler.sample(logits, seqs)
            if lps and len(rows) != len(out.seqs):
                lps = {rows[i]: res for i, res in lps.items()}
            return RunnerOutput(tokens, lps, prompt_logprobs=prompt_lps)
        seqs, owner = [], []  # a forking row's samples follow it, the row's own first
        for r in rows:
            for q in [out.seqs[r], *out.forks.get(r, ())]:
                seqs.append(q)
                owner.append(r)
        tokens, lps = self.sampler.sample(logits, seqs)
        column, by_row, forked = [], {}, {}
        for i, (r, tok) in enumerate(zip(owner, tokens, strict=True)):
            res = lps.get(i)
            if r in out.forks:
                forked.setdefault(r, []).append(res or SampleResult(tok))
                if len(forked[r]) > 1:
                    continue
            elif res is not None:
                by_row[r] = res
            column.append(tok)
        return RunnerOutput(column, by_row, forked=forked, prompt_logprobs=prompt_lps)

    def _forward(self, input_ids, positions, meta, graph_step, lora, device_ids: torch.Tensor | None = None):
        """The model over the step's tokens: (hidden states, None) eagerly, or (None, every row's logits) from
        the static buffers (a graph replay on a GPU). `device_ids`: the input tokens, already on the device."""
        if graph_step is not None:  # (the graphs, the step's inputs)
            graphs, inputs = graph_step
            if graphs is self.mixed:
                self.num_mixed_graph_steps += 1
            else:
                self.num_graph_steps += 1
            return None, graphs.run(*inputs, device_ids=device_ids)
        ids = device_ids if device_ids is not None else input_ids
        return self.model.forward(ids, positions, self.kv_caches, meta, lora), None

    def _sampled_logits(self, hidden, logits, logits_idx) -> torch.Tensor:
        if hidden is not None:
            return self.model.logits(hidden[logits_idx])
        return logits if logits_idx is None else logits[logits_idx]  # (None: every row of the replay, in order)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, start: float, after: InFlight | None = None) -> InFlight:
        """Async scheduling: run a step of one decode per row (every row sampled, plain requests only:
        `Scheduler.overlaps`) without waiting for its tokens; `after`, the step in flight whose tokens are
        this step's inputs (`out.behind`), taken on the device. `collect` gives the tokens."""
        self.apply_block_ops(out.ops)
        input_ids, positions, meta, logits_idx, _, graph_step, _, lora, _ = self._prepare(out)
        device_ids = after.next_inputs() if after is not None else None
        hidden, logits = self._forward(input_ids, positions, meta, graph_step, lora, device_ids)
        tokens = self.sampler.choose(self._sampled_logits(hidden, logits, logits_idx), out.seqs)
        return InFlight.started(out, start, tokens)

    @staticmethod
    def collect(step: InFlight) -> RunnerOutput:
        """A launched step's tokens, once they are on the host."""
        return RunnerOutput(step.tokens_on_host())

    def _sample_with_verifications(self, logits: torch.Tensor, out: SchedulerOutput, prompt_lps) -> RunnerOutput:
        """Plain rows sampled as one batch; each verification's rows checked against its drafts."""
        plain_rows, plain_seqs, spans, row = [], [], [], 0
        sampled = np.flatnonzero(out.sampled).tolist()
        for r in sampled:
            k = len(out.drafts.get(r, ()))
            if k:
                spans.append((row, row + k + 1))
                row += k + 1
            else:
                for q in [out.seqs[r], *out.forks.get(r, ())]:
                    plain_rows.append(row)
                    plain_seqs.append(q)
                    row += 1
        tokens, lps = (self.sampler.sample(logits[torch.tensor(plain_rows, device=logits.device)], plain_seqs)
                       if plain_rows else ([], {}))
        plain = iter(range(len(tokens)))
        spans_it = iter(spans)
        column, by_row, verified, forked = [], {}, {}, {}
        for r in sampled:
            if r in out.drafts:
                a, b = next(spans_it)
                verified[r] = verify(self.sampler, logits[a:b], out.seqs[r], out.drafts[r])
                column.append(verified[r][0].token_id)
                continue
            results = [lps.get(i) or SampleResult(tokens[i])
                       for i in [next(plain) for _ in range(1 + len(out.forks.get(r, ())))]]
            if r in out.forks:
                forked[r] = results
            elif results[0].logprob is not None:
                by_row[r] = results[0]
            column.append(results[0].token_id)
        return RunnerOutput(column, by_row, verified, forked, prompt_lps)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor):
        """Logprobs of prompt tokens for the requests that ask for them: the row of position p predicts the
        prompt token at p + 1. Only those rows get logits (the rest of the batch pays nothing), a few hundred
        at a time so a long prefill chunk never holds [chunk, vocab] at once."""
        found = []
        offset = 0
        for seq, a, k in zip(out.seqs, out.start.tolist(), out.num_tokens.tolist(), strict=True):
            req = seq.request
            lo, hi = a, min(a + k, req.num_prompt_tokens - 1)
            if req.needs_prompt_logprobs and hi > lo:
                results: list[SampleResult] = []
                for x in range(lo, hi, _PROMPT_LOGPROB_ROWS):
                    y = min(x + _PROMPT_LOGPROB_ROWS, hi)
                    rows = hidden[offset + x - a: offset + y - a]
                    results += prompt_logprob_results(self.model.logits(rows), req.prompt_token_ids[x + 1:y + 1],
                                                      req.params.prompt_logprobs)
                found.append((req, lo + 1, results))
            offset += k
        return found


@torch.inference_mode()
def profile_largest_step(model: DecoderLM, block_size: int, num_tokens: int, num_rows: int,
                         kv_cache_dtype: str = "auto") -> None:
    """Runs the largest step the scheduler can form, so that the device's peak memory can be read after it: one
    prompt chunk of `num_tokens` tokens through every layer (into a KV pool just large enough), then the logits
    of `num_rows` rows and what sampling them takes (logprobs, a top-p sort, a draw). Its outputs are dropped."""
    dev = model.embed.device
    num_blocks = -(-num_tokens // block_size)
    runner = ModelRunner(model, num_blocks, block_size, 0, seed=0, kv_cache_dtype=kv_cache_dtype)
    table = torch.arange(num_blocks, dtype=torch.long)
    meta = AttentionMetadata(slot_mapping=torch.arange(num_tokens, dtype=torch.long),
                             decode_idx=torch.zeros(0, dtype=torch.long),
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                             decode_seq_lens=torch.zeros(0, dtype=torch.long),
                             prefills=[PrefillSpan(0, num_tokens, num_tokens, table)], block_size=block_size)
    meta.derived = model.attn.derive(meta)
    ids = torch.zeros(num_tokens, dtype=torch.long)
    positions = torch.arange(num_tokens, dtype=torch.long) % model.spec.max_position_embeddings
    hidden = model.forward(ids.to(dev), positions.to(dev), runner.kv_caches, meta.to(dev))
    rows = torch.arange(num_rows, device=dev) % num_tokens
    logits = model.logits(hidden[rows])
    del hidden
    n = logits.shape[0]
    raw = torch.log_softmax(logits.float(), dim=-1)
    ones = torch.ones(n, device=dev)
    weights = kept_weights(logits, ones, torch.zeros(n, dtype=torch.long, device=dev), ones * 0.95, ones * 0)
    draw(weights, ones * 0.5)
    del raw, weights, logits, runner


@torch.inference_mode()
def profile_graphs(model: DecoderLM, block_size: int, max_model_len: int, decode_size: int, mixed_tokens: int,
                   max_rows: int, kv_cache_dtype: str = "auto") -> ModelRunner:
    """Captures the largest CUDA graphs an engine will (a decode graph of `decode_size` rows and, where
    `mixed_tokens`, a mixed-step graph of that many tokens), in one pool as the engine does, over a cache of one
    block, with block tables as wide as `max_model_len` needs; returns the runner that holds them, so that the
    KV plan measures the device memory they take and then frees them (engine/kv_sizing.py)."""
    runner = ModelRunner(model, 1, block_size, 0, seed=0, cuda_graph_sizes=[decode_size],
                         max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype)
    if mixed_tokens:
        runner.enable_mixed_graphs([mixed_tokens], max_rows, capture=True)
    return runner
