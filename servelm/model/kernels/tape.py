"""Kernel tapes: pure-decode steps replayed from C++, with no Python between the kernel calls.

The decoder's layer loop (`DecoderLM.run_layers`) is the one definition of the forward pass. Where the
fused CPU kernels run a model, the first pure-decode step of each token count T runs that loop once while
recording: every kernel call (kernel_ops' `_Recordable` entry points) is appended to a tape as the address
of its tape entry and its arguments as int64 words, and a PyTorch dispatch mode watches every op. Later
steps of T tokens copy their inputs into the tape's buffers and replay it in one C++ call
(`servelm_run_tape`, csrc/tape.cpp): the same kernels in the same order on the same data, so the same bits.

A recording is refused, and the model stays on the Python loop for good, when the loop did anything but
call kernels, allocate and take views (a PyTorch op that computes: Gemma's path, MoE routing, partial
RoPE, quantized linears...), called a kernel that has no tape entry, or passed a kernel a pointer into
memory the tape cannot vouch for: neither the model's tensors, the KV cache, the tape's own input
buffers, nor what the recording itself allocated.

What the recording allocated is laid out again in one arena by lifetime (from the first to the last call
that touches each allocation), so a tape holds about one layer's activations, not every layer's. Inputs:
the embedding rows (the residual stream), positions, slots, context lengths and block tables, whose
columns are rounded up to a power of two (only a row stride to the attention kernel); a step with longer
tables records its T again. Tapes are dropped when the KV cache tensors change.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from servelm.model.attention import AttentionMetadata

MAX_TAPES = 64  # token counts kept (least recently used dropped first)
_ALIGN = 64  # bytes: every arena slot starts on a cache line, as the allocations it replaces did
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default}


class _Watch(TorchDispatchMode):
    """Every PyTorch op of the recorded loop: keeps what it allocates and names the first op that computes."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[torch.Tensor] = []
        self.computed: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(out)
        elif not func.is_view and self.computed is None:
            self.computed = str(func)
        return out


class _Recorder:
    """What kernel_ops appends to while a thread records: (entry, argument words, their kinds) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], tuple[str, ...]]] = []
        self.refused: str | None = None

    def append(self, entry: int, words: list[int], kinds: tuple[str, ...]) -> None:
        self.calls.append((entry, words, kinds))

    def refuse(self, why: str) -> None:
        self.refused = self.refused or why


class _Tape:
    """One token count's tape: its input buffers, the arena of its activations, the words, the output."""

    def __init__(self, model, T: int, columns: int) -> None:
        self.columns = columns
        self.h = torch.empty(T, model.spec.hidden_size, dtype=model.dtype)  # the residual stream
        self.positions, self.slots, self.lens = (torch.empty(T, dtype=torch.long) for _ in range(3))
        self.tables = torch.zeros(T, columns, dtype=torch.long)
        self.arena: torch.Tensor | None = None
        self.words: torch.Tensor | None = None
        self.output: torch.Tensor | None = None

    def buffers(self) -> list[torch.Tensor]:
        return [self.h, self.positions, self.slots, self.lens, self.tables]

    def load(self, model, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        model.embed_tokens(input_ids, out=self.h)
        self.positions.copy_(positions)
        self.slots.copy_(meta.slot_mapping)
        self.lens.copy_(meta.decode_seq_lens)
        tables = meta.decode_block_tables
        self.tables[:, :tables.shape[1]].copy_(tables)  # columns past a row's blocks are never read

    def meta(self, block_size: int) -> AttentionMetadata:
        T = self.h.shape[0]
        return AttentionMetadata(self.slots, torch.arange(T), self.tables, self.lens, [], block_size)


def _storage_range(t: torch.Tensor) -> tuple[int, int] | None:
    if t.layout != torch.strided or t.device.type != "cpu":
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # opaque tensors (oneDNN's packed weights)
        return None
    return (s.data_ptr(), s.data_ptr() + s.nbytes()) if s.nbytes() else None


def _tensors(obj, depth: int, seen: set[int]):
    """The tensors reachable from obj through servelm's own objects, lists and dicts (the model's weights)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or id(obj) in seen or isinstance(obj, DecodeTapes):
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif type(obj).__module__.startswith("servelm") and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for x in items:
        yield from _tensors(x, depth - 1, seen)


class _Ranges:
    """Sorted, merged [start, end) byte ranges: where a tape's pointers may point besides its arena."""

    def __init__(self, tensors) -> None:
        spans = sorted(r for r in map(_storage_range, tensors) if r is not None)
        self.starts: list[int] = []
        self.ends: list[int] = []
        for a, b in spans:
            if self.ends and a <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], b)
            else:
                self.starts.append(a)
                self.ends.append(b)

    def __contains__(self, p: int) -> bool:
        i = bisect.bisect_right(self.starts, p) - 1
        return i >= 0 and p < self.ends[i]


def _layout(rec: _Recorder, allocated: list[torch.Tensor], out: torch.Tensor, known: _Ranges
            ) -> tuple[list[int], dict[int, int], int] | str:
    """Places the recording's allocations in one arena by lifetime. Returns (the tape's words with each
    pointer into an allocation as an offset marker, {allocation start: arena offset}, arena bytes), or why
    the recording cannot be a tape."""
    spans: dict[int, list[int]] = {}  # allocation start -> [bytes, first call, last call]
    for t in allocated:
        r = _storage_range(t)
        if r is not None:
            spans.setdefault(r[0], [r[1] - r[0], -1, -1])
    starts = sorted(spans)

    def owner(p: int) -> int | None:
        i = bisect.bisect_right(starts, p) - 1
        return starts[i] if i >= 0 and p < starts[i] + spans[starts[i]][0] else None

    pointers: list[tuple[int, int, int]] = []  # (word index, allocation start, offset in it)
    words: list[int] = []
    for c, (entry, args, kinds) in enumerate(rec.calls):
        words += [entry, len(args)]
        for w, k in zip(args, kinds, strict=True):
            if k == "p" and w:
                b = owner(w)
                if b is not None:
                    span = spans[b]
                    span[1] = c if span[1] < 0 else span[1]
                    span[2] = c
                    pointers.append((len(words), b, w - b))
                elif w not in known:
                    return f"call {c} takes a pointer ({w:#x}) outside the model, the cache and its buffers"
            words.append(w)
    b = owner(out.data_ptr())
    if b is None or spans[b][1] < 0:
        return "the loop's output is not a kernel's"
    spans[b][2] = len(rec.calls)  # read after the last call
    offsets: dict[int, int] = {}
    placed: list[tuple[int, int, int, int]] = []  # (offset, bytes, first, last)
    for b in sorted((b for b in starts if spans[b][1] >= 0), key=lambda b: spans[b][1]):
        size, first, last = spans[b]
        size = -(-size // _ALIGN) * _ALIGN
        off = 0
        for o, s, _, _ in sorted(p for p in placed if not (p[3] < first or p[2] > last)):
            if off + size <= o:
                break
            off = max(off, o + s)
        placed.append((off, size, first, last))
        offsets[b] = off
    for i, b, d in pointers:
        words[i] = (b, d)  # resolved against the arena by the caller
    return words, offsets, max((o + s for o, s, _, _ in placed), default=_ALIGN)


class DecodeTapes:
    """The kernel tapes of one model's pure-decode steps, one per token count (see the module docstring)."""

    def __init__(self, model, kernels) -> None:
        self.model, self.kernels = model, kernels
        self.tapes: OrderedDict[int, _Tape] = OrderedDict()
        self.refused: str | None = None  # why this model's loop cannot be taped; then it never is
        self.recorded = 0
        self.replayed = 0
        self._caches: list | None = None  # the KV cache the tapes point into
        self._ends: tuple | None = None

    @property
    def active(self) -> bool:
        """Whether decode steps replay tapes: one was recorded and none refused."""
        return self.refused is None and self.recorded > 0

    def reset(self) -> None:
        """Forget every tape (the model's weights or kernels changed)."""
        self.tapes.clear()
        self.refused = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
                ) -> torch.Tensor | None:
        """The hidden states of a pure-decode step from its tape (recording it first where there is none),
        or None where the step is not taped: the caller runs the Python loop."""
        if self.refused is not None or meta.prefills or meta.derived is not None or input_ids.device.type != "cpu":
            return None
        ends = (len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())
        if kv_caches is not self._caches or ends != self._ends:
            self.tapes.clear()
            self._caches, self._ends = kv_caches, ends
        T, columns = input_ids.numel(), meta.decode_block_tables.shape[1]
        tape = self.tapes.get(T)
        if tape is None or tape.columns < columns:
            return self._record(input_ids, positions, kv_caches, meta)
        self.tapes.move_to_end(T)
        tape.load(self.model, input_ids, positions, meta)
        self.kernels.run_tape(tape.words)
        self.replayed += 1
        return tape.output.clone()  # the arena is the next step's

    def _record(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
                ) -> torch.Tensor:
        m, T = self.model, input_ids.numel()
        tape = _Tape(m, T, max(16, 1 << (meta.decode_block_tables.shape[1] - 1).bit_length()))
        tape.load(m, input_ids, positions, meta)
        rec, watch, step = _Recorder(), _Watch(), tape.meta(meta.block_size)
        with self.kernels.recording(rec), watch:
            out = m.run_layers(tape.h, tape.positions, kv_caches, step)
        why = rec.refused or (watch.computed and f"the layer loop runs {watch.computed}")
        if why is None:
            # depth 8: model, layers, a layer, its gate/up, a fused weight's parts (layers.PartsLinear), a part,
            # its kernel, the packed weight
            known = _Ranges([*_tensors(m, 8, set()), *(t for kv in kv_caches for t in kv), *tape.buffers()])
            laid = _layout(rec, watch.allocated, out, known)
            if isinstance(laid, str):
                why = laid
            else:
                self._finish(tape, out, *laid)
                self.tapes[T] = tape
                self.tapes.move_to_end(T)
                while len(self.tapes) > MAX_TAPES:
                    self.tapes.popitem(last=False)
                self.recorded += 1
        if why is not None:
            self.refused = why
            self.tapes.clear()
        return out  # this step's result, computed by the loop itself

    @staticmethod
    def _finish(tape: _Tape, out: torch.Tensor, words: list, offsets: dict[int, int], size: int) -> None:
        tape.arena = torch.empty(size, dtype=torch.uint8)
        base = tape.arena.data_ptr()
        assert base % _ALIGN == 0
        tape.words = torch.tensor([base + offsets[w[0]] + w[1] if isinstance(w, tuple) else w for w in words],
                                  dtype=torch.int64)
        start = _storage_range(out)[0]
        at = offsets[start] + out.data_ptr() - start
        tape.output = tape.arena.view(out.dtype).as_strided(out.shape, out.stride(), at // out.element_size())
