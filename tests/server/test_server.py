"""A real server on localhost with a tiny model, driven by the official openai SDK and raw httpx."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from serving import (
    HOLD,
    HOLD_BLOCKS,
    HOLD_CONTEXT,
    _ready,
    _wait,
    raw_request,
    start_server,
    stats,
    stop_server,
)
from tiny_models import random_prompts

from servelm import LLM, BeamSearchParams, SamplingParams, __version__

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(llama_dir):
    proc, url = start_server(llama_dir, "--num-kv-blocks", "256", "--max-model-len", "512")
    yield url
    assert stop_server(proc) == 0  # SIGTERM drains and exits cleanly


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, max_model_len=512)


def test_health_ready_models(server, client):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert httpx.get(server + "/version").json() == {"version": __version__}  # vLLM's route
    assert httpx.get(server + "/ready").status_code == 200
    assert stats(server)["scheduler"]["num_kv_blocks"] == 256  # engine stats are there as soon as it is ready
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "all-MiniLM-L6-v2"]
    card = httpx.get(server + "/v1/models/tiny").json()
    assert card["max_model_len"] == 512 and card["object"] == "model"


def test_completion_greedy_equals_offline_generate(client, offline):
    prompts = random_prompts(3, 5, 40, seed=40)
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, r in zip(prompts, ref, strict=True):
        res = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert res.choices[0].text == r.outputs[0].text
        assert res.usage.prompt_tokens == len(p) and res.usage.completion_tokens == 12
        assert res.usage.total_tokens == len(p) + 12
        stream = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == r.outputs[0].text


def test_allowed_token_ids_and_bad_words_match_offline(client, offline):
    """vLLM's allowed_token_ids and bad_words through the server (the bad words tokenized in the API process,
    masked in the engine's) give the offline API's text; each changes the greedy text."""
    [prompt] = random_prompts(1, 12, 12, seed=41)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    greedy = offline.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    bad = [offline.get_tokenizer().decode(greedy.token_ids[3:5])]
    for extra in ({"allowed_token_ids": [5, 17, 300, 777, 901]}, {"bad_words": bad}):
        want = offline.generate([prompt], SamplingParams(**{**vars(plain), **extra}), use_tqdm=False)[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True, **extra})
        assert got.choices[0].text == want.text != greedy.text, extra


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client, offline, tokenizer):
    """vLLM's truncate_prompt_tokens: the request runs on its prompt's last k tokens (-1: up to the context),
    for text and token-id prompts and chat; echo shows the kept tokens; 0 is refused."""
    [prompt] = random_prompts(1, 12, 12, seed=42)
    ref = offline.generate([prompt[-5:]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    for form in (prompt, tokenizer.decode(prompt)):
        res = client.completions.create(model="tiny", prompt=form, max_tokens=6, temperature=0, echo=True,
                                        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
        kept = tokenizer.decode(prompt[-5:]) if isinstance(form, list) else \
            tokenizer.decode(tokenizer(form).input_ids[-5:])
        assert res.usage.prompt_tokens == 5 and res.choices[0].text.startswith(kept)
        if isinstance(form, list):
            assert res.choices[0].text == kept + ref
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(prompt)
    msgs = [{"role": "user", "content": "hello " * 30}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    cut = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 7})
    assert full.usage.prompt_tokens > 7 and cut.usage.prompt_tokens == 7
    r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_chat_stream_and_usage(server, client, offline):
    msgs = [{"role": "user", "content": "Say something"}]
    ref = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    res = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert res.choices[0].message.content == ref.outputs[0].text
    assert res.choices[0].finish_reason == "length" and res.object == "chat.completion"
    assert abs(res.created - time.time()) < 3600
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(server, client, offline):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's and vLLM's field) is the engine's count: the offline
    engine, asked the same requests in the same order, reports the same numbers. A prompt no other test sends
    starts uncached on both."""
    import random

    prompt = random.Random(20261128).choices(range(5, 250), k=45)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [offline.generate([prompt], greedy, use_tqdm=False)[0].num_cached_tokens for _ in range(2)]
    assert want[0] == 0 and 0 < want[1] <= len(prompt)
    got = [client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True}).usage.prompt_tokens_details.cached_tokens
           for _ in range(2)]
    assert got == want
    # chat, streamed or not, and the Responses API on one conversation; the chat template's head, which every
    # conversation shares, is cached on both first (whatever other tests sent)
    warm = [{"role": "user", "content": "hello"}]
    offline.chat(warm, greedy, use_tqdm=False)
    client.chat.completions.create(model="tiny", messages=warm, max_tokens=1)
    text = " ".join(f"word{i}" for i in random.Random(7).sample(range(1000), 30))
    msgs = [{"role": "user", "content": text}]
    want = [offline.chat(msgs, greedy, use_tqdm=False)[0].num_cached_tokens for _ in range(2)]
    assert want[1] > want[0]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert [first.usage.prompt_tokens_details.cached_tokens,
            chunks[-1].usage.prompt_tokens_details.cached_tokens] == want
    r = httpx.post(f"{server}/v1/responses", json={"model": "tiny", "input": text, "max_output_tokens": 4,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == want[1]


def _sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_gives_the_engines_ids(server, offline, tokenizer):
    """vLLM's return_token_ids: the prompt's ids and each choice's, whole or as each chunk's new ones."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The tiny model says"
    want = offline.generate([prompt], greedy, use_tqdm=False)[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    [choice] = r["choices"]
    assert choice["prompt_token_ids"] == want.prompt_token_ids and choice["token_ids"] == want.outputs[0].token_ids
    chunks = _sse(server, "/v1/completions", body)
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c["choices"][0]] == \
        [want.prompt_token_ids]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.outputs[0].token_ids
    assert "token_ids" not in httpx.post(server + "/v1/completions", json={**body, "return_token_ids": False},
                                         timeout=60).json()["choices"][0]
    # chat: the prompt's ids on the response (on a stream, its first chunk), each choice's on the choice
    msgs = [{"role": "user", "content": "Say something"}]
    want = offline.chat(msgs, greedy, use_tqdm=False)[0]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["prompt_token_ids"] == want.prompt_token_ids and r["choices"][0]["token_ids"] == want.outputs[0].token_ids
    chunks = _sse(server, "/v1/chat/completions", body)
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [want.prompt_token_ids]
    assert "prompt_token_ids" in chunks[0]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == want.outputs[0].token_ids


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(server):
    """vLLM's return_tokens_as_token_ids: each logprobs token (chosen, alternative, echoed) as "token_id:N", with
    the same logprobs as the plain request."""
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": True, "return_token_ids": True}
    plain = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    by_id = httpx.post(server + "/v1/completions", json={**body, "return_tokens_as_token_ids": True},
                       timeout=60).json()["choices"][0]
    ids = by_id["prompt_token_ids"] + by_id["token_ids"]
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert by_id["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top, chosen in zip(by_id["logprobs"]["top_logprobs"][1:], ids[1:], strict=True):
        assert f"token_id:{chosen}" in top and all(key.startswith("token_id:") for key in top)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    r = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    content = r["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in r["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)


def test_continue_final_message_goes_on_from_the_assistants_text(server, client, offline, tokenizer):
    msgs = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a"}]
    text = tokenizer.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    assert text.rstrip().endswith("Once upon a")  # the oracle: transformers leaves the message open
    ids = tokenizer(text, add_special_tokens=False).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = offline.generate([ids], greedy, use_tqdm=False)[0].outputs[0].text
    assert offline.chat(msgs, greedy, use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0].outputs[0].text == want
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": msgs,
                                                          "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    with pytest.raises(ValueError, match="continue_final_message"):
        offline.chat(msgs, greedy, continue_final_message=True)


def test_beam_search_answers_as_the_offline_api(server, client, offline):
    """vLLM's use_beam_search: n beams, best first, as LLM.beam_search finds them, on completions (streamed or
    not, with logprobs) and chat; the beams' step requests leave no slot or block behind."""
    tok = offline.get_tokenizer()
    [prompt] = random_prompts(1, 20, 20, seed=44)
    beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5)
    [want] = offline.beam_search([prompt], beam)
    texts = [tok.decode(s.tokens[len(prompt):]) for s in want.sequences]
    body = {"ignore_eos": True, "use_beam_search": True, "length_penalty": 0.5}
    res = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, logprobs=2, extra_body=body)
    assert [c.text for c in res.choices] == texts and [c.index for c in res.choices] == [0, 1, 2]
    assert res.usage.completion_tokens == 18 and {c.finish_reason for c in res.choices} == {"length"}
    for c, seq in zip(res.choices, want.sequences, strict=True):
        assert c.logprobs.token_logprobs == pytest.approx(
            [top[t].logprob for t, top in zip(seq.tokens[len(prompt):], seq.logprobs, strict=True)], abs=1e-5)
        assert all(len(top) <= 3 for top in c.logprobs.top_logprobs)  # the chosen token and the top 2
    stream = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, stream=True, extra_body=body)
    streamed = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    msgs = [{"role": "user", "content": "Say something"}]
    ids = offline.apply_chat_template(msgs)
    [want_chat] = offline.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    chat = client.chat.completions.create(model="tiny", messages=msgs, n=2, max_tokens=5,
                                          extra_body={"ignore_eos": True, "use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [tok.decode(s.tokens[len(ids):], skip_special_tokens=True)
                                                         for s in want_chat.sequences]
    total = stats(server)["scheduler"]["num_kv_blocks"]
    _wait(lambda: (s := stats(server))["engine"]["in_flight"] == 0 and s["scheduler"]["num_running"] == 0
          and s["scheduler"]["num_free_blocks"] == total, 60, "the beams' blocks to come back")


@pytest.mark.parametrize("extra,param", [
    ({"top_p": 0.5}, "top_p"), ({"stop": ["x"]}, "stop"), ({"seed": 3}, "seed"), ({"n": 11}, "n"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"echo": True, "logprobs": 1}, "use_beam_search"),
])
def test_beam_search_refuses_what_it_would_ignore(server, extra, param):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "use_beam_search": True, "n": 2, **extra}
    r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    neutral = {"prompt": [1, 2, 3], "max_tokens": 2, "use_beam_search": True, "n": 2, "top_p": 1, "top_k": -1}
    assert len(httpx.post(server + "/v1/completions", json=neutral).json()["choices"]) == 2


def test_raw_sse_framing(server):
    with httpx.stream("POST", server + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def _raw_until_closed(url: str, request: bytes) -> bytes:
    """Send `request` on a new connection (in a thread, so that a server refusing it part-way cannot block
    the send) and return all the server sends until it closes the connection."""
    import contextlib
    import socket
    import threading
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
        def send():
            with contextlib.suppress(OSError):  # the server closed (or reset) the connection part-way
                sock.sendall(request)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
        sender.join(60)
    return data


def test_http10_stream_has_no_chunked_framing_and_ends_with_done(server):
    """An HTTP/1.0 client cannot read chunked encoding: its stream comes whole with a Content-Length, the bare
    events ending with `data: [DONE]`, and the connection closes (with httptools it came chunked)."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head, _, payload = _raw_until_closed(server, request).partition(b"\r\n\r\n")
    status, *header_lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip().lower() for k, v in (line.split(":", 1) for line in header_lines)}
    assert status.split()[1] == "200" and headers["content-type"].startswith("text/event-stream"), head
    assert "transfer-encoding" not in headers and int(headers["content-length"]) == len(payload), headers
    assert payload.endswith(b"data: [DONE]\n\n"), payload[-200:]
    events = payload.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]  # chunk sizes in the body would not parse
    assert "".join(c["choices"][0]["text"] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_oversized_request_head_is_refused(server):
    """A 2 MB header is refused with 431 and the server serves on."""
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (2 << 20) + b"\r\n\r\n"
    reply = _raw_until_closed(server, request)
    assert reply.split(b"\r\n", 1)[0].split()[1] == b"431", reply[:200]
    assert httpx.get(server + "/health").status_code == 200


def test_n2_stop_seed_logprobs(client, offline):
    p = random_prompts(1, 10, 10, seed=41)[0]
    res = client.completions.create(model="tiny", prompt=p, max_tokens=8, n=2, temperature=1.0, seed=7,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in res.choices) == [0, 1]
    assert res.usage.completion_tokens == 16
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(v <= 0 for v in lp.token_logprobs)
    again = client.completions.create(model="tiny", prompt=p, max_tokens=8, n=2, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in res.choices]  # seeded: reproducible
    greedy = offline.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    text = greedy[0].outputs[0].text
    stop = text[3:6]
    stopped = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 3  # one entry per generated token
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob <= 0 and c.logprob == c.top_logprobs[0].logprob  # greedy: the chosen token is the top one


def test_prompt_logprobs_field_on_completions_and_chat(server, hf_models):
    """vLLM's prompt_logprobs request field: completions put them on each choice, chat on the response; each
    prompt token after the first has its own logprob and rank and the top k, as transformers computes them.
    Beside echo with fewer logprobs, the echoed alternatives keep their own count."""
    ids = random_prompts(1, 12, 12, seed=45)[0]
    ref = _hf_logprobs(hf_models["llama"], ids)

    def check(entries: list, prompt: list[int], k: int) -> None:
        assert len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            row, entry = ref[j - 1], entries[j]
            own = entry[str(prompt[j])]
            assert own["logprob"] == pytest.approx(float(row[prompt[j]]), abs=1e-4) and own["rank"] >= 1
            top = [int(t) for t, v in sorted(entry.items(), key=lambda kv: kv[1]["rank"]) if v["rank"] <= k]
            assert top == row.topk(k).indices.tolist()

    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 3}
    res = httpx.post(server + "/v1/completions", json=body).json()
    assert len(res["choices"]) == 2
    for choice in res["choices"]:
        check(choice["prompt_logprobs"], ids, 3)
    plain = httpx.post(server + "/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    echo = httpx.post(server + "/v1/completions", json={**body, "n": 1, "echo": True, "logprobs": 1}).json()
    [choice] = echo["choices"]
    check(choice["prompt_logprobs"], ids, 3)
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])  # its own token and the best
    tokenized = httpx.post(server + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 2, "prompt_logprobs": 2}).json()
    chat_ids = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "Say something"}]}
                          ).json()["tokens"]
    ref = _hf_logprobs(hf_models["llama"], chat_ids)
    check(tokenized["prompt_logprobs"], chat_ids, 2)
    streamed = httpx.post(server + "/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_completion_prompt_forms_and_echo(client):
    res = client.completions.create(model="tiny", prompt=["Hello", "World"], max_tokens=2, temperature=0)
    assert sorted(c.index for c in res.choices) == [0, 1]
    res = client.completions.create(model="tiny", prompt=[[1, 5, 6], [1, 7]], max_tokens=2, temperature=0)
    assert len(res.choices) == 2 and res.usage.prompt_tokens == 5
    echo = client.completions.create(model="tiny", prompt="Hello there", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello there")


def _hf_logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_returns_the_prompt_tokens(server, client, hf_models, tokenizer):
    """What lm-evaluation-harness's loglikelihood tasks send: the prompt's tokens come back with their
    logprobs (the first None), for text and token-id prompts, also with max_tokens 0."""
    text = "The capital of France is"
    ids = httpx.post(server + "/tokenize", json={"prompt": text}).json()["tokens"]
    ref = _hf_logprobs(hf_models["llama"], ids)
    res = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and res.choices[0].text.startswith(text)
    assert lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
        best = int(ref[j - 1].argmax())
        assert lp.top_logprobs[j][tokenizer.decode([best])] == pytest.approx(float(ref[j - 1, best]), abs=1e-4)
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # token ids and max_tokens 0: only the prompt, scored; nothing generated
    scored = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=0, max_tokens=0)
    c = scored.choices[0]
    assert c.text == tokenizer.decode(ids) and c.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx([float(ref[j - 1, ids[j]]) for j in range(1, len(ids))],
                                                          abs=1e-4)
    # streamed: the echo chunk carries the prompt's logprobs, and max_tokens 0 adds no text
    chunks = list(client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=0, max_tokens=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == tokenizer.decode(ids)
    assert chunks[0].choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"
    # max_tokens 0 without echo generates nothing and scores nothing: refused
    r = httpx.post(server + "/v1/completions", json={"prompt": text, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_streamed_prompts_run_concurrently(client, offline):
    """Several prompts in one streamed request run at once: the second prompt's first chunk comes before
    the first prompt ends (run one after another, every chunk of prompt 0 would come first), each chunk
    carries its prompt's index, and each prompt's text is what it gets alone."""
    prompts = random_prompts(2, 6, 12, seed=44)
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert {c.index for c in chunks} == {0, 1}
    first_of_1 = next(k for k, c in enumerate(chunks) if c.index == 1)
    end_of_0 = next(k for k, c in enumerate(chunks) if c.index == 0 and c.finish_reason)
    assert first_of_1 < end_of_0
    for i in (0, 1):
        assert "".join(c.text for c in chunks if c.index == i) == ref[i].outputs[0].text
        assert [c.finish_reason for c in chunks if c.index == i][-1] == "length"


def test_tokenize_detokenize_native(server):
    ids = httpx.post(server + "/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 512
    assert httpx.post(server + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"].endswith("Hello world")
    gen = httpx.post(server + "/generate", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0}).json()
    assert set(gen) == {"id", "text", "finish_reason", "usage"} and gen["usage"]["completion_tokens"] <= 4
    with httpx.stream("POST", server + "/generate", json={"prompt": "Hi", "max_tokens": 4, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["finish_reason"] in ("stop", "length", "stop_sequence")
    assert all(set(e) == {"token", "index", "finish_reason"} for e in events)
    indexes = [e["index"] for e in events]
    assert indexes == sorted(indexes) and indexes[0] >= 0 and indexes[-1] < 4  # token positions in the output
    chat = httpx.post(server + "/chat", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and "text" in chat.json()


def test_native_generate_samples_as_the_completions_route(server, hf_models):
    """/generate takes vLLM's sampling parameters and samples with them exactly as /v1/completions does (one
    validation, one SamplingParams): the same seed and parameters give the same text, and they are not ignored."""
    import torch

    opts = {"max_tokens": 12, "temperature": 0.75, "top_k": 20, "min_p": 0.0625, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.25, "seed": 11, "ignore_eos": True, "min_tokens": 12}
    native = httpx.post(server + "/generate", json={"prompt": "Hi", **opts}).json()
    ref = httpx.post(server + "/v1/completions", json={"prompt": "Hi", **opts}).json()
    assert native["text"] == ref["choices"][0]["text"] and native["usage"] == ref["usage"]
    assert native["usage"]["completion_tokens"] == 12
    other = httpx.post(server + "/generate", json={"prompt": "Hi", "max_tokens": 12, "temperature": 0.75,
                                                    "seed": 11, "ignore_eos": True}).json()
    assert other["text"] != native["text"]  # top_k, min_p and the penalties changed what was drawn
    # stop_token_ids: greedy, the reply ends at the first of transformers' greedy tokens that is a stop id
    ids = httpx.post(server + "/tokenize", json={"prompt": "Hi"}).json()["tokens"]
    with torch.no_grad():
        greedy = hf_models["llama"].generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                             min_new_tokens=6)[0, len(ids):].tolist()
    cut = httpx.post(server + "/generate", json={"prompt": "Hi", "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True, "stop_token_ids": [greedy[3]]}).json()
    assert cut["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == greedy.index(greedy[3]) + 1


def test_embeddings_float_and_base64(server, client):
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a cat", "a dog"])  # SDK: base64 path
    v = np.array(res.data[0].embedding)
    assert v.shape == (384,) and abs(np.linalg.norm(v) - 1) < 1e-4
    raw = httpx.post(server + "/v1/embeddings", json={"input": "a cat", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, v, atol=1e-5)
    flt = httpx.post(server + "/v1/embeddings", json={"input": "a cat"}).json()
    assert np.allclose(flt["data"][0]["embedding"], v, atol=1e-5)
    native = httpx.post(server + "/embeddings", json={"input": ["x"]}).json()
    assert len(native["embeddings"][0]) == 384
    emb = stats(server)["embeddings"]
    assert emb["batches"] >= 1 and emb["real_tokens"] <= emb["padded_tokens"]


def _vectors(server, texts: list[str]) -> np.ndarray:
    r = httpx.post(server + "/v1/embeddings", json={"input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


def test_score_and_rerank_are_the_embeddings_cosine_similarity(server):
    """vLLM's /score and the rerank API (Jina's, Cohere's and vLLM's shape) over the embedding model: the cosine
    similarity of /v1/embeddings' vectors, the documents ordered by it."""
    query, docs = "a cat sat on the mat", ["stock markets fell", "a kitten on a rug", "cats and mats", "rain"]
    q, d = _vectors(server, [query]), _vectors(server, docs)
    want = (d @ q[0]) / (np.linalg.norm(d, axis=1) * np.linalg.norm(q[0]))
    for path, body in (("/score", {"text_1": query, "text_2": docs}),
                       ("/v1/score", {"queries": [query], "documents": docs})):
        r = httpx.post(server + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert [x["index"] for x in got["data"]] == [0, 1, 2, 3] and got["model"] == "all-MiniLM-L6-v2"
        assert np.allclose([x["score"] for x in got["data"]], want, atol=1e-5)
        assert got["usage"]["prompt_tokens"] > len(docs)
    # pairs: each text_1 with its own text_2
    r = httpx.post(server + "/score", json={"text_1": docs[:2], "text_2": docs[2:]}, timeout=60).json()
    a, b = _vectors(server, docs[:2]), _vectors(server, docs[2:])
    pair = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert np.allclose([x["score"] for x in r["data"]], pair, atol=1e-5)
    order = list(np.argsort(-want, kind="stable"))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(server + path, json={"query": query, "documents": docs, "top_n": 3}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        assert [x["document"]["text"] for x in results] == [docs[i] for i in order[:3]]
        assert np.allclose([x["relevance_score"] for x in results], want[order[:3]], atol=1e-5)
    r = httpx.post(server + "/rerank", json={"query": query, "documents": docs, "return_documents": False}).json()
    assert [x["index"] for x in r["results"]] == order and "document" not in r["results"][0]
    # bad input: mismatched sides, an empty document, both spellings of a side, a generation model
    for path, body, param in (("/score", {"text_1": docs[:2], "text_2": docs[:3]}, "text_1"),
                              ("/rerank", {"query": query, "documents": ["ok", ""]}, "documents.1"),
                              ("/score", {"text_1": "a", "queries": "b", "text_2": "c"}, "queries")):
        r = httpx.post(server + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server + "/rerank", json={"model": "tiny", "query": query, "documents": docs})
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == "model", r.text


def test_embeddings_truncate_prompt_tokens_keeps_the_first_or_last_tokens(server):
    """vLLM's truncate_prompt_tokens on /v1/embeddings: each input is embedded from its first k tokens (vLLM's
    truncation_side "right" for these models), or its last ones with truncation_side "left", the model's special
    tokens around them (k counts them), as the text of those words alone would be; -1 and a short input leave it
    whole; a k smaller than the special tokens keeps one word; 0 is a 400."""
    words = "one two three four five six seven eight nine ten"  # one wordpiece each
    head, tail = "one two three four", "seven eight nine ten"

    def embed(body):
        r = httpx.post(server + "/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]]), r.json()["usage"]["prompt_tokens"]

    (first, last, whole, cat), _ = embed({"input": [head, tail, words, "a cat"]})
    cut, tokens = embed({"input": [words, "a cat"], "truncate_prompt_tokens": 6})
    assert tokens == 6 + 4  # [CLS] four words [SEP], and "a cat" whole
    assert np.allclose(cut[0], first, atol=1e-5) and not np.allclose(cut[0], whole, atol=1e-2)
    assert np.allclose(cut[1], cat, atol=1e-5)
    cut, _ = embed({"input": words, "truncate_prompt_tokens": 6, "truncation_side": "left"})
    assert np.allclose(cut[0], last, atol=1e-5)
    same, _ = embed({"input": words, "truncate_prompt_tokens": -1})
    assert np.allclose(same[0], whole, atol=1e-5)
    (one,), _ = embed({"input": "one"})
    tiny, tokens = embed({"input": words, "truncate_prompt_tokens": 1})
    assert tokens == 3 and np.allclose(tiny[0], one, atol=1e-5)  # [CLS] one [SEP]: never fewer
    r = httpx.post(server + "/v1/embeddings", json={"input": words, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_embeddings_take_token_ids_as_openai_does(server, client):
    """OpenAI's `input` as token ids (one input's, or several inputs'), what LangChain's OpenAIEmbeddings sends:
    the ids are embedded as they are, with no special tokens added, so the text's own ids give the text's vector;
    truncate_prompt_tokens cuts them from either side; an id outside the embedding model's vocabulary is a 400
    naming `input`, and the server goes on serving."""
    from transformers import AutoTokenizer

    from servelm.runtimes.embedder import default_embedding_path

    tok = AutoTokenizer.from_pretrained(default_embedding_path())
    texts = ["a cat sat on the mat", "stock markets fell"]
    want = _vectors(server, texts)
    ids = [tok(t)["input_ids"] for t in texts]  # [CLS] ... [SEP], as the server tokenizes a text

    def embed(body):
        r = httpx.post(server + "/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]]), r.json()["usage"]["prompt_tokens"]

    one, tokens = embed({"input": ids[0]})
    assert tokens == len(ids[0]) and np.allclose(one[0], want[0], atol=1e-5)
    both, tokens = embed({"input": ids})
    assert tokens == len(ids[0]) + len(ids[1]) and np.allclose(both, want, atol=1e-5)
    sdk = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids)
    assert np.allclose([d.embedding for d in sdk.data], want, atol=1e-5)
    bare, tokens = embed({"input": tok(texts[0], add_special_tokens=False)["input_ids"]})  # taken as they are
    assert tokens == len(ids[0]) - 2 and not np.allclose(bare[0], want[0], atol=1e-2)
    head, _ = embed({"input": ids[0][:4]})
    tail, _ = embed({"input": ids[0][-4:]})
    cut, tokens = embed({"input": ids[0], "truncate_prompt_tokens": 4})
    assert tokens == 4 and np.allclose(cut[0], head[0], atol=1e-5)
    cut, _ = embed({"input": ids[0], "truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert np.allclose(cut[0], tail[0], atol=1e-5)
    for bad in ([ids[0], [101, len(tok) + 5, 102]], []):
        r = httpx.post(server + "/v1/embeddings", json={"input": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("input"), r.text
    assert np.allclose(embed({"input": texts})[0], want, atol=1e-5)


def test_an_encoder_batch_of_texts_and_token_ids_pads_them_together():
    """The embedding process batches requests together: one batch mixing a text and another request's token ids
    gives each the vector it gets alone."""
    from servelm.runtimes.embedder import default_embedding_path
    from servelm.runtimes.encoder_runner import EncoderRunner

    runner = EncoderRunner(default_embedding_path())
    ids = runner.tokenizer("a kitten on a rug")["input_ids"]
    text, given = ("a cat sat on the mat", None, None, "right"), (ids, None, None, "right")
    mixed = runner.embed([text, given])
    assert np.allclose(mixed.rows[0], runner.embed([text]).rows[0], atol=1e-5)
    assert np.allclose(mixed.rows[1], runner.embed([("a kitten on a rug", None, None, "right")]).rows[0], atol=1e-5)
    assert mixed.token_ids[1] == ids
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        runner.embed([([runner.vocab_size], None, None, "right")])


def test_embedding_process_is_separate_and_replaced_when_it_dies(server):
    st = stats(server)
    pid, engine_pid = st["embeddings"]["pid"], st["engine"]["pid"]

    def parent(p: int) -> int:
        return int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])

    # a child of the API process beside the engine process, not the API process itself
    assert pid is not None and pid != engine_pid and parent(pid) == parent(engine_pid) != pid
    before = httpx.post(server + "/v1/embeddings", json={"input": "a cat"}).json()["data"][0]["embedding"]
    os.kill(pid, signal.SIGKILL)
    down = httpx.post(server + "/v1/embeddings", json={"input": "a cat"})
    assert down.status_code == 503 and down.json()["error"]["code"] == "embedder_unavailable"
    again = httpx.post(server + "/v1/embeddings", json={"input": "a cat"}, timeout=120)  # waits for the new one
    assert again.status_code == 200 and np.allclose(again.json()["data"][0]["embedding"], before, atol=1e-6)
    emb = stats(server)["embeddings"]
    assert emb["restarts"] == 1 and emb["pid"] not in (None, pid)
    assert httpx.post(server + "/v1/chat/completions", json={  # generation never noticed
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400,
     "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    # over --max-logprobs (20, vLLM's default)
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                      "top_logprobs": 21}, 400, "top_logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("GET", "/v1/completions", None, 405, None),
    ("GET", "/v1/nothing-here", None, 404, None),
    ("GET", "/v1/models/gpt-9", None, 404, "model"),
])
def test_errors_have_openai_shape(server, method, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = httpx.request(method, server + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


def test_context_error_names_both_numbers(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": [1] * 500, "max_tokens": 100})
    assert r.status_code == 400
    assert "512" in r.json()["error"]["message"] and "500" in r.json()["error"]["message"]


def test_32_concurrent_streams_match_offline(client, offline):
    prompts = random_prompts(32, 4, 60, seed=42)
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)

    def one(p):
        s = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in s)

    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, prompts))
    assert texts == [r.outputs[0].text for r in ref]


def test_disconnect_mid_stream_frees_blocks(server):
    total = stats(server)["scheduler"]["num_kv_blocks"]
    with httpx.stream("POST", server + "/v1/completions", json={
            "prompt": random_prompts(1, 40, 40, seed=43)[0], "max_tokens": 400, "stream": True,
            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    _wait(lambda: (s := stats(server))["engine"]["in_flight"] == 0 and s["scheduler"]["num_running"] == 0
          and s["scheduler"]["num_free_blocks"] == total, 60, "the aborted request's blocks to come back")


def test_disconnect_while_queued_and_engine_restart(long_llama_dir):
    proc, url = start_server(long_llama_dir, "--num-kv-blocks", str(HOLD_BLOCKS), "--max-model-len",
                             str(HOLD_CONTEXT), "--max-num-seqs", "1", "--embedding-model", "none")
    try:
        body = HOLD  # runs until its client leaves
        admitted_before = stats(url)["scheduler"]["prefix_cache_queries"]  # counts tokens at each admission
        with httpx.stream("POST", url + "/v1/completions", json=body) as running:
            running_lines = running.iter_lines()  # kept alive: dropping the iterator closes the connection
            next(running_lines)  # the first request holds the only slot
            queued = raw_request(url, "/v1/completions", body)  # a streaming client, waiting for its headers
            # engine stats arrive with the next step, so wait for both views to agree
            _wait(lambda: (s := stats(url))["engine"]["in_flight"] == 2 and s["scheduler"]["num_waiting"] == 1,
                  30, "the second request to queue")
            assert stats(url)["scheduler"]["num_running"] == 1
            queued.close()
            # the queued client left: its request is removed from the engine's queue
            _wait(lambda: stats(url)["scheduler"]["num_waiting"] == 0 and stats(url)["engine"]["in_flight"] == 1,
                  30, "the queued request to be aborted")
            assert stats(url)["scheduler"]["prefix_cache_queries"] == admitted_before + 4  # never admitted
            assert stats(url)["scheduler"]["num_running"] == 1  # the first one is untouched
            # a non-streaming client that gives up while queued is aborted the same way
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
            _wait(lambda: stats(url)["scheduler"]["num_waiting"] == 0 and stats(url)["engine"]["in_flight"] == 1,
                  30, "the non-streaming queued request to be aborted")
            s = stats(url)["scheduler"]
            assert s["num_running"] == 1 and s["prefix_cache_queries"] == admitted_before + 4
        _wait(lambda: stats(url)["scheduler"]["num_free_blocks"] == HOLD_BLOCKS, 30, "all blocks to be free")

        # Kill the engine mid-request: the client gets an error at once, /ready says so, the engine restarts.
        pid = stats(url)["engine"]["pid"]
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in e and "engine" in e for e in events)
        assert events[-1] == "data: [DONE]"
        _wait(lambda: stats(url)["engine"]["pid"] != pid and _ready(url), 300, "the engine to restart")
        assert stats(url)["engine"]["restarts"] == 1
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
        assert ok["usage"]["completion_tokens"] >= 1

        # SIGTERM while a stream is in flight: it still completes, then the server exits 0.
        drain = {**body, "max_tokens": 300}
        with httpx.stream("POST", url + "/v1/completions", json=drain, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
        finals = [json.loads(x[6:]) for x in rest[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            assert stop_server(proc) == 0
