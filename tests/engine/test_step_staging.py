"""An eager step's inputs staged in one copy (engine/step_staging.py): the views give back every array with its
dtype and shape, a step's views survive the next step's staging, a step larger than the buffers grows them; and
the engine with every eager step's inputs staged (forced on the CPU, where it is off by default: no copy is
needed there; on CUDA the GPU tests' eager runs take it by default) gives transformers' greedy tokens through prompt chunks, prefix hits and mixed steps, on the
PyTorch backend and on the Triton backend, whose per-row arrays travel in the same copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_prompts, reference, run

from servelm import LLM
from servelm.engine.step_staging import StepStaging


def _arrays(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 1000, size=(n, 7))
    return [rng.integers(0, 2**40, size=n), rng.integers(-5, 5, size=n).astype(np.int32), np.zeros(0, np.int64),
            table[:, 1:5],  # a column slice: not contiguous
            rng.integers(0, 9, size=3).astype(np.int32), rng.random(n).astype(np.float32) > 0.5]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _same(views: list[torch.Tensor], arrays: list[np.ndarray]) -> None:
    assert len(views) == len(arrays)
    for v, a in zip(views, arrays, strict=True):
        assert v.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and tuple(v.shape) == a.shape
        assert np.array_equal(v.cpu().numpy(), a)


@pytest.mark.parametrize("device", DEVICES)
def test_every_array_comes_back_with_its_dtype_and_shape_and_survives_the_next_step(device):
    staging = StepStaging(torch.device(device), capacity=256)
    assert all(h.is_pinned() == (device == "cuda") for h in staging._host)  # pinned where a copy crosses
    first = _arrays(1, 5)
    views = staging.stage(first)
    _same(views, first)
    kept = [v.clone() for v in views]
    second = _arrays(2, 5)
    _same(staging.stage(second), second)
    _same(views, first)  # the other buffer took the next step: the first step's views are untouched
    assert all(torch.equal(k, v) for k, v in zip(kept, views, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_larger_than_the_buffers_grows_them(device):
    staging = StepStaging(torch.device(device), capacity=64)
    small = _arrays(3, 2)
    views = staging.stage(small)
    big = _arrays(4, 500)  # about 12 KB
    _same(staging.stage(big), big)
    _same(staging.stage(big), big)  # both buffers grown
    _same(views, small)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_with_staged_inputs_matches_transformers(backend, model_dirs, hf_models, monkeypatch):
    from servelm.model.loading import loader

    if backend == "triton":
        from servelm.model.attention import triton_paged

        if not triton_paged.HAS_TRITON:
            pytest.skip("triton is not installed")
        monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)
    staged = []
    real_stage = StepStaging.stage
    monkeypatch.setattr(StepStaging, "stage", lambda self, arrays: staged.append(len(arrays)) or real_stage(self, arrays))
    shared = random_prompts(1, 18, 18, seed=21)[0]
    prompts = [shared + p for p in random_prompts(3, 2, 12, seed=22)] + random_prompts(2, 25, 40, seed=23)
    # compiled Triton kernels (a GPU machine) read only CUDA tensors: there the engine runs on the GPU, where the
    # runner stages its inputs by default; on the CPU (kernels interpreted) staging is forced
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device=device, enforce_eager=True, num_kv_blocks=96,
              block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    runner = llm.engine.core.runner
    if device == "cpu":
        assert runner.staging is None  # the CPU needs no copy
        runner.staging = StepStaging(torch.device("cpu"), capacity=128)
    else:
        assert isinstance(runner.staging, StepStaging)
    assert run(llm, prompts) == reference(hf_models, "llama", prompts)
    assert staged and llm.engine.get_stats().prefix_cache_hits > 0
    assert set(staged) == {7 + (6 if backend == "triton" else 0)}  # ids, positions, rows, 4 of metadata, derived
