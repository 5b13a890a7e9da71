"""The fp8 KV cache (--kv-cache-dtype fp8): the quantization's round trip, the PyTorch backend (and the CPU
backend, which routes an fp8 cache to it) against float attention, and the engine end to end on a tiny model:
first-step logits close to the float cache's, generation, twice the blocks, swap, and the config's errors.
The Triton kernels' fp8 loads are checked in tests/kernels/test_triton_fp8_kv.py."""

from __future__ import annotations

import pytest
import torch

from servelm.config.engine import ConfigError, EngineConfig
from servelm.model.attention import AttentionMetadata, PrefillSpan, TorchPagedAttention
from servelm.model.attention.kv_quant import FP8, FP8_MAX, KVCache, cache_dtype, dequantize, quantize, scales

# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself; below the smallest normal (2^-6)
# the spacing is the subnormals' 2^-9, so half of that is the absolute bound there
REL, ABS = 2.0**-4, 2.0**-10


def test_round_trip_is_within_e4m3_rounding_and_saturates():
    x = torch.cat([torch.randn(4096, generator=torch.Generator().manual_seed(0)) * s for s in (1e-3, 1.0, 100.0)]
                  + [torch.tensor([1000.0, -2000.0])])
    before = x.clone()
    for scale in (1.0, 0.25, 3.0):
        back = dequantize(quantize(x, scale), scale, torch.float32)
        assert torch.equal(x, before)  # the input is left as it was
        inside = x.abs() <= FP8_MAX * scale
        bound = REL * x.abs() + ABS * scale
        assert bool(((back - x).abs() <= bound)[inside].all())
        assert torch.equal(back[~inside], FP8_MAX * scale * x[~inside].sign())  # saturated beyond the range
    q = quantize(torch.tensor([1000.0, -1e6, 448.0, 0.0, float("inf")]))
    assert q.dtype == FP8
    assert q.float().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, 0.0, FP8_MAX]  # saturated, never NaN
    # a scale widens the range: 832 is out of range at 1.0, exactly 2 x 416 at 2.0
    assert dequantize(quantize(torch.tensor([832.0]), 2.0), 2.0, torch.float32).item() == 832.0
    assert dequantize(quantize(torch.tensor([1.5], dtype=torch.bfloat16)), 1.0, torch.bfloat16).dtype == torch.bfloat16


def test_cache_dtype_names():
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8", torch.bfloat16) == cache_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        cache_dtype("fp8_e5m2", torch.bfloat16)
    assert scales((torch.zeros(1), torch.zeros(1))) == (1.0, 1.0)
    assert scales(KVCache(torch.zeros(1), torch.zeros(1), 0.5, 2)) == (0.5, 2.0)
    import copy

    assert scales(copy.deepcopy(KVCache(torch.zeros(1), torch.zeros(1), 0.5, 2))) == (0.5, 2.0)


def _step(hkv: int, d: int, bs: int, nb: int):
    """A random float cache and a mixed step: 3 decodes, a 20-token chunk after a 27-token cached prefix and a
    9-token prompt (as tests/kernels/test_triton_attention.py)."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g) * 3
    perm = torch.randperm(nb, generator=g)
    dec_lens, dec_tables = torch.tensor([1, 17, 40]), perm[:15].view(3, 5)
    spans = [PrefillSpan(3, 20, 47, perm[15:21]), PrefillSpan(23, 9, 9, perm[21:23])]
    slots = [int(dec_tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(dec_lens.tolist())]
    for s in spans:
        slots += [int(s.block_table[p // bs]) * bs + p % bs for p in range(s.ctx_len - s.q_len, s.ctx_len)]
    return kc, vc, AttentionMetadata(torch.tensor(slots), torch.arange(3), dec_tables, dec_lens, spans, bs), 32


def fp8_case(hq=4, hkv=2, d=16, bs=8, nb=24, k_scale=0.5, v_scale=2.0):
    """(q, k, v, the fp8 cache, a float cache holding its dequantized values, the float cache it was quantized
    from, meta)."""
    kc, vc, meta, t = _step(hkv, d, bs, nb)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    fp8 = KVCache(quantize(kc, k_scale), quantize(vc, v_scale), k_scale, v_scale)
    ref = (dequantize(fp8[0], k_scale, torch.float32), dequantize(fp8[1], v_scale, torch.float32))
    return q, k, v, fp8, ref, (kc, vc), meta


@pytest.mark.parametrize("window", [None, 7])
def test_torch_backend_reads_an_fp8_cache_as_its_dequantized_values(window):
    """The mixed step (decodes, a chunk over a cached prefix, a fresh prompt) over an fp8 cache with scales: the
    same as float attention over the dequantized cache and the dequantized new keys and values, and within fp8
    rounding of float attention over the unquantized ones. The new keys and values land quantized."""
    hq, hkv, d = 4, 2, 16
    q, k, v, fp8, ref_cache, orig, meta = fp8_case()
    k_scale, v_scale = scales(fp8)
    attn = TorchPagedAttention(hq, hkv, d, d**-0.5)
    out = attn.forward(q, k, v, fp8, meta, window)
    kq, vq = (dequantize(quantize(x, s), s, torch.float32) for x, s in ((k, k_scale), (v, v_scale)))
    want = attn.forward(q, kq, vq, tuple(c.clone() for c in ref_cache), meta, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    exact = attn.forward(q, k, v, orig, meta, window)
    err = (out - exact).abs()  # what e4m3's rounding (2^-4 relative at most) moves the outputs by
    assert err.mean() < 0.06 * exact.abs().mean() and err.max() < 0.3
    slots = meta.slot_mapping
    assert torch.equal(fp8[0].view(-1, hkv, d)[slots].view(torch.uint8), quantize(k, k_scale).view(torch.uint8))
    assert torch.equal(fp8[1].view(-1, hkv, d)[slots].view(torch.uint8), quantize(v, v_scale).view(torch.uint8))


def test_cpu_backend_routes_an_fp8_cache_to_the_torch_path():
    """The C++ kernels read caches in the model's dtype only: with an fp8 cache the CPU backend gives the
    PyTorch backend's output bit for bit (and writes the same bytes)."""
    from servelm.model.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C++ kernels are not built")
    from servelm.model.attention import CpuPagedAttention

    hq, hkv, d = 4, 2, 16
    q, k, v, fp8, _, _, meta = fp8_case()
    fp8_b = KVCache(fp8[0].clone(), fp8[1].clone(), *scales(fp8))
    want = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, fp8, meta, None)
    got = CpuPagedAttention(hq, hkv, d, d**-0.5, kernels=kernels).forward(q, k, v, fp8_b, meta, None)
    assert torch.equal(got, want)
    assert torch.equal(fp8[0].view(torch.uint8), fp8_b[0].view(torch.uint8))


# -- the engine --------------------------------------------------------------------------------------------

def _first_logits(llm, prompt: list[int]) -> torch.Tensor:
    """The logits of the prompt's last position, and of the first generated token's, from the engine's runner."""
    from servelm import SamplingParams

    seen = []
    model = llm.engine.loaded.model
    real = model.logits

    def spy(hidden):
        out = real(hidden)
        seen.append(out.float().clone())
        return out

    model.logits = spy
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        del model.logits
    return torch.cat(seen)


def test_engine_with_an_fp8_cache(llama_dir, monkeypatch):
    """A tiny Llama with kv_cache_dtype=fp8: twice the blocks of the float32 cache for the same memory... four
    times (float32 is 4 bytes); first-step logits equal, to float rounding, those of the float-cache engine whose
    new keys and values are rounded through fp8 before they are written (so every read of the fp8 cache, the
    prompt's own included, sees exactly the quantized values), and close to the float cache's (greedy choices are
    not promised equal: the random tiny model's scores are large, so e4m3's 2^-4 rounding moves its logits by some
    15%, bfloat16's 2^-8 by 1%); generation runs, a shared prefix read back from the prefix cache included."""
    from tiny_models import random_prompts

    from servelm import LLM, SamplingParams
    from servelm.model.attention import base, torch_paged

    kw = dict(dtype="float32", kv_cache_memory_gb=2**-7, max_num_batched_tokens=32)  # 8 MiB
    auto, fp8 = LLM(str(llama_dir), **kw), LLM(str(llama_dir), kv_cache_dtype="fp8", **kw)
    assert fp8.engine.core.kv_plan.num_blocks == 4 * auto.engine.core.kv_plan.num_blocks
    assert fp8.engine.core.runner.kv_caches[0][0].dtype == FP8
    assert fp8.engine.get_stats().kv_cache_dtype == "float8_e4m3fn"
    assert "of float8_e4m3fn" in fp8.engine.core.kv_plan.describe()
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    exact, got = _first_logits(auto, prompt), _first_logits(fp8, prompt)

    write = base.AttentionBackend.write_kv

    def rounded(k, v, kv_cache, slots):
        write(*(dequantize(quantize(x), 1.0, x.dtype) for x in (k, v)), kv_cache, slots)

    monkeypatch.setattr(base.AttentionBackend, "write_kv", staticmethod(rounded))
    monkeypatch.setattr(torch_paged.CpuPagedAttention, "write_kv", lambda self, *a: rounded(*a))
    emulated = _first_logits(LLM(str(llama_dir), **kw), prompt)
    monkeypatch.undo()
    torch.testing.assert_close(got, emulated, atol=1e-4, rtol=1e-4)
    assert bool(((got - exact).norm(dim=-1) < 0.3 * exact.norm(dim=-1)).all())
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    shared = random_prompts(1, 20, 20, seed=7)[0]
    prompts = [shared + own for own in random_prompts(3, 3, 15, seed=8)]
    outs = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert fp8.engine.get_stats().prefix_cache_hits > 0
    tapes = fp8.engine.loaded.model.tapes  # the C++ decode tapes (where they run) never see an fp8 cache
    assert tapes is None or (tapes.recorded == 0 and tapes.replayed == 0)


def test_engine_bf16_block_count_doubles(llama_dir):
    """In bfloat16 (the usual model dtype) fp8 halves a block's bytes: twice the blocks for the same memory."""
    from servelm.engine.model_runner import kv_bytes_per_block
    from servelm.model.loading.loader import load_model

    model = load_model(str(llama_dir), dtype="bfloat16", with_tokenizer=False).model
    assert kv_bytes_per_block(model, 16, "fp8") * 2 == kv_bytes_per_block(model, 16, "auto")


def test_swap_keeps_the_fp8_cache(llama_dir):
    """Preemption by swap with an fp8 cache: the CPU copies are fp8 too, and the swapped requests finish with
    the tokens an unpressured fp8 engine gives them."""
    from tiny_models import random_prompts

    from servelm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(6, 20, 30, seed=11)
    kw = dict(dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=64)
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), num_kv_blocks=128, **kw).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(str(llama_dir), num_kv_blocks=14, preemption_mode="swap", swap_space_gb=0.01, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.get_stats().num_swaps > 0
    assert llm.engine.core.runner.cpu_caches[0][0].dtype == FP8
    assert got == ref


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto with batch_invariant"):
        EngineConfig(kv_cache_dtype="fp8", batch_invariant=True)
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").cache_config.kv_cache_dtype == "fp8_e4m3"


def test_the_serve_flag(monkeypatch):
    """--kv-cache-dtype on `servelm serve`, as vLLM spells it."""
    from servelm.entrypoints.cli import build_parser
    from servelm.server import serve

    for k in [k for k in __import__("os").environ if k.startswith("SERVELM_")]:
        monkeypatch.delenv(k)
    assert serve.load_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])).engine.cache_config.kv_cache_dtype \
        == "fp8"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be auto, fp8 or fp8_e4m3 \(set by --kv-cache-dtype\)"):
        serve.load_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"]))


def test_persisted_fp8_cache_restores_into_fp8_only(llama_dir, tmp_path):
    """A saved fp8 prefix cache restores into an fp8 engine (hits, the same tokens) and is refused by an engine
    whose cache is float32, and the reverse: bytes are never read as another element type."""
    from tiny_models import random_prompts, run

    from servelm import LLM, SamplingParams
    from servelm.engine import kv_persist
    from servelm.engine.kv_persist import KVMismatchError
    from servelm.model.loading.source import resolve_model

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + p[1:] for p in random_prompts(3, 12, 20, seed=8)]

    def llm(kv_cache_dtype: str) -> LLM:
        return LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)

    first = llm("fp8")
    digest = kv_persist.model_hash(resolve_model(str(llama_dir)), first.engine.core.model.spec)
    outputs = run(first, prompts, params)
    path = tmp_path / "fp8.kvcache"
    saved = kv_persist.save(first.engine.core, path, digest)
    assert saved.size_bytes < 0.3 * saved.num_blocks * 2 * 2 * 16 * 2 * 16 * 4 + 4096  # 1 byte an entry, not 4
    fresh = llm("fp8")
    assert kv_persist.load(fresh.engine.core, path, digest).num_blocks == saved.num_blocks
    assert run(fresh, prompts, params) == outputs
    assert fresh.engine.get_stats().prefix_cache_hits > 0
    float_engine = llm("auto")
    with pytest.raises(KVMismatchError, match=r"different KV cache dtype \(float8_e4m3fn; this engine: float32\)"):
        kv_persist.load(float_engine.engine.core, path, digest)
    run(float_engine, prompts, params)
    float_path = tmp_path / "float.kvcache"
    kv_persist.save(float_engine.engine.core, float_path, digest)
    with pytest.raises(KVMismatchError, match=r"different KV cache dtype \(float32; this engine: float8_e4m3fn\)"):
        kv_persist.load(llm("fp8").engine.core, float_path, digest)


def test_an_fp8_cache_needs_compute_capability_8_9_on_a_gpu(monkeypatch):
    from servelm.engine.model_runner import check_kv_cache_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer"):
        check_kv_cache_dtype("fp8", torch.device("cuda"))
    check_kv_cache_dtype("auto", torch.device("cuda"))
    check_kv_cache_dtype("fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype("fp8_e4m3", torch.device("cuda"))


def test_checkpoint_scales_are_loaded(llama_dir, tmp_path):
    """A checkpoint made for an fp8 KV cache gives self_attn.k_scale / v_scale per layer (vLLM's names; an older
    kv_scale serves both): the fp8 cache uses them, a cache in the model's dtype ignores them, as vLLM."""
    from safetensors.torch import save_file

    from servelm import LLM, SamplingParams

    folder = tmp_path / "scaled"
    folder.mkdir()
    for f in llama_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.kv_scale": torch.tensor([0.25])}, str(folder / "kv-scales.safetensors"))
    fp8 = LLM(str(folder), dtype="float32", num_kv_blocks=32, kv_cache_dtype="fp8")
    assert [scales(kv) for kv in fp8.engine.core.runner.kv_caches] == [(0.5, 2.0), (0.25, 0.25)]
    out = fp8.generate([[1, 5, 9, 200]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    auto = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    assert [scales(kv) for kv in auto.engine.core.runner.kv_caches] == [(1.0, 1.0), (1.0, 1.0)]


def test_a_draft_model_shares_the_cache_dtype(llama_dir):
    """Speculative decoding with a self-draft over fp8 caches: the draft's cache is fp8 too, and greedy
    verification gives the fp8 engine's own tokens."""
    from tiny_models import random_prompts, run

    from servelm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(3, 10, 30, seed=5)
    kw = dict(dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8")
    plain = run(LLM(str(llama_dir), **kw), prompts, params)
    spec = LLM(str(llama_dir), speculative_model="self:1", num_speculative_tokens=3, **kw)
    assert spec.engine.core.spec.proposer.runner.kv_caches[0][0].dtype == FP8
    assert run(spec, prompts, params) == plain


def test_tensor_parallel_ranks_keep_fp8_caches(model_dirs):
    """TP=2 with an fp8 cache (each rank its heads' fp8 blocks): the prompt tokens' logprobs are those of one
    process with an fp8 cache, to within what a rounding of a key or value to the other side of an fp8 step moves
    them (the ranks' float32 sums differ from one process's in their last bits), far inside fp8's own error."""
    from test_tensor_parallel import _prompt_logprobs
    from tiny_models import random_prompts

    from servelm import LLM

    prompts = random_prompts(3, 10, 40, seed=14)
    path = str(model_dirs["qwen3"])
    exact = _prompt_logprobs(LLM(path, dtype="float32", num_kv_blocks=64), prompts)
    tp1 = _prompt_logprobs(LLM(path, dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8"), prompts)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8", tensor_parallel_size=2)
    tp2 = _prompt_logprobs(llm, prompts)
    llm.engine.close()
    assert (tp2 - tp1).abs().mean() <= 0.25 * (tp1 - exact).abs().mean()


def test_an_fp8_checkpoints_kv_scales_reach_the_fp8_cache(llama_dir, tmp_path):
    """An FP8 checkpoint (fp8 weights, quantization auto -> fp8) with per-layer k_scale/v_scale: the fp8 KV cache
    takes them (the weights' reader passes them on); the model's-dtype cache ignores them."""
    from fp8_checkpoints import write_fp8_checkpoint
    from safetensors.torch import save_file

    from servelm import LLM, SamplingParams

    out = tmp_path / "fp8"
    write_fp8_checkpoint(llama_dir, out, tmp_path / "twin", "tensor")
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s) for i in range(2)
               for n, s in (("k", 0.5), ("v", 0.125))}, str(out / "model-kv-scales.safetensors"))
    llm = LLM(str(out), dtype="float32", num_kv_blocks=32, kv_cache_dtype="fp8")
    assert llm.engine.core.model.quantization == "fp8"
    assert [scales(kv) for kv in llm.engine.core.runner.kv_caches] == [(0.5, 0.125)] * 2
    out_tokens = llm.generate([[1, 5, 9, 200]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)
    assert len(out_tokens[0].outputs[0].token_ids) == 4
    auto = LLM(str(out), dtype="float32", num_kv_blocks=32)
    assert [scales(kv) for kv in auto.engine.core.runner.kv_caches] == [(1.0, 1.0)] * 2
