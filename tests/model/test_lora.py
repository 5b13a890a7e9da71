"""LoRA adapters against PEFT: greedy tokens equal transformers running the adapter merged into the weights
(float32), for adapters of two ranks alone and batched with base rows and each other, under chunked prefill and
the prefix cache; adapters that cannot serve a base are refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from random_weights import make_adapter
from tiny_models import hf_greedy, random_prompts, run

from servelm import LLM, LoRARequest, SamplingParams
from servelm.lora import LoRARequest as LoRARequestFromPackage

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rsLoRA, target modules): PEFT's common attention-only adapter, and a rank-64 one on every linear
ADAPTERS = {"small": (8, 16, False, ["q_proj", "v_proj"]), "big": (64, 32, True, ALL)}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, model_dirs, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    merged, paths = {}, {}
    for i, (name, (r, alpha, rs, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        merged[name] = make_adapter(model_dirs[arch], paths[name], r, alpha, rs, targets, seed=10 + i)
    return arch, model_dirs[arch], paths, merged


def _oracle(models, prompts, max_new=12):
    return [hf_greedy(models, p, max_new) for p in prompts]


def _params(n=12):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_lora_request_is_vllms(tmp_path):
    r = LoRARequest("sql", 1, str(tmp_path))
    assert (r.name, r.adapter_id, r.path) == ("sql", 1, str(tmp_path))
    assert LoRARequestFromPackage is LoRARequest
    with pytest.raises(ValueError, match="positive"):
        LoRARequest("x", 0, "p")


def test_each_adapter_alone_matches_peft_merged(setup, hf_models):
    arch, base_dir, paths, merged = setup
    prompts = random_prompts(3, 5, 40, seed=21)
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=128, enable_lora=True)
    base = run(llm, prompts, _params())
    for i, name in enumerate(ADAPTERS, 1):
        got = run_lora(llm, prompts, LoRARequest(name, i, str(paths[name])))
        want = _oracle(merged[name], prompts)
        assert got == want, name
        assert got != base  # the adapter changed the outputs: the comparison above is not vacuous


def run_lora(llm, prompts, lora):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), use_tqdm=False, lora_request=lora)]


@pytest.mark.parametrize("budget", [2048, 7])
def test_adapters_batched_with_base_rows_under_chunking_and_the_prefix_cache(setup, hf_models, budget):
    """One generate call mixes base rows and both adapters on the same prompts (so a prefix-cache hit across
    adapters would give wrong tokens); a second call repeats them over the warm cache. Budget 7 cuts every
    prompt into chunks that share steps with other rows' decodes."""
    arch, base_dir, paths, merged = setup
    prompts = random_prompts(4, 20, 50, seed=22)
    loras = [None, LoRARequest("small", 1, str(paths["small"])), LoRARequest("big", 2, str(paths["big"]))]
    batch = [p for p in prompts for _ in loras]
    per_row = [lr for _ in prompts for lr in loras]
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=256, enable_lora=True, max_num_batched_tokens=budget,
              block_size=8)
    want = []
    for p in prompts:
        want += [hf_greedy(hf_models[arch], p, 12), hf_greedy(merged["small"], p, 12), hf_greedy(merged["big"], p, 12)]
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, _params(), use_tqdm=False, lora_request=per_row)]
        assert got == want
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0  # the second round reused blocks, each within its own adapter


def test_adapters_with_steps_launched_behind_one_another(setup, hf_models):
    """Asynchronous scheduling (the GPU's default) launches each decode step behind the one in flight: every row
    keeps its adapter in the steps behind, so the outputs are still PEFT's merged models'."""
    arch, base_dir, paths, merged = setup
    prompts = random_prompts(3, 10, 30, seed=24)
    loras = [None, LoRARequest("small", 1, str(paths["small"])), LoRARequest("big", 2, str(paths["big"]))]
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=256, enable_lora=True, async_scheduling=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)]
    assert got == [hf_greedy(m, p, 12) for m, p in zip((hf_models[arch], merged["small"], merged["big"]), prompts,
                                                      strict=True)]
    assert llm.engine.core.num_overlapped_steps > 0  # steps did go behind one another


def test_max_loras_bounds_a_step_and_requests_still_finish(setup):
    """With room for one adapter per step, rows of two adapters take turns; every request finishes correctly."""
    arch, base_dir, paths, merged = setup
    prompts = random_prompts(4, 5, 20, seed=23)
    loras = [LoRARequest("small", 1, str(paths["small"])), LoRARequest("big", 2, str(paths["big"]))] * 2
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=1)
    seen = []
    core = llm.engine.core
    step = core.runner.execute

    def watch(out):
        names = {s.request.lora.lora_name for s in out.seqs if s.request.lora}
        seen.append(len(names))
        return step(out)

    core.runner.execute = watch
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)]
    assert got == [hf_greedy(merged[lr.lora_name], p, 12) for p, lr in zip(prompts, loras, strict=True)]
    assert max(seen) == 1


def test_stats_name_the_adapters_running_and_waiting(setup):
    """What lora_requests_info reports: with room for one adapter per step, the second adapter's request waits."""
    from servelm.engine.llm_engine import LLMEngine

    arch, base_dir, paths, merged = setup
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=1)
    engine: LLMEngine = llm.engine
    assert (engine.core.stats().max_loras, engine.core.stats().running_lora_adapters) == (1, [])
    engine.add_request("a", [5, 6, 7], _params(4), lora_request=LoRARequest("small", 1, str(paths["small"])))
    engine.add_request("b", [5, 6, 8], _params(4), lora_request=LoRARequest("big", 2, str(paths["big"])))
    engine.add_request("c", [5, 6, 9], _params(4))  # the base model's rows name no adapter
    engine.step()
    st = engine.core.stats()
    assert (st.running_lora_adapters, st.waiting_lora_adapters) == (["small"], ["big"])
    while engine.has_unfinished_requests():
        engine.step()
    st = engine.core.stats()
    assert (st.running_lora_adapters, st.waiting_lora_adapters) == ([], [])


def test_lora_modules_load_at_start_and_adapters_unload(setup):
    arch, base_dir, paths, merged = setup
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=64, lora_modules=(f"small={paths['small']}",))
    assert llm.engine.list_loras() == ["small"]
    prompt = random_prompts(1, 10, 10, seed=24)
    # named without a path: the adapter loaded at start
    assert run_lora(llm, prompt, LoRARequest("small", 1)) == _oracle(merged["small"], prompt)
    assert llm.engine.remove_lora("small") and llm.engine.list_loras() == []
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate(prompt, _params(), use_tqdm=False, lora_request=LoRARequest("small", 1))
    assert not llm.engine.core.loras.refs  # the refused request holds nothing


def test_least_recently_used_adapters_are_unloaded_and_read_again(setup):
    arch, base_dir, paths, merged = setup
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=1, max_cpu_loras=1)
    prompt = random_prompts(1, 10, 10, seed=25)
    a, b = LoRARequest("small", 1, str(paths["small"])), LoRARequest("big", 2, str(paths["big"]))
    assert run_lora(llm, prompt, a) == _oracle(merged["small"], prompt)
    assert run_lora(llm, prompt, b) == _oracle(merged["big"], prompt)
    loras = llm.engine.core.loras
    assert list(loras.loaded) == ["big"] and set(loras.known) == {"small", "big"}
    assert run_lora(llm, prompt, a) == _oracle(merged["small"], prompt)  # read again from its path
    assert list(loras.loaded) == ["small"]


def _write_adapter(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize("case,match", [
    ("rank", "over max_lora_rank"),
    ("shape", "another base model"),
    ("module", "cannot take an adapter|not a LoRA matrix"),
    ("dora", "DoRA"),
])
def test_adapters_that_cannot_serve_the_base_are_refused(llama_dir, tmp_path, case, match):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    tensors = {key.format("A"): torch.randn(4, 64), key.format("B"): torch.randn(64, 4)}
    if case == "rank":
        config["r"] = 8
        tensors = {key.format("A"): torch.randn(8, 64), key.format("B"): torch.randn(64, 8)}
    elif case == "shape":
        tensors[key.format("A")] = torch.randn(4, 96)
    elif case == "module":
        tensors = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 10)}
    elif case == "dora":
        config["use_dora"] = True
    path = _write_adapter(tmp_path / case, config, tensors)
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 5, 6]], _params(2), use_tqdm=False, lora_request=LoRARequest("bad", 1, str(path)))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.core.loras.refs


def test_a_lora_request_without_enable_lora_is_refused(llama_dir, tmp_path):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable-lora"):
        llm.generate([[1, 5, 6]], _params(2), use_tqdm=False, lora_request=LoRARequest("x", 1, str(tmp_path)))
    assert not llm.engine.has_unfinished_requests()


def _gate_up_cases():
    """(id, gate, up, dtype, act) for each way GateUpLinear runs here: the fused dense kernel in float32 and
    bf16 (or the tile kernels where the CPU has them), kept GGUF blocks with the fused store, int8 codes (no
    fused store: [gate | up] from Linear) and GeGLU (PyTorch's activation)."""
    from random_weights import random_blocks

    from servelm.model.quant.weight_only import quantize_int8

    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    return [
        pytest.param(gate, up, torch.float32, "silu", id="float32"),
        pytest.param(gate.bfloat16(), up.bfloat16(), torch.bfloat16, "silu", id="bf16"),
        pytest.param(random_blocks("Q8_0", 64, 256, 1), random_blocks("Q8_0", 64, 256, 2), torch.bfloat16, "silu", id="gguf"),
        pytest.param(quantize_int8(gate, torch.float32), quantize_int8(up, torch.float32), torch.float32, "silu",
                     id="int8"),
        pytest.param(gate, up, torch.float32, "gelu_tanh", id="geglu"),
    ]


@pytest.mark.parametrize("gate,up,dtype,act", _gate_up_cases())
def test_gate_up_preactivation_is_gate_then_up_on_every_path(gate, up, dtype, act):
    """What a LoRA update is added to: x [Wg; Wu]^T in [gate | up] order whatever order the kernel stores, and
    its activation equal to the fused layer's output."""
    from servelm.model.layers.blocks import GateUpLinear

    def dense(w):
        return w.float() if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)

    layer = GateUpLinear(gate, up, act)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6)).to(dtype)
    pre = layer.preactivation(x)
    want = x.float() @ torch.cat([dense(gate), dense(up)]).t()
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert torch.allclose(pre.float(), want, rtol=tol, atol=tol * want.abs().max())
    out = layer.activate(pre)
    assert torch.allclose(out.float(), layer(x).float(), rtol=tol, atol=tol * out.float().abs().max())


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_bases_take_adapters(setup, quantization):
    """On an int8/int4/fp8 base the adapter's rows change and base rows in the same batch keep the base's tokens."""
    arch, base_dir, paths, merged = setup
    prompts = random_prompts(2, 8, 20, seed=26)
    llm = LLM(str(base_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, quantization=quantization)
    base = run(llm, prompts, _params())
    lora = LoRARequest("big", 2, str(paths["big"]))
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts * 2, _params(), use_tqdm=False,
                                                          lora_request=[None, None, lora, lora])]
    assert mixed[:2] == base
    assert mixed[2:] != base
