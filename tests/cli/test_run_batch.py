"""`servelm run-batch`: a file of OpenAI Batch API requests run through the server's routes, as vllm run-batch.
Each result is what the server answers the same request (its greedy text the offline API's), in the input's
order, with the line's custom_id; a line that is no request gets an error and the others still run."""

from __future__ import annotations

import json
import subprocess
import sys

from servelm import LLM, SamplingParams

PROMPT = [1, 500, 600, 700, 800]
LINES = [
    {"custom_id": "complete", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}},
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
              "ignore_eos": True}},
    {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": PROMPT, "max_tokens": 10**6}},
    {"custom_id": "admin", "method": "POST", "url": "/admin/gc", "body": {}},
    {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
]


def _run(llama_dir, *extra, stdin: str | None = None):
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "run-batch", str(llama_dir), "--served-model-name",
           "tiny", "--dtype", "float32", "--embedding-model", "none", "--num-kv-blocks", "64", *extra]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=600)


def test_a_batch_file_gets_the_servers_answers_in_order(llama_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in LINES[:2]) + "\nnot json\n\n" +
                   "\n".join(json.dumps(line) for line in LINES[2:]) + "\n")
    done = _run(llama_dir, "-i", str(src), "-o", str(dst), "--max-concurrency", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["complete", "chat", None, "too-long", "admin", "streamed"]
    assert len({r["id"] for r in results}) == 6

    want = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    complete = results[0]["response"]
    assert complete["status_code"] == 200 and complete["request_id"] and results[0]["error"] is None
    assert complete["body"]["object"] == "text_completion" and complete["body"]["model"] == "tiny"
    assert complete["body"]["choices"][0]["text"] == want.outputs[0].text
    assert complete["body"]["usage"]["completion_tokens"] == 6
    chat = results[1]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 4

    assert results[2]["response"] is None and "not JSON" in results[2]["error"]["message"]
    too_long = results[3]["response"]  # the server's own 400, in its shape
    assert too_long["status_code"] == 400 and too_long["body"]["error"]["type"] == "invalid_request_error"
    assert results[4]["response"] is None and "url must be one of" in results[4]["error"]["message"]
    assert results[5]["response"] is None and "cannot stream" in results[5]["error"]["message"]
    assert "2 succeeded, 4 failed" in done.stderr


def test_standard_input_and_output_with_many_in_flight(llama_dir):
    lines = [{**LINES[0], "custom_id": f"r{k}", "body": {**LINES[0]["body"], "prompt": [1, 100 + k, 200 + k]}}
             for k in range(12)]
    done = _run(llama_dir, "-i", "-", "-o", "-", stdin="".join(json.dumps(line) + "\n" for line in lines))
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{k}" for k in range(12)]
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["usage"]["prompt_tokens"] == 3
               for r in results)


def test_a_bad_concurrency_or_missing_file_is_one_line(llama_dir, tmp_path):
    done = _run(llama_dir, "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert done.returncode == 2 and "missing.jsonl" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "in.jsonl").write_text(json.dumps(LINES[0]) + "\n")
    done = _run(llama_dir, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                "--max-concurrency", "0")
    assert done.returncode == 2 and "--max-concurrency" in done.stderr
