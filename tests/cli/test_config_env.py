"""Environment variables are read in one place, servelm/config/env.py, and each is documented."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from servelm.config import env

ROOT = Path(__file__).resolve().parents[2]
# setup.py runs the kernel build by path, before servelm is importable: it reads $CXX itself
OUTSIDE = {"servelm/model/kernels/build.py"}


def _reads(tree: ast.AST):
    """Lines that read the environment: os.environ.get / os.getenv / os.environ[...] as a value."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "environ":
                yield node.lineno
            if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                yield node.lineno
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            yield node.lineno


def test_no_module_outside_config_reads_the_environment():
    found = []
    for path in (ROOT / "servelm").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("servelm/config/") or rel in OUTSIDE:
            continue
        found += [f"{rel}:{line}" for line in _reads(ast.parse(path.read_text()))]
    assert not found, "read the environment through servelm.config.env instead:\n" + "\n".join(found)


def test_every_variable_is_documented():
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    missing = [name for name in env.VARIABLES if f"`{name}`" not in page]
    assert not missing, f"docs/reference/environment.md does not describe {missing}"


def test_values_are_read_when_asked(monkeypatch, tmp_path):
    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert env.cpu_kernels() == "auto" and not env.quant_kernel_reference() and not env.hf_offline()
    monkeypatch.setenv("SERVELM_CPU_KERNELS", " AVX2 ")
    monkeypatch.setenv("SERVELM_REGISTRY_URL", "sqlite:///old.db")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert env.cpu_kernels() == "avx2"
    assert env.database_url() == "sqlite:///old.db"  # the older name, where the new one is not set
    assert env.client_api_key() == "sk-openai" and env.api_key() is None
    assert env.hf_offline() and env.hf_cache_dir() == tmp_path / "hub"
    monkeypatch.setenv("SERVELM_DATABASE_URL", "postgresql://db/servelm")
    monkeypatch.setenv("SERVELM_API_KEY", "sk-servelm")
    assert env.database_url() == "postgresql://db/servelm" and env.client_api_key() == "sk-servelm"
    with pytest.raises(KeyError):
        env._get("SERVELM_NOT_A_VARIABLE")
