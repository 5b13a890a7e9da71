"""Turns a scheduler step into one forward pass: owns the KV cache tensors, builds the flattened batch,
executes block copies, runs the model and samples."""

from __future__ import annotations

import numpy as np
import torch

from servelm.engine.cuda_graphs import DecodeGraphs
from servelm.engine.kv_cache_manager import BlockOps
from servelm.engine.rejection import verify
from servelm.engine.sampler import Sampler, SampleResult, draw, kept_weights, prompt_logprob_results
from servelm.engine.scheduler import SchedulerOutput
from servelm.engine.step_outputs import RunnerOutput
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


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, num_cpu_blocks: int, seed: int,
                 cuda_graph_sizes: list[int] | None = None, max_model_len: int = 0,
                 kv_cache_dtype: str = "auto") -> None:
        """`cuda_graph_sizes`: on a CUDA device, decode batch sizes to capture (None: run eagerly).
        `kv_cache_dtype`: auto (the model's dtype) or fp8 (attention/kv_quant.py)."""
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
        self.sampler = Sampler(seed)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0  # decode steps run through the static buffers (replays on a GPU)
        # filled by execute(): (request, first prompt position, results) for prompt-logprob requests
        if cuda_graph_sizes and self.device.type == "cuda":
            self.enable_decode_graphs(cuda_graph_sizes, capture=True)
        # tensor parallelism (engine/tp_workers.py): the other ranks, sent each step's block ops and inputs
        self.tp_workers = None
        self.loras = None  # the engine's LoRA adapters (engine/lora_manager.py), where enabled

    def enable_decode_graphs(self, sizes: list[int], capture: bool, with_logits: bool = True) -> None:
        """Run pure-decode steps of up to max(sizes) sequences through padded static buffers, replaying a
        CUDA graph per size when `capture` (without it, on any device, the same buffers run eagerly)."""
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_blocks, self.spare_block,
                                   sizes, capture, with_logits)

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
        """The step's inputs, and whether a request in it wants its prompt's logprobs (checked on prompt
        chunks only: a decode row never holds prompt positions, so decodes pay nothing for the feature)."""
        bs = self.block_size
        want_prompt = False
        ids, positions, slots = [], [], []
        decode_idx, decode_tables, decode_lens, prefills = [], [], [], []
        logits_idx, repeats = [], []
        offset = n_dec = len(out.decode_seqs)  # the batch's steady decodes come first, as columns
        for s in out.scheduled:
            seq, start, n = s.seq, s.start, s.num_tokens
            table = seq.block_table
            # Where a token's attention runs depends only on its position, never on the chunking: prompt
            # positions take the prefill path (one left after a prefix-cache hit included), generated ones
            # the decode path, one row each (a recompute after preemption included). The two kernels sum
            # in different orders, so choosing by chunk size made outputs depend on scheduling.
            prompt_end = min(max(seq.num_prompt_tokens, start), start + n)
            if n == 1 and prompt_end == start:  # a decode: plain ints, no per-sequence arrays (most rows)
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_idx.append(offset)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                # a verification's drafts follow the sequence's last token (they are not its tokens yet)
                ids.extend(seq.token_ids[start:start + n] + s.spec_token_ids)
                pos = np.arange(start, start + n)
                arr = np.asarray(table, dtype=np.int64)
                positions.extend(range(start, start + n))
                slots.extend((arr[pos // bs] * bs + pos % bs).tolist())
                if prompt_end > start:
                    prefills.append(PrefillSpan(offset, prompt_end - start, prompt_end, torch.from_numpy(arr)))
                    want_prompt = want_prompt or seq.request.needs_prompt_logprobs
                for p in range(prompt_end, start + n):  # generated tokens recomputed after preemption
                    decode_idx.append(offset + p - start)
                    decode_tables.append(table)
                    decode_lens.append(p + 1)
            offset += n
            if s.spec_token_ids:  # a verification needs every row's logits: one per draft, plus the bonus
                logits_idx.extend(range(offset - len(s.spec_token_ids) - 1, offset))
                repeats.extend([1] * (len(s.spec_token_ids) + 1))
            elif s.sample_seqs:
                logits_idx.append(offset - 1)
                repeats.append(len(s.sample_seqs))
        dev = self.device  # built on the host, copied once per step (no copy at all on the CPU)

        def tensor(x) -> torch.Tensor:
            return torch.from_numpy(x) if isinstance(x, np.ndarray) else torch.tensor(x, dtype=torch.long)

        def cat(columns: np.ndarray, rest: list[int]) -> np.ndarray:  # int64 also when `rest` is empty
            return np.concatenate([columns, np.asarray(rest, dtype=np.int64)])

        max_blocks = max((len(t) for t in decode_tables), default=1)
        if n_dec:
            b_ids, b_pos, b_slots, b_lens, b_blocks = out.batch.inputs(n_dec)
            max_blocks = max(max_blocks, b_blocks)
            ids, positions, slots = cat(b_ids, ids), cat(b_pos, positions), cat(b_slots, slots)
            decode_idx, decode_lens = cat(np.arange(n_dec), decode_idx), cat(b_lens, decode_lens)
            logits_idx = cat(np.arange(n_dec), logits_idx)
            repeats = [1] * n_dec + repeats
        repeats_t = torch.tensor(repeats, dtype=torch.long)
        tables = np.zeros((n_dec + len(decode_tables), max_blocks), dtype=np.int64)
        if n_dec:
            tables[:n_dec] = out.batch.tables[:n_dec, :max_blocks]
        for r, t in enumerate(decode_tables, n_dec):
            tables[r, : len(t)] = t
        lora = self._lora_batch(out) if self.loras is not None and self.loras.active else None
        if not prefills and lora is None and self.graphs is not None and self.graphs.can_run(len(ids), max_blocks):
            graph_inputs = tuple(np.asarray(x, dtype=np.int64) for x in (ids, positions, slots, tables, decode_lens))
            # each decode row sampled once, in order (the usual case): the replay's logits as they are
            every_row = len(logits_idx) == len(ids) and np.array_equal(logits_idx, np.arange(len(ids)))
            logits_dev = None if every_row else tensor(logits_idx).to(dev)
            rank_inputs = ("graph", self.graphs.sizes, graph_inputs)
            return None, None, None, logits_dev, repeats_t, graph_inputs, False, None, rank_inputs
        logits_dev = tensor(logits_idx).to(dev)
        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            decode_idx=tensor(decode_idx),
            decode_block_tables=tensor(tables),
            decode_seq_lens=tensor(decode_lens),
            prefills=prefills,
            block_size=bs,
        )
        meta.derived = self.model.attn.derive(meta)
        ids_t, positions_t = tensor(ids), tensor(positions)
        # the other tensor-parallel ranks get the host tensors and copy them to their own GPU
        rank_inputs = ("eager", ids_t, positions_t, meta)
        return (ids_t.to(dev, non_blocking=True), positions_t.to(dev, non_blocking=True),
                meta.to(dev), logits_dev, repeats_t, None, want_prompt, lora, rank_inputs)

    def _lora_batch(self, out: SchedulerOutput):
        """The step's adapters and their rows (None where every row runs the base model): the decode batch's rows
        first, then each scheduled sequence's tokens, as `_prepare` lays them out."""
        names = [s.request.lora.lora_name if s.request.lora is not None else None for s in out.decode_seqs]
        for s in out.scheduled:
            lora = s.seq.request.lora
            names += [lora.lora_name if lora is not None else None] * s.num_tokens
        return self.loras.batch(names)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: the token of each of the batch's decodes (`out.decode_seqs`), the new tokens of each
        sequence in the order of all `sample_seqs` lists (one token, or for a verification the accepted drafts
        and the token after them), and the prompt logprobs the step's prompt chunks asked for."""
        self.apply_block_ops(out.ops)
        if not out:
            if self.tp_workers is not None and out.ops:
                self.tp_workers.step(out.ops, None)
            return RunnerOutput()
        input_ids, positions, meta, logits_idx, repeats, graph_step, want_prompt, lora, rank_inputs = \
            self._prepare(out)
        if self.tp_workers is not None:  # the ranks replay the block ops and run their shards with ours
            self.tp_workers.step(out.ops, rank_inputs)
        if graph_step is not None:  # every row's logits, from the static buffers (a graph replay on a GPU)
            hidden, logits = None, self.graphs.run(*graph_step)
            self.num_graph_steps += 1
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta, lora)
        prompt_lps = self._prompt_logprobs(out, hidden) if want_prompt else ()
        if logits_idx is not None and logits_idx.numel() == 0:  # a step of prompt chunks that sample nothing yet
            return RunnerOutput((), (), prompt_lps)
        if graph_step is None:
            logits = self.model.logits(hidden[logits_idx])
        elif logits_idx is not None:  # (None: every row of the replay, in order)
            logits = logits[logits_idx]
        if bool((repeats > 1).any()):
            logits = logits.repeat_interleave(repeats.to(logits.device), dim=0)
        if not any(s.spec_token_ids for s in out.scheduled):
            n_dec = len(out.decode_seqs)
            seqs = out.decode_seqs + [q for s in out.scheduled for q in s.sample_seqs]
            tokens, results = self.sampler.sample(logits, seqs, n_dec)
            return RunnerOutput(tokens, [[r] for r in results], prompt_lps)
        assert not out.decode_seqs, "speculative decoding runs without a decode batch"
        return RunnerOutput((), self._sample_with_verifications(logits, out), prompt_lps)

    def _sample_with_verifications(self, logits: torch.Tensor, out: SchedulerOutput) -> list[list[SampleResult]]:
        """Plain rows sampled as one batch; each verification's rows checked against its drafts."""
        plain_rows, plain_seqs, spans, row = [], [], [], 0
        for s in out.scheduled:
            if s.spec_token_ids:
                spans.append((row, row + len(s.spec_token_ids) + 1))
                row = spans[-1][1]
            else:
                for q in s.sample_seqs:
                    plain_rows.append(row)
                    plain_seqs.append(q)
                    row += 1
        plain = iter(self.sampler.sample(logits[torch.tensor(plain_rows, device=logits.device)], plain_seqs)[1]
                     if plain_rows else [])
        spans_it = iter(spans)
        results: list[list[SampleResult]] = []
        for s in out.scheduled:
            if s.spec_token_ids:
                a, b = next(spans_it)
                results.append(verify(self.sampler, logits[a:b], s.seq, s.spec_token_ids))
            else:
                results += [[next(plain)] for _ in s.sample_seqs]
        return results

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor):
        """Logprobs of prompt tokens for the requests that ask for them: the row of position p predicts the
        prompt token at p + 1. Only those rows get logits (the rest of the batch pays nothing), a few hundred
        at a time so a long prefill chunk never holds [chunk, vocab] at once."""
        found = []
        offset = len(out.decode_seqs)
        for s in out.scheduled:
            req = s.seq.request
            lo, hi = s.start, min(s.start + s.num_tokens, req.num_prompt_tokens - 1)
            if req.needs_prompt_logprobs and hi > lo:
                results: list[SampleResult] = []
                for a in range(lo, hi, _PROMPT_LOGPROB_ROWS):
                    b = min(a + _PROMPT_LOGPROB_ROWS, hi)
                    rows = hidden[offset + a - s.start: offset + b - s.start]
                    results += prompt_logprob_results(self.model.logits(rows), req.prompt_token_ids[a + 1:b + 1],
                                                      req.params.prompt_logprobs)
                found.append((req, lo + 1, results))
            offset += s.num_tokens
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

