"""HTTPS as vLLM serves it (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs): a server with a
certificate from a test CA answers HTTPS only, and with --ssl-cert-reqs 2 only clients holding a certificate of
that CA (mutual TLS). Settings that cannot work stop the start, naming the setting."""

from __future__ import annotations

import signal
import ssl
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from serving import start_server, stop_server

from servelm.config.settings import load


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A test CA, the server's certificate for 127.0.0.1 and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("client@example.test")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    client.private_key_and_cert_chain_pem.write_to_path(str(d / "client.pem"))
    other = trustme.CA().issue_cert("intruder@example.test")  # a certificate of another CA
    other.private_key_and_cert_chain_pem.write_to_path(str(d / "other.pem"))
    return d


def _trusting(pki, client_cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert is not None:
        ctx.load_cert_chain(str(pki / client_cert))
    return ctx


def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(llama_dir, pki):
    tls = ["--ssl-keyfile", str(pki / "server.key"), "--ssl-certfile", str(pki / "server.pem"),
           "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-cert-reqs", "2", "--drain-timeout", "120"]
    proc, url = start_server(llama_dir, *tls, tls={"verify": _trusting(pki, "client.pem")})
    try:
        # the openai SDK over HTTPS, checking the server's certificate and showing its own
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(verify=_trusting(pki, "client.pem")))
        with client:
            r = client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert r.usage.completion_tokens == 3
        # no client certificate, or one of another CA: the handshake fails, no request reaches the API
        for ctx in (_trusting(pki), _trusting(pki, "other.pem")):
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/v1/models", verify=ctx, timeout=10).raise_for_status()
        # a client that does not trust the test CA refuses the server
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/v1/models", timeout=10)
        # plain HTTP on the HTTPS port gets no answer
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/v1/models", timeout=10).raise_for_status()
        assert "serving tiny on https://127.0.0.1" in Path(proc.log_path).read_text()
        # a client keeping an idle HTTPS connection in its pool does not hold the drain: a TLS close would wait
        # for its close_notify, which it never reads the socket to send, for the SSL shutdown timeout (30 s)
        with httpx.Client(verify=_trusting(pki, "client.pem")) as idle:
            assert idle.get(url + "/v1/models").status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
    finally:
        stop_server(proc)


@pytest.mark.parametrize(("settings", "key", "says"), [
    ({"ssl_certfile": "server.pem"}, "ssl_keyfile", "both or neither"),
    ({"ssl_keyfile": "server.key", "ssl_certfile": "missing.pem"}, "ssl_certfile", "a readable PEM file"),
    ({"ssl_keyfile": "client.pem", "ssl_certfile": "server.pem"}, "ssl_certfile", "matching ssl_keyfile"),
    ({"ssl_keyfile": "server.key", "ssl_certfile": "server.pem", "ssl_cert_reqs": 2}, "ssl_cert_reqs",
     "ssl_ca_certs"),
    ({"ssl_keyfile": "server.key", "ssl_certfile": "server.pem", "ssl_ca_certs": "ca.pem", "ssl_cert_reqs": 3},
     "ssl_cert_reqs", "0 (none), 1 (optional) or 2 (required)"),
    ({"ssl_ca_certs": "ca.pem"}, "ssl_ca_certs", "only with ssl_certfile"),
    ({"ssl_keyfile": "server.key", "ssl_certfile": "server.pem", "ssl_ca_certs": "server.key"}, "ssl_ca_certs",
     "PEM CA certificates"),
])
def test_tls_settings_that_cannot_work_stop_the_start(pki, settings, key, says):
    cli = {k: v if isinstance(v, int) else str(pki / v) for k, v in settings.items()}
    with pytest.raises(ValueError, match=key) as e:
        load(cli, env={})
    assert says in str(e.value)


def test_valid_tls_settings_load(pki):
    api = load({"ssl_keyfile": str(pki / "server.key"), "ssl_certfile": str(pki / "server.pem")},
               env={}).server.api_config
    assert api.scheme == "https" and api.ssl_cert_reqs == 0
    assert load({}, env={}).server.api_config.scheme == "http"
