"""The content-addressed artifact store: `<data_dir>/artifacts/<sha256>/<name>` (a model folder or a .gguf file).

An artifact is imported once per content (identical folders share one copy), hard-linked where the source is
on the same filesystem (no copy, no extra disk) and copied otherwise, then made read-only. Its digest is
re-computed before it is served (`check`), so a version never changes under a running deployment unnoticed.
Hard links share the source's files: making them read-only makes the source files read-only too.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import time
import uuid
from pathlib import Path

from servelm.control.errors import Conflict, InvalidRequest

_CHUNK = 1 << 20
_STALE_IMPORT_S = 3600.0
_READ_ONLY_FILE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
_READ_ONLY_DIR = _READ_ONLY_FILE | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


def _files(path: Path) -> list[tuple[str, Path]]:
    """(relative name, file) for every file of an artifact, in a fixed order; a lone file is named by its own
    name."""
    if path.is_file():
        return [(path.name, path)]
    return sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file())


def digest(path: Path) -> str:
    """sha256 over (relative name, size, content) of every file, each length-prefixed so no two different
    artifacts hash alike by shifting bytes between names and contents."""
    h = hashlib.sha256()
    for rel, f in _files(Path(path)):
        name = rel.encode()
        h.update(len(name).to_bytes(8, "little") + name + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def size_bytes(path: Path) -> int:
    """The artifact's total file size."""
    return sum(f.stat().st_size for _, f in _files(Path(path)))


def _link_or_copy(src: Path, dst: Path) -> str:
    """Hard-link src to dst, or copy it where a link is impossible (another filesystem, no permission)."""
    try:
        os.link(src, dst)
        return "link"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copy2(src, dst)
    return "copy"


def _set_read_only(root: Path) -> None:
    for p in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # files before their dirs
        p.chmod(_READ_ONLY_DIR if p.is_dir() else _READ_ONLY_FILE)
    root.chmod(_READ_ONLY_DIR)


def _remove(root: Path) -> None:
    """Delete a read-only tree (its directories need write permission back first)."""
    for p in [root, *root.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(stat.S_IRWXU)
    shutil.rmtree(root)


class ArtifactStore:
    """Artifacts under `root` (normally `<data_dir>/artifacts`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.last_mode = ""  # "link", "copy" or "dedup": how the last import stored its files (for tests, logs)

    def path_of(self, sha: str, name: str) -> Path:
        return self.root / sha / name

    def put(self, source: Path) -> tuple[str, Path]:
        """Import a folder or a single file; returns (sha256, path in the store). Importing the same content
        again returns the existing copy."""
        source = Path(source).expanduser().resolve()
        if not source.exists():
            raise InvalidRequest(f"path {str(source)!r} does not exist", code="invalid_path", param="path")
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            target = tmp / source.name
            modes = set()
            if source.is_file():
                modes.add(_link_or_copy(source, target))
            else:
                for rel, f in _files(source):
                    (target / rel).parent.mkdir(parents=True, exist_ok=True)
                    modes.add(_link_or_copy(f, target / rel))
            # Hash what the store holds, not the source: that is what will be served.
            sha = digest(target)
            final = self.root / sha
            if final.exists():
                self.last_mode = "dedup"
                _remove(tmp)
                return sha, final / next(p.name for p in final.iterdir())
            _set_read_only(target)
            try:
                os.rename(tmp, final)  # atomic: a concurrent import of the same content finds it whole or absent
            except OSError:
                if not final.exists():
                    raise
                self.last_mode = "dedup"
                _remove(tmp)
                return sha, final / next(p.name for p in final.iterdir())
            final.chmod(_READ_ONLY_DIR)
            self.last_mode = "copy" if "copy" in modes else "link"
            return sha, final / source.name
        except BaseException:
            if tmp.exists():
                _remove(tmp)
            raise

    def check(self, path: Path, sha: str) -> None:
        """Raise Conflict unless the artifact at `path` still has digest `sha`."""
        path = Path(path)
        if not path.exists():
            raise Conflict(f"the artifact {path} is missing from the store", code="artifact_missing")
        now = digest(path)
        if now != sha:
            raise Conflict(f"the artifact {path} changed: its sha256 is {now}, registered as {sha}",
                           code="artifact_changed")

    def digests(self) -> set[str]:
        """The digests of every artifact in the store."""
        return {p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")}

    def remove(self, sha: str) -> bool:
        """Delete one artifact; False when it was not there."""
        path = self.root / sha
        if not path.is_dir():
            return False
        _remove(path)
        return True

    def gc(self, keep: set[str]) -> list[str]:
        """Delete every artifact whose digest is not in `keep` (the ones kept versions reference), and any
        import that was interrupted; returns the digests removed."""
        removed = []
        for sha in sorted(self.digests() - keep):
            if self.remove(sha):
                removed.append(sha)
        for tmp in self.root.glob(".tmp-*"):
            if time.time() - tmp.stat().st_mtime > _STALE_IMPORT_S:  # a younger one may still be importing
                _remove(tmp)
        return removed
