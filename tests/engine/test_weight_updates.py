"""Weights updated in place (LLM.load_weights, update_weights_from_disk): the running engine takes another
checkpoint of the same shapes and answers as transformers does on that checkpoint, with its kernel tapes and
buffers where they were; the prefix cache forgets what the old weights computed; a checkpoint that does not fit
changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_parity import (
    GREEDY8,
    assert_greedy_matches,
    granite_config,
    hf_state_dict,
    mixed_prompts,
    references,
    save_tiny,
)
from tiny_models import COMMON, run

from servelm import LLM
from servelm.model.weight_update import weight_tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Two Llama checkpoints of one shape and settings (seeds 0 and 1), one of another width, and one of the
    same shapes with another RoPE base."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("weights")

    def llama(**kw):
        return LlamaConfig(**{**COMMON, "tie_word_embeddings": False, **kw})

    return {"a": save_tiny(llama(), root / "a", tokenizer_dir, seed=0),
            "b": save_tiny(llama(), root / "b", tokenizer_dir, seed=1),
            "wider": save_tiny(llama(intermediate_size=2 * COMMON["intermediate_size"]), root / "wider",
                               tokenizer_dir, seed=2),
            "theta": save_tiny(llama(rope_theta=500000.0), root / "theta", tokenizer_dir, seed=3)}


def check(llm: LLM, folder: Path, dtype: str) -> None:
    prompts = mixed_prompts()
    assert_greedy_matches(folder, dtype, prompts, run(llm, prompts, GREEDY8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_state_dict_and_a_folder_replace_the_weights_in_place(checkpoints, dtype):
    llm = LLM(str(checkpoints["a"]), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=16)
    check(llm, checkpoints["a"], dtype)
    model = llm.engine.core.model
    where = {path: t.data_ptr() for path, t in weight_tensors(model).items()}
    replayed = model.tapes.replayed if model.tapes is not None else None
    llm.load_weights(hf_state_dict(checkpoints["b"]))  # float32 tensors, under transformers' names
    assert {path: t.data_ptr() for path, t in weight_tensors(model).items()} == where  # nothing moved
    check(llm, checkpoints["b"], dtype)
    if replayed is not None:  # bf16 on servelm's kernels: the same tapes replay the new values
        assert model.tapes.replayed > replayed
    llm.update_weights_from_disk(str(checkpoints["a"]))
    check(llm, checkpoints["a"], dtype)


def test_the_prefix_cache_forgets_what_the_old_weights_computed(checkpoints):
    """A prompt cached under the old weights is computed again under the new ones; its second run is cached."""
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64)
    prompt = mixed_prompts()[2]  # 40 tokens: two full blocks to cache
    [first] = llm.generate([prompt], GREEDY8, use_tqdm=False)
    llm.load_weights(hf_state_dict(checkpoints["b"]).items())
    [after] = llm.generate([prompt], GREEDY8, use_tqdm=False)
    [again] = llm.generate([prompt], GREEDY8, use_tqdm=False)
    assert after.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert after.outputs[0].token_ids == references(checkpoints["b"], "float32", [prompt])[0] \
        != first.outputs[0].token_ids


@pytest.mark.parametrize("bad, why", [("wider", "do not fit"), ("theta", "inv_freq differs"), ("missing", "lacks"),
                                      ("extra", "does not"), ("another architecture", "differs")])
def test_a_checkpoint_that_does_not_fit_changes_nothing(checkpoints, tmp_path, tokenizer_dir, bad, why):
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64)
    model = llm.engine.core.model
    before = {path: t.clone() for path, t in weight_tensors(model).items()}
    with pytest.raises(ValueError, match=why):
        if bad == "wider":
            llm.load_weights(hf_state_dict(checkpoints["wider"]))
        elif bad == "theta":
            llm.update_weights_from_disk(str(checkpoints["theta"]))
        elif bad == "another architecture":
            llm.update_weights_from_disk(str(save_tiny(granite_config(), tmp_path / "g", tokenizer_dir)))
        else:
            sd = hf_state_dict(checkpoints["b"])
            if bad == "missing":
                del sd["model.layers.1.mlp.down_proj.weight"]
            else:
                sd["model.layers.9.mlp.down_proj.weight"] = torch.zeros(4)
            llm.load_weights(sd)
    after = weight_tensors(model)
    assert all(torch.equal(after[p], t) for p, t in before.items())
    check(llm, checkpoints["a"], "float32")


def test_an_update_waits_for_an_idle_engine(checkpoints):
    """Tokens of one request from two models would be neither's: while one runs, the update is refused."""
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64)
    llm.engine.add_request("busy", mixed_prompts()[0], GREEDY8)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.load_weights(hf_state_dict(checkpoints["b"]))
    llm.engine.abort_request("busy")
    check(llm, checkpoints["a"], "float32")


def test_a_gguf_model_kept_quantized_takes_a_gguf_file():
    """The default model's Q4_1 linears, kept as stored: dense tensors cannot become its blocks (a ValueError
    naming the way), and a GGUF file's blocks are copied into them (the same file: the same tokens after)."""
    from servelm.model.loading.source import default_model_path

    path = default_model_path()
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    if llm.engine.core.model.quantization != "gguf":
        pytest.skip("this CPU runs no GGUF kernels: the linears are dequantized at load")
    prompt = "The capital of France is"
    before = llm.generate([prompt], GREEDY8, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="GGUF file's path"):
        llm.load_weights({"model.norm.weight": torch.ones(576)})
    llm.update_weights_from_disk(str(path))
    assert llm.generate([prompt], GREEDY8, use_tqdm=False)[0].outputs[0].token_ids == before


def test_a_mixture_of_experts_model_takes_new_weights(tmp_path, tokenizer_dir):
    """Qwen3-MoE: its router and stacked experts (and the spec's MoE options, compared field by field) too."""
    from family_parity import moe_config

    a, b = (save_tiny(moe_config("qwen3_moe"), tmp_path / name, tokenizer_dir, seed=seed)
            for name, seed in (("a", 0), ("b", 1)))
    llm = LLM(str(a), dtype="float32", num_kv_blocks=64)
    check(llm, a, "float32")
    llm.update_weights_from_disk(str(b))
    check(llm, b, "float32")


def test_a_checkpoint_of_weights_and_config_alone_is_enough(checkpoints, tmp_path):
    """What a trainer writes: config.json and the safetensors, no tokenizer files."""
    bare = tmp_path / "step-1"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((checkpoints["b"] / f).read_bytes())
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64)
    llm.update_weights_from_disk(str(bare))
    check(llm, checkpoints["b"], "float32")


def test_a_partial_update_applies_each_layer_once_all_of_it_has_arrived(checkpoints):
    """load_weights(partial=True), one tensor at a time as a trainer's loop over named_parameters sends them
    (vLLM's model.load_weights takes any subset): a layer is copied once its last tensor arrives, the others
    wait (and no request is taken meanwhile), and at the end the model is the new checkpoint."""
    llm = LLM(str(checkpoints["a"]), dtype="float32", num_kv_blocks=64)
    model = llm.engine.core.model
    new = hf_state_dict(checkpoints["b"])
    layer0 = [n for n in new if n.startswith("model.layers.0.")]
    before = {p: t.clone() for p, t in weight_tensors(model.layers[1]).items()}
    first = {p: t.clone() for p, t in weight_tensors(model.layers[0]).items()}
    for name in layer0[:-1]:
        assert llm.load_weights([(name, new[name])], partial=True) == sorted(layer0[:layer0.index(name) + 1])
    with pytest.raises(ValueError, match="waits for the rest of its layers"):
        llm.generate([[1, 2, 3]], GREEDY8, use_tqdm=False)
    with pytest.raises(ValueError, match="do not fit"):  # a wrong shape changes nothing, what waits included
        llm.load_weights([(layer0[-1], torch.zeros(3))], partial=True)
    assert all(torch.equal(weight_tensors(model.layers[0])[p], t) for p, t in first.items())  # waiting
    assert llm.load_weights([(layer0[-1], new[layer0[-1]])], partial=True) == []  # layer 0 complete: copied
    assert not all(torch.equal(weight_tensors(model.layers[0])[p], t) for p, t in first.items())
    after = weight_tensors(model.layers[1])
    assert all(torch.equal(after[p], t) for p, t in before.items())  # layer 1 untouched so far
    rest = [n for n in new if n not in layer0]
    for name in rest:
        left = llm.load_weights([(name, new[name])], partial=True)
    assert left == []
    check(llm, checkpoints["b"], "float32")
    llm.load_weights([(rest[0], new[rest[0]])], partial=True)  # waits again; a whole state dict supersedes it
    llm.load_weights(hf_state_dict(checkpoints["a"]))
    check(llm, checkpoints["a"], "float32")
