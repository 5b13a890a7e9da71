"""Kernel tapes (model/kernels/tape.py): a pure-decode step replayed from C++ gives the Python layer loop's bits, the
KV cache included, in bf16 and in float32 on every kernel build; a tape that skipped or reordered a call would
not; a loop that does more than call kernels is never taped."""

from __future__ import annotations

import pytest
import torch
from tiny_models import COMMON

from servelm.model.attention import AttentionMetadata
from servelm.model.layers.blocks import fused_kernels

fused = fused_kernels(torch.bfloat16)
pytestmark = pytest.mark.skipif(fused is None, reason="CPU kernels could not be compiled here")
BS, BLOCKS = 8, 40


@pytest.fixture(scope="module")
def qwen3_window_dir(tmp_path_factory, tokenizer_dir):
    """Qwen3 (q/k norms) with a sliding window on its second layer and qkv biases off; tiny."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**COMMON, head_dim=32, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    out = tmp_path_factory.mktemp("qwen3w")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _load(path, dtype: str = "bfloat16"):
    from servelm.model.loading.loader import load_model

    model = load_model(str(path), None, None, dtype, "cpu").model
    assert model.tapes is not None
    return model


class Steps:
    """Decode steps over random caches: the same step through the tape and through the Python loop, each
    on its own copy of the caches."""

    def __init__(self, model, seed: int = 0) -> None:
        self.model, s = model, model.spec
        g = self.g = torch.Generator().manual_seed(seed)
        dtype = model.embed.dtype
        caches = [tuple(torch.randn(BLOCKS, BS, s.num_kv_heads, s.head_dim, generator=g).to(dtype) for _ in "kv")
                  for _ in range(s.num_layers)]
        self.base = caches
        self.taped = [(k.clone(), v.clone()) for k, v in caches]
        self.python = [(k.clone(), v.clone()) for k, v in caches]
        self.tables = torch.randperm(BLOCKS, generator=g)[:32].view(4, 8)

    def reset(self) -> None:
        """Both caches back to the start, in place (the tapes point into them)."""
        for kv in (self.taped, self.python):
            for (k, v), (k0, v0) in zip(kv, self.base, strict=True):
                k.copy_(k0)
                v.copy_(v0)

    def meta(self, lens: torch.Tensor, rows: list[int], columns: int) -> AttentionMetadata:
        tables = torch.zeros(len(rows), columns, dtype=torch.long)
        tables[:, :8] = self.tables[rows]
        slots = torch.tensor([int(tables[r, (n - 1) // BS]) * BS + (n - 1) % BS for r, n in enumerate(lens.tolist())])
        return AttentionMetadata(slots, torch.arange(len(rows)), tables, lens, [], BS)

    def run(self, lens: list[int], rows: list[int], columns: int = 8, ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(taped, Python) hidden states of one step of decodes at context lengths `lens` (the new token
        included) of the sequences `rows`."""
        lens_t = torch.tensor(lens)
        meta = self.meta(lens_t, rows, columns)
        if ids is None:
            ids = torch.randint(4, self.model.spec.vocab_size, (len(rows),), generator=self.g)
        taped = self.model.forward(ids, lens_t - 1, self.taped, meta)
        tapes, self.model.tapes = self.model.tapes, None
        try:
            python = self.model.forward(ids, lens_t - 1, self.python, meta)
        finally:
            self.model.tapes = tapes
        return taped, python

    def caches_equal(self) -> bool:
        return all(torch.equal(a, b) for x, y in zip(self.taped, self.python, strict=True)
                   for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("which", ["qwen3_window", "qwen2"])
def test_taped_decode_steps_equal_the_python_loop(which, dtype, qwen3_window_dir, model_dirs):
    """Batches of decodes at different context lengths (57 > the window), across several steps: the first
    step of each token count records its tape, the next ones replay it; a step with longer block tables
    records again. Hidden states and caches are the Python loop's, bit for bit."""
    model = _load(qwen3_window_dir if which == "qwen3_window" else model_dirs["qwen2"], dtype)
    if which == "qwen3_window":
        assert model.layers[0].q_norm is not None and model.spec.sliding_windows == [None, 24]
    steps = Steps(model)
    plan = [([1, 9, 30, 57], [0, 1, 2, 3], 8),  # records T=4 (tables rounded up to 16 columns)
            ([2, 10, 31, 58], [0, 1, 2, 3], 8),  # replays it
            ([32], [2], 8),  # records T=1
            ([3, 11, 32, 59], [0, 1, 2, 3], 12),  # replays T=4: 12 columns fit in 16
            ([33], [2], 8),  # replays T=1
            ([4, 12, 33, 60], [0, 1, 2, 3], 20)]  # 20 columns: records T=4 again
    for lens, rows, columns in plan:
        taped, python = steps.run(lens, rows, columns)
        assert torch.equal(taped, python)
        assert steps.caches_equal()
    assert (model.tapes.recorded, model.tapes.replayed, model.tapes.refused) == (3, 3, None)


def _calls(words: torch.Tensor) -> list[list[int]]:
    w, out, i = words.tolist(), [], 0
    while i < len(w):
        out.append(w[i:i + 2 + w[i + 1]])
        i += 2 + w[i + 1]
    return out


def test_a_tape_that_skips_or_reorders_a_call_gives_other_bits(qwen3_window_dir):
    """What the equality test above would catch: the same tape with one call left out, or two calls
    swapped, no longer gives the Python loop's hidden states or cache."""
    model = _load(qwen3_window_dir)
    steps = Steps(model, seed=1)
    steps.run([1, 9, 30, 57], [0, 1, 2, 3])  # records
    tape = model.tapes.tapes[4]
    calls = _calls(tape.words)
    # per layer: norm, qkv, q norm, k norm, rotary, q and v copies, cache write, attention, o_proj, add+norm,
    # gate_up, down; then the final norm
    assert len(calls) == model.spec.num_layers * 13 + 1
    good = tape.words
    broken = {f"skip {i}": calls[:i] + calls[i + 1:] for i in range(0, len(calls), 3)}
    broken.update({f"swap {i}": calls[:i] + [calls[i + 1], calls[i]] + calls[i + 2:] for i in (0, 1, 4, 12)})
    lens, ids = [2, 10, 31, 58], torch.tensor([5, 700, 9000, 31])
    for name, bad in broken.items():
        tape.words = torch.tensor([w for c in bad for w in c], dtype=torch.int64)
        with torch.inference_mode():
            tape.arena.zero_()  # no activation left over from the last run
        steps.reset()
        taped, python = steps.run(lens, [0, 1, 2, 3], ids=ids)
        assert not (torch.equal(taped, python) and steps.caches_equal()), name
    tape.words = good
    steps.reset()
    taped, python = steps.run(lens, [0, 1, 2, 3], ids=ids)
    assert torch.equal(taped, python) and steps.caches_equal()
    assert model.tapes.recorded == 1 and model.tapes.replayed == len(broken) + 1


class _Scratch:
    """An o_proj that also copies its output somewhere the model does not own."""

    def __init__(self, lin) -> None:
        self.lin, self.scratch = lin, None

    def __call__(self, x):
        y = self.lin(x)
        if self.scratch is None or self.scratch.shape != y.shape:
            self.scratch = torch.empty_like(y)
        fused.copy_rows(self.scratch, y)
        return y


@pytest.mark.parametrize("change", ["torch op", "foreign pointer"])
def test_a_loop_that_is_not_all_kernels_is_not_taped(change, model_dirs):
    """A PyTorch op that computes (as Gemma's, MoE's or partial RoPE's layers have) or a pointer into memory
    neither the model, the cache nor the tape owns: the recording is refused and every step runs the
    Python loop, with the same results."""
    model = _load(model_dirs["llama"])
    lw = model.layers[1]
    if change == "torch op":
        lin = lw.o_proj
        lw.o_proj = lambda x: lin(x) * 1
    else:
        lw.o_proj = _Scratch(lw.o_proj)
        lw.o_proj.scratch = torch.empty(4, 64, dtype=torch.bfloat16)  # allocated before the recording
    steps = Steps(model)
    for lens in ([1, 9, 30, 57], [2, 10, 31, 58]):
        taped, python = steps.run(lens, [0, 1, 2, 3])
        assert torch.equal(taped, python) and steps.caches_equal()
    assert model.tapes.recorded == 0 and model.tapes.replayed == 0 and not model.tapes.active
    assert ("aten.mul" if change == "torch op" else "outside the model") in model.tapes.refused
