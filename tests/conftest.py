"""Fixtures every test area shares: the test tokenizer, tiny random-weight models of each supported family
(tests/support/tiny_models.py builds them), the CPU kernels' bf16 dot-product switch, and real PostgreSQL
and Redis servers (tests/support/services.py). The helpers in tests/support/ are importable by module name."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # the torch-free smoke subset (API side, config, scheduler) runs without it
    torch = None

sys.path.insert(0, str(Path(__file__).parent / "support"))  # tests import their helpers by module name
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if torch is not None:
    # under pytest-xdist the workers share the cores: threads beyond a worker's share only contend (OpenMP
    # threads spin at barriers), which made a transformers oracle 1.5x slower beside a busy worker
    _share = (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, _share)))
    if not torch.cuda.is_available():
        # Triton decides at each kernel's definition whether the interpreter runs it: set before any test
        # imports a module that defines kernels, so that no import order leaves one compiled for a missing GPU
        os.environ.setdefault("TRITON_INTERPRET", "1")

from services import need, new_database  # noqa: E402
from tiny_models import ARCHS, build_model  # noqa: E402


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


@pytest.fixture(scope="session")
def long_llama_dir(llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a context of HOLD_CONTEXT tokens (tests/support/serving.py): a request for nearly all
    of it holds a batch slot for minutes, longer than any test waits, until its client leaves. Server tests
    that need requests still running while they look take it, so that no check depends on how fast the machine
    generates."""
    from serving import HOLD_CONTEXT

    out = tmp_path_factory.mktemp("long") / "llama"
    shutil.copytree(llama_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": HOLD_CONTEXT}))
    return out


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


# -- real PostgreSQL and Redis (tests/support/services.py) -------------------------------------------------
@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL per test process (xdist worker); tests take a database of their own from it."""
    from services import Postgres, missing_postgres

    need(missing_postgres())
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


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """Each control-plane database servelm supports, new and empty: a SQLite file, a PostgreSQL database."""
    return new_database(request, tmp_path, request.param)


@pytest.fixture
def redis_server():
    """A redis-server of this test's own (a test may stop and restart it)."""
    from services import Redis, missing_redis

    need(missing_redis())
    r = Redis()
    try:
        r.start()
        yield r
    finally:
        r.close()
