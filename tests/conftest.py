"""Fixtures: tiny random-weight models of each supported family, built from transformers configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # the torch-free smoke subset (API side, config, scheduler) runs without it
    torch = None

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if torch is not None:
    # under pytest-xdist the workers share the cores: threads beyond a worker's share only contend (OpenMP
    # threads spin at barriers), which made a transformers oracle 1.5x slower beside a busy worker
    _share = (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, _share)))

VOCAB = 49152  # the SmolLM2 tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
              # Wide weights give peaked logits, so greedy choices never hinge on float rounding noise.
              initializer_range=0.2)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**COMMON),
        "llama3rope": LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        # Built only where a test asks for it (not in ARCHS): the GGUF tests' YaRN model.
        "llama_yarn": LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 64,
            "beta_fast": 16.0, "beta_slow": 2.0}),
        "mistral": MistralConfig(**COMMON, sliding_window=24),
        "qwen2": Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=24, max_window_layers=1),
        "qwen3": Qwen3Config(**COMMON, head_dim=32),
    }


ARCHS = ["llama", "llama3rope", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The real SmolLM2 tokenizer (from the default model's GGUF), saved as a plain HF folder.
    $SERVELM_TEST_TOKENIZER names such a folder instead, where the default model's package is not installed
    (the GPU machine, which takes the tests with a copied tokenizer)."""
    if os.environ.get("SERVELM_TEST_TOKENIZER"):
        return Path(os.environ["SERVELM_TEST_TOKENIZER"])
    from servelm.model.loading.metadata import load_gguf_config_and_tokenizer
    from servelm.model.loading.source import default_model_path

    _, tok = load_gguf_config_and_tokenizer(default_model_path())
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def build_gemma(config, out: Path, tokenizer_dir: Path, seed: int = 0):
    """A random Gemma from a transformers config, saved with the test tokenizer: (folder, model). Its norm
    weights are randomised: Gemma initialises them to zero, which would hide whether (1 + w) is applied."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out, model


def build_model(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[arch], dtype=torch.float32)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: build_model(a, root / a, tokenizer_dir) for a in ARCHS}


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for a, d in model_dirs.items()}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' own greedy generate, never stopping early."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None  # else generate() merges it back in and stops at EOS
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, "the oracle must not stop early"
    return new


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(4, VOCAB, (k - 1,), generator=g).tolist() for k in lens]


_refs: dict = {}


def reference(hf_models, arch: str, prompts: list[list[int]], max_new: int = 16) -> list[list[int]]:
    """The oracle's greedy continuations, each computed once per session."""
    out = []
    for p in prompts:
        key = (arch, tuple(p), max_new)
        if key not in _refs:
            _refs[key] = hf_greedy(hf_models[arch], p, max_new)
        out.append(_refs[key])
    return out


def run(llm, prompts, params=None) -> list[list[int]]:
    """servelm's token ids for each prompt (16 greedy tokens unless `params` says otherwise)."""
    from servelm import SamplingParams

    params = params or SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def cpu_vendor() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return next((line.split(":")[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")


@pytest.fixture(params=["bf16", "fma"])
def dot(request):
    """Each of the CPU kernels' two ways to multiply bf16 pairs (AVX512-BF16's dot-product instruction, or
    float FMAs), the process default restored after; skipped where the kernels are not built."""
    from servelm.model.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("CPU kernels could not be compiled here")
    before = kernels.bf16_dot()
    kernels.set_bf16_dot(request.param)
    yield request.param
    if before in ("bf16", "fma"):
        kernels.set_bf16_dot(before)


RPC_KEYS = """keys:
  - {name: alice, key: sk-alice-000001}
  - {name: limited, key: sk-limited-0003, rpm: 2}
  - {name: bronze, key: sk-bronze-000006, priority: low}
  - {name: boxed, key: sk-boxed-000007, models: [another-model]}
"""
RPC_ADMIN = "sk-rpc-admin-01"


_rpc: dict = {}  # the shared gRPC server's process while it runs


@pytest.fixture(scope="session")
def rpc_server(llama_dir, tmp_path_factory):
    """One server with gRPC, keys, an admin key and a registry, shared by tests/test_grpc.py and
    tests/test_grpc_oip.py (one start instead of two): (process, HTTP url, gRPC address). It is stopped as
    soon as no later test needs it (pytest_runtest_teardown), not at the session's end."""
    from serving import _free_port, start_server, stop_server

    d = tmp_path_factory.mktemp("rpc")
    (d / "keys.yaml").write_text(RPC_KEYS)
    port = _free_port()
    proc, url = start_server(llama_dir, "--api-keys-file", str(d / "keys.yaml"), "--admin-key", RPC_ADMIN,
                             "--data-dir", str(d / "data"), "--num-kv-blocks", "128", "--max-model-len", "512",
                             "--model-roots", str(tmp_path_factory.getbasetemp()),  # test_grpc_oip.py models
                             env={"SERVELM_GRPC_PORT": str(port)})  # an env var: the config tree has it
    _rpc["proc"] = proc
    yield proc, url, f"127.0.0.1:{port}"
    if _rpc.pop("proc", None) is not None:
        assert stop_server(proc) == 0


def pytest_runtest_teardown(item, nextitem):
    proc = _rpc.get("proc")
    if proc is None or (nextitem is not None and "rpc_server" in nextitem.fixturenames):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under xdist a worker runs files in the order the scheduler hands them out, not the collection
        # order below, so "no later test needs it" cannot be known: the fixture stops it at the end.
        return
    items = item.session.items
    if not any("rpc_server" in later.fixturenames for later in items[items.index(item) + 1:]):
        from serving import stop_server

        del _rpc["proc"]
        assert stop_server(proc) == 0


# -- real PostgreSQL and Redis (tests/services.py) -------------------------------------------------
def _need(reason: str | None) -> None:
    """Skip when a service cannot run here, saying why; CI installs both, so there a missing one fails."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (the README's test command installs it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL per test process (xdist worker); tests take a database of their own from it."""
    from services import Postgres, missing_postgres

    _need(missing_postgres())
    pg = Postgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.close()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """The SQLAlchemy URL of a new, empty PostgreSQL database."""
    return postgres_server.create_database()


def new_database(request, tmp_path, kind: str) -> str:
    """A new, empty control-plane database of `kind` (sqlite | postgresql): its URL."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'control.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """Each control-plane database servelm supports, new and empty: a SQLite file, a PostgreSQL database."""
    return new_database(request, tmp_path, request.param)


# for a module whose `database_url` is SQLite unless a test asks for both (its heavier fixtures)
both_databases = pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture
def redis_server():
    """A redis-server of this test's own (a test may stop and restart it)."""
    from services import Redis, missing_redis

    _need(missing_redis())
    r = Redis()
    try:
        r.start()
        yield r
    finally:
        r.close()
