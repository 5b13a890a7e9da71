"""Host placement of streamed tensors: huge-page mappings for weights and the KV pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from servelm.model import memory


def test_lazy_zeros_are_zero_and_writable():
    t = memory.lazy_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    t[1, 2, 3] = 4
    assert t.sum().item() == 4
    assert memory.lazy_zeros((0, 4), torch.float32).numel() == 0


def test_move_rebinds_copies_in_one_aligned_arena():
    shared = torch.randn(3, 3)
    a = SimpleNamespace(w=torch.randn(5, 7).to(torch.bfloat16), b=None, t=shared)
    b = SimpleNamespace(w=torch.arange(13, dtype=torch.int64), t=shared, s=torch.randn(4, 6).t())
    originals = {k: v.clone() for k, v in (("aw", a.w), ("bw", b.w), ("s", b.s), ("t", shared))}
    memory.move_to_huge_pages([(a, "w"), (a, "b"), (a, "t"), (b, "w"), (b, "t"), (b, "s")])
    assert a.b is None
    for got, key in ((a.w, "aw"), (b.w, "bw"), (b.s, "s"), (a.t, "t")):
        assert got.dtype == originals[key].dtype and torch.equal(got, originals[key])
        assert got.is_contiguous() and got.data_ptr() % memory.ALIGN == 0
    assert a.t is b.t  # one tensor held twice moves once
    storages = {t.untyped_storage().data_ptr() for t in (a.w, a.t, b.w, b.s)}
    assert len(storages) == 1  # all in one mapping
    assert a.w.data_ptr() != b.w.data_ptr()


def test_move_refuses_device_tensors():
    meta = SimpleNamespace(w=torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="only CPU tensors"):
        memory.move_to_huge_pages([(meta, "w")])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the kernels' packed layouts where they apply
@pytest.mark.parametrize("place", [True, False])
def test_decoder_weights_share_one_mapping(place, dtype, model_dirs, monkeypatch):
    from servelm.model.loading.loader import load_model

    monkeypatch.setattr(memory, "WEIGHTS_IN_HUGE_PAGES", place)
    model = load_model(str(model_dirs["qwen2"]), None, None, dtype, "cpu").model
    lw = model.layers[-1]
    held = [model.norm, lw.input_norm, lw.post_norm, lw.qkv.bias]
    for lin in (lw.qkv, lw.o_proj, lw.down, model.lm_head):
        held += lin.kernel.tensors()
    gu = lw.gate_up
    held += (gu.kernel if gu.linear is None else gu.linear.kernel).tensors()
    held = [t for t in held if t is not None]
    assert len(held) >= 5
    storages = {t.untyped_storage().data_ptr() for t in held}
    assert (len(storages) == 1) == place
