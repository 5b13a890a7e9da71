"""The real SmolLM2-135M GGUF: native loading matches transformers loading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy

from servelm import LLM, SamplingParams
from servelm.model.loading.gguf_loader import dequantize, hf_name, read_gguf_header, unpermute_rotary
from servelm.model.loading.source import default_model_path, resolve_model

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In 1492, Columbus",
           "The best way to learn a language is", "Water boils at", "My favourite colour is", "import numpy as np"]


@pytest.fixture(scope="module")
def smollm():
    path = default_model_path()
    return LLM(str(path.parent), gguf_file=path.name, dtype="float32", kv_cache_memory_gb=0.25)


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # llama.cpp's converter interleaves the two rotary halves of every head
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rotary(permuted, n_head), w)


def test_model_sources_resolve(tmp_path):
    path = default_model_path()
    assert resolve_model(str(path)).kind == "gguf"  # LLM(model="x.gguf")
    assert resolve_model(str(path.parent), path.name).path == path  # LLM(model="dir", gguf_file=...)
    assert resolve_model(None).path == path  # the default model
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(path.parent), "missing.gguf")


def test_header_reader_agrees_with_gguf_reader():
    import mmap

    import gguf

    path = default_model_path()
    ref = gguf.GGUFReader(str(path))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        head = read_gguf_header(buf)
    assert head.data_offset == ref.data_offset
    assert [(n, list(s), t, o) for n, s, t, o in head.tensors] == \
        [(t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset) - ref.data_offset)
         for t in ref.tensors]
    scalars = {k: f.contents() for k, f in ref.fields.items()
               if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert scalars and all(head.fields[k] == pytest.approx(v) if isinstance(v, float) else head.fields[k] == v
                           for k, v in scalars.items())
    assert all(head.fields[k] is None for k, f in ref.fields.items() if f.types[0] == gguf.GGUFValueType.ARRAY)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "F16", "F32"])
def test_whole_tensor_dequantize_matches_gguf(name):
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    rows, cols = 7, 256
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    if name.startswith("Q") and name != "Q6_K":
        raw = gguf.quants.quantize(x, qtype)  # [rows, bytes per row], uint8
    else:  # no numpy quantizer for Q6_K: random blocks decode just as well; floats as their bytes
        nbytes = cols // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
        raw = (x.astype(np.float16 if name == "F16" else np.float32).view(np.uint8) if name.startswith("F")
               else np.random.default_rng(1).integers(0, 256, (rows, nbytes), dtype=np.uint8))
    want = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw, qtype)
    assert got.shape == (rows, cols) and np.array_equal(got, want, equal_nan=True)


def test_gguf_names_map_to_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("rope_freqs.weight") is None


def test_smollm2_gguf_greedy_matches_transformers(smollm):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = smollm.get_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    ours = smollm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, ours, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 32)


def test_smollm2_default_model_answers(smollm):
    out = smollm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(", the city of Nova Haven was a thriving metropolis")
    chat = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert chat.text == "The capital of France is Paris."
    assert chat.finish_reason == "stop" and chat.stop_reason is None  # ended by EOS <|im_end|>


def test_smollm2_q4_1_linears_kept_as_int4_exactly():
    """quantization=gguf on the real file: every linear (Q4_1) comes as the file's blocks, whose float32 weight
    is the dequantized tensor bit for bit, as is that of their int4 form (PyTorch's kernels' path) (checked in
    the first and last layers; all 210 were, once) (llama.cpp's Q/K row permutation undone on whole rows of
    blocks); the rest (the Q8_0 embedding, float32 norms) is dequantized as before."""
    from servelm.model.loading.gguf_loader import iter_gguf_tensors
    from servelm.model.quant.gguf import GGUFBlocks
    from servelm.model.quant.weight_only import is_linear_weight

    path = default_model_path()
    kept = iter_gguf_tensors(path, torch.float32, keep_quantized=True)
    linears = 0
    for (name, q), (same, dense) in zip(kept, iter_gguf_tensors(path, torch.float32), strict=True):
        assert name == same
        if is_linear_weight(name):
            assert isinstance(q, GGUFBlocks) and q.source == "Q4_1", name
            linears += 1
            if name.startswith(("model.layers.0.", "model.layers.29.")):  # first and last layer: bit for bit
                assert torch.equal(q.dequantize(), dense) and torch.equal(q.to_int4().dequantize(), dense), name
        else:
            assert torch.equal(q, dense), name
    assert linears == 210
