"""Sleep mode (LLM.sleep / wake_up, engine/sleep.py): an idle engine gives back the memory of its KV cache, and
at level 2 of its weights, and answers as before once woken; new weights can be loaded between waking the
weights and waking the KV cache; nothing runs while it sleeps."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from family_parity import GREEDY8, assert_greedy_matches, hf_state_dict, mixed_prompts, save_tiny
from tiny_models import COMMON, run

from servelm import LLM, SamplingParams
from servelm.engine.sleep import Sleeper, checkpoint_tensors_of


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Two Llama checkpoints of one shape and settings (seeds 0 and 1)."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("sleep")
    config = LlamaConfig(**COMMON)
    return {"a": save_tiny(config, root / "a", tokenizer_dir, seed=0),
            "b": save_tiny(config, root / "b", tokenizer_dir, seed=1)}


def resident(tensors: list[torch.Tensor]) -> int:
    """Bytes of the pages wholly inside the tensors that are in memory (mincore)."""
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, total = mmap.PAGESIZE, 0
    for t in tensors:
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end <= start:
            continue
        vec = np.zeros((end - start) // page, dtype=np.uint8)
        assert libc.mincore(start, end - start, vec.ctypes.data) == 0
        total += int((vec & 1).sum()) * page
    return total


def kv_tensors(llm: LLM) -> list[torch.Tensor]:
    return [t for pair in llm.engine.core.runner.kv_caches for t in pair]


def answers(llm: LLM, folder: Path, dtype: str) -> list[list[int]]:
    """The greedy answers to the mixed prompts, checked against transformers' on `folder`."""
    prompts = mixed_prompts()
    outs = run(llm, prompts, GREEDY8)
    assert_greedy_matches(folder, dtype, prompts, outs)
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_level_1_gives_back_the_kv_cache_and_wakes_to_the_same_answers(checkpoints, dtype):
    llm = LLM(str(checkpoints["a"]), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=16,
              enable_sleep_mode=True)
    before = answers(llm, checkpoints["a"], dtype)
    core = llm.engine.core
    assert resident(kv_tensors(llm)) > 0  # the prompts' blocks were written
    weights = {id(t): (t.data_ptr(), t.clone()) for t in checkpoint_tensors_of(core.model)}
    tapes = core.model.tapes
    recorded = tapes.recorded if tapes is not None else None
    llm.sleep(level=1)
    assert llm.is_sleeping() and core.sleeping() == ["weights", "kv_cache"]
    assert resident(kv_tensors(llm)) == 0  # every page of the pool went back to the OS
    assert len(core.kv.pool.cached) == 0
    llm.wake_up()
    assert not llm.is_sleeping()
    # on the CPU level 1 keeps the weights where and as they are
    assert all(t.data_ptr() == weights[id(t)][0] and torch.equal(t, weights[id(t)][1])
               for t in checkpoint_tensors_of(core.model))
    assert answers(llm, checkpoints["a"], dtype) == before
    if recorded is not None:  # bf16 on servelm's kernels: the same tapes replay over the same addresses
        assert tapes.active and tapes.recorded == recorded


def test_level_2_discards_the_weights_and_takes_new_ones_before_the_kv_cache(checkpoints):
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64, enable_sleep_mode=True)
    answers(llm, checkpoints["a"], "float32")
    core = llm.engine.core
    weights = checkpoint_tensors_of(core.model)
    big = [t for t in weights if t.numel() * t.element_size() >= 4 * mmap.PAGESIZE]
    assert resident(big) > 0
    llm.sleep(level=2)
    assert resident(big) == 0 and resident(kv_tensors(llm)) == 0
    llm.wake_up(["weights"])
    assert core.sleeping() == ["kv_cache"] and core.sleeper.needs_weights
    llm.load_weights(hf_state_dict(checkpoints["b"]))
    llm.wake_up(["kv_cache"])
    answers(llm, checkpoints["b"], "float32")
    # woken whole with no weights loaded: the engine reads the checkpoint it last loaded from disk again (a's:
    # b's weights came as tensors)
    llm.sleep(level=2)
    llm.wake_up()
    answers(llm, checkpoints["a"], "float32")
    llm.update_weights_from_disk(str(checkpoints["b"]))
    llm.sleep(level=2)
    llm.wake_up()
    answers(llm, checkpoints["b"], "float32")


def test_nothing_runs_or_changes_while_asleep(checkpoints):
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64, enable_sleep_mode=True)
    engine = llm.engine
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="in flight"):
        llm.sleep()
    assert not llm.is_sleeping()
    engine.abort_request("busy")
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(["Hello"], GREEDY8, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # the refused requests left nothing behind
    with pytest.raises(ValueError, match="asleep"):  # the weights must be woken before they are written
        llm.load_weights(hf_state_dict(checkpoints["b"]))
    with pytest.raises(ValueError, match="unknown sleep tag"):
        llm.wake_up(["everything"])
    # a request added to a sleeping engine waits: steps schedule nothing until it is woken
    engine.add_request("waits", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    assert engine.step() == [] and engine.get_stats().num_running == 0
    llm.wake_up()
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2]
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)


def test_sleep_mode_is_asked_for(checkpoints):
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
    assert not llm.is_sleeping()


def test_relocation_frees_each_storage_and_restores_it(checkpoints, monkeypatch):
    """The GPU's way (storages shrunk to nothing, grown back at new addresses), run on the CPU over plain
    allocations: the answers are the same after each level, and the kernel tapes recorded over the old
    addresses are recorded again."""
    from servelm.engine import model_runner
    from servelm.model import memory

    monkeypatch.setattr(memory, "WEIGHTS_IN_HUGE_PAGES", False)
    monkeypatch.setattr(model_runner, "lazy_zeros", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    llm = LLM(str(checkpoints["a"]), dtype="bfloat16", num_kv_blocks=64, enable_sleep_mode=True)
    core = llm.engine.core
    core.sleeper = Sleeper(core.runner, relocate=True)
    before = answers(llm, checkpoints["a"], "bfloat16")
    tapes = core.model.tapes
    for level in (1, 2):
        storages = [t.untyped_storage() for t in checkpoint_tensors_of(core.model) + kv_tensors(llm)]
        llm.sleep(level=level)
        assert all(s.nbytes() == 0 for s in storages)
        llm.wake_up()
        assert all(s.nbytes() > 0 for s in storages)
        if tapes is not None:
            assert not tapes.tapes  # forgotten: they hold the old addresses
        assert answers(llm, checkpoints["a"], "bfloat16") == before


def test_weights_that_cannot_be_read_again_stay_asleep(checkpoints, tmp_path):
    """A level-2 wake with no new weights reads the checkpoint again; where it has gone, the wake fails and the
    weights count as asleep (their memory is back, their values are not), so no request runs on discarded
    values; new weights loaded then wake the engine."""
    import shutil

    folder = shutil.copytree(checkpoints["a"], tmp_path / "gone")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, enable_sleep_mode=True)
    llm.sleep(level=2)
    shutil.rmtree(folder)
    with pytest.raises(FileNotFoundError):
        llm.wake_up()
    assert llm.is_sleeping() and llm.engine.core.sleeping() == ["weights"]
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([[1, 2, 3]], GREEDY8, use_tqdm=False)
    llm.load_weights(hf_state_dict(checkpoints["b"]))
    assert not llm.is_sleeping()
    answers(llm, checkpoints["b"], "float32")


@pytest.mark.parametrize("relocate", [False, True])
def test_a_second_sleep_at_level_2_discards_what_level_1_kept(checkpoints, monkeypatch, relocate):
    """Asleep at level 1, then at level 2: the weights' kept values go too (their pages, or their host copy),
    and the wake reads the checkpoint again."""
    if relocate:
        from servelm.engine import model_runner
        from servelm.model import memory

        monkeypatch.setattr(memory, "WEIGHTS_IN_HUGE_PAGES", False)
        monkeypatch.setattr(model_runner, "lazy_zeros", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64, enable_sleep_mode=True)
    core = llm.engine.core
    if relocate:
        core.sleeper = Sleeper(core.runner, relocate=True)
    before = answers(llm, checkpoints["a"], "float32")
    llm.sleep(level=1)
    llm.sleep(level=2)
    assert core.sleeper.weights == "discarded"
    if relocate:
        assert all(copy is None for _, _, copy in core.sleeper._weights.held)
    else:
        big = [t for t in checkpoint_tensors_of(core.model) if t.numel() * t.element_size() >= 4 * mmap.PAGESIZE]
        assert resident(big) == 0
    llm.wake_up()
    assert not core.sleeper.needs_weights and answers(llm, checkpoints["a"], "float32") == before
