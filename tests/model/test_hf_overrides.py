"""vLLM's --hf-overrides on a generation model: fields merged over its config.json before its engine loads it
(the offline LLM, the server's engine process), held to transformers run on the same merged config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from serving import start_server, stop_server
from tiny_models import hf_greedy, random_prompts, reference, run

from servelm import LLM, SamplingParams


def _yarn(config: dict) -> dict:
    """YaRN over the model's trained context, four times as long: what Qwen's docs pass vLLM."""
    n = config["max_position_embeddings"]
    return {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": n},
            "max_position_embeddings": 4 * n}


def test_a_generation_model_runs_with_its_config_overridden(llama_dir, hf_models, tmp_path):
    from transformers import AutoModelForCausalLM

    before = (llama_dir / "config.json").read_text()
    overrides = _yarn(json.loads(before))
    merged = tmp_path / "merged"  # the oracle: transformers on a copy whose config.json carries the overrides
    shutil.copytree(llama_dir, merged)
    (merged / "config.json").write_text(json.dumps({**json.loads(before), **overrides}))
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    prompts = random_prompts(3, 8, 24, seed=5)
    want = [hf_greedy(hf, p, 12) for p in prompts]
    assert want != reference(hf_models, "llama", prompts, 12)  # the overrides change what the model says

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=260, hf_overrides=overrides)
    assert run(llm, prompts, params) == want
    assert llm.engine.core.max_model_len == overrides["max_position_embeddings"]
    assert (llama_dir / "config.json").read_text() == before  # the original folder is left as it was
    with pytest.raises(ValueError, match="GGUF"):  # a GGUF file has no config.json to merge them over
        LLM(None, hf_overrides=overrides)


def test_serve_takes_hf_overrides_for_its_generation_model(llama_dir):
    """`servelm serve MODEL --hf-overrides JSON`: the engine runs the overridden model (its longer context is
    the one /v1/models reports) under MODEL's name, and its greedy text is the offline LLM's."""
    overrides = _yarn(json.loads((llama_dir / "config.json").read_text()))
    proc, url = start_server(llama_dir, "--hf-overrides", json.dumps(overrides), "--num-kv-blocks", "260")
    try:
        card = httpx.get(url + "/v1/models/tiny").json()
        assert card["max_model_len"] == overrides["max_position_embeddings"]
        prompt = random_prompts(1, 10, 10, seed=9)[0]
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                       timeout=120)
        assert r.status_code == 200, r.text
        offline = LLM(str(llama_dir), dtype="float32", num_kv_blocks=260, hf_overrides=overrides)
        want = run(offline, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        assert stop_server(proc) == 0


def test_a_model_the_overrides_cannot_apply_to_stops_before_any_engine_starts(llama_dir):
    """The checks made before an engine starts judge the model as its engine will load it: overrides on a GGUF
    file, or ones that name an architecture servelm does not run, are one line and exit 2 from `serve` and
    `generate`, with no engine process started."""
    env = {**os.environ, "SERVELM_CPU_KERNELS": "0"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    for args in (["generate", "hi"], ["serve", "--port", "0"]):  # the default model is a GGUF file
        r = cli(*args, "--hf-overrides", '{"max_position_embeddings": 64}')
        assert r.returncode == 2 and "GGUF file" in r.stderr and "engine process started" not in r.stderr
    r = cli("serve", str(llama_dir), "--port", "0", "--hf-overrides", '{"architectures": ["NoSuchForCausalLM"]}')
    assert r.returncode == 2 and "NoSuchForCausalLM" in r.stderr and "engine process started" not in r.stderr
