"""One check of a GPU machine: every GPU test, the device's ceilings, the GPU workloads on three Llama shapes
and S1 through `servelm serve`, under one time budget, printed as JSON.

  python bench/gpu_check.py                          # on an NVIDIA GPU: about 9 minutes at most
  python bench/gpu_check.py --device cpu --quick     # the same steps on tiny shapes: a smoke test (CI)
  python bench/gpu_check.py --download-wheels .whl   # where pip works: the serving packages, for a machine without

Sections, in order, each under its own cap inside the global --budget-s (a section that no longer fits is
reported as skipped, with the reason, and the JSON is printed all the same):

  setup     wheels from --wheels installed where their package is missing; tokenizers made for the shapes
  ceilings  device copy bandwidth (GB/s, bytes read + written) and a large bf16 matmul's TFLOP/s
  tests     pytest over the GPU test files: passed / failed / skipped counts and the failing test ids
  60m, 1b   random-weight bf16 Llama shapes (bench/gpu_bench.py): W1 output tok/s; batch-1 TPOT against the
            bandwidth bound (the weights and the context's KV read once per step at the measured copy rate);
            a 2k-token prefill's TFLOP/s; W1-sampled (temperature 0.8, top_p 0.95; 256 x 128/128) against
            greedy on the same prompts; the decode attention kernel alone at the shape's heads, single-pass
            against split-KV (batch 1 and 64, contexts 512 and 4096); the prefill attention kernel alone
            under eight launch settings (a 2,048-token prompt, a 512-token chunk after 3,584 cached); W1-big (1,024 prompts of 64..1024 tokens, 128 out) output and total
            tok/s against the compute bound, where the time left allows
  s1        S1 through `servelm serve` on 127.0.0.1 at three rates: `servelm bench serve`'s client-side ITL
            beside the server's own, from the servelm:inter_token_latency_seconds histogram of /metrics
  8b        as 60m and 1b, last (the largest), where the GPU's memory and the time left allow it

With --baseline DIR (another source tree of servelm, such as an earlier commit's `git archive`), each shape's W1
and batch-1 TPOT run a second time with that tree, on the same model and machine, and the shape's figures
give the ratios (`baseline`: w1_speedup, tpot_b1_speedup).

With --fp8-shapes (default: 8b on a GPU of compute capability 8.9 or newer), those shapes' batch-1 TPOT and 2k
prefill run again with `--quantization fp8` (`fp8`: the figures, the TPOT's bound at one byte a linear weight, and
the speed-ups over bf16), `fp8_linear` times the shape's linears alone on each fp8 path beside bf16, from one
row to 2,048 (where the weight-only kernel should give way to `_scaled_mm`), and `fp8_tuning` times the
weight-only kernel at 1, 4 and 16 rows under fourteen launch settings (programs per SM, tile width, warps,
stages; and the matrix-vector kernel, without `tl.dot`, for those row counts).

With --mixed-shapes (default: 60m and 8b), those shapes' W1 and 2k prefill run again with
`--cuda-graph-mixed-tokens 2048` (`mixed`: steps with prompt chunks replayed from graphs; the speed-ups over
this tree's eager ones).

With --async-shapes (default: 60m, 1b and 8b, those measured), those shapes' W1 and batch-1 TPOT run again step
by step, `--no-async-scheduling` (`async`: those figures and the speed-ups of the default, which on a GPU launches
each decode step behind the one in flight, over them).

Each measurement runs in a child process (a crash or a hang costs its section, not the run); every figure is
printed as a JSON line as it comes, and one JSON object ends the run (also written to --out-dir). Models get
a tokenizer of exactly their vocabulary size whose every id decodes to text (a byte-level BPE vocabulary
padded with `<xN>` tokens), so that every generated token is a streamed chunk. A check, not a test: CI runs
only the `--device cpu --quick` smoke (tests/gpu/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# The GPU test files (the Triton kernels, the CUDA-graph path, the engine on CUDA against transformers, and
# tensor parallelism over NCCL, which needs two GPUs).
GPU_TESTS = ["tests/gpu/test_gpu.py", "tests/engine/test_step_staging.py", "tests/engine/test_mixed_graphs.py",
             "tests/kernels/test_triton_attention.py",
             "tests/kernels/test_triton_elementwise.py",
             "tests/kernels/test_quant_triton.py", "tests/kernels/test_cuda_graphs.py", "tests/kernels/test_triton_rope.py",
             "tests/gpu/test_fp8_gpu.py", "tests/gpu/test_fp8_kv_gpu.py", "tests/kernels/test_triton_fp8_kv.py",
             "tests/kernels/test_triton_fp8.py",
             "tests/gpu/test_tp_nccl.py"]  # (test_tp_nccl skips itself with fewer than 2 GPUs)
# Without CUDA: test_gpu.py skips itself; one quick test of the graph path shows that pytest ran.
CPU_TESTS = ["tests/gpu/test_gpu.py", "tests/kernels/test_cuda_graphs.py::test_capture_sizes_cover_every_batch_up_to_the_limit"]
TEST_VOCAB = 49152  # tests/conftest.py's VOCAB

TINY = (128, 2, 4, 2, 256, 1024, False)  # hidden, layers, heads, kv heads, intermediate, vocab, tied: CPU smoke

# What `servelm serve`, `servelm bench serve` and the GPU tests import beyond torch, triton, transformers and
# what those need (numpy, tokenizers, safetensors, huggingface-hub, pyyaml, jinja2, tqdm ...): distributions
# whose wheels --download-wheels fetches, and whose modules the setup section checks. (module, distribution)
SERVE_PACKAGES = [
    ("fastapi", "fastapi"), ("fastapi_offline", "fastapi-offline"), ("starlette", "starlette"),
    ("uvicorn", "uvicorn"), ("pydantic", "pydantic"), ("pydantic_core", "pydantic-core"),
    ("annotated_types", "annotated-types"), ("typing_inspection", "typing-inspection"),
    ("annotated_doc", "annotated-doc"), ("zmq", "pyzmq"), ("msgspec", "msgspec"), ("gguf", "gguf"),
    ("httpx", "httpx"), ("httpcore", "httpcore"), ("h11", "h11"), ("anyio", "anyio"), ("sniffio", "sniffio"),
    ("prometheus_client", "prometheus-client"), ("sqlalchemy", "sqlalchemy"), ("greenlet", "greenlet"),
    ("opentelemetry.sdk", "opentelemetry-sdk"), ("opentelemetry", "opentelemetry-api"),
    ("opentelemetry.semconv", "opentelemetry-semantic-conventions"),
    ("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http"),
    ("opentelemetry.exporter.otlp.proto.common", "opentelemetry-exporter-otlp-proto-common"),
    ("opentelemetry.proto", "opentelemetry-proto"), ("google.protobuf", "protobuf"),
    ("google.rpc", "googleapis-common-protos"), ("typing_extensions", "typing-extensions"), ("scipy", "scipy"),
    ("pytest", "pytest"), ("pluggy", "pluggy"), ("iniconfig", "iniconfig"), ("alembic", "alembic"), ("mako", "Mako"),
]
# Installed from the wheels also where an older version is there (newer versions only add): pydantic and
# fastapi need a recent typing-extensions.
UPGRADE = {"typing-extensions"}
# Never carried (too large, or bound to the machine's own torch build): the check reports them missing instead.
NOT_CARRIED = {"scipy", "numpy", "torch", "triton", "transformers", "tokenizers", "safetensors"}
SERVER_MODULES = ["fastapi", "uvicorn", "pydantic", "zmq", "msgspec", "httpx", "prometheus_client", "sqlalchemy"]


def profile(device: str, quick: bool) -> dict:
    """Sizes and caps. On a GPU the workloads as specified; on the CPU (or --quick) the same steps, small."""
    gpu = device.startswith("cuda")
    small = quick or not gpu
    return {
        "shapes": ["tiny"] if not gpu else (["60m"] if quick else ["60m", "1b", "8b"]),
        "s1_shape": "tiny" if not gpu else ("60m" if quick else "1b"),
        "w1": (8, 16) if small else (64, 128),  # requests, output tokens (128-token prompts)
        "sampled": (16, 16) if small else (256, 128),
        "big": (8, 16) if small else (1024, 128),  # requests (prompts uniform 64..1024), output tokens
        "big_on": ["tiny", "60m"] if small else ["1b", "8b"],
        "tpot": (64, 32) if small else (512, 128),  # prompt tokens (W2's, cut), output tokens
        "reps": 1 if small else 3,
        "s1_rates": [8.0, 16.0, 32.0] if small else [4.0, 16.0, 64.0],
        "s1_requests": 4 if small else 100,
        "s1_warmup": 2 if small else 16,
        "budget_s": 240 if small else 510,
        # section caps (s); a section also stops at the global deadline, and the last one takes what is left
        "caps": {"setup": 60, "ceilings": 40, "tests": 60 if small else 210, "shape": 120 if small else 90,
                 "shape:60m": 60, "s1": 150 if small else 110},
        "min_s": {"ceilings": 5, "tests": 10, "shape": 15 if small else 25, "s1": 20 if small else 35},
    }


# ---------------------------------------------------------------------------------------------- output


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def shape_of(name: str) -> tuple:
    if name == "tiny":
        return TINY
    sys.path.insert(0, str(BENCH))
    from gpu_bench import SHAPES

    return SHAPES[name]


# ------------------------------------------------------------------------------------------- tokenizers


def write_tokenizer(out: Path, vocab: int, base: Path | None = None) -> Path:
    """A tokenizer folder of exactly `vocab` ids (or the base's own, where larger) in which every id decodes to
    text: `base`'s tokenizer.json (a BPE or word-level vocabulary) or byte-level BPE without merges, its unused
    ids filled with `<xN>` tokens that decode to themselves."""
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    spec = None
    if base is not None and (base / "tokenizer.json").exists():
        spec = json.loads((base / "tokenizer.json").read_text())
        if not isinstance(spec.get("model", {}).get("vocab"), dict):
            spec = None  # a unigram list: not padded, the synthetic vocabulary instead
    from_base = spec is not None and (base / "tokenizer_config.json").exists()
    if spec is None:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        ids = {t: i for i, t in enumerate(specials + alphabet)}
        tok = Tokenizer(models.BPE(vocab=ids, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        spec = json.loads(tok.to_str())
    table = spec["model"]["vocab"]
    used = set(table.values()) | {a["id"] for a in spec.get("added_tokens") or []}
    for i in range(vocab):
        if i not in used and f"<x{i}>" not in table:
            table[f"<x{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    out.mkdir(parents=True, exist_ok=True)
    if from_base:
        for f in base.iterdir():
            if f.is_file() and f.name != "tokenizer.json":
                shutil.copy(f, out / f.name)
        (out / "tokenizer.json").write_text(tok.to_str())
    else:
        tok.add_special_tokens(specials)
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                pad_token="<pad>", model_max_length=8192).save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------ the figures' bounds


def linear_params(shape: tuple) -> tuple[int, int]:
    """(the decoder layers' linear weights, the LM head's) in parameters."""
    h, n, heads, kv, inter, vocab, _ = shape
    hd = h // heads
    per_layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * inter
    return n * per_layer, h * vocab


def kv_bytes_per_token(shape: tuple) -> int:
    h, n, heads, kv, *_ = shape
    return 2 * n * kv * (h // heads) * 2  # K and V, bf16


def attention_flops(shape: tuple, ctx_from: int, ctx_to: int) -> float:
    """Attention FLOPs (QK^T and PV) of the tokens at positions ctx_from+1 .. ctx_to, each over its context."""
    h, n, heads, *_ = shape
    tokens_ctx = (ctx_to * (ctx_to + 1) - ctx_from * (ctx_from + 1)) / 2  # sum of the contexts
    return 4.0 * n * heads * (h // heads) * tokens_ctx


def request_flops(shape: tuple, prompt: int, out: int) -> float:
    """A request's FLOPs: every prompt and output token through the layers, the LM head for each output token
    (a prompt's last position makes the first), attention over each token's context."""
    layers, head = linear_params(shape)
    return 2.0 * layers * (prompt + out - 1) + 2.0 * head * out + attention_flops(shape, 0, prompt + out - 1)


# ---------------------------------------------------------------------------------------------- children


def result(key: str, **fig) -> None:
    print("RESULT " + json.dumps({"key": key, **fig}), flush=True)


def model_dir(work: Path, name: str) -> Path:
    return work / name


def build_model(name: str, work: Path, tokenizer: Path) -> tuple[Path, float]:
    """bench/gpu_bench.py's random-weight bf16 checkpoint, made in a scratch folder then moved into place (a
    build cut short leaves nothing that looks finished)."""
    out = model_dir(work, name)
    t = time.perf_counter()
    if not (out / "config.json").exists():
        sys.path.insert(0, str(BENCH))
        import gpu_bench

        gpu_bench.SHAPES.setdefault("tiny", TINY)
        scratch = work / ".building"
        shutil.rmtree(scratch, ignore_errors=True)
        gpu_bench.make_model(name, scratch, tokenizer).rename(out)
        shutil.rmtree(scratch, ignore_errors=True)
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the made model's memory, before the engine loads the checkpoint
    return out, time.perf_counter() - t


def kv_cache_gb(shape: tuple, device: str, weight_bytes: int, max_seqs: int, max_len: int) -> float:
    """Room for max_seqs sequences of max_len tokens, within 90% of the GPU's memory less the weights and
    6 GiB for activations and CUDA graphs; 0.25 GiB on the CPU."""
    if not device.startswith("cuda"):
        return 0.25
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    need = kv_bytes_per_token(shape) * max_seqs * max_len * 1.1
    room = 0.9 * total - weight_bytes - 6 * 2**30
    return round(max(1.0, min(need, room) / 2**30), 1)


def child_ceilings(spec: dict) -> None:
    import torch

    dev = spec["device"]
    if dev.startswith("cuda"):
        sys.path.insert(0, str(BENCH))
        from gpu_bench import ceilings

        props = torch.cuda.get_device_properties(torch.device(dev))
        result("device", gpu=props.name, memory_gb=round(props.total_memory / 2**30, 1),
               multiprocessors=props.multi_processor_count, capability=[props.major, props.minor],
               torch=torch.__version__,
               cuda=torch.version.cuda)
        result("ceilings", **ceilings())
        return
    # the CPU: the same two figures, small and quick (PyTorch's bf16 matmul is slow on some CPUs)
    x = torch.randn(2**24)  # 64 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    copy = statistics.median(_wall(lambda: y.copy_(x)) for _ in range(5))
    n = 256
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        rates[dtype] = round(2 * n**3 / statistics.median(_wall(lambda a=a, b=b: a @ b) for _ in range(3)) / 1e12, 4)
    result("device", gpu=None, cpu_threads=torch.get_num_threads(), torch=torch.__version__)
    result("ceilings", copy_gb_s=round(2 * x.numel() * 4 / copy / 1e9, 1), bf16_tflop_s=rates[torch.bfloat16],
           fp32_tflop_s=rates[torch.float32])


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def child_shape(spec: dict) -> None:
    """One shape's workloads, each printed when done; W1-big only where the time left allows it."""
    if not spec["device"].startswith("cuda"):  # the decode attention figure's kernels, interpreted: set
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything defines a Triton kernel
    import numpy as np
    import torch

    sys.path.insert(0, str(BENCH))
    from gpu_bench import timed

    from servelm import LLM, SamplingParams
    from servelm.bench.workloads import make_workload

    name, dev, work = spec["shape"], spec["device"], Path(spec["work"])
    on_gpu = dev.startswith("cuda")
    shape = shape_of(name)
    h, n_layers, heads, kv, inter, vocab, tied = shape
    layers_p, head_p = linear_params(shape)
    extra = spec.get("llm_kwargs") or {}  # a variant's engine settings (fp8 weights, say)
    want = set(spec.get("only") or ("w1", "tpot_b1", "prefill_2k", "rest"))
    # what a decode step reads besides the KV (the embedding: a few rows); fp8 linears are one byte a weight
    read_bytes = (1 if extra.get("quantization") == "fp8" else 2) * layers_p + 2 * head_p
    reps = spec["reps"]
    copy_gb_s, tflop_s = spec.get("copy_gb_s"), spec.get("bf16_tflop_s")

    path, build_s = build_model(name, work, Path(spec["tokenizer"]))
    params_b = (layers_p + head_p + (0 if tied else h * vocab)) / 1e9
    result("build", s=round(build_s, 2), params_b=round(params_b, 3), path=str(path))
    max_seqs = 256
    kv_gb = kv_cache_gb(shape, dev, read_bytes, max_seqs, 1024 + 128 + 16)
    t = time.perf_counter()
    llm = LLM(str(path), dtype="bfloat16" if on_gpu else "auto", device=dev, kv_cache_memory_gb=kv_gb,
              max_num_seqs=max_seqs, enable_prefix_caching=False, **extra)
    import servelm

    result("load", s=round(time.perf_counter() - t, 2), kv_cache_gb=kv_gb, servelm=str(Path(servelm.__file__).parent),
           **extra)

    def params(n: int, sampled: bool = False) -> SamplingParams:
        if sampled:
            return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True)
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def gen(prompts, p) -> None:
        llm.generate(prompts, p, use_tqdm=False)

    if "w1" in want:  # W1: 64 x 128/128 greedy (compilation, graph replay and the allocator warmed first)
        n_req, n_out = spec["w1"]
        w1 = make_workload("W1", vocab).prompts[:n_req]
        gen(w1[:2], params(4))
        gen(w1, params(8))
        s = timed(lambda: gen(w1, params(n_out)), reps)
        result("w1", requests=n_req, prompt_tokens=len(w1[0]), output_tokens=n_out,
               output_tok_s=round(n_req * n_out / s, 1), s=round(s, 3))

    if "tpot_b1" in want:  # batch-1 TPOT (W2's 512-token prompt) against the bandwidth bound
        n_prompt, n_out = spec["tpot"]
        w2 = make_workload("W2", vocab).prompts[0][:n_prompt]
        gen([w2], params(2))
        ttft = timed(lambda: gen([w2], params(1)), max(3, reps))
        e2e = timed(lambda: gen([w2], params(n_out)), max(3, reps))
        tpot = (e2e - ttft) / (n_out - 1)
        step_bytes = read_bytes + kv_bytes_per_token(shape) * (len(w2) + n_out // 2)
        bound = step_bytes / (copy_gb_s * 1e9) if copy_gb_s else None
        result("tpot_b1", prompt_tokens=len(w2), output_tokens=n_out, ttft_ms=round(ttft * 1e3, 2),
               tpot_ms=round(tpot * 1e3, 3), bytes_per_step_gb=round(step_bytes / 1e9, 3),
               bound_ms=round(bound * 1e3, 3) if bound else None,
               tpot_over_bound=round(tpot / bound, 2) if bound else None)

    if "prefill_2k" in want or "rest" in want:  # prefill of a 2k-token prompt: TFLOP/s against the matmul rate
        rng = np.random.Generator(np.random.PCG64(5))
        p2k = [1] + [int(i) for i in rng.integers(4, vocab, size=2047)]
        gen([p2k], params(1))
        pf = timed(lambda: gen([p2k], params(1)), reps)
        flops = request_flops(shape, len(p2k), 1)
        achieved = flops / pf / 1e12
        result("prefill_2k", prompt_tokens=len(p2k), ms=round(pf * 1e3, 2), tflop=round(flops / 1e12, 3),
               tflop_s=round(achieved, 3 if not on_gpu else 1),
               of_peak=round(achieved / tflop_s, 3) if tflop_s else None)
    if "rest" not in want:  # a baseline tree or a variant: the figures asked for only
        return

    # W1-sampled: temperature 0.8, top_p 0.95 against greedy on the same prompts, alternating
    n_req, n_out = spec["sampled"]
    ws = make_workload("W1", vocab, scale=n_req / 64).prompts[:n_req]
    gen(ws, params(8, sampled=True))
    gen(ws, params(8))
    greedy_s, sampled_s = [], []
    for _ in range(max(1, reps - 1)):
        greedy_s.append(timed(lambda: gen(ws, params(n_out)), 1))
        sampled_s.append(timed(lambda: gen(ws, params(n_out, sampled=True)), 1))
    g, sm = statistics.median(greedy_s), statistics.median(sampled_s)
    result("w1_sampled", requests=n_req, output_tokens=n_out, temperature=0.8, top_p=0.95,
           greedy_tok_s=round(n_req * n_out / g, 1), sampled_tok_s=round(n_req * n_out / sm, 1),
           sampled_over_greedy=round(g / sm, 3))

    for figure, fn in (("decode_attention", decode_attention), ("prefill_attention", prefill_attention)):
        try:
            result(figure, **fn(shape, on_gpu))
        except Exception as e:  # a kernel that fails to compile costs this figure, not the shape's others
            result(figure, status="failed", error=f"{type(e).__name__}: {e}"[-1500:])
            if on_gpu:
                torch.cuda.empty_cache()

    if spec.get("fp8_linear"):
        for figure, fn in (("fp8_linear", fp8_linear), ("fp8_tuning", fp8_tuning)):
            try:
                result(figure, **fn(shape, on_gpu))
            except Exception as e:  # as decode_attention's
                result(figure, status="failed", error=f"{type(e).__name__}: {e}"[-1500:])
                if on_gpu:
                    torch.cuda.empty_cache()

    w1_big(spec, gen, params, shape, pf / len(p2k), g / (len(ws) * spec["sampled"][1]), tflop_s)
    if on_gpu:
        result("memory", peak_gpu_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2))


DECODE_ATTENTION_FLUSH_BYTES = 192 * 2**20  # more KV than an H100's or H200's L2 (50, 60 MB) holds


def _attention_bench(shape: tuple, on_gpu: bool):
    """What the attention timings share: the shape's query heads, KV heads and head size, the device and the
    dtype (bf16 on a GPU; float32 interpreted, numpy having no bfloat16)."""
    import torch

    h, _, heads, kv, *_ = shape
    return heads, kv, h // heads, "cuda" if on_gpu else "cpu", torch.bfloat16 if on_gpu else torch.float32


def decode_attention(shape: tuple, on_gpu: bool) -> dict:
    """The decode attention kernel alone (model/attention/triton_paged.py) at the shape's heads: the single-pass
    kernel against split-KV with the split count the engine would choose, batch 1 and 64 at contexts 512 and
    4096, bf16, block size 16, each sequence's blocks scattered over the pool. Milliseconds per call are
    CUDA-event times of replays of a captured graph of calls (as the engine replays decode steps, so that
    launch costs are not what is measured), each call reading its own copy of the KV so that the L2 cache
    holds none of it; medians of 5 replays. On the CPU, under Triton's interpreter, batch 1 and 2 at context 64
    in float32, one call each: a smoke of the same code, not a measurement."""
    import torch

    from servelm.model.attention import AttentionMetadata, triton_paged

    if not triton_paged.HAS_TRITON:
        return {"status": "skipped", "reason": "triton is not installed"}
    heads, kv, d, dev, dtype = _attention_bench(shape, on_gpu)
    batches, contexts = ((1, 64), (512, 4096)) if on_gpu else ((1, 2), (64,))
    bs = 16
    reps = 5 if on_gpu else 1
    g = torch.Generator(device=dev).manual_seed(0)
    variants = {"single": triton_paged.TritonPagedAttention(heads, kv, d, d**-0.5, split_kv=False),
                "split": triton_paged.TritonPagedAttention(heads, kv, d, d**-0.5)}
    runs = []
    for batch in batches:
        for ctx in contexts:
            per_seq = -(-ctx // bs)
            per_copy = batch * per_seq
            copy_bytes = 2 * per_copy * bs * kv * d * dtype.itemsize
            copies = min(512, -(-DECODE_ATTENTION_FLUSH_BYTES // copy_bytes)) if on_gpu else 1
            n_blocks = copies * per_copy
            kc = torch.randn(n_blocks, bs, kv, d, generator=g, device=dev, dtype=dtype)
            vc = torch.randn(n_blocks, bs, kv, d, generator=g, device=dev, dtype=dtype)
            q = torch.randn(batch, heads, d, generator=g, device=dev, dtype=dtype)
            order = torch.randperm(n_blocks, generator=g, device=dev).cpu()
            metas = []
            for c in range(copies):
                tables = order[c * per_copy:(c + 1) * per_copy].view(batch, per_seq)
                meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.arange(batch), tables,
                                         torch.full((batch,), ctx, dtype=torch.int64), [], bs)
                meta.derived = variants["single"].derive(meta)
                metas.append(meta.to(dev))
            row = {"batch": batch, "context": ctx, "calls_per_replay": copies}
            for name, attn in variants.items():
                row[f"{name}_ms"] = round(_attention_ms(attn, q, (kc, vc), metas, on_gpu, reps), 4)
            row["splits"] = variants["split"].splits_for(batch, per_seq * bs, dev)
            row["single_over_split"] = round(row["single_ms"] / row["split_ms"], 3)
            runs.append(row)
            del kc, vc, metas
            if on_gpu:
                torch.cuda.empty_cache()
    return {"dtype": str(dtype).removeprefix("torch."), "block_size": bs, "heads": heads, "kv_heads": kv,
            "head_dim": d, "runs": runs}


# the single-pass attention kernel's launch settings for prompt chunks the sweep times, as
# model/attention/triton_paged.py's PrefillTiling fields (block_m: (query, query head) pairs a tile; block_n: KV
# positions an iteration; warps; pipeline stages); the first is the default
PREFILL_TILINGS = [{}, {"block_n": 64}, {"block_m": 128, "block_n": 64, "num_warps": 8},
                   {"block_m": 128, "block_n": 32, "num_warps": 8}, {"block_m": 64, "block_n": 64, "num_stages": 2},
                   {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
                   {"block_m": 128, "block_n": 64, "num_warps": 4}, {"block_m": 64, "block_n": 128, "num_stages": 2}]


def prefill_attention(shape: tuple, on_gpu: bool) -> dict:
    """The single-pass attention kernel on prompt chunks under each setting of PREFILL_TILINGS: a 2,048-token
    prompt from position 0 and a 512-token chunk after 3,584 cached tokens, at the shape's heads, bf16, block
    size 16, the blocks scattered over the pool. Milliseconds per call (graph replays, as decode_attention
    times them), the TFLOP/s of the causal attention's two matmuls, and per chunk the fastest setting and its
    speed-up over the default. On the CPU, interpreted, a 32-token prompt under two settings in float32: a
    smoke of the same code, not a measurement."""
    import dataclasses

    import torch

    from servelm.model.attention import AttentionMetadata, PrefillSpan, triton_paged

    if not triton_paged.HAS_TRITON:
        return {"status": "skipped", "reason": "triton is not installed"}
    heads, kv, d, dev, dtype = _attention_bench(shape, on_gpu)
    chunks = ((2048, 2048), (512, 4096)) if on_gpu else ((32, 32),)
    bs, reps, calls = 16, (5 if on_gpu else 1), (4 if on_gpu else 1)
    g = torch.Generator(device=dev).manual_seed(0)
    runs = []
    for q_len, ctx in chunks:
        n_blocks = -(-ctx // bs)
        kc = torch.randn(n_blocks, bs, kv, d, generator=g, device=dev, dtype=dtype)
        vc = torch.randn(n_blocks, bs, kv, d, generator=g, device=dev, dtype=dtype)
        q = torch.randn(q_len, heads, d, generator=g, device=dev, dtype=dtype)
        table = torch.randperm(n_blocks, generator=g, device=dev).cpu()
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2  # (query, visible key) pairs
        tflop = 4 * heads * d * pairs / 1e12
        for setting in (PREFILL_TILINGS if on_gpu else [PREFILL_TILINGS[0], PREFILL_TILINGS[2]]):
            tiling = triton_paged.PrefillTiling(**setting)
            attn = triton_paged.TritonPagedAttention(heads, kv, d, d**-0.5, prefill=tiling)
            meta = AttentionMetadata(torch.zeros(q_len, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                     torch.zeros(0, n_blocks, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                     [PrefillSpan(0, q_len, ctx, table)], bs)
            meta.derived = attn.derive(meta)
            ms = _attention_ms(attn, q, (kc, vc), [meta.to(dev)] * calls, on_gpu, reps)
            runs.append({**dataclasses.asdict(tiling), "q_len": q_len, "context": ctx, "ms": round(ms, 4),
                         "tflop_s": float(f"{tflop / (ms / 1e3):.4g}")})  # (an interpreted run's is tiny)
        del kc, vc, q
        if on_gpu:
            torch.cuda.empty_cache()
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "block_size": bs, "heads": heads, "kv_heads": kv,
                 "head_dim": d, "default": dataclasses.asdict(triton_paged.PrefillTiling()), "runs": runs}
    for q_len, ctx in chunks:
        mine = [r for r in runs if (r["q_len"], r["context"]) == (q_len, ctx)]
        best = min(mine, key=lambda r: r["ms"])
        out[f"best_{q_len}_of_{ctx}"] = {**best, "speedup_over_default": round(mine[0]["ms"] / best["ms"], 3)}
    return out


def _attention_ms(attn, q, kv_cache, metas: list, on_gpu: bool, reps: int) -> float:
    """Median milliseconds per `attend` call over `metas` (one call each, in turn)."""

    def calls() -> None:
        for m in metas:
            attn.attend(q, kv_cache, m, None)

    return _replay_ms(calls, len(metas), on_gpu, reps)


def _replay_ms(calls, n_calls: int, on_gpu: bool, reps: int) -> float:
    """Median milliseconds per call of `calls` (which makes `n_calls` calls): on a GPU, CUDA-event times of
    replays of a captured graph of them (compiled and warmed first); on the CPU, wall time."""
    import torch

    if not on_gpu:  # interpreted: nothing to compile or warm
        return statistics.median(_wall(calls) for _ in range(reps)) * 1e3 / n_calls
    calls()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n_calls)
    del graph
    return statistics.median(times)


def _linear_bench(shape: tuple, on_gpu: bool, seed: int):
    """What the linear timings share: the shape's four linears as (name, outputs, inputs) (fused qkv, o_proj,
    fused gate_up, down_proj), the device, the dtype, the timing repetitions and a seeded generator."""
    import torch

    h, _, heads, kv, inter, *_ = shape
    d = h // heads
    dev = "cuda" if on_gpu else "cpu"
    linears = [("qkv", (heads + 2 * kv) * d, h), ("o_proj", h, heads * d), ("gate_up", 2 * inter, h),
               ("down_proj", h, inter)]
    return (linears, dev, torch.bfloat16 if on_gpu else torch.float32, 5 if on_gpu else 1,
            torch.Generator(device=dev).manual_seed(seed))


def fp8_linear(shape: tuple, on_gpu: bool) -> dict:
    """An fp8 linear's paths alone at the shape's four linears (fused qkv, o_proj, fused gate_up, down_proj):
    bf16 `F.linear` on the unquantized weight, the weight-only Triton kernel and `_scaled_mm` (activations
    quantized per token), at step sizes from one row (decode) to 2,048 (prefill); the engine takes the
    weight-only kernel up to WEIGHT_ONLY_ROWS rows and `_scaled_mm` above. Milliseconds per call are CUDA-event
    times of graph replays over enough copies of the weight that the L2 cache holds none of it, and `*_gb_s`
    the weight's bytes read per second. On the CPU, interpreted, rows 1 and 2 and the reference path in
    `_scaled_mm`'s place: a smoke of the same code, not a measurement."""
    import torch
    import torch.nn.functional as F

    from servelm.model.quant import fp8
    from servelm.model.quant.triton_matmul import HAS_TRITON, TritonFp8Matmul

    if not HAS_TRITON:
        return {"status": "skipped", "reason": "triton is not installed"}
    linears, dev, dtype, reps, g = _linear_bench(shape, on_gpu, seed=0)
    runs = []
    for name, n, k in linears:
        copies = min(64, -(-DECODE_ATTENTION_FLUSH_BYTES // (n * k))) if on_gpu else 1
        dense = [torch.randn(n, k, generator=g, device=dev, dtype=dtype) * k**-0.5 for _ in range(copies)]
        quant = [fp8.quantize_fp8(w) for w in dense]
        paths = {"bf16": [lambda x, w=w: F.linear(x, w) for w in dense],
                 "weight_only": [TritonFp8Matmul(q) for q in quant]}
        if on_gpu and fp8.scaled_mm_applies(quant[0]) is None:
            paths["scaled_mm"] = [fp8.Fp8ScaledMatmul(q) for q in quant]
        elif not on_gpu:
            paths["scaled_mm"] = [fp8.Fp8ReferenceMatmul(q) for q in quant]
        for rows in ((1, 16, 32, 64, 256, 2048) if on_gpu else (1, 2)):
            x = torch.randn(rows, k, generator=g, device=dev, dtype=dtype)
            row = {"linear": name, "n": n, "k": k, "rows": rows, "calls_per_replay": copies}
            for path, mms in paths.items():
                ms = _replay_ms(lambda mms=mms, x=x: [mm(x) for mm in mms], copies, on_gpu, reps)
                row[f"{path}_ms"] = round(ms, 4)
                row[f"{path}_gb_s"] = round(n * k * (2 if path == "bf16" else 1) / ms / 1e6, 1 if on_gpu else 4)
            timed_paths = [p for p in ("weight_only", "scaled_mm") if f"{p}_ms" in row]
            row["fastest_fp8"] = min(timed_paths, key=lambda p: row[f"{p}_ms"])
            row["fastest_fp8_over_bf16"] = round(row["bf16_ms"] / row[f"{row['fastest_fp8']}_ms"], 3)
            runs.append(row)
        del dense, quant, paths
        if on_gpu:
            torch.cuda.empty_cache()
    return {"dtype": str(dtype).removeprefix("torch."), "weight_only_rows": fp8.WEIGHT_ONLY_ROWS, "runs": runs}


# the weight-only fp8 kernel's launch settings the sweep times, as model/quant/triton_matmul.py's Fp8Tuning
# fields; the first is the default. The dot kernel's: programs per SM, output columns a program, warps,
# pipeline stages. The matrix-vector kernel's (every timed step up to 16 rows takes it): its tile of outputs
# by inputs, and programs per SM
FP8_TUNINGS = [{}, {"programs_per_sm": 4}, {"programs_per_sm": 8}, {"programs_per_sm": 4, "block_n": 32},
               {"programs_per_sm": 4, "block_n": 128, "num_warps": 8}, {"programs_per_sm": 4, "num_stages": 4},
               {"programs_per_sm": 8, "num_stages": 4}, {"programs_per_sm": 8, "block_n": 128, "num_warps": 8,
                                                         "num_stages": 4}]
FP8_TUNINGS += [{"gemv_rows": 16, "programs_per_sm": pps, "gemv_block_n": bn, "gemv_block_k": bk}
                for pps, bn, bk in ((4, 16, 256), (4, 32, 256), (4, 16, 512), (8, 16, 256), (8, 8, 512),
                                    (4, 32, 128))]


def fp8_tuning(shape: tuple, on_gpu: bool) -> dict:
    """The weight-only fp8 kernel at decode sizes (1, 4 and 16 rows) under each launch setting of FP8_TUNINGS
    (model/quant/triton_matmul.py's Fp8Tuning), the dot kernel's and the matrix-vector kernel's: milliseconds
    for the shape's four linears together and the weight bytes streamed per second, the fastest setting at
    each row count, and its speed-up over the default. Timed as `fp8_linear` times; on the CPU, interpreted,
    the default and one matrix-vector setting at one row: a smoke of the same code."""
    import dataclasses

    import torch

    from servelm.model.quant import fp8
    from servelm.model.quant.triton_matmul import HAS_TRITON, Fp8Tuning, TritonFp8Matmul

    if not HAS_TRITON:
        return {"status": "skipped", "reason": "triton is not installed"}
    linears, dev, dtype, reps, g = _linear_bench(shape, on_gpu, seed=1)
    shapes = [(n, k) for _, n, k in linears]
    weights = []
    for n, k in shapes:
        copies = min(64, -(-DECODE_ATTENTION_FLUSH_BYTES // (n * k))) if on_gpu else 1
        weights.append([fp8.quantize_fp8(torch.randn(n, k, generator=g, device=dev, dtype=dtype) * k**-0.5)
                        for _ in range(copies)])
    total_bytes = sum(n * k for n, k in shapes)
    runs = []
    for setting in (FP8_TUNINGS if on_gpu else [FP8_TUNINGS[0], FP8_TUNINGS[-1]]):
        tuning = Fp8Tuning(**setting)
        for rows in ((1, 4, 16) if on_gpu else (1,)):
            ms = 0.0
            for (_, k), quant in zip(shapes, weights, strict=True):
                x = torch.randn(rows, k, generator=g, device=dev, dtype=dtype)
                mms = [TritonFp8Matmul(q, tuning=tuning) for q in quant]
                ms += _replay_ms(lambda mms=mms, x=x: [mm(x) for mm in mms], len(mms), on_gpu, reps)
            runs.append({**dataclasses.asdict(tuning), "kernel": "gemv" if rows <= tuning.gemv_rows else "dot",
                         "rows": rows, "ms": round(ms, 4), "gb_s": round(total_bytes / ms / 1e6, 1 if on_gpu else 4)})
    del weights
    if on_gpu:
        torch.cuda.empty_cache()
    out: dict = {"default": dataclasses.asdict(Fp8Tuning()), "runs": runs}
    for rows in sorted({r["rows"] for r in runs}):
        mine = [r for r in runs if r["rows"] == rows]
        best = min(mine, key=lambda r: r["ms"])
        out[f"best_{rows}_rows"] = {**best, "speedup_over_default": round(mine[0]["ms"] / best["ms"], 3)}
    return out


def w1_big(spec: dict, gen, params, shape: tuple, prefill_s_per_token: float, decode_s_per_token: float,
           tflop_s: float | None) -> None:
    """W1-big: 1,024 prompts of uniform 64..1024 tokens, 128 out, once, where the time left covers it."""
    import numpy as np

    sys.path.insert(0, str(BENCH))
    from gpu_bench import timed

    n_req, n_out = spec["big"]
    vocab = shape[5]
    if not spec["big_on"]:
        result("w1_big", status="skipped", reason=f"not run on {spec['shape']} (--big-on)")
        return
    rng = np.random.Generator(np.random.PCG64(0))
    big = []
    for _ in range(n_req):
        plen = int(rng.integers(64, 1025))
        big.append([1] + [int(i) for i in rng.integers(4, vocab, size=plen - 1)])
    prompt_tokens = sum(map(len, big))
    # the prompts at the 2k prefill's rate, then waves of greedy decoding at the 256-row batch's rate
    estimate = prompt_tokens * prefill_s_per_token + n_req * n_out * decode_s_per_token
    left = spec["deadline"] - time.time()
    if estimate * 1.5 + 5 > left:
        result("w1_big", status="skipped", reason=f"about {estimate:.0f} s needed, {left:.0f} s left")
        return
    s = timed(lambda: gen(big, params(n_out)), 1)
    flops = sum(request_flops(shape, len(p), n_out) for p in big)
    bound = flops / (tflop_s * 1e12) if tflop_s else None
    total = prompt_tokens + n_req * n_out
    result("w1_big", requests=n_req, prompt_tokens=prompt_tokens, output_tokens=n_req * n_out, s=round(s, 2),
           output_tok_s=round(n_req * n_out / s, 1), total_tok_s=round(total / s, 1),
           compute_bound_s=round(bound, 3) if bound else None,
           total_tok_s_bound=round(total / bound, 1) if bound else None,
           of_bound=round(bound / s, 3) if bound else None)


def child_build(spec: dict) -> None:
    path, s = build_model(spec["shape"], Path(spec["work"]), Path(spec["tokenizer"]))
    result("build", s=round(s, 2), path=str(path))


CHILDREN = {"ceilings": child_ceilings, "shape": child_shape, "build": child_build}


# ------------------------------------------------------------------------------------------ orchestrator


class Run:
    """The global budget, the child processes and the logs."""

    def __init__(self, args, prof: dict) -> None:
        self.args, self.prof = args, prof
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.work = args.work
        self.logs = args.out_dir or args.work
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.sections: dict[str, dict] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, name: str) -> Path:
        return self.logs / name

    def popen(self, cmd: list[str], log: Path, **kw) -> subprocess.Popen:
        with open(log, "a") as fh:
            fh.write(f"\n$ {' '.join(cmd)}\n")
            fh.flush()
            return subprocess.Popen(cmd, cwd=ROOT, env=kw.pop("env", None) or self.env, stderr=fh,
                                    start_new_session=True, text=True, **kw)

    def stream(self, proc: subprocess.Popen, cap: float, on_line) -> str:
        """Feed proc's stdout lines to on_line until it exits ('ok' or 'failed') or cap passes ('timeout':
        its process group is ended)."""
        lines: queue.Queue = queue.Queue()

        def reader() -> None:
            for line in proc.stdout or ():
                lines.put(line)
            if proc.stdout is None:
                proc.wait()
            lines.put(None)

        threading.Thread(target=reader, daemon=True).start()
        end = time.monotonic() + cap
        while True:
            try:
                line = lines.get(timeout=max(0.05, min(1.0, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= end:
                    stop(proc)
                    return "timeout"
                continue
            if line is None:
                break
            on_line(line.rstrip("\n"))
        proc.wait()
        return "ok" if proc.returncode == 0 else "failed"

    def child(self, kind: str, spec: dict, cap: float, section: str) -> tuple[str, dict]:
        """A child of this script; its RESULT lines are printed as they come and returned by key."""
        figs: dict = {}
        spec = {**spec, "device": self.args.device, "work": str(self.work), "deadline": time.time() + cap}
        log = self.log("children.log")
        env = None
        if spec.get("src"):  # servelm imported from another source tree (a baseline checkout) instead of ROOT
            rest = [p for p in self.env["PYTHONPATH"].split(os.pathsep) if p and Path(p).resolve() != ROOT]
            env = {**self.env, "PYTHONPATH": os.pathsep.join([spec["src"], *rest])}
        proc = self.popen([sys.executable, str(Path(__file__).resolve()), "--child", kind, "--spec",
                           json.dumps(spec)], log, stdout=subprocess.PIPE, env=env)

        def on_line(line: str) -> None:
            if line.startswith("RESULT "):
                fig = json.loads(line[7:])
                key = fig.pop("key")
                figs[key] = fig
                emit({"section": section, "figure": key, **fig})

        status = self.stream(proc, cap, on_line)
        stop(proc)  # anything it left in its process group (GPU memory, before the next section)
        if status == "failed":
            figs["error"] = tail(log)
        return status, figs


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a child and then whatever is left of its process group (an engine process, which holds GPU memory):
    SIGTERM to the child first (a server shuts its engine down itself), then to the group, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        end = time.monotonic() + wait
        while time.monotonic() < end:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
    proc.wait()


def tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def dist_name(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def older(have: str, wheel: str) -> bool:
    try:
        from packaging.version import Version

        return Version(have) < Version(wheel)
    except Exception:  # an unparsable version: leave the machine's
        return False


def section_setup(run: Run, cap: float) -> dict:
    out: dict = {"python": sys.version.split()[0]}
    for dist in ("torch", "triton", "transformers", "tokenizers"):
        out[dist] = installed(dist)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    wheels = run.args.wheels
    if wheels is None and (ROOT / ".whl").is_dir():
        wheels = ROOT / ".whl"
    if wheels is not None:
        todo = [w for w in sorted(wheels.glob("*.whl")) if installed(dist_name(w)) is None
                or (dist_name(w) in UPGRADE and older(installed(dist_name(w)), w.name.split("-")[1]))]
        site = run.work / "site"
        if todo:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, todo)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, cap - 10))
            out["wheels_installed"] = [dist_name(w) for w in todo] if proc.returncode == 0 else []
            if proc.returncode:
                out["wheels_error"] = proc.stderr[-1500:]
        else:
            out["wheels_installed"] = []
        if site.is_dir():
            sys.path.insert(0, str(site))
            run.env["PYTHONPATH"] += os.pathsep + str(site)
            importlib.invalidate_caches()
    missing = []
    for module, dist in SERVE_PACKAGES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    out["missing_packages"] = missing
    out["kernels_built"] = any((ROOT / "servelm" / "model" / "kernels" / "lib").glob("*.so"))
    t = time.perf_counter()
    base = run.args.tokenizer
    vocabs = {TEST_VOCAB} | {shape_of(n)[5] for n in run.prof["shapes"] + [run.prof["s1_shape"]]}
    run.tokenizers = {v: write_tokenizer(run.work / f"tokenizer-{v}", v, base) for v in sorted(vocabs)}
    out["tokenizers"] = {str(v): str(p) for v, p in run.tokenizers.items()}
    out["tokenizer_base"] = str(base) if base else "byte-level, no merges, padded with <xN> tokens"
    out["tokenizer_s"] = round(time.perf_counter() - t, 2)
    return out


def section_ceilings(run: Run, cap: float) -> dict:
    status, figs = run.child("ceilings", {}, cap, "ceilings")
    out = {**figs.get("device", {}), **figs.get("ceilings", {})}
    if "error" in figs:
        out["error"] = figs["error"]
    run.ceilings = figs.get("ceilings", {})
    run.device_info = figs.get("device", {})
    return {"status": status, **out}


_PYTEST_LINE = re.compile(r"^(\S+::\S+?)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def section_tests(run: Run, cap: float) -> dict:
    gpu = run.args.device.startswith("cuda")
    files = GPU_TESTS if gpu else CPU_TESTS
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=", *files]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd[4:4] = ["--timeout", str(int(min(120, cap)))]
    run.env["SERVELM_TEST_TOKENIZER"] = str(run.tokenizers[TEST_VOCAB])
    log = run.log("pytest.log")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    summary: dict[str, int] = {}
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "skipped"}

    with open(log, "a") as fh:
        def on_line(line: str) -> None:
            fh.write(line + "\n")
            m = _PYTEST_LINE.match(line)
            if m:
                counts[key[m.group(2)]] += 1
                if m.group(2) in ("FAILED", "ERROR"):
                    failing.append(m.group(1))
                emit({"section": "tests", "test": m.group(1), "outcome": m.group(2)})
            elif line.startswith("=") and (" passed" in line or " failed" in line or " skipped" in line
                                           or " error" in line):
                for n, what in _PYTEST_SUMMARY.findall(line):
                    summary["errors" if what.startswith("error") else what] = int(n)
            elif line.startswith("ERROR ") and "::" not in line:  # a file that failed to collect
                failing.append(line[6:].split(" ")[0])

        t = time.perf_counter()
        proc = run.popen(cmd, log, stdout=subprocess.PIPE)
        status = run.stream(proc, cap, on_line)
        stop(proc)
    for k in counts:
        counts[k] = max(counts[k], summary.get(k, 0))
    if status == "failed" and not counts["failed"] and not counts["errors"]:
        counts["errors"] = 1
    out = {"status": "timeout" if status == "timeout" else ("failed" if counts["failed"] or counts["errors"]
                                                               else "ok"),
           "files": files, **counts, "failing": failing[:50], "s": round(time.perf_counter() - t, 1),
           "returncode": proc.returncode}
    if status == "timeout":
        out["reason"] = f"stopped at the section's cap ({cap:.0f} s); counts are of the tests that finished"
    return out


SHAPE_KEYS = ["build", "load", "w1", "tpot_b1", "prefill_2k", "w1_sampled", "decode_attention", "prefill_attention",
              "w1_big"]


def section_shape(run: Run, cap: float, name: str) -> dict:
    prof = run.prof
    shape = shape_of(name)
    gpu = run.args.device.startswith("cuda")
    if gpu and run.device_info.get("memory_gb"):
        need = 2 * sum(linear_params(shape)) / 2**30 + (0 if shape[6] else 2 * shape[0] * shape[5] / 2**30) + 10
        if run.device_info["memory_gb"] < need:
            return {"status": "skipped", "reason": f"needs about {need:.0f} GiB, the GPU has "
                                                  f"{run.device_info['memory_gb']} GiB"}
    fp8_shapes = run.fp8_shapes
    if fp8_shapes is None:  # 8b where the GPU runs fp8 matmuls (compute capability 8.9 or newer)
        fp8_shapes = ["8b"] if tuple(run.device_info.get("capability") or (0, 0)) >= (8, 9) else []
    spec = {"shape": name, "tokenizer": str(run.tokenizers[shape[5]]), "reps": prof["reps"],
            "fp8_linear": name in fp8_shapes,
            "w1": prof["w1"], "sampled": prof["sampled"], "big": prof["big"], "tpot": prof["tpot"],
            "big_on": name in prof["big_on"], **{k: run.ceilings.get(k) for k in ("copy_gb_s", "bf16_tflop_s")}}
    # the model is made in a process of its own: the process that measures then holds no trace of making it
    # (a process that had made the model with transformers ran the host's part of a decode step slower)
    t = time.monotonic()
    built, made = run.child("build", spec, cap, name)
    if built != "ok":
        return {"status": built, "build": made.get("build", {}), "error": made.get("error")}
    status, figs = run.child("shape", spec, max(1.0, cap - (time.monotonic() - t)), name)
    figs["build"] = {**figs.get("build", {}), **made["build"]}
    out: dict = {"status": status}
    if run.args.baseline is not None and name in run.baseline_shapes and status == "ok":
        # beyond the section's cap: a baseline asked for is worth the time of the sections after it
        out["baseline"] = baseline_figures(run, spec, name, min(BASELINE_CAP_S, max(1.0, run.left() - 3)), figs)
    if name in fp8_shapes and status == "ok":
        out["fp8"] = fp8_figures(run, spec, name, min(BASELINE_CAP_S, max(1.0, run.left() - 3)), figs)
    if name in run.mixed_shapes and status == "ok":
        out["mixed"] = mixed_figures(run, spec, name, min(BASELINE_CAP_S, max(1.0, run.left() - 3)), figs)
    if name in run.async_shapes and status == "ok":
        out["async"] = async_figures(run, spec, name, min(BASELINE_CAP_S, max(1.0, run.left() - 3)), figs)
    for k in SHAPE_KEYS:
        if k in figs:
            out[k] = figs[k]
        else:
            why = {"timeout": f"the section's cap ({cap:.0f} s) was reached first",
                   "failed": "the child process failed (see error)"}.get(status, "not measured")
            out[k] = {"status": "skipped", "reason": why}
    for k in ("fp8_linear", "fp8_tuning", "memory", "error"):
        if k in figs:
            out[k] = figs[k]
    if name != prof["s1_shape"] and model_dir(run.work, name).exists() and not run.args.keep_models:
        shutil.rmtree(model_dir(run.work, name), ignore_errors=True)  # the disk, for the next shape
    return out


BASELINE_CAP_S = 90  # a baseline tree's W1 and TPOT on one shape: its load, graph capture and the two workloads


def baseline_figures(run: Run, spec: dict, name: str, cap: float, figs: dict) -> dict:
    """W1 and batch-1 TPOT of the --baseline source tree on the same model, machine and settings, and this
    tree's figures over them (W1: tok/s ratio; TPOT: the baseline's time over this tree's, >1 is faster)."""
    status, old = run.child("shape", {**spec, "src": str(run.args.baseline.resolve()), "only": ["w1", "tpot_b1"]},
                            cap, f"{name}:baseline")
    out: dict = {"status": status, "src": str(run.args.baseline), **{k: old[k] for k in ("load", "w1", "tpot_b1", "error")
                                                                     if k in old}}
    if "w1" in old and "w1" in figs:
        out["w1_speedup"] = round(figs["w1"]["output_tok_s"] / old["w1"]["output_tok_s"], 3)
    if "tpot_b1" in old and "tpot_b1" in figs:
        out["tpot_b1_speedup"] = round(old["tpot_b1"]["tpot_ms"] / figs["tpot_b1"]["tpot_ms"], 3)
    return out


# a variant's figure over this tree's default one: > 1 where the variant is faster
_SPEEDUP = {"w1": lambda base, got: got["output_tok_s"] / base["output_tok_s"],
            "tpot_b1": lambda base, got: base["tpot_ms"] / got["tpot_ms"],
            "prefill_2k": lambda base, got: base["ms"] / got["ms"]}


def variant_figures(run: Run, spec: dict, name: str, cap: float, figs: dict, label: str, llm_kwargs: dict,
                    only: list[str], of_default: bool = False) -> dict:
    """The figures `only` again with the engine settings `llm_kwargs` on the same model, and each one's speed-up
    over this tree's default figure (`<figure>_speedup`, > 1: the variant is faster); with `of_default`, the
    default's speed-up over the variant (> 1: the default is faster)."""
    status, got = run.child("shape", {**spec, "llm_kwargs": llm_kwargs, "only": only}, cap, f"{name}:{label}")
    out: dict = {"status": status, **{k: got[k] for k in (*only, "error") if k in got}}
    for k in only:
        if k in got and k in figs:
            base, variant = (got[k], figs[k]) if of_default else (figs[k], got[k])
            out[f"{k}_speedup"] = round(_SPEEDUP[k](base, variant), 3)
    return out


def fp8_figures(run: Run, spec: dict, name: str, cap: float, figs: dict) -> dict:
    """Batch-1 TPOT (against the bound of one byte a linear weight) and the 2k prefill with `--quantization fp8`
    on the same model, beside this tree's bf16 figures."""
    return variant_figures(run, spec, name, cap, figs, "fp8", {"quantization": "fp8"}, ["tpot_b1", "prefill_2k"])


def async_figures(run: Run, spec: dict, name: str, cap: float, figs: dict) -> dict:
    """W1 and batch-1 TPOT step by step (`--no-async-scheduling`) on the same model, and the speed-ups of this
    tree's default figures over them: on a GPU the default launches each decode step behind the one in flight
    (asynchronous scheduling), on the CPU it goes step by step too (the speed-ups are then about 1)."""
    return variant_figures(run, spec, name, cap, figs, "step_by_step", {"async_scheduling": False},
                           ["w1", "tpot_b1"], of_default=True)


def mixed_figures(run: Run, spec: dict, name: str, cap: float, figs: dict) -> dict:
    """W1 and the 2k prefill with `--cuda-graph-mixed-tokens 2048` (steps with prompt chunks replayed from
    graphs too) on the same model, beside this tree's figures, where those steps run eagerly."""
    return variant_figures(run, spec, name, cap, figs, "mixed", {"cuda_graph_mixed_tokens": 2048},
                           ["w1", "prefill_2k"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def _itl_histogram(text: str) -> tuple[dict[float, float], float, float]:
    """The servelm:inter_token_latency_seconds histogram of a /metrics scrape: cumulative bucket counts by
    upper bound, the sum and the count, over every label set."""
    sys.path.insert(0, str(BENCH))
    from concurrency import _buckets

    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("servelm:inter_token_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("servelm:inter_token_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return _buckets(text), total, count


def _server_itl(before: str, after: str) -> dict:
    from concurrency import _quantile

    b0, s0, c0 = _itl_histogram(before)
    b1, s1, c1 = _itl_histogram(after)
    n = c1 - c0
    return {"count": int(n), "mean": round((s1 - s0) / n * 1e3, 2) if n > 0 else None,
            **{f"p{q}": _quantile(b0, b1, q / 100) for q in (50, 90, 99)}}


def section_s1(run: Run, cap: float) -> dict:
    prof = run.prof
    end = time.monotonic() + cap
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return {"status": "skipped", "reason": f"missing packages: {', '.join(missing)} (carry their wheels: "
                                               "--download-wheels, then --wheels)"}
    name = prof["s1_shape"]
    shape = shape_of(name)
    path = model_dir(run.work, name)
    out: dict = {"status": "ok", "shape": name, "rates": []}
    if not (path / "config.json").exists():
        status, figs = run.child("build", {"shape": name, "tokenizer": str(run.tokenizers[shape[5]])},
                                 end - time.monotonic(), "s1")
        if status != "ok":
            return {"status": status, "shape": name, "reason": "building the model failed", **figs}
    gpu = run.args.device.startswith("cuda")
    kv_gb = 4.0 if gpu else 0.25
    if gpu and run.device_info.get("memory_gb"):
        kv_gb = round(min(16.0, 0.5 * run.device_info["memory_gb"]), 1)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", str(path), "--device", run.args.device,
           "--dtype", "bfloat16" if gpu else "auto", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", f"llama-{name}", "--embedding-model", "none", "--data-dir",
           str(run.work / "data"), "--kv-cache-memory-gb", str(kv_gb)]
    if not gpu:
        cmd += ["--num-threads", "1"]  # a tiny model: the API process and the client keep the other core
    log = run.log("server.log")
    t = time.perf_counter()
    server = run.popen(cmd, log, stdout=subprocess.DEVNULL)
    try:
        while _get(url + "/ready", 2)[0] != 200:
            if server.poll() is not None:
                return {**out, "status": "failed", "reason": "the server exited", "error": tail(log)}
            if time.monotonic() > end - 10:
                return {**out, "status": "timeout", "reason": "the server was not ready within the cap",
                        "error": tail(log)}
            time.sleep(0.5)
        out["ready_s"] = round(time.perf_counter() - t, 1)
        emit({"section": "s1", "figure": "ready", "s": out["ready_s"]})
        bench = [sys.executable, "-m", "servelm.entrypoints.cli", "bench", "serve", "--base-url", url,
                 "--vocab-size", str(shape[5]), "--label", f"servelm-{name}"]
        warm = run.popen(bench + ["--rate", "inf", "--num-requests", str(prof["s1_warmup"]), "--seed", "99"],
                         run.log("children.log"), stdout=subprocess.DEVNULL)
        if run.stream(warm, max(1.0, end - time.monotonic()), lambda line: None) == "timeout":
            return {**out, "status": "timeout", "reason": "the warm-up outlasted the cap"}
        for rate in prof["s1_rates"]:
            if time.monotonic() > end - 5:
                out["rates"].append({"rate": rate, "status": "skipped", "reason": "the section's cap was reached"})
                continue
            before = _get(url + "/metrics")[1]
            reports: list[dict] = []

            def on_line(line: str, reports=reports) -> None:
                if line.startswith("{"):
                    reports.append(json.loads(line))

            client = run.popen(bench + ["--rate", str(rate), "--num-requests", str(prof["s1_requests"])],
                               run.log("children.log"), stdout=subprocess.PIPE)
            status = run.stream(client, max(1.0, end - time.monotonic()), on_line)
            after = _get(url + "/metrics")[1]
            if not reports:
                out["rates"].append({"rate": rate, "status": status, "reason": "no report from the client"})
                continue
            rep = reports[-1]
            server_itl = _server_itl(before, after)
            client_itl = rep.get("itl_ms", {})
            row = {"rate": rate, "status": "ok", "requests": rep["requests"], "completed": rep["completed"],
                   "failed": rep["failed"], "output_tok_s": rep["output_tok_per_s"],
                   "ttft_ms": rep.get("ttft_ms"), "tpot_ms": rep.get("tpot_ms"),
                   "client_itl_ms": client_itl, "server_itl_ms": server_itl,
                   "client_over_server_mean": round(client_itl["mean"] / server_itl["mean"], 3)
                   if client_itl.get("mean") and server_itl.get("mean") else None,
                   "client_over_server_p99": round(client_itl["p99"] / server_itl["p99"], 3)
                   if client_itl.get("p99") and server_itl.get("p99") else None,
                   "goodput_req_s": rep.get("goodput_req_per_s"), "errors": rep.get("errors")}
            out["rates"].append(row)
            emit({"section": "s1", "figure": f"rate {rate:g}", **row})
    finally:
        stop(server, grace=20)
    if any(r.get("status") != "ok" for r in out["rates"]):
        out["status"] = "partial"
    return out


def main_check(args) -> int:
    prof = profile(args.device, args.quick)
    if args.budget_s is None:
        args.budget_s = prof["budget_s"]
    if args.shapes:
        prof["shapes"] = args.shapes.split(",")
    if args.s1_shape:
        prof["s1_shape"] = args.s1_shape
    if args.big_on is not None:
        prof["big_on"] = [s for s in args.big_on.split(",") if s]
    if args.s1_rates:
        prof["s1_rates"] = [float(r) for r in args.s1_rates.split(",")]
    if args.s1_requests:
        prof["s1_requests"] = args.s1_requests
    if args.work is None:
        shm = Path("/dev/shm")
        big = args.device.startswith("cuda") and shm.is_dir() and shutil.disk_usage(shm).free > 48 * 2**30
        args.work = Path(tempfile_dir(shm if big else None))
    args.work.mkdir(parents=True, exist_ok=True)
    run = Run(args, prof)
    run.tokenizers, run.ceilings, run.device_info = {}, {}, {}
    run.baseline_shapes = prof["shapes"] if args.baseline_shapes is None else args.baseline_shapes.split(",")
    run.fp8_shapes = None if args.fp8_shapes is None else [s for s in args.fp8_shapes.split(",") if s]
    run.async_shapes = [s for s in args.async_shapes.split(",") if s]
    run.mixed_shapes = [s for s in args.mixed_shapes.split(",") if s]
    skip = set(filter(None, args.skip.split(",")))
    caps, mins = prof["caps"], prof["min_s"]
    plan: list[tuple[str, str, object]] = [("setup", "setup", section_setup), ("ceilings", "ceilings",
                                                                               section_ceilings),
                                           ("tests", "tests", section_tests)]
    shapes = prof["shapes"]
    for s in shapes:
        if s == "8b":
            continue
        plan.append((s, "shape", lambda r, c, s=s: section_shape(r, c, s)))
    plan.append(("s1", "s1", section_s1))
    if "8b" in shapes:
        plan.append(("8b", "shape", lambda r, c: section_shape(r, c, "8b")))
    emit({"check": "gpu_check", "device": args.device, "quick": args.quick, "budget_s": args.budget_s,
          "work": str(args.work), "sections": [p[0] for p in plan]})
    for name, kind, fn in plan:
        left = run.left() - 3
        cap = min(caps.get(f"{kind}:{name}", caps[kind]), left)
        if name == plan[-1][0]:
            cap = left  # the last section takes what is left
        if name == "setup":
            cap = caps["setup"]  # always: the other sections need it
        if name in skip:
            res = {"status": "skipped", "reason": "--skip"}
        elif name != "setup" and not run.tokenizers:
            res = {"status": "skipped", "reason": "setup failed"}
        elif cap < mins.get(kind, 0):
            res = {"status": "skipped", "reason": f"time budget: {max(0, left):.0f} s left of {args.budget_s} s, "
                                                  f"the section needs at least {mins.get(kind, 0)} s"}
        else:
            t = time.perf_counter()
            try:
                res = fn(run, cap)
            except Exception as e:  # one section's failure is reported, the others still run
                res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            res.setdefault("status", "ok")
            res["wall_s"] = round(time.perf_counter() - t, 1)
            res["cap_s"] = round(cap, 1)
        run.sections[name] = res
        emit({"section": name, "done": True, "status": res["status"], "wall_s": res.get("wall_s")})
    final = {"check": "gpu_check", "device": args.device, "gpu": run.device_info.get("gpu"),
             "quick": args.quick, "budget_s": args.budget_s, "wall_s": round(time.monotonic() - run.t0, 1),
             "ok": all(s["status"] in ("ok", "skipped") for s in run.sections.values()),
             "complete": all(s["status"] == "ok" for s in run.sections.values()),
             "sections": run.sections}
    text = json.dumps(final)
    (run.logs / "gpu_check.json").write_text(text + "\n")
    print(text, flush=True)
    if not args.keep_models and args.work_is_temp:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


def tempfile_dir(parent: Path | None) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="servelm-gpu-check-", dir=parent)


def download_wheels(dest: Path, python: str) -> int:
    """pip download the serving packages' wheels (the versions installed here, where installed) for Linux
    x86-64 and the given CPython version; the check installs those its machine lacks."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = []
    for _, dist in SERVE_PACKAGES:
        if dist in NOT_CARRIED or dist in ("pytest", "pluggy", "iniconfig"):  # the GPU image has pytest
            continue
        version = installed(dist)
        reqs.append(f"{dist}=={version}" if version else dist)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)]
    platforms += ["manylinux2014_x86_64", "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(dest)]
    for p in platforms:
        cmd += ["--platform", p]
    print("$ " + " ".join(cmd + reqs), file=sys.stderr)
    rc = subprocess.call(cmd + reqs)
    size = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(json.dumps({"wheels": sorted(f.name for f in dest.glob("*.whl")), "mib": round(size / 2**20, 1)}))
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (or cuda:N); cpu runs the same steps on tiny shapes")
    p.add_argument("--quick", action="store_true", help="small workloads and few requests (a smoke run)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the whole run's time budget (default: 510 on a GPU, 240 with --quick or on the CPU)")
    p.add_argument("--shapes", default=None, help="comma-separated: 60m, smollm2, 1b, 8b (tiny on the CPU)")
    p.add_argument("--big-on", default=None, help="the shapes W1-big runs on (default: 1b,8b)")
    p.add_argument("--s1-shape", default=None, help="the model `servelm serve` runs for S1 (default: 1b)")
    p.add_argument("--s1-rates", default=None, help="S1's three request rates, req/s (default: 4,16,64)")
    p.add_argument("--s1-requests", type=int, default=None, help="S1 requests per rate (default: 100)")
    p.add_argument("--skip", default="", help="sections to leave out: setup is always run; ceilings, tests, "
                                              "the shape names, s1")
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                   help="another servelm source tree (e.g. `git archive 3d918c2 | tar -x -C DIR`): each shape's "
                        "W1 and batch-1 TPOT run again with it, on the same model and machine, beside this tree's")
    p.add_argument("--baseline-shapes", default=None, help="the shapes --baseline runs on (default: every shape)")
    p.add_argument("--fp8-shapes", default=None, help="the shapes whose batch-1 TPOT and 2k prefill run again with "
                   "--quantization fp8 (default: 8b on a GPU of compute capability 8.9 or newer, none elsewhere)")
    p.add_argument("--mixed-shapes", default="60m,8b", help="the shapes whose W1 and 2k prefill run again with "
                   "--cuda-graph-mixed-tokens 2048 (default: 60m,8b)")
    p.add_argument("--async-shapes", default="60m,1b,8b", help="the shapes whose W1 and batch-1 TPOT run again "
                   "step by step (--no-async-scheduling) beside the default, where measured ('' for none)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer folder to pad to each model's vocabulary (default: a synthetic byte-level one)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="a folder of wheels (--download-wheels) installed, where their package is missing, into "
                        "the work folder (default: .whl in the checkout, if there)")
    p.add_argument("--work", type=Path, default=None, help="models, tokenizers and the server's data (default: a "
                                                           "temporary folder, removed at the end)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where gpu_check.json and the logs go (pytest.log, server.log, children.log)")
    p.add_argument("--keep-models", action="store_true", help="keep the work folder and every model")
    p.add_argument("--download-wheels", type=Path, default=None, metavar="DIR",
                   help="only download the serving packages' wheels into DIR (needs pip and an index)")
    p.add_argument("--python-version", default="3.12", help="with --download-wheels: the GPU machine's Python")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    spec = json.loads(args.spec) if args.child else {}
    # servelm from this checkout (or a child's --baseline tree), and the bench modules reused here
    sys.path[:0] = [spec.get("src") or str(ROOT), str(BENCH)]
    if args.child:
        CHILDREN[args.child](spec)
        return 0
    if args.download_wheels:
        return download_wheels(args.download_wheels, args.python_version)
    args.work_is_temp = args.work is None
    return main_check(args)


if __name__ == "__main__":
    raise SystemExit(main())
