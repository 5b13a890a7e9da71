"""Ollama-style model commands: `servelm pull`, `list`, `ps` and `rm`.

pull, list and rm work on this machine's Hugging Face cache (the one transformers, vLLM and the `hf` command
share; HF_HOME or HF_HUB_CACHE move it), and list also reads the model registry if there is one. ps asks a
running server what it serves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from servelm.config import env
from servelm.model.loading import hub

CACHE_NOTE = ("The Hugging Face cache is HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; "
              "HF_HUB_OFFLINE=1 keeps servelm off the network.")


class _Formatter(argparse.HelpFormatter):
    """Descriptions and epilogs as paragraphs: each wrapped to the terminal, example lines (indented) kept."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith("  ") for line in lines):
                out.append("\n".join(line if line.startswith("  ") else textwrap.fill(line, width)
                                     for line in lines))
            else:
                out.append(textwrap.fill(" ".join(lines), width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)


def add_args(sub) -> None:
    """The four commands, on `servelm`'s subparsers."""
    p = sub.add_parser("pull", help="download a Hugging Face model into the local cache (or bring it up to date)",
                       formatter_class=_Formatter, description=(
                           "Download what servelm needs of a Hugging Face model into the Hugging Face cache, so "
                           "that `servelm serve NAME` starts without the network. For a safetensors repo: its "
                           "config, tokenizer and weights (not the PyTorch .bin copies or the original/ folder); "
                           "for a GGUF repo: one .gguf file. Pulling a model that is already cached checks it "
                           "against the Hub and downloads only what changed; offline (HF_HUB_OFFLINE=1) or with "
                           "the Hub unreachable, a cached copy is kept as it is.\n\n" + CACHE_NOTE),
                       epilog="examples:\n"
                              "  servelm pull Qwen/Qwen3-0.6B\n"
                              "  servelm pull Qwen/Qwen3-0.6B --revision main\n"
                              "  servelm pull bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M\n"
                              "  servelm pull unsloth/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf\n\n"
                              "Gated models (Llama, Gemma) need a token with access: HF_TOKEN=hf_... or "
                              "`hf auth login`")
    p.add_argument("name", metavar="NAME", help=hub.HUB_HELP)
    p.add_argument("--revision", default=None, help="a branch, tag or commit (the same as NAME@REVISION; "
                   "default: main)")
    p.add_argument("--gguf-file", default=None, help="the .gguf file to download from a GGUF repo (the same as "
                   "NAME:FILE.gguf)")
    _add_download_dir(p)
    p.add_argument("--hf-token", default=None, metavar="TOKEN", help="the token for a gated or private repo, in "
                   "place of HF_TOKEN (as vLLM's --hf-token; HF_TOKEN keeps it off the command line)")
    p.set_defaults(func=cmd_pull)

    ls = sub.add_parser("list", help="the models on this machine: the Hugging Face cache and the model registry",
                        formatter_class=_Formatter, description=(
                            "The models servelm can serve from this machine: each one in the Hugging Face cache "
                            "that servelm can run (a safetensors repo of a supported architecture, or each "
                            "supported .gguf file of a repo), named as `servelm serve` and `servelm rm` take it, "
                            "with its size and when it was last modified; then the model registry's versions, "
                            "where a registry exists (the data directory's registry.db, or --database-url). "
                            "To see what a running server serves, use `servelm ps`.\n\n" + CACHE_NOTE))
    ls.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ls.add_argument("--all", action="store_true", help="also list cached model repos servelm cannot serve, "
                    "with the reason")
    ls.add_argument("--data-dir", default=env.data_dir(),
                    help="the server's data directory, where the registry lives (default: $SERVELM_DATA_DIR, "
                    "else $XDG_DATA_HOME/servelm or ~/.local/share/servelm)")
    ls.add_argument("--database-url", "--registry-url", dest="registry_url",
                    default=env.database_url(),
                    help="the control database's SQLAlchemy URL, where it is not the data directory's SQLite file "
                    "(default: $SERVELM_DATABASE_URL, or its older name $SERVELM_REGISTRY_URL)")
    _add_download_dir(ls)
    ls.set_defaults(func=cmd_list)

    from servelm.entrypoints.models_cli import _add_shared

    ps = sub.add_parser("ps", help="the models a running server has loaded",
                        formatter_class=_Formatter, description=(
                            "Ask a running server (servelm, or any OpenAI-compatible one) which models it "
                            "serves: GET /v1/models, and with an admin key also GET /admin/deployments for the "
                            "workers of each deployment."),
                        epilog="examples:\n"
                               "  servelm ps\n"
                               "  servelm ps --url http://10.0.0.5:8000 --api-key-file ~/.servelm-key --json")
    _add_shared(ps, defaults=True)
    ps.add_argument("--api-key-file", default=None, help="file holding an API key, where the server requires one "
                    "(else $SERVELM_API_KEY)")
    ps.set_defaults(func=cmd_ps)

    rm = sub.add_parser("rm", help="delete models from the Hugging Face cache",
                        formatter_class=_Formatter, description=(
                            "Delete models from the Hugging Face cache with huggingface_hub's cache API: "
                            "ORG/NAME removes the whole repo (every cached revision), ORG/NAME@REVISION one "
                            "revision, ORG/NAME:FILE.gguf (or :QUANT) one .gguf file. Files another kept "
                            "revision shares stay. A running server goes on serving what it has loaded, but "
                            "could not load it again. The registry's versions are removed with `servelm models "
                            "delete`.\n\n" + CACHE_NOTE),
                        epilog="examples:\n"
                               "  servelm rm Qwen/Qwen3-0.6B\n"
                               "  servelm rm bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M --dry-run")
    rm.add_argument("names", nargs="+", metavar="NAME", help="a name as `servelm list` shows it")
    rm.add_argument("--dry-run", action="store_true", help="say what would be deleted and freed, delete nothing")
    _add_download_dir(rm)
    rm.set_defaults(func=cmd_rm)


def _add_download_dir(p) -> None:
    p.add_argument("--download-dir", default=None, metavar="DIR", help="a Hugging Face cache folder to use "
                   "instead of HF_HUB_CACHE's, as `servelm serve --download-dir` (vLLM's flag) uses it")


def _use_hub_settings(args: argparse.Namespace) -> None:
    env.export_hub_settings(args.download_dir, getattr(args, "hf_token", None))


# -- formatting -------------------------------------------------------------------------------------------

def human_size(n: int | None) -> str:
    """Bytes in decimal units, as Ollama and the `hf` command print them."""
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def ago(t: float | None, now: float | None = None) -> str:
    if not t:
        return ""
    s = max(0.0, (now or time.time()) - t)
    for step, unit in ((86400 * 365, "year"), (86400 * 30, "month"), (86400 * 7, "week"), (86400, "day"),
                       (3600, "hour"), (60, "minute")):
        if s >= step:
            k = int(s // step)
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "just now"


def _table(rows: list[dict], cols: list[str]) -> str:
    from servelm.entrypoints.models_cli import table

    return table(rows, cols)


# -- pull -------------------------------------------------------------------------------------------------

def cmd_pull(args: argparse.Namespace) -> int:
    _use_hub_settings(args)
    name = args.name
    try:
        if args.revision is not None:
            name = hub.with_revision(name, args.revision)
        result = hub.pull(name, args.gguf_file)
    except (hub.HubError, ValueError) as e:
        print(f"servelm: error: {e}", file=sys.stderr)
        return 1
    src = result.source
    what = f"{src.name} (commit {src.commit[:12]}, {human_size(_size(src.path))})"
    if result.status == "downloaded":
        print(f"pulled {what} into {hub.cache_dir()}")
    elif result.status == "up to date":
        print(f"{what} is up to date in {hub.cache_dir()}")
    else:
        print(f"{what} is already in {hub.cache_dir()}; {result.note}")
    return 0


def _size(path: Path) -> int:
    """Bytes of a .gguf file, or of a snapshot folder's files (through their links to the blobs)."""
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files)


# -- list -------------------------------------------------------------------------------------------------

def _servable(path: Path) -> tuple[str | None, str | None]:
    """(architecture, None) where servelm can serve this snapshot folder or .gguf file, else (None, why)."""
    import struct
    from types import SimpleNamespace

    from servelm.model.loading import hf_files
    from servelm.model.loading.metadata import architecture, check_model

    try:
        if path.suffix == ".gguf":
            from servelm.model.loading.gguf_config import gguf_config_dict
            from servelm.model.loading.gguf_header import read_gguf_file_header

            cfg = gguf_config_dict(path, read_gguf_file_header(path))
        else:
            check_model(str(path))
            cfg = hf_files.read_json(path / "config.json") or {}
    except (ValueError, OSError, struct.error) as e:
        return None, str(e).replace(str(path.parent) + "/", "")
    return architecture(SimpleNamespace(**{"architectures": None, "model_type": None, **cfg})), None


def _in_snapshot(f, snap: Path) -> str:
    """A cached file's path within its snapshot (huggingface_hub's file_name is the base name alone)."""
    return Path(f.file_path).relative_to(snap).as_posix()


def _label(rev) -> str:
    """How a cached revision is named after the repo id: nothing for main, @REF for another branch or tag,
    @COMMIT (12 digits) for a revision no ref names."""
    if "main" in rev.refs:
        return ""
    return "@" + (sorted(rev.refs)[0] if rev.refs else rev.commit_hash[:12])


def cached_models(include_all: bool = False) -> list[dict]:
    """The models in the Hugging Face cache that servelm can serve, one row per safetensors revision and per
    .gguf file, by repo id, main first and then the newest (with include_all, the others too, with why not)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = hub.cache_dir()
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: ("main" not in r.refs, -r.last_modified)):
            snap = Path(rev.snapshot_path)
            name = repo.repo_id + _label(rev)
            base = {"repo_id": repo.repo_id, "commit": rev.commit_hash, "refs": sorted(rev.refs)}
            files = {_in_snapshot(f, snap): f for f in rev.files}  # paths in the snapshot (split models: folders)
            ggufs = hub._ggufs(sorted(files))
            found = False
            if (snap / "config.json").is_file() and hub._weights_complete(snap):
                arch, why = _servable(snap)
                if arch is not None or include_all:
                    found = True
                    rows.append({"name": name, **base, "kind": "safetensors", "architecture": arch,
                                 "size_bytes": rev.size_on_disk, "modified": rev.last_modified,
                                 "path": str(snap), **({"unservable": why} if why else {})})
            for g in ggufs:
                arch, why = _servable(snap / g)
                if arch is not None or include_all:
                    found = True
                    parts = [files[n] for n in hub.gguf_files(g) if n in files]  # a split model: all its files
                    rows.append({"name": f"{name}:{g.rsplit('/', 1)[-1]}", **base, "kind": "gguf", "architecture": arch,
                                 "size_bytes": sum(f.size_on_disk for f in parts),
                                 "modified": max(f.blob_last_modified for f in parts),
                                 "path": str(snap / g), **({"unservable": why} if why else {})})
            if include_all and not found:
                rows.append({"name": name, **base, "kind": None, "architecture": None,
                             "size_bytes": rev.size_on_disk, "modified": rev.last_modified, "path": str(snap),
                             "unservable": "neither a config.json with safetensors weights nor a .gguf file"})
    return rows


def _registry_versions(args) -> tuple[str | None, list[dict] | None, str | None]:
    """(where, versions, error): the registry's versions, where a registry exists; nothing is created."""
    from servelm.config.settings import ServerConfig

    data_dir = ServerConfig(data_dir=args.data_dir).data_path()
    url = args.registry_url
    if url is None and not (data_dir / "registry.db").is_file():
        return None, None, None
    where = url or str(data_dir / "registry.db")
    try:
        from servelm.control.registry import Registry

        reg = Registry(url, data_dir)
    except Exception as e:  # a registry that cannot be opened is reported, the cache still listed
        return where, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        out = []
        for name in reg.models():
            for v in reg.versions(name):
                out.append({"name": v.ref, "state": v.state.value, "kind": v.kind.value,
                            "architecture": v.architecture, "size_bytes": v.size_bytes,
                            "modified": v.created_at, "source": v.source})
        return where, out, None
    finally:
        reg.close()


def cmd_list(args: argparse.Namespace) -> int:
    _use_hub_settings(args)
    rows = cached_models(args.all)
    where, versions, error = _registry_versions(args)
    if args.json:
        print(json.dumps({"cache": str(hub.cache_dir()), "models": rows,
                          "registry": None if where is None else {"url": where, "versions": versions,
                                                                  "error": error}}, indent=2))
        return 0
    now = time.time()
    cols = ["name", "kind", "architecture", "size", "modified"] + (["unservable"] if args.all else [])
    print(f"Hugging Face cache ({hub.cache_dir()}):")
    if rows:
        print(_table([{**r, "size": human_size(r["size_bytes"]), "modified": ago(r["modified"], now)}
                      for r in rows], cols))
    else:
        print("  no models servelm can serve; download one with `servelm pull ORG/NAME`")
    if where is not None:
        print(f"\nmodel registry ({where}):")
        if error is not None:
            print(f"  cannot be read: {error}")
        elif versions:
            print(_table([{**v, "size": human_size(v["size_bytes"]), "modified": ago(v["modified"], now)}
                          for v in versions], ["name", "state", "kind", "architecture", "size", "modified"]))
        else:
            print("  no versions registered")
    return 0


# -- ps ---------------------------------------------------------------------------------------------------

def cmd_ps(args: argparse.Namespace) -> int:
    import httpx

    def key(file: str | None, from_env) -> str | None:
        return Path(file).expanduser().read_text().strip() if file else from_env()

    api_key = key(args.api_key_file, env.api_key)
    admin_key = key(args.admin_key_file, env.admin_key)
    base = args.url.rstrip("/")
    try:
        with httpx.Client(base_url=base, timeout=args.timeout) as http:
            r = http.get("/v1/models", headers={"Authorization": f"Bearer {api_key or admin_key}"}
                         if (api_key or admin_key) else {})
            if r.status_code in (401, 403):
                print(f"servelm: error: {base} wants an API key for /v1/models (HTTP {r.status_code}): give "
                      "--api-key-file or $SERVELM_API_KEY", file=sys.stderr)
                return 1
            r.raise_for_status()
            cards = r.json().get("data", [])
            deployments = None
            if admin_key:
                d = http.get("/admin/deployments", headers={"Authorization": f"Bearer {admin_key}"})
                deployments = d.json() if d.status_code == 200 else None
    except httpx.HTTPStatusError as e:
        print(f"servelm: error: {base}/v1/models answered HTTP {e.response.status_code}", file=sys.stderr)
        return 1
    except (httpx.HTTPError, ValueError) as e:
        print(f"servelm: error: cannot reach {base}: {e} (is a server running there? see --url)",
              file=sys.stderr)
        return 1
    by_ref = {d.get("ref"): d for d in deployments or []}
    rows = []
    for c in cards:
        dep = by_ref.get(c.get("root")) if c.get("version") is not None else None
        rows.append({"model": c.get("id"), "alias_of": c.get("root") if c.get("version") is None else None,
                     "version": c.get("root") if c.get("version") is not None else None, "state": c.get("state"),
                     "context": c.get("max_model_len"), "workers": dep.get("workers") if dep else None,
                     "ready": dep.get("ready") if dep else None})
    if args.json:
        print(json.dumps({"url": base, "models": rows, "deployments": deployments}, indent=2))
        return 0
    if not rows:
        print(f"{base} serves no models")
        return 0
    cols = ["model", "alias_of", "version", "state", "context"] + (["workers", "ready"] if deployments else [])
    cols = [c for c in cols if c == "model" or any(r.get(c) is not None for r in rows)]
    print(_table(rows, cols))
    return 0


# -- rm ---------------------------------------------------------------------------------------------------

def _targets(info, name: str):
    """What `name` names in the scanned cache: (revision hashes, files). Raises HubError."""
    ref = hub.parse_ref(name)
    if ref is None:
        raise hub.HubError(f"{name!r} is not a Hugging Face repo id; rm takes a name as `servelm list` shows it")
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == ref.repo_id), None)
    if repo is None:
        raise hub.HubError(f"{ref.repo_id} is not in the Hugging Face cache ({hub.cache_dir()})")
    if ref.revision is None:
        revisions = list(repo.revisions)
    else:
        found = hub._snapshot(ref)
        revisions = [r for r in repo.revisions if found is not None and r.commit_hash == found[1]]
        if not revisions:
            raise hub.HubError(f"{ref.repo_id} has no cached revision {ref.revision!r} (cached: "
                               f"{', '.join(_label(r).lstrip('@') or 'main' for r in repo.revisions)})")
    if ref.file is None:
        return [r.commit_hash for r in revisions], []
    files = []
    for rev in revisions:
        by_path = {_in_snapshot(f, Path(rev.snapshot_path)): f for f in rev.files}
        try:
            chosen = hub.pick_gguf(ref, sorted(by_path), None, f"in the cached snapshot {rev.commit_hash[:12]}")
        except hub.HubError:
            continue
        files += [by_path[n] for n in hub.gguf_files(chosen) if n in by_path]  # a split model: all its files
    if not files:
        raise hub.HubError(f"no cached file of {ref.repo_id} matches {ref.file!r}")
    return [], files


def cmd_rm(args: argparse.Namespace) -> int:
    _use_hub_settings(args)
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    status = 0
    for name in args.names:
        try:
            try:
                info = scan_cache_dir(hub.cache_dir())
            except CacheNotFound:
                raise hub.HubError(f"there is no Hugging Face cache at {hub.cache_dir()}") from None
            revisions, files = _targets(info, name)
            if files and not hasattr(info, "delete_files"):
                raise hub.HubError("deleting one file needs a newer huggingface_hub (HFCacheInfo.delete_files); "
                                   f"delete the whole repo with `servelm rm {hub.parse_ref(name).repo_id}`")
            strategy = info.delete_files(*files) if files else info.delete_revisions(*revisions)
        except hub.HubError as e:
            print(f"servelm: error: {e}", file=sys.stderr)
            status = 1
            continue
        freed = strategy.expected_freed_size_str
        if args.dry_run:
            print(f"would delete {name} (frees {freed})")
            continue
        strategy.execute()
        print(f"deleted {name} (freed {freed})")
    return status
