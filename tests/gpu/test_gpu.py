"""The CUDA path end to end: greedy outputs on the GPU (Triton attention, CUDA graphs or eager) match
transformers token for token under batching, prefix caching, chunked prefill, preemption and
copy-on-write. Skipped where there is no CUDA device (CI); run on a GPU machine (see BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, random_prompts, reference, run

from servelm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODES = ["graphs", "eager"]


def gpu_llm(model_dir, mode: str, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cuda", enforce_eager=mode == "eager", **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_matches_transformers_on_gpu(arch, mode, model_dirs, hf_models):
    prompts = random_prompts(12, 3, 70, seed=2)
    llm = gpu_llm(model_dirs[arch], mode, num_kv_blocks=256)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    runner = llm.engine.core.runner
    assert (runner.num_graph_steps > 0) == (mode == "graphs")
    assert bool(runner.graphs and runner.graphs.graphs) == (mode == "graphs")  # really captured
    assert runner.staging is not None  # prompts (and eager decodes) take their inputs in one pinned copy


@pytest.mark.parametrize("mode", MODES)
def test_async_scheduling_matches_transformers_on_gpu(mode, model_dirs, hf_models):
    """Steps launched behind the one in flight, input ids gathered on the device, through graph replays and
    eagerly: rows end at different lengths and on stop ids taken from their own continuations."""
    prompts = random_prompts(8, 3, 60, seed=4)
    want = reference(hf_models, "llama", prompts)
    llm = gpu_llm(model_dirs["llama"], mode, num_kv_blocks=256, async_scheduling=True)
    stops = [w[3 + i] if 3 + i < len(w) else None for i, w in enumerate(want)]
    params = [SamplingParams(temperature=0.0, max_tokens=len(w), ignore_eos=True,
                             stop_token_ids=[s] if s is not None else None) for w, s in zip(want, stops, strict=True)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [w[:w.index(s) + 1] if s is not None else w for w, s in zip(want, stops, strict=True)]
    core = llm.engine.core
    assert core.num_overlapped_steps > 0 and (core.runner.num_graph_steps > 0) == (mode == "graphs")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_steps_replayed_from_graphs_match_transformers_on_gpu(arch, model_dirs, hf_models):
    """--cuda-graph-mixed-tokens: prompt chunks beside decodes (a token budget of 24), prefix-cache hits and
    fresh prompts, replayed from the captured mixed-step graphs."""
    shared = random_prompts(1, 14, 14, seed=31)[0]
    prompts = [shared + p for p in random_prompts(3, 2, 9, seed=32)] + random_prompts(4, 20, 40, seed=33)
    llm = gpu_llm(model_dirs[arch], "graphs", num_kv_blocks=256, max_num_batched_tokens=24, max_num_seqs=4,
                  cuda_graph_mixed_tokens=24)
    runner = llm.engine.core.runner
    assert runner.mixed is not None and sorted(runner.mixed.graphs) == [16, 24]  # captured
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    assert runner.num_mixed_graph_steps > 0 and runner.num_graph_steps > 0


def test_the_engine_stays_within_its_share_of_the_device_with_its_graphs(model_dirs, hf_models):
    """gpu_memory_utilization is a ceiling: the KV cache is what is left after the largest CUDA graphs were
    captured and measured (decode and mixed-step, 2,048 tokens), so with every graph captured and steps served
    the device holds no more than the share (a tolerance of 64 MiB for the allocator's rounding)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = min(0.95, (total - free) / total + 0.1)  # what the device holds already, and 10% of it more
    llm = gpu_llm(model_dirs["llama"], "graphs", gpu_memory_utilization=share, max_num_batched_tokens=2048,
                  cuda_graph_mixed_tokens=2048, max_model_len=1024)
    core = llm.engine.core
    assert core.kv_plan.graphs > 0 and core.runner.mixed is not None and core.runner.graphs.graphs
    prompts = random_prompts(12, 3, 300, seed=8)
    assert run(llm, prompts) == reference(hf_models, "llama", prompts)
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    assert total - free <= share * total + 64 * 2**20, (core.kv_plan.describe(), total - free, share * total)


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_other_than_the_tile(block_size, model_dirs, hf_models):
    prompts = random_prompts(5, 20, 60, seed=3)
    llm = gpu_llm(model_dirs["mistral"], "graphs", num_kv_blocks=2048 // block_size, block_size=block_size)
    assert run(llm, prompts) == reference(hf_models, "mistral", prompts)


def test_prefix_cache_and_chunked_prefill_on_gpu(model_dirs, hf_models):
    shared = random_prompts(1, 48, 48, seed=3)[0]
    prompts = [shared + own for own in random_prompts(6, 5, 20, seed=4)]
    llm = gpu_llm(model_dirs["llama"], "graphs", num_kv_blocks=256, max_num_batched_tokens=24)
    first = run(llm, prompts[:1])
    rest = run(llm, prompts[1:])
    assert llm.engine.get_stats().prefix_cache_hits >= 5 * 48
    assert first + rest == reference(hf_models, "llama", prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_on_gpu(mode, model_dirs, hf_models):
    prompts = random_prompts(8, 30, 45, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device="cuda", num_kv_blocks=14, block_size=8,
              preemption_mode=mode, swap_space_gb=0.01)
    assert run(llm, prompts, params) == reference(hf_models, "llama", prompts, 24)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swaps > 0) == (mode == "swap")
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_n2_copy_on_write_and_sampled_rows_on_gpu(model_dirs, hf_models):
    prompts = random_prompts(3, 21, 29, seed=7)
    llm = gpu_llm(model_dirs["qwen3"], "graphs", num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for o, ref in zip(outs, reference(hf_models, "qwen3", prompts), strict=True):
        assert [c.token_ids for c in o.outputs] == [ref, ref]
    # a seeded sampled request draws the same tokens whatever the other rows draw (per-row generators). Both
    # batches have the same shape at every step, so its logits are the same bits: on a GPU the matmuls' and the
    # split-KV attention's summation order depends on the batch size, and a draw near a boundary between two
    # tokens' probability mass then differs between a batch of one and of three (seen on an H200)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    other = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (9, 11)]
    a = llm.generate(prompts, [sampled, other[0], greedy], use_tqdm=False)
    b = llm.generate(prompts, [sampled, greedy, other[1]], use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


@pytest.mark.parametrize("mode", MODES)
def test_lora_adapters_batched_with_base_rows_on_gpu(mode, model_dirs, hf_models, tmp_path):
    """Base rows and two adapters in one batch on the GPU: each row's greedy tokens equal transformers with that
    adapter merged by PEFT; steps with adapter rows run eagerly beside graph replays of base-only steps."""
    pytest.importorskip("peft")
    from random_weights import make_adapter
    from tiny_models import hf_greedy

    from servelm import LoRARequest

    merged = {"small": make_adapter(model_dirs["llama"], tmp_path / "small", 8, 16, False, ["q_proj", "v_proj"], 41),
              "big": make_adapter(model_dirs["llama"], tmp_path / "big", 32, 32, True,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 42)}
    prompts = random_prompts(3, 10, 40, seed=7)
    loras = [None, LoRARequest("small", 1, str(tmp_path / "small")), LoRARequest("big", 2, str(tmp_path / "big"))]
    llm = gpu_llm(model_dirs["llama"], mode, num_kv_blocks=256, enable_lora=True)
    batch = [p for p in prompts for _ in loras]
    per_row = [lr for _ in prompts for lr in loras]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False, lora_request=per_row)]
    want = []
    for p in prompts:
        want += [hf_greedy(hf_models["llama"], p, 12), hf_greedy(merged["small"], p, 12), hf_greedy(merged["big"], p, 12)]
    assert got == want
    assert run(llm, prompts) == reference(hf_models, "llama", prompts)  # base-only steps after them


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["smollm3", "granite"])
def test_smollm3_and_granite_match_transformers_on_gpu(family, mode, tmp_path, tokenizer_dir):
    """SmolLM3's layers without RoPE (the fused RoPE + KV-cache write must leave them alone) and Granite's
    scalars, batched on the GPU, as transformers on the same weights."""
    from family_parity import granite_config, save_tiny, smollm3_config
    from tiny_models import hf_greedy
    from transformers import AutoModelForCausalLM

    config = smollm3_config(use_sliding_window=True, sliding_window=24) if family == "smollm3" else granite_config()
    folder = save_tiny(config, tmp_path / family, tokenizer_dir)
    prompts = random_prompts(8, 3, 60, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, 8) for p in prompts]
    llm = gpu_llm(folder, mode, num_kv_blocks=128)
    assert run(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) == want


@pytest.mark.parametrize("family", ["olmo3", "glm4", "ernie", "exaone4", "cohere2", "ministral3"])
def test_more_families_match_transformers_on_gpu(family, tmp_path, tokenizer_dir):
    """Norms after the sublayers only (OLMo 3, EXAONE 4), interleaved RoPE over reordered q/k rows (GLM-4's partial,
    ERNIE's whole, Cohere's), a parallel block and NoPE global layers (Cohere2), and Ministral 3's query scaling,
    which its CUDA graphs hold for every position: batched on the GPU under CUDA graphs, as transformers."""
    import family_parity as fp
    from tiny_models import hf_greedy
    from transformers import AutoModelForCausalLM

    config = fp.cohere_config(2) if family == "cohere2" else fp.olmo_config(3) if family == "olmo3" else \
        getattr(fp, f"{family}_config")()
    folder = fp.save_tiny(config, tmp_path / family, tokenizer_dir)
    prompts = random_prompts(8, 3, 60, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, 8) for p in prompts]
    llm = gpu_llm(folder, "graphs", num_kv_blocks=128)
    assert run(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) == want


@pytest.mark.parametrize("mode", MODES)
def test_weights_updated_in_place_replay_in_the_captured_graphs(mode, tmp_path, tokenizer_dir):
    """LLM.load_weights on a GPU: the decode graphs captured with the old weights' addresses replay the new
    values (nothing moved), so the outputs are transformers' on the new checkpoint."""
    from family_parity import save_tiny
    from tiny_models import COMMON, hf_greedy
    from transformers import AutoModelForCausalLM, LlamaConfig

    folders = [save_tiny(LlamaConfig(**COMMON), tmp_path / f"m{seed}", tokenizer_dir, seed=seed) for seed in (0, 1)]
    prompts = random_prompts(8, 3, 60, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = gpu_llm(folders[0], mode, num_kv_blocks=128)
    hf = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in folders]
    assert run(llm, prompts, greedy) == [hf_greedy(hf[0], p, 8) for p in prompts]
    llm.load_weights(hf[1].state_dict())
    assert run(llm, prompts, greedy) == [hf_greedy(hf[1], p, 8) for p in prompts]


@pytest.mark.parametrize("mode", MODES)
def test_sleep_gives_back_gpu_memory_and_wakes_to_the_same_answers(mode, tmp_path, tokenizer_dir):
    """Sleep mode on a GPU: each level gives the weights' and KV cache's device memory back to the driver; the
    engine wakes (the CUDA graphs captured again over the new addresses, and mixed-step graphs too) to
    transformers' answers: level 1 from the weights kept in host memory, level 2 from new ones loaded between
    waking the weights and the KV cache, or from the checkpoint read again."""
    from family_parity import save_tiny
    from tiny_models import COMMON, hf_greedy
    from transformers import AutoModelForCausalLM, LlamaConfig

    folders = [save_tiny(LlamaConfig(**COMMON), tmp_path / f"m{seed}", tokenizer_dir, seed=seed) for seed in (0, 1)]
    prompts = random_prompts(8, 3, 60, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = gpu_llm(folders[0], mode, num_kv_blocks=2048, enable_sleep_mode=True,
                  **({"cuda_graph_mixed_tokens": 32} if mode == "graphs" else {}))
    hf = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in folders]
    want = [[hf_greedy(m, p, 8) for p in prompts] for m in hf]
    runner = llm.engine.core.runner
    assert run(llm, prompts, greedy) == want[0]
    for level in (1, 2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        llm.sleep(level=level)
        pool = 2048 * 16 * 2 * 16 * 4 * 2 * 2  # blocks x tokens x KV heads x head dim x fp32 x (K, V) x layers
        assert torch.cuda.memory_reserved() <= before - pool
        llm.wake_up()
        assert llm.is_sleeping() is False
        assert bool(runner.graphs and runner.graphs.graphs) == (mode == "graphs")  # captured again
        assert (runner.mixed is not None) == (mode == "graphs")
        assert run(llm, prompts, greedy) == want[0]
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.load_weights(hf[1].state_dict())
    llm.wake_up(["kv_cache"])
    assert run(llm, prompts, greedy) == want[1]
    assert (runner.num_graph_steps > 0) == (mode == "graphs")
