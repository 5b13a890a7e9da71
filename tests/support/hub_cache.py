"""A Hugging Face cache built by hand, in the layout huggingface_hub writes, and a stand-in for the Hub on
127.0.0.1 (no network):

    <cache>/models--ORG--NAME/blobs/<sha256>                 the files' contents
    <cache>/models--ORG--NAME/snapshots/<commit>/<file>      relative symlinks to the blobs
    <cache>/models--ORG--NAME/refs/<branch>                  the branch's commit
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def use_cache(monkeypatch, root: Path) -> Path:
    """Point HF_HOME (and so the hub cache, $HF_HOME/hub) at `root` for this test; the hub cache's path."""
    monkeypatch.setenv("HF_HOME", str(root))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return root / "hub"


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _sha256(content: Path | bytes) -> str:
    if isinstance(content, bytes):
        return hashlib.sha256(content).hexdigest()
    h = hashlib.sha256()
    with open(content, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def add_snapshot(cache: Path, repo_id: str, files: dict[str, Path | bytes], commit: str | None = None,
                 ref: str | None = "main") -> Path:
    """Cache `files` (name -> a file to copy, or its bytes) as one commit of `repo_id`; `ref` (a branch or
    tag, None: none) names that commit. The snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or commit_of(f"{repo_id}:{sorted(files)}:{ref}")
    snap = repo / "snapshots" / commit
    for name, content in files.items():
        blob = repo / "blobs" / _sha256(content)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists() and isinstance(content, bytes):
            blob.write_bytes(content)
        elif not blob.exists():  # a hard link where it can be (a large file costs no copy)
            try:
                os.link(content, blob)
            except OSError:
                shutil.copyfile(content, blob)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    snap.mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def add_folder(cache: Path, repo_id: str, folder: Path, **kw) -> Path:
    """A model folder's top-level files as one commit of `repo_id` (see add_snapshot)."""
    return add_snapshot(cache, repo_id, {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}, **kw)


class StubHub:
    """The few Hugging Face Hub routes huggingface_hub downloads through (repo info, file tree, file
    resolve), served on 127.0.0.1 for HF_ENDPOINT: repos are {repo_id: {file name: bytes}}, each at one
    commit. `downloads` lists the files fetched (GET, not HEAD), `tokens` each request's bearer token."""

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.repos = repos
        self.downloads: list[str] = []
        self.tokens: list[str | None] = []  # each request's bearer token (None: it sent none)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _send(self, status: int, body: bytes, headers: dict | None = None, head: bool = False) -> None:
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _answer(self, head: bool) -> None:
                from urllib.parse import unquote, urlparse

                auth = self.headers.get("Authorization") or ""
                stub.tokens.append(auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None)

                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                api = parts[:2] == ["api", "models"]
                repo_id = "/".join(parts[2:4] if api else parts[:2])
                files = stub.repos.get(repo_id)
                if files is None:
                    return self._send(404, b'{"error": "Repository not found"}',
                                      {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"}, head)
                commit = commit_of(repo_id)
                if api and parts[4:5] == ["tree"]:
                    tree = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                            for name, data in sorted(files.items())]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                if api:
                    info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                            "siblings": [{"rfilename": n} for n in sorted(files)]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                name = "/".join(parts[4:]) if parts[2:3] == ["resolve"] else None
                if name not in files:
                    return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}, head)
                if not head:
                    stub.downloads.append(f"{repo_id}/{name}")
                data = files[name]
                return self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{_sha256(data)}"'}, head)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
