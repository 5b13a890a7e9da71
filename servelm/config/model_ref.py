"""How a model string names a Hugging Face Hub repository (ORG/NAME, @REVISION, :FILE.gguf or :QUANT): plain
string parsing, which the config validates with and servelm/model/loading/hub.py resolves from the cache or the Hub."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None  # None: the main branch
    file: str | None = None  # a .gguf file in the repo, or a quantization tag

    @property
    def name(self) -> str:
        """The name the model is served under: the repo id, with the file or tag where one was given (not
        the revision, as vLLM serves `--model X --revision R` as X)."""
        return self.repo_id + (f":{self.file}" if self.file else "")

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (f":{self.file}" if self.file else "")


def parse_ref(model: str) -> HubRef | None:
    """The Hub reference `model` spells, or None where it spells none (the caller decides whether a local
    path of that name exists first)."""
    text = model.strip()
    for prefix in _PREFIXES:
        if text.lower().startswith(prefix):
            text = text[len(prefix):]
            break
    head, colon, file = text.partition(":")
    repo, at, revision = head.partition("@")
    if colon and "@" in file and not at:  # ORG/NAME:FILE@REVISION reads the same
        file, at, revision = file.rpartition("@")[0], "@", file.rpartition("@")[2]
    if not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo:
        return None
    if (colon and not file) or (at and not revision) or (file and ("/" in file or file.startswith("."))):
        return None
    return HubRef(repo, revision or None, file or None)


def hub_ref(model: str | None) -> HubRef | None:
    """`model`'s Hub reference unless it is None or a local file or folder."""
    if model is None or Path(model).expanduser().exists():
        return None
    return parse_ref(model)


def with_revision(model: str | None, revision: str | None) -> str | None:
    """`model` with --revision folded in (ORG/NAME@REVISION), so every process that resolves the model string
    finds the same snapshot. A local path, or a reference already naming that revision, is returned as it is.
    Raises ValueError for a reference that names another revision."""
    ref = hub_ref(model) if revision else None
    if ref is None or ref.revision == revision:
        return model
    if ref.revision is not None:
        raise ValueError(f"model {model!r} names revision {ref.revision!r}, and --revision says {revision!r}")
    return str(HubRef(ref.repo_id, revision, ref.file))
