"""quantization fp8 end to end on the CPU (the reference path): a float model quantized at load, and FP8
checkpoints in Hugging Face's formats (model/loading/fp8_checkpoint.py), each held to transformers run on the
dequantized weights: greedy tokens equal, prompt logprobs close. Plus the setting's validation and bad
checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from tiny_models import build_model, hf_greedy, random_prompts, run

from servelm import LLM, SamplingParams
from servelm.config.engine import ConfigError, EngineConfig
from servelm.model.loading.fp8_checkpoint import Fp8Checkpoint, fp8_checkpoint
from servelm.model.quant.fp8 import quantize_fp8
from servelm.model.quant.weight_only import is_linear_weight

PROMPTS = random_prompts(2, 5, 20, seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCHEMES = [("tensor", None), ("channel", None), ("compressed", None), ("block", (128, 128)), ("block", (48, 40))]


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory, tokenizer_dir):
    return build_model("llama", tmp_path_factory.mktemp("fp8") / "llama", tokenizer_dir, seed=5)


def _oracle(folder, prompts):
    """transformers' float32 greedy tokens and per-prompt-token logprobs over the twin's weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with torch.no_grad():
        lps = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[torch.arange(len(p) - 1),
                                                                              torch.tensor(p[1:])]
               for p in prompts]
    return tokens, torch.cat(lps)


def _prompt_logprobs(llm, prompts) -> torch.Tensor:
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([d[t].logprob for o, p in zip(outs, prompts, strict=True)
                         for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)])


def _check_against_twin(llm, twin):
    tokens, lps = _oracle(twin, PROMPTS)
    assert run(llm, PROMPTS, GREEDY) == tokens
    got = _prompt_logprobs(llm, PROMPTS)
    torch.testing.assert_close(got, lps, rtol=0, atol=1e-3)


def _fp8_linears(llm):
    model = llm.engine.core.model
    # gate_up.linear is None where a C++ kernel fuses the SiLU-and-multiply (float weights only)
    return [lin for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.down, lw.gate_up.linear or lw.gate_up)]


def test_float_model_quantized_at_load_matches_transformers_on_its_dequantized_weights(float_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    twin = tmp_path / "twin"
    twin.mkdir()
    for f in float_llama.iterdir():
        if f.suffix != ".safetensors":
            (twin / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(float_llama / "model.safetensors"))
    save_file({n: quantize_fp8(t, torch.float32).dequantize() if is_linear_weight(n) else t
               for n, t in weights.items()}, str(twin / "model.safetensors"))
    llm = LLM(str(float_llama), dtype="float32", quantization="fp8", num_kv_blocks=32)
    model = llm.engine.core.model
    assert model.quantization == "fp8"
    lins = _fp8_linears(llm)
    assert all(lin.quant is not None and lin.quant.kind == "fp8" and lin.weight is None for lin in lins)
    assert all(lin.kernel.path == "reference" for lin in lins)
    assert model.lm_head.quant is None  # embeddings and lm_head stay in the model's dtype
    _check_against_twin(llm, twin)


@pytest.mark.parametrize(("scheme", "block"), SCHEMES, ids=lambda v: str(v))
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(scheme, block, float_llama, tmp_path):
    out, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(float_llama, out, twin, scheme, block)
    llm = LLM(str(out), dtype="float32", num_kv_blocks=32)  # quantization auto: fp8 for an fp8 checkpoint
    assert llm.engine.core.model.quantization == "fp8"
    lins = _fp8_linears(llm)
    assert all(lin.quant is not None and lin.quant.kind == "fp8" for lin in lins)
    per_row = block is None or block[1] >= 128  # a block as wide as the 64/128 inputs: one group per row
    assert all(lin.quant.w.per_row == per_row for lin in lins)
    _check_against_twin(llm, twin)


def test_fp8_checkpoint_under_other_quantizations_is_dequantized(float_llama, tmp_path):
    out, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(float_llama, out, twin, "block", (48, 40))
    none = LLM(str(out), dtype="float32", quantization="none", num_kv_blocks=32)
    assert none.engine.core.model.quantization == "none"
    assert all(lin.quant is None for lin in _fp8_linears(none))
    assert run(none, PROMPTS, GREEDY) == run(LLM(str(twin), dtype="float32", num_kv_blocks=32), PROMPTS, GREEDY)
    int8 = LLM(str(out), dtype="float32", quantization="int8", num_kv_blocks=32)
    assert all(lin.quant.kind == "int8" for lin in _fp8_linears(int8))


def test_quantization_config_is_recognised():
    class Config:
        pass

    def of(qc):
        c = Config()
        c.quantization_config = qc
        return fp8_checkpoint(c)

    assert fp8_checkpoint(Config()) is None
    assert of({"quant_method": "fp8"}) == Fp8Checkpoint("fp8", None)
    assert of({"quant_method": "fp8", "weight_block_size": [128, 128]}) == Fp8Checkpoint("fp8", (128, 128))
    assert of({"quant_method": "fbgemm_fp8"}) == Fp8Checkpoint("fbgemm_fp8", None)
    assert of({"quant_method": "gptq", "bits": 4}) is None
    int8_groups = {"g": {"weights": {"type": "int", "num_bits": 8}}}
    assert of({"quant_method": "compressed-tensors", "config_groups": int8_groups}) is None
    with pytest.raises(ValueError, match="only e4m3"):
        of({"quant_method": "fp8", "fmt": "e5m2"})
    with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
        of({"quant_method": "fp8", "weight_block_size": [128]})


def _rewrite(folder, edit):
    """Applies `edit` to the {name: tensor} of each safetensors file in folder."""
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        edit(tensors)
        save_file(tensors, str(f))


def test_bad_fp8_checkpoints_are_refused_with_the_tensor_named(float_llama, tmp_path):
    out, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(float_llama, out, twin, "block", (48, 40))
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    _rewrite(out, lambda t: t.pop(name, None))
    with pytest.raises(ValueError, match="without their pair.*q_proj.weight"):
        LLM(str(out), dtype="float32", num_kv_blocks=32)

    out2, twin2 = tmp_path / "fp8b", tmp_path / "twinb"
    write_fp8_checkpoint(float_llama, out2, twin2, "block", (48, 40))
    _rewrite(out2, lambda t: t.update({name: torch.ones(1, 1)}) if name in t else None)
    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv: shape \[1, 1\], expected \[2, 2\]"):
        LLM(str(out2), dtype="float32", num_kv_blocks=32)

    out3, twin3 = tmp_path / "fp8c", tmp_path / "twinc"
    write_fp8_checkpoint(float_llama, out3, twin3, "channel")
    scale = "model.layers.1.mlp.down_proj.weight_scale"
    _rewrite(out3, lambda t: t.update({scale: torch.ones(3)}) if scale in t else None)
    with pytest.raises(ValueError, match="neither one scale nor one per output row"):
        LLM(str(out3), dtype="float32", num_kv_blocks=32)
    config = json.loads((out3 / "config.json").read_text())
    del config["quantization_config"]
    (out3 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tensors this model does not use"):  # fp8 tensors, no fp8 config
        LLM(str(out3), dtype="float32", num_kv_blocks=32)


def test_the_setting_is_validated():
    assert EngineConfig(quantization="fp8").model_config.quantization == "fp8"
    assert EngineConfig(quantization="fp8", device="cuda").model_config.quantization == "fp8"
    assert EngineConfig(device="cuda").load_quantization() == "auto"  # the loader picks fp8 for fp8 checkpoints
    assert EngineConfig(tensor_parallel_size=2).load_quantization() == "none"
    with pytest.raises(ConfigError, match="quantization must be auto, none or gguf with batch_invariant"):
        EngineConfig(quantization="fp8", batch_invariant=True)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size must be 1, or run with quantization none, int8 "
                                          r"or int4 \(fp8 weights are not split"):
        EngineConfig(quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="quantization must be auto, none, gguf, int8, int4 or fp8, got 'fp4'"):
        EngineConfig(quantization="fp4")

