"""LoRA adapters through `servelm serve`: --lora-modules at start, the adapter's name as `model` on the OpenAI and
Ollama APIs (the same text the offline API gives with the adapter), /v1/models listing adapters with their base,
and run-time load/unload through the admin API and vLLM's routes."""

from __future__ import annotations

import httpx
import pytest
from random_weights import make_adapter
from serving import start_server, stop_server

pytest.importorskip("peft")

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPT = [1, 500, 600, 700, 800, 900, 1000, 1100]


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    make_adapter(model_dirs["llama"], root / "small", 8, 16, False, ["q_proj", "v_proj"], seed=31)
    make_adapter(model_dirs["llama"], root / "big", 16, 32, True,
                 ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=32)
    return root


@pytest.fixture(scope="module")
def offline(llama_dir, adapters):
    """The offline API's greedy text for PROMPT on the base and each adapter."""
    from servelm import LLM, LoRARequest, SamplingParams

    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = {None: llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("small", "big"), 1):
        lr = LoRARequest(name, i, str(adapters / name))
        out[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lr)[0].outputs[0].text
    return out


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    proc, url = start_server(llama_dir, "--lora-modules", f"small={adapters / 'small'}", "--admin-key",
                             "admin-secret", "--num-kv-blocks", "128")
    yield url
    stop_server(proc)


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 10,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)


def test_models_lists_adapters_with_their_base(server, adapters):
    cards = {c["id"]: c for c in httpx.get(server + "/v1/models").json()["data"]}
    assert cards["small"]["parent"] == "tiny" and cards["small"]["root"] == str(adapters / "small")
    assert "parent" not in cards["tiny"]


def test_the_adapter_name_selects_it_on_openai_and_ollama(server, offline):
    assert offline["small"] != offline[None]  # the adapter changes the text: the checks below mean something
    r = _complete(server, "small")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "small"
    assert r.json()["choices"][0]["text"] == offline["small"]
    assert _complete(server, "tiny").json()["choices"][0]["text"] == offline[None]
    r = httpx.post(server + "/api/generate", json={"model": "small", "prompt": "hi", "stream": False,
                                                   "options": {"num_predict": 4, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "small"


def test_adapters_load_and_unload_at_run_time(server, adapters, offline):
    assert _complete(server, "big").status_code == 404
    body = {"lora_name": "big", "lora_path": str(adapters / "big")}
    assert httpx.post(server + "/v1/load_lora_adapter", json=body).status_code in (401, 403)  # admin key needed
    r = httpx.post(server + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert _complete(server, "big").json()["choices"][0]["text"] == offline["big"]
    listed = httpx.get(server + "/admin/lora", headers=ADMIN).json()["data"]
    assert {a["name"] for a in listed} == {"small", "big"}
    r = httpx.post(server + "/admin/lora/unload", json={"lora_name": "big"}, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert _complete(server, "big").status_code == 404
    assert "big" not in {c["id"] for c in httpx.get(server + "/v1/models").json()["data"]}


def test_a_bad_adapter_is_a_400_and_the_server_goes_on(server, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
    r = httpx.post(server + "/admin/lora/load", json={"lora_name": "bad", "lora_path": str(tmp_path)},
                   headers=ADMIN, timeout=60)
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]
    r = httpx.post(server + "/admin/lora/load", json={"lora_name": "nowhere", "lora_path": str(tmp_path / "x")},
                   headers=ADMIN, timeout=60)
    assert r.status_code == 400
    assert _complete(server, "small").status_code == 200
    assert _complete(server, "bad").status_code == 404
