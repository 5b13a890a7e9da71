"""Every environment variable servelm reads, read here and nowhere else (tests/cli/test_config_env.py checks that no
other module reads one, and that docs/reference/environment.md describes each). The one exception is the kernel
build (model/kernels/build.py), which setup.py runs by path before servelm is importable: it reads $CXX.

`SERVELM_<SETTING>` for each `servelm serve` setting is read by config/settings.py (`env_values`), through
`settings_values` below; the rest are the variables listed in `VARIABLES`, each behind a function named for what
it gives. Values are read when asked for, never at import, so a test or a parent process can set them first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# name -> what it does (the reference page says more)
VARIABLES: dict[str, str] = {
    "SERVELM_CONFIG": "the config file `servelm serve` reads when --config is not given",
    "SERVELM_CACHE_DIR": "where converted artefacts are kept (default ~/.cache/servelm)",
    "SERVELM_CPU_KERNELS": "which build of the C++ CPU kernels runs: auto, a variant name, or 0 (off)",
    "SERVELM_CPU_BF16_DOT": "how the AVX512-BF16 kernels multiply bf16 pairs: auto, bf16 (the instruction) or fma",
    "SERVELM_QUANT_KERNEL": "reference: the GGUF block kernels' arithmetic in torch (tests, debugging)",
    "SERVELM_ALLOW_FAULTS": "1: honour the servelm.fault label of registered versions (drills)",
    "SERVELM_URL": "the server `servelm models`, `ps` and `traffic` manage",
    "SERVELM_API_KEY": "the API key clients (`chat`, `ps`, `bench serve`) send; also the server's --api-key",
    "SERVELM_ADMIN_KEY": "the admin key `servelm models` sends; also the server's --admin-key",
    "SERVELM_DATA_DIR": "the data directory `servelm list` and `db` read; also the server's --data-dir",
    "SERVELM_DATABASE_URL": "the control database `servelm list` and `db` use; also the server's --database-url",
    "SERVELM_REGISTRY_URL": "the older name of SERVELM_DATABASE_URL",
    "OPENAI_API_KEY": "the API key clients send when SERVELM_API_KEY is not set",
    "HF_HUB_OFFLINE": "1: a Hugging Face repo id must already be in the cache",
    "TRANSFORMERS_OFFLINE": "as HF_HUB_OFFLINE",
    "HF_HUB_CACHE": "the Hugging Face cache (else $HF_HOME/hub)",
    "HUGGINGFACE_HUB_CACHE": "the older name of HF_HUB_CACHE",
    "HF_TOKEN": "the Hugging Face token for gated or private repos (read by huggingface_hub; --hf-token sets it)",
    "HF_HOME": "the Hugging Face home (default $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface)",
    "XDG_CACHE_HOME": "the base of the Hugging Face home when HF_HOME is not set",
    "XDG_DATA_HOME": "the base of the default data directory (~/.local/share/servelm)",
}


def _get(name: str) -> str | None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of servelm's environment variables (config/env.py VARIABLES)")
    return os.environ.get(name) or None


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def settings_values() -> Mapping[str, str]:
    """The environment as config/settings.py reads `SERVELM_<SETTING>` from it."""
    return os.environ


def config_file() -> str | None:
    return _get("SERVELM_CONFIG")


def cache_dir() -> Path:
    """Where converted artefacts (e.g. GGUF tokenizers, gRPC stubs) are kept: $SERVELM_CACHE_DIR or
    ~/.cache/servelm."""
    return Path(_get("SERVELM_CACHE_DIR") or Path.home() / ".cache" / "servelm")


def cpu_kernels() -> str:
    """SERVELM_CPU_KERNELS, lower case: auto (default), a variant name, or 0/off/false/none."""
    return (_get("SERVELM_CPU_KERNELS") or "auto").strip().lower()


def cpu_bf16_dot() -> str:
    """SERVELM_CPU_BF16_DOT, lower case: auto (default: the CPU vendor's faster form), bf16 or fma."""
    value = (_get("SERVELM_CPU_BF16_DOT") or "auto").strip().lower()
    if value not in ("auto", "bf16", "fma"):
        raise ValueError(f"SERVELM_CPU_BF16_DOT={value!r}: auto, bf16 or fma")
    return value


def quant_kernel_reference() -> bool:
    """SERVELM_QUANT_KERNEL=reference: GGUF weights run the torch reference arithmetic."""
    return (_get("SERVELM_QUANT_KERNEL") or "").strip().lower() == "reference"


def allow_faults() -> bool:
    return _get("SERVELM_ALLOW_FAULTS") == "1"


def server_url(default: str = "http://127.0.0.1:8000") -> str:
    return _get("SERVELM_URL") or default


def client_api_key() -> str | None:
    """The key a client sends when none is given: $SERVELM_API_KEY (what `servelm serve` reads), else
    $OPENAI_API_KEY (what OpenAI's clients, `vllm chat` and vLLM's benchmark read)."""
    return _get("SERVELM_API_KEY") or _get("OPENAI_API_KEY")


def api_key() -> str | None:
    return _get("SERVELM_API_KEY")


def admin_key() -> str | None:
    return _get("SERVELM_ADMIN_KEY")


def data_dir() -> str | None:
    return _get("SERVELM_DATA_DIR")


def database_url() -> str | None:
    return _get("SERVELM_DATABASE_URL") or _get("SERVELM_REGISTRY_URL")


def hf_offline() -> bool:
    """Whether the user turned the Hub off: HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE)."""
    return _true(_get("HF_HUB_OFFLINE")) or _true(_get("TRANSFORMERS_OFFLINE"))


def hf_cache_dir() -> Path:
    """The Hugging Face cache, as huggingface_hub finds it: HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    path = _get("HF_HUB_CACHE") or _get("HUGGINGFACE_HUB_CACHE")
    if not path:
        home = _get("HF_HOME") or os.path.join(_get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
        path = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(path)))


def export_hub_settings(download_dir: str | None, token: str | None) -> None:
    """--download-dir and --hf-token, as the Hugging Face variables they stand for (HF_HUB_CACHE, HF_TOKEN): set
    in this process's environment, so that every reader of the cache here (hf_cache_dir, huggingface_hub's
    downloads) and every process started from here (engine, embedding model, workers) sees the same ones."""
    if download_dir is not None:
        os.environ["HF_HUB_CACHE"] = str(Path(download_dir).expanduser().resolve())
    if token is not None:
        os.environ["HF_TOKEN"] = token


def xdg_data_home() -> str | None:
    return _get("XDG_DATA_HOME")
