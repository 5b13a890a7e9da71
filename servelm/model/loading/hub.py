"""Models named by their Hugging Face Hub id, kept in the Hugging Face cache that transformers, vLLM and the
`hf` command share.

A reference is `ORG/NAME`, optionally followed by `@REVISION` (a branch, a tag or a commit) and `:FILE` (a
.gguf file in the repo, or a quantization tag such as Q4_K_M as Ollama spells it): `Qwen/Qwen3-0.6B`,
`Qwen/Qwen3-0.6B@main`, `bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`. An `hf.co/` or `huggingface.co/`
prefix is accepted and dropped. A local file or folder of the same name always wins.

Finding a model in the cache (`find_cached`, which `resolve_model` uses in every process) never touches the
network. Downloading is a separate step (`fetch_model`, `pull`) that the entry points run once, before any
process loads the model: when the model is not cached yet, and never while HF_HUB_OFFLINE (or
TRANSFORMERS_OFFLINE) is set.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from servelm.config import env
from servelm.config.model_ref import HubRef, hub_ref, parse_ref, with_revision  # noqa: F401 (re-exported)
from servelm.model.loading.gguf_header import SHARD_NAME, shard_names, shard_stem
from servelm.model.loading.source import ModelSource

logger = logging.getLogger("servelm.hub")

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHORT_COMMIT = re.compile(r"[0-9a-f]{7,39}")
# Ollama's choice among a GGUF repo's files when no tag is given
DEFAULT_GGUF_TAG = "Q4_K_M"
# What a safetensors repo needs (top-level files only): config, tokenizer, chat template, weights. Not the
# PyTorch .bin/.pth copies or the original/ folder many repos also carry.
HF_FILE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
HUB_HELP = ("a Hugging Face repo id: ORG/NAME, ORG/NAME@REVISION, ORG/NAME:FILE.gguf or ORG/NAME:QUANT "
            "(e.g. Qwen/Qwen3-0.6B, bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M)")


class HubError(FileNotFoundError):
    """The model cannot be had from the cache or the Hub; the message is one line saying what to do."""


class HubUnreachable(HubError):
    """The Hub could not be reached (no network, a proxy, HF_ENDPOINT pointing nowhere); `cause` says how."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether the user turned the Hub off: HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE)."""
    return env.hf_offline()


def cache_dir() -> Path:
    """The Hugging Face cache, as huggingface_hub finds it: HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (read now, not at import)."""
    return env.hf_cache_dir()


def repo_folder(repo_id: str) -> Path:
    """The cache folder of a model repo: `models--ORG--NAME`."""
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def _snapshot(ref: HubRef) -> tuple[Path, str] | None:
    """The cached snapshot folder of `ref`'s revision and its commit, or None: refs/REVISION names the commit
    of a branch or tag; a commit (or a unique prefix of at least 7 digits) names its snapshot directly."""
    folder = repo_folder(ref.repo_id)
    revision = ref.revision or "main"
    ref_file = folder / "refs" / revision
    commit = None
    if ref_file.is_file():
        commit = ref_file.read_text().strip()
    elif _COMMIT.fullmatch(revision):
        commit = revision
    elif _SHORT_COMMIT.fullmatch(revision) and (folder / "snapshots").is_dir():
        found = [p.name for p in (folder / "snapshots").iterdir() if p.name.startswith(revision)]
        commit = found[0] if len(found) == 1 else None
    if commit is None or not (folder / "snapshots" / commit).is_dir():
        return None
    return folder / "snapshots" / commit, commit


def _weights_complete(snap: Path) -> bool:
    """Whether a snapshot holds every safetensors file its index names (or, without an index, at least one)."""
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return bool(shards) and all((snap / s).is_file() for s in shards)
    return any(p.is_file() for p in snap.glob("*.safetensors"))


def _ggufs(names: list[str]) -> list[str]:
    """The GGUF models among a repo's files (relative paths): its top-level .gguf files, and the first file of
    each split model (NAME-00001-of-0000N.gguf), at the top level or in a folder of its own, as large quantized
    models are published. Not vision projectors."""
    def model(n: str) -> bool:
        base = n.rsplit("/", 1)[-1]
        if not n.endswith(".gguf") or base.lower().startswith("mmproj") or n.count("/") > 1:
            return False
        m = SHARD_NAME.match(base)
        return int(m["no"]) == 1 if m is not None else "/" not in n
    return sorted(n for n in names if model(n))


def gguf_files(name: str) -> list[str]:
    """The files of the GGUF model `name` (a repo path): a split model's, in order, else `name` alone."""
    folder, _, base = name.rpartition("/")
    return [f"{folder}/{n}" if folder else n for n in shard_names(base)]


def _matches(name: str, tag: str) -> bool:
    """Whether a GGUF model's file (or the folder of a split model) is named for quantization `tag`."""
    folder, _, base = name.rpartition("/")
    stem, tag = shard_stem(base).lower(), tag.lower()
    return stem == tag or any(stem.endswith(sep + tag) for sep in "-._") or folder.lower() == tag


def pick_gguf(ref: HubRef, files: list[str], gguf_file: str | None, where: str) -> str:
    """The .gguf file `ref` (or --gguf-file) asks for among `files` (the repo's top-level names): a file
    named outright, the one matching a quantization tag, the only one, or Ollama's default (Q4_K_M).
    Raises HubError naming the choices."""
    want = gguf_file or ref.file
    choices = _ggufs(files)
    listing = ", ".join(choices) if choices else "none"
    if want is not None and want.endswith(".gguf"):
        found = [n for n in files if n == want or n.rsplit("/", 1)[-1] == want]  # a split model's: in its folder
        if len(found) == 1:
            return gguf_files(found[0])[0]  # a split model by its first file, whichever was named
        raise HubError(f"{ref.repo_id} has no file {want!r} {where} (its .gguf files: {listing})")
    if want is not None and want.lower() != "latest":
        found = [n for n in choices if _matches(n, want)]
        if len(found) == 1:
            return found[0]
        what = "several files match" if found else "no .gguf file matches"
        raise HubError(f"{ref.repo_id}: {what} {want!r} {where} (its .gguf files: {listing}); name one as "
                       f"{ref.repo_id}:FILE.gguf")
    if len(choices) == 1:
        return choices[0]
    default = [n for n in choices if _matches(n, DEFAULT_GGUF_TAG)]
    if len(default) == 1:
        return default[0]
    if not choices:
        raise HubError(f"{ref.repo_id} has neither a config.json with safetensors weights nor a .gguf file {where}")
    raise HubError(f"{ref.repo_id} holds several .gguf files {where}: pick one as {ref.repo_id}:FILE.gguf or "
                   f"{ref.repo_id}:QUANT ({listing})")


def _source(ref: HubRef, snap: Path, commit: str, gguf_file: str | None) -> ModelSource:
    """The model in a cached snapshot. Raises HubError where the snapshot lacks it."""
    where = f"in the cached snapshot {commit[:12]}"
    names = sorted(p.name for p in snap.iterdir() if p.is_file()) + sorted(  # and split models in their folders
        p.relative_to(snap).as_posix() for p in snap.glob("*/*.gguf") if p.is_file())
    if gguf_file is None and ref.file is None and (snap / "config.json").is_file() and _weights_complete(snap):
        return ModelSource("hf", snap, ref.name, ref.repo_id, commit)
    if gguf_file is None and ref.file is None and (snap / "config.json").is_file() and not _ggufs(names):
        raise HubError(f"{ref.repo_id}: the cached snapshot {commit[:12]} lacks some of its safetensors weights "
                       f"(an interrupted download?): run `servelm pull {ref}`")
    name = pick_gguf(ref, names, gguf_file, where)
    missing = [n for n in gguf_files(name) if n not in names]
    if missing:
        raise HubError(f"{ref.repo_id}: the cached snapshot {commit[:12]} lacks {', '.join(missing)} of the split "
                       f"model {shard_stem(name.rsplit('/', 1)[-1])} (an interrupted download?): run "
                       f"`servelm pull {ref}`")
    return ModelSource("gguf", snap / name, ref.name, ref.repo_id, commit)


def find_cached(ref: HubRef, gguf_file: str | None = None) -> ModelSource | None:
    """`ref`'s model from the Hugging Face cache, without the network; None when its revision is not cached.
    Raises HubError where the cached snapshot lacks what `ref` asks for."""
    found = _snapshot(ref)
    return None if found is None else _source(ref, *found, gguf_file)


def not_cached_message(ref: HubRef) -> str:
    return (f"model {str(ref)!r} is not in the Hugging Face cache ({cache_dir()}): download it with "
            f"`servelm pull {ref}`, or start servelm where the Hugging Face Hub is reachable")


def _network_error(e: BaseException) -> bool:
    """Whether `e` says the Hub could not be reached (whatever HTTP library this huggingface_hub uses)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError, TimeoutError)):
        return True
    return any(c.__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")
               for c in type(e).__mro__)


def _hub_error(ref: HubRef, e: BaseException) -> HubError:
    """One line for a failed Hub call."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return HubError(f"{ref.repo_id} is gated: accept its terms on https://huggingface.co/{ref.repo_id}, then "
                        "give a token with access in HF_TOKEN (or run `hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return HubError(f"no model {ref.repo_id!r} on the Hugging Face Hub (or it is private: give a token with "
                        "access in HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"{ref.repo_id} has no revision {ref.revision!r} on the Hugging Face Hub")
    if isinstance(e, EntryNotFoundError):
        return HubError(f"{ref.repo_id}: a file is missing on the Hugging Face Hub ({_first_line(e)})")
    if _network_error(e) or (isinstance(e, HfHubHTTPError) and getattr(e.response, "status_code", 0) >= 500):
        cause = f"{type(e).__name__}: {_first_line(e)}"
        return HubUnreachable(f"cannot reach the Hugging Face Hub to download {ref} ({cause}): check the network "
                              f"(or HF_ENDPOINT, a proxy), or copy the model into the Hugging Face cache "
                              f"({cache_dir()}) from a machine that has it", cause)
    return HubError(f"downloading {ref} failed: {type(e).__name__}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _repo_files(ref: HubRef) -> tuple[list[str], str]:
    """The repo's files at `ref`'s revision and its commit (one Hub call)."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(ref.repo_id, revision=ref.revision, files_metadata=False)
    return [s.rfilename for s in info.siblings or []], info.sha


def download(ref: HubRef, gguf_file: str | None = None) -> ModelSource:
    """Download what servelm needs of `ref` into the Hugging Face cache (with progress bars), skipping the
    files already there: a safetensors repo's top-level config, tokenizer and weights (the shards its index
    names), or one .gguf file. Raises HubError (HubUnreachable where the Hub cannot be reached)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    cache = str(cache_dir())
    revision = ref.revision or "main"
    try:
        files, commit = _repo_files(ref)
        if gguf_file is None and ref.file is None and "config.json" in files and \
                any(f.endswith(".safetensors") and "/" not in f for f in files):
            patterns = list(HF_FILE_PATTERNS)
            if "model.safetensors.index.json" in files:  # only the shards the index names (not consolidated.*)
                index = hf_hub_download(ref.repo_id, "model.safetensors.index.json", revision=revision,
                                        cache_dir=cache)
                shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
                patterns = [p for p in patterns if p != "*.safetensors"] + shards
            logger.info("downloading %s (commit %s) from the Hugging Face Hub into %s", ref.repo_id, commit[:12],
                        cache)
            snap = snapshot_download(ref.repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns,
                                     ignore_patterns=["*/*"])
            modules = _module_folders(Path(snap)) if "modules.json" in files else []
            if modules:  # a sentence-transformers model's modules keep their settings in folders of their own
                snapshot_download(ref.repo_id, revision=revision, cache_dir=cache,
                                  allow_patterns=[f"{m}/*.json" for m in modules])
        else:
            name = pick_gguf(ref, files, gguf_file, f"at {revision}")
            names = gguf_files(name)  # a split model: each of its files
            missing = [n for n in names if n not in files]
            if missing:
                raise HubError(f"{ref.repo_id} lacks {', '.join(missing)} of the split model {name} at {revision}")
            logger.info("downloading %s from %s (commit %s) into %s", name if len(names) == 1 else
                        f"{name} and the {len(names) - 1} other files of its split model", ref.repo_id,
                        commit[:12], cache)
            for n in names:
                hf_hub_download(ref.repo_id, n, revision=revision, cache_dir=cache)
    except HubError:
        raise
    except Exception as e:  # huggingface_hub's and its HTTP library's errors: one line naming the cause
        raise _hub_error(ref, e) from e
    src = find_cached(HubRef(ref.repo_id, ref.revision, ref.file), gguf_file)
    if src is None:  # the ref file could not be written (a read-only cache?): the commit names it
        src = find_cached(HubRef(ref.repo_id, commit, ref.file), gguf_file)
    if src is None:
        raise HubError(f"{ref} was downloaded, but its snapshot is not in {cache}")
    return ModelSource(src.kind, src.path, ref.name, ref.repo_id, src.commit)


def _module_folders(snap: Path) -> list[str]:
    """The folders a sentence-transformers modules.json places its modules in (`1_Pooling`, ...): where each
    module's config.json is. The transformer's own (path "") is the top level, already downloaded."""
    try:
        listed = json.loads((snap / "modules.json").read_text())
    except (OSError, ValueError):
        return []  # not readable: the embedder says so when it reads the folder
    paths = [str(m.get("path") or "").strip("/") for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
    return [p for p in dict.fromkeys(paths) if p and ".." not in p.split("/")]


def fetch_model(model: str | None, gguf_file: str | None = None) -> None:
    """Make sure a Hub model is in the cache before anything loads it: from the cache when it is there (no
    network), else downloaded unless HF_HUB_OFFLINE is set. Local paths and the default model pass through.
    Raises HubError (a FileNotFoundError) with what to do."""
    ref = hub_ref(model)
    if ref is None:
        return
    try:
        if find_cached(ref, gguf_file) is not None:
            return
    except HubError:  # cached, but without what was asked for (another .gguf file, weights cut short)
        if offline():
            raise
    else:
        if offline():
            raise HubError(f"{not_cached_message(ref)} (HF_HUB_OFFLINE is set, so servelm will not download it)")
    download(ref, gguf_file)


@dataclass(frozen=True)
class Pulled:
    source: ModelSource
    status: str  # "downloaded" | "up to date" | "cached" (not checked: offline or the Hub unreachable)
    note: str = ""  # why it was not checked


def pull(model: str, gguf_file: str | None = None) -> Pulled:
    """`servelm pull`: bring `model` into the cache, or up to date with its revision on the Hub. Offline or
    with the Hub unreachable, a cached copy is kept as it is (status "cached"). Raises HubError."""
    ref = parse_ref(model)
    if ref is None:
        raise HubError(f"{model!r} is not a Hugging Face repo id; pull takes {HUB_HELP}")
    try:
        before = find_cached(ref, gguf_file)
    except HubError:
        if offline():
            raise
        before = None  # cached without what was asked for: the Hub says what there is
    if offline():
        if before is None:
            raise HubError(f"model {str(ref)!r} is not in the Hugging Face cache ({cache_dir()}), and "
                           "HF_HUB_OFFLINE is set: unset it to download")
        return Pulled(before, "cached", "HF_HUB_OFFLINE is set, so it was not checked for updates")
    try:
        after = download(ref, gguf_file)
    except HubUnreachable as e:
        if before is None:
            raise
        return Pulled(before, "cached", f"the Hugging Face Hub could not be reached ({e.cause}), so it was "
                      "not checked for updates")
    same = before is not None and before.commit == after.commit and before.path == after.path
    return Pulled(after, "up to date" if same else "downloaded")


def fetch_models(config) -> None:
    """fetch_model for an EngineConfig's model and its draft model (speculative decoding), into its
    --download-dir (and with its --hf-token) if it names one."""
    env.export_hub_settings(config.model_config.download_dir, config.model_config.hf_token)
    fetch_model(config.model_config.model, config.model_config.gguf_file)
    draft = config.speculative_config.speculative_model
    if draft is not None and not draft.startswith("self:"):
        fetch_model(draft)


def served_name(model: str | None, gguf_file: str | None = None) -> str:
    """The name a model is served under by default: a Hub model's repo id (known before it is downloaded),
    else the name of its file or folder."""
    ref = hub_ref(model)
    if ref is not None:
        return ref.name
    from servelm.model.loading.source import resolve_model

    return resolve_model(model, gguf_file).name
