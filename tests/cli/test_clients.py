"""Clients of a running server: `servelm chat --url` (a terminal chat over the OpenAI chat API, driven in a pty)
and `servelm bench serve` with a dataset file (JSONL or ShareGPT, sent as text prompts), against one real server
with a tiny model and an API key; and the dataset readers and option names on their own."""

from __future__ import annotations

import json
import os
import sys

import pytest

from servelm.bench.workloads import dataset_name_for, load_jsonl, load_sharegpt
from servelm.entrypoints.chat import base_url, request_fields
from servelm.entrypoints.cli import build_parser, main
from servelm.sampling_params import SamplingParams

KEY = "sk-test-clients-1"
PROMPT = "\r\n> "
STOPPED = "\r\n[stopped]\r\n> "  # a reply cut short, then the prompt (reply text may hold "> ")


# -- the dataset readers -----------------------------------------------------------------------------------------
def _jsonl(path, rows) -> str:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return str(path)


def test_jsonl_prompts_in_file_order_with_their_output_lengths(tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}, {"prompt": "two", "output_len": 7}, "",
                                      {"prompt": "three", "max_tokens": 3}])
    wl = load_jsonl(f, 3)
    assert wl.name == "jsonl" and wl.prompts == ["one", "two", "three"] and wl.output_lens == [128, 7, 3]
    assert load_jsonl(f, 2, output_len=5).output_lens == [5, 7]
    more = load_jsonl(f, 8, seed=1)  # fewer prompts than requests: all of them, then random repeats
    assert more.num_requests == 8 and more.prompts[:3] == ["one", "two", "three"]
    assert set(more.prompts) <= {"one", "two", "three"} and more == load_jsonl(f, 8, seed=1)


@pytest.mark.parametrize("line, message", [("not json", "p.jsonl:1: not a JSON object"),
                                           ('{"text": "x"}', 'needs a "prompt" string'),
                                           ('{"prompt": "x", "output_len": 0}', "a positive integer")])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        load_jsonl(_jsonl(tmp_path / "p.jsonl", [line]), 1)


def _count(texts: list[str], special: bool) -> list[int]:
    """A stand-in tokenizer: one token per word, and a BOS with special tokens."""
    return [len(t.split()) + special for t in texts]


def _sharegpt(path, pairs, extra=()) -> str:
    data = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
            for i, (p, r) in enumerate(pairs)]
    path.write_text(json.dumps([*data, *extra]))
    return str(path)


def test_sharegpt_takes_the_first_human_turn_and_the_reply_length(tmp_path):
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    pairs = [(words(5), words(6)), (words(10), words(20)), (words(2), words(9)),  # prompt too short
             (words(8), words(3)), (words(1100), words(10)), (words(900), words(1200))]  # reply too short, too long
    odd = [{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": words(6)},
                              {"from": "human", "value": "x"}, {"from": "gpt", "value": words(11)}]},
           {"conversations": [{"from": "gpt", "value": "no prompt"}]}, {"no": "conversations"}]
    f = _sharegpt(tmp_path / "sg.json", pairs, odd)
    wl = load_sharegpt(f, 3, _count)
    assert wl.name == "sharegpt" and wl.num_requests == 3
    # the valid ones, in the seed's order: prompt -> the gpt reply's token count
    got = sorted(zip(wl.prompts, wl.output_lens, strict=True))
    assert got == sorted([(words(5), 6), (words(10), 20), (words(6), 11)])
    assert load_sharegpt(f, 3, _count) == wl  # the same seed, the same sample
    assert set(load_sharegpt(f, 3, _count, output_len=4).output_lens) == {4}
    # a server's context bounds prompt + reply; fewer valid conversations than requests are repeated
    small = load_sharegpt(f, 5, _count, max_model_len=20)
    assert small.num_requests == 5
    assert set(zip(small.prompts, small.output_lens, strict=True)) <= {(words(5), 6), (words(6), 11)}
    with pytest.raises(ValueError, match="no conversation fits"):
        load_sharegpt(f, 1, _count, max_model_len=8)
    (tmp_path / "bad.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(tmp_path / "bad.json", 1, _count)


def test_dataset_format_from_name_or_file_name():
    assert dataset_name_for("a.jsonl", None) == "jsonl" and dataset_name_for("a.json", None) == "sharegpt"
    assert dataset_name_for("a.json", "custom") == "jsonl" and dataset_name_for("a.jsonl", "sharegpt") == "sharegpt"


def _bench_args(*argv: str):
    return build_parser().parse_args(["bench", "serve", *argv])


def test_bench_serve_takes_vllm_option_names():
    a = _bench_args("--num-prompts", "7", "--request-rate", "inf", "--max-concurrency", "3",
                    "--dataset-name", "sharegpt", "--dataset-path", "x.json")
    assert (a.num_requests, a.rate, a.concurrency, a.dataset_name, a.dataset_path) == (7, float("inf"), 3,
                                                                                      "sharegpt", "x.json")
    b = _bench_args("--num-requests", "7", "--rate", "inf", "--concurrency", "3")
    assert (b.num_requests, b.rate, b.concurrency, b.dataset_path) == (7, float("inf"), 3, None)


def test_chat_client_options():
    a = build_parser().parse_args(["chat", "--url", "http://h:1/v1", "--api-key", "k", "--model", "m"])
    assert (a.url, a.api_key, a.model) == ("http://h:1/v1", "k", "m")
    assert base_url("http://h:1/v1/") == base_url("http://h:1/") == "http://h:1"
    # only what differs from the defaults, so a server without vLLM's extensions gets none of them
    assert request_fields(SamplingParams(max_tokens=9, temperature=0.5)) == {"max_tokens": 9, "temperature": 0.5}
    assert request_fields(SamplingParams(top_k=5, stop=["x"], ignore_eos=True)) == {
        "max_tokens": 16, "temperature": 1.0, "top_k": 5, "stop": ["x"], "ignore_eos": True}


# -- against a real server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(long_llama_dir):
    """The long context: a reply that Ctrl-C stops is still streaming whenever it is stopped."""
    from serving import HOLD_CONTEXT, start_server, stop_server

    proc, url = start_server(long_llama_dir, "--max-model-len", str(HOLD_CONTEXT), "--api-key", KEY, "--log-prompts",
                             "--embedding-model", "none")
    yield proc, url
    assert stop_server(proc) == 0


def _chat_lines(proc) -> list[dict]:
    from serving import server_log_lines

    return [x for x in server_log_lines(proc) if x.get("path") == "/v1/chat/completions"]


def _chat(url: str, *extra: str, key: str = KEY):
    pexpect = pytest.importorskip("pexpect")
    args = ["-m", "servelm.entrypoints.cli", "chat", "--url", url, "--temperature", "0", "--ignore-eos", *extra]
    env = {k: v for k, v in os.environ.items() if k != "SERVELM_API_KEY"} | {"OPENAI_API_KEY": key}
    # the timeout only ends a hang: every expect waits for an event that comes
    return pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=300, dimensions=(40, 200))


@pytest.mark.server
def test_chat_url_streams_replies_and_sends_the_history(served):
    import pexpect
    from serving import _wait

    proc, url = served
    child = _chat(url + "/v1", "--max-tokens", "8", "--system", "Be brief.")
    try:
        child.expect_exact(f"servelm chat: tiny at {url}")  # the first model /v1/models lists
        child.expect_exact("> ")
        child.sendline("hello there")
        child.expect_exact("hello there\r\n")
        child.expect_exact(PROMPT)
        assert child.before.strip()  # the reply, printed
        first = _wait(lambda: _chat_lines(proc), 30, "the first reply's log line")[-1]
        assert first["status"] == 200 and first["stream"] and first["completion_tokens"] == 8 and first["completion"]

        child.sendline("and again")
        child.expect_exact("and again\r\n")
        child.expect_exact(PROMPT)
        second = _wait(lambda: (x := _chat_lines(proc))[1:] and x, 30, "the second reply's log line")[-1]
        prompt = json.loads(second["prompt"])  # the rendered conversation: system, both turns, the first reply
        at = [prompt.index(s) for s in ("Be brief.", "hello there", first["completion"], "and again")]
        assert at == sorted(at) and second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
    finally:
        child.close(force=True)


@pytest.mark.server
def test_chat_url_ctrl_c_stops_a_reply(served):
    import pexpect
    from serving import HOLD_CONTEXT, _wait, stats

    proc, url = served
    long = HOLD_CONTEXT - 1024
    child = _chat(url, "--max-tokens", str(long))
    try:
        child.expect_exact("> ")
        child.sendline("tell a long story")
        child.expect_exact("tell a long story\r\n")
        child.expect(r"\S{5}")  # the reply is streaming
        child.sendintr()
        child.expect_exact(STOPPED)  # back at the prompt, the reply cut short and the request aborted
        _wait(lambda: stats(url, {"Authorization": f"Bearer {KEY}"})["engine"]["in_flight"] == 0, 60,
              "the stopped request to be aborted")
        line = _wait(lambda: [x for x in _chat_lines(proc) if x.get("status") == 499], 30, "the abort's log line")
        assert 0 < line[-1]["completion_tokens"] < long
        child.sendintr()  # at the prompt: quit
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
    finally:
        child.close(force=True)


@pytest.mark.server
def test_chat_url_with_a_wrong_key_is_one_line(served):
    import pexpect

    child = _chat(served[1], key="sk-wrong-key-000")
    try:
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 1 and "HTTP 401" in child.before and "Traceback" not in child.before
    finally:
        child.close(force=True)


def _bench(capsys, url: str, *argv: str) -> dict:
    assert main(["bench", "serve", "--base-url", url, *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.server
def test_bench_serve_sends_a_jsonl_dataset(served, tmp_path, capsys, monkeypatch):
    proc, url = served
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    f = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "The capital of France is", "output_len": 5},
                                            {"prompt": "Once upon a time"}])
    r = _bench(capsys, url, "--dataset-path", f, "--num-prompts", "3", "--request-rate", "inf",
               "--output-len", "4")
    assert r["workload"] == "jsonl" and r["dataset"] == f and r["requests"] == 3
    assert r["completed"] == 3 and r["failed"] == 0 and r["input_tokens"] > 0
    assert r["output_tokens"] in (5 + 4 + 5, 5 + 4 + 4)  # the third request repeats one of the two
    r = _bench(capsys, url, "--dataset-path", f, "--dataset-name", "custom", "--num-prompts", "2",
               "--max-concurrency", "1")
    assert r["concurrency"] == 1 and r["completed"] == 2 and r["output_tokens"] == 5 + 128


@pytest.mark.server
def test_bench_serve_sends_a_sharegpt_dataset(served, tmp_path, capsys, monkeypatch, tokenizer, tokenizer_dir):
    proc, url = served
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    pairs = [("What is the capital of France? Answer in one word.", "Paris is the capital of France."),
             ("Write a haiku about autumn leaves falling slowly.", "Red leaves drift and fall, the wind hums."),
             ("hi", "a reply to a prompt too short to keep")]
    f = _sharegpt(tmp_path / "ShareGPT_V3.json", pairs)
    expected = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for _, r in pairs[:2])
    r = _bench(capsys, url, "--dataset-name", "sharegpt", "--dataset-path", f, "--num-prompts", "2",
               "--request-rate", "inf")
    assert r["workload"] == "sharegpt" and r["completed"] == 2 and r["output_tokens"] == expected
    r = _bench(capsys, url, "--dataset-path", f, "--num-prompts", "2", "--tokenizer", str(tokenizer_dir),
               "--max-concurrency", "2")
    assert r["workload"] == "sharegpt" and r["completed"] == 2 and r["output_tokens"] == expected


def test_bench_serve_dataset_errors(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset-name",
                 "jsonl"]) == 2
    assert "--dataset-name needs --dataset-path" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset-path", "x.jsonl",
                 "--workload", "W1"]) == 2
    assert "replaces --workload" in capsys.readouterr().err
