"""`POST /admin/models` imports only from the server's allowed model roots: the folders of the models it was
started with, the packaged defaults, and `server.model_roots` (CLI > env > file). Anything else, a symlink
out of a root included, is a 403 in the OpenAI error shape, refused before anything is read."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fakes import IdleEngine

from servelm.config.settings import load

ADMIN = {"x-api-key": "sk-admin-roots-1"}


def test_model_roots_setting_and_defaults(tmp_path):
    from servelm.control.model_roots import allowed_roots

    assert load({"model_roots": "/a"}, env={"SERVELM_MODEL_ROOTS": "/b"}).server.storage_config.model_roots == "/a"  # CLI > env
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"server: {{model_roots: /f}}\nmodels: [{{name: x, path: {tmp_path}/models/x}}]\n")
    config = load({"model": str(tmp_path / "srv" / "m")}, env={"SERVELM_MODEL_ROOTS": f"/e{os.pathsep}/e2"},
                  file=str(cfg))
    here = tmp_path.resolve()
    assert allowed_roots(config)[:4] == [Path("/e").resolve(), Path("/e2").resolve(), here / "models", here / "srv"]


@pytest.fixture
def client(tokenizer, llama_dir, tmp_path):
    from starlette.testclient import TestClient

    from servelm.control.plane import ControlPlane
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False, "data_dir": str(tmp_path / "data"),
                   "admin_key": ADMIN["x-api-key"], "model_roots": str(llama_dir.parent)}, env={})
    state = build_state(config, tokenizer, IdleEngine(), "alpha")
    state.control = ControlPlane.open(config)
    with TestClient(build_app(state)) as c:
        yield c
        c.portal.call(state.control.close)


def test_register_outside_the_model_roots_is_403(client, llama_dir, tmp_path):
    outside = tmp_path / "outside"  # a valid checkpoint (hard links), outside every root
    shutil.copytree(llama_dir, outside, copy_function=os.link)
    link = llama_dir.parent / f"link-{tmp_path.name}"
    os.symlink(outside, link)  # inside a root, pointing out of it
    try:
        for path in (str(outside), str(link), "/etc"):
            r = client.post("/admin/models", headers=ADMIN, json={"name": "x", "path": path})
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == "path"
            assert err["code"] == "path_not_allowed" and str(llama_dir.parent.resolve()) in err["message"]
    finally:
        link.unlink()
    assert client.get("/admin/models", headers=ADMIN).json() == []  # nothing was registered
    r = client.post("/admin/models", headers=ADMIN, json={"name": "ok", "path": str(llama_dir)})
    assert r.status_code == 201 and r.json()["ref"] == "ok:1"
