"""A request's output does not depend on how the scheduler ran it, on the paths users run by default: the same
request gives the same tokens and the same logprob bits whatever the prefix cache held, the step's token budget,
preemption (recompute or swap) or the other requests in its batch. The C++ kernels promise it by construction
(every row and every query summed in one fixed order, whatever else is in the step), on every build variant:
the dense float32 and bf16 linears, every GGUF format kept quantized (the int8-activation kernel for any number
of rows), attention. PyTorch's int8/int4 kernels (quantization int8/int4) are checked as they come.

`test_each_variant_passes_the_kernel_tests` (test_kernel_build.py) reruns this file's mixed-schedule tests on
every other variant this CPU executes, so an AMX machine checks the AVX512-BF16 (AMD Zen 4/5) and AVX2 paths;
the `dot` fixture runs the bf16 paths with both ways to multiply bf16 pairs (Intel's and AMD's default)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, random_prompts

from servelm import LLM, SamplingParams
from servelm.model.kernels import cpu as cpu_kernels

_kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(_kernels is None, reason="the guarantee is the C++ kernels' (not built here)")

# Head size 64 and widths that are multiples of 256 (the GGUF K-quants' super-blocks) take the kernels a real
# model takes; an MLP input of 1024 is wide enough for oneDNN's and MKL's matmuls to change their sums with the
# row count; a small initializer keeps the logits flat, so a rounding difference anywhere shows up in the
# chosen tokens and logprobs too.
CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              pad_token_id=2, tie_word_embeddings=False, initializer_range=0.05)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
GGUF_FORMATS = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
# name -> (dtype, quantization, GGUF format the linears are stored in); "auto" is what this CPU picks
PATHS = {"auto": ("auto", "auto", None), "float32": ("float32", "none", None), "bfloat16": ("bfloat16", "none", None),
         **{f"gguf-{f}": ("bfloat16", "auto", f) for f in GGUF_FORMATS},
         "int8": ("bfloat16", "int8", None), "int4": ("bfloat16", "int4", None)}
DEFAULT_PATHS = ["auto", "bfloat16", "gguf-Q4_1"]  # the default dtype, bf16, the packaged model's format


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("invariance_model")
    AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return str(out)


@pytest.fixture(scope="module")
def make(model_dir):
    """make(path, **engine args) -> an LLM on that path; GGUF formats come from the checkpoint's linears
    turned into blocks of the format as the loader reads them."""
    from servelm.model.loading import loader
    from servelm.model.quant.gguf import GGUFBlocks
    from servelm.model.quant.weight_only import is_linear_weight

    def build(path: str, **kw) -> LLM:
        dtype, quantization, fmt = PATHS[path]
        kw = {"num_kv_blocks": 256, **kw}
        if fmt is None:
            return LLM(model_dir, dtype=dtype, quantization=quantization, **kw)
        original = loader._iter_safetensors

        def quantized(p, dt, **kw):
            for name, t in original(p, dt, **kw):
                if is_linear_weight(name):
                    raw = gguf_blocks(t, fmt)
                    t = GGUFBlocks(fmt, torch.from_numpy(np.ascontiguousarray(raw)), t.shape[1], dt)
                yield name, t

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader, "_iter_safetensors", quantized)
            return LLM(model_dir, dtype=dtype, quantization=quantization, **kw)

    return build


def gguf_blocks(t: torch.Tensor, fmt: str) -> np.ndarray:
    """A weight's rows as GGUF blocks of `fmt`: gguf's quantizer, or (the K types, which it cannot quantize)
    random codes and sub-scales under small super-block scales, seeded by the weight's shape."""
    import gguf

    if fmt not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType[fmt])
    rows, cols = t.shape
    rng = np.random.default_rng(rows * cols)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[fmt]
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    if fmt == "Q6_K":  # d at the end: weights d * sc * (q - 32) within about 0.04
        raw[:, 208:210] = np.full((len(raw), 1), 1e-5, dtype=np.float16).view(np.uint8)
    else:  # d and dmin first: weights d * sc * q - dmin * m within about 0.2
        raw[:, 0:4] = np.full((len(raw), 2), 2e-4, dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def outputs(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    """Per request: its token ids and the logprob bits of every position's top tokens."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs or []])
            for c in (o.outputs[0] for o in outs)]


_alone: dict = {}


def alone(make, path, prompts, params=GREEDY) -> list[tuple]:
    """The reference: each request by itself, nothing cached, its prompt in one chunk (computed once per path,
    bf16 dot mode and kernel variant)."""
    ps = params if isinstance(params, list) else [params] * len(prompts)
    mode = (path, _kernels.variant, _kernels.bf16_dot())
    todo = [(p, s) for p, s in zip(prompts, ps, strict=True) if (mode, tuple(p), repr(s)) not in _alone]
    if todo:
        llm = make(path, enable_prefix_caching=False)
        for p, s in todo:
            _alone[mode, tuple(p), repr(s)] = outputs(llm, [p], s)[0]
    return [_alone[mode, tuple(p), repr(s)] for p, s in zip(prompts, ps, strict=True)]


@pytest.fixture(params=["default", "bf16", "fma"])
def dot(request):
    """The process's way to multiply bf16 pairs, then each of the two explicitly where the build has both
    (AVX512-BF16: Intel's default is float FMAs, AMD's the dot-product instruction); the default restored."""
    if request.param != "default" and not _kernels.avx512_bf16:
        pytest.skip("one way to multiply bf16 pairs in this build")
    before = _kernels.bf16_dot()
    if request.param != "default":
        _kernels.set_bf16_dot(request.param)
    yield request.param
    if before in ("bf16", "fma"):
        _kernels.set_bf16_dot(before)


# 16k + 1 tokens: a full prefix-cache hit (or a 16-token budget) leaves exactly one prompt token to compute
PROMPTS = [p[:16 * k + 1] for p, k in zip(random_prompts(4, 60, 60, seed=40), (2, 3, 1, 3), strict=True)]


@pytest.mark.parametrize("path", DEFAULT_PATHS)
def test_prefix_cache_hits_of_none_one_or_all_blocks_keep_outputs(make, path):
    ref = alone(make, path, PROMPTS)
    llm = make(path)
    assert outputs(llm, PROMPTS) == ref  # nothing cached
    hits = llm.engine.get_stats().prefix_cache_hits
    assert outputs(llm, PROMPTS) == ref  # every full block cached: one token left to compute
    assert llm.engine.get_stats().prefix_cache_hits - hits == sum(len(p) - 1 for p in PROMPTS)
    fresh = make(path)
    outputs(fresh, [p[:16] + [7] * 20 for p in PROMPTS])  # only each prompt's first block
    assert outputs(fresh, PROMPTS) == ref


@pytest.mark.parametrize("path", DEFAULT_PATHS)
def test_token_budget_of_1_16_or_2048_keeps_outputs(make, path):
    prompts = PROMPTS + random_prompts(2, 70, 100, seed=41)
    ref = alone(make, path, prompts)
    for budget in (1, 16, 2048):  # one token a step: the 16k + 1 prompts only (a step per token is slow)
        batch = PROMPTS if budget == 1 else prompts
        got = outputs(make(path, max_num_batched_tokens=budget, enable_prefix_caching=False), batch)
        assert got == ref[:len(batch)], budget


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("path", DEFAULT_PATHS)
def test_preemption_keeps_outputs(make, path, mode):
    prompts = PROMPTS + random_prompts(4, 30, 45, seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = alone(make, path, prompts, params)
    # a loaded server's step budget: prompt chunks of a few tokens, and preemption (and swapping back in) between
    llm = make(path, num_kv_blocks=20, block_size=8, preemption_mode=mode, swap_space_gb=0.01,
               enable_prefix_caching=False, max_num_batched_tokens=16)
    assert outputs(llm, prompts, params) == ref
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (mode == "swap")


@pytest.mark.parametrize("path", DEFAULT_PATHS)
def test_the_same_outputs_alone_or_among_31_others(make, path):
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True, logprobs=2) for s in (1, 2)]
    requests = PROMPTS[:2] + PROMPTS[:2]
    params = [GREEDY, GREEDY] + seeded
    ref = alone(make, path, requests, params)
    others = random_prompts(31, 5, 80, seed=44)  # long and short neighbours: prompt chunks beside decodes
    noise = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True)
    llm = make(path, num_kv_blocks=512)
    assert outputs(llm, others + requests, [noise] * len(others) + params)[-4:] == ref  # among 31 others
    for i, (p, s) in enumerate(zip(requests, params, strict=True)):  # again, all but one token cached
        mixed = others[: 5 * i + 2] + [p]  # a different batch (size and neighbours) for each request
        assert outputs(llm, mixed, [noise] * (len(mixed) - 1) + [s])[-1] == ref[i], i


# every path with the process's bf16 pair product; the default ones with each of the two explicitly as well. The
# default paths, float32 and one format of each kernel family (4-bit, 5-bit, 6-bit codes; PyTorch's int4) are
# rerun on every other kernel variant this CPU executes (test_kernel_build.py)
_EVERY_VARIANT = {*DEFAULT_PATHS, "float32", "gguf-Q5_K", "gguf-Q6_K", "int4"}
MIXED = [pytest.param(p, "default", marks=[pytest.mark.every_variant] if p in _EVERY_VARIANT else [])
         for p in PATHS] + [(p, d) for p in DEFAULT_PATHS if p != "auto" for d in ("bf16", "fma")]


@pytest.mark.parametrize(("path", "dot"), MIXED, indirect=["dot"])
def test_mixed_schedule_keeps_outputs(make, path, dot):
    """A batch beside 7 neighbours with 8-token prompt chunks, a KV pool small enough to preempt, and the same
    requests again over a warm prefix cache, against each request alone."""
    prompts = PROMPTS[:3] + random_prompts(1, 70, 90, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = alone(make, path, prompts, params)
    others = random_prompts(7, 5, 60, seed=45)
    noise = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    llm = make(path, num_kv_blocks=16, block_size=8, max_num_batched_tokens=8)
    assert outputs(llm, others + prompts, [noise] * len(others) + [params] * len(prompts))[len(others):] == ref
    again = outputs(llm, prompts[::-1] + others[:3], [params] * len(prompts) + [noise] * 3)
    assert again[:len(prompts)] == ref[::-1]
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_the_default_model_keeps_its_outputs_over_the_cache_and_the_batch():
    """The packaged default model as `LLM(dtype="bfloat16")` loads it (kept quantized where the kernels run its
    format): 12 prompts twice (the second time over the prefix cache), then 6 of them one at a time, give the
    same tokens every time."""
    llm = LLM(dtype="bfloat16", num_kv_blocks=512)
    text = (__doc__ or "") * 8
    ids = llm.get_tokenizer()(text).input_ids
    prompts = [ids[i * 40:i * 40 + 97] for i in range(1, 9)] + [ids[i * 30:i * 30 + 113] for i in range(1, 5)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tokens(ps):
        return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]

    first = tokens(prompts)
    assert tokens(prompts) == first  # over the prefix cache
    assert [tokens([p])[0] for p in prompts[:6]] == first[:6]  # one at a time, cached, against the batch of 12
