"""vLLM's --uds: the server listens on a Unix domain socket instead of a TCP port. A real server: reached over
the socket with the openai SDK, the socket open to local users, a stale socket file replaced, a live one
refused to a second server, and the file removed at exit."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

import httpx
import openai
from serving import start_server, stop_server


def test_a_server_on_a_unix_socket(llama_dir, capsys):
    from servelm.entrypoints.cli import build_parser
    from servelm.server.serve import cmd_serve

    path = os.path.join(tempfile.mkdtemp(prefix="servelm-uds-"), "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # a server that died left its socket file
        dead.bind(path)
    proc, url = start_server(llama_dir, "--embedding-model", "none", uds=path)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o666
        http = httpx.Client(transport=httpx.HTTPTransport(uds=path))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", http_client=http)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"
        # a second server on the same socket stops at once, before any model loads
        args = build_parser().parse_args(["serve", str(llama_dir), "--embedding-model", "none", "--uds", path])
        assert cmd_serve(args) == 2
        assert "already in use" in capsys.readouterr().err
        assert http.get(url + "/health").status_code == 200  # the first is untouched
        # nor does a server take the place of a file that is not a socket
        plain = os.path.join(os.path.dirname(path), "notes.txt")
        with open(plain, "w") as f:
            f.write("keep me")
        args = build_parser().parse_args(["serve", str(llama_dir), "--embedding-model", "none", "--uds", plain])
        assert cmd_serve(args) == 2
        assert "not a socket" in capsys.readouterr().err and Path(plain).read_text() == "keep me"
    finally:
        assert stop_server(proc) == 0
    assert not os.path.exists(path)
