"""The gRPC service beside HTTP (`--grpc-port`), driven by a real grpc client: streaming generation and chat
equal to the HTTP API's, embeddings, the model list, health checking and reflection, and the HTTP server's
keys, rate limits, priorities, metrics, request logs and abort-on-cancel."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from serving import HOLD_CONTEXT, _wait, server_log_lines, stats

from servelm.server.rpc.stubs import load

pytestmark = pytest.mark.server
pb, pb_grpc = load("servelm_llm_v1")

ALICE = "sk-alice-000001"  # the keys of conftest.RPC_KEYS
HEAD = {"Authorization": f"Bearer {ALICE}"}


def auth(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def srv(rpc_server):
    proc, url, address = rpc_server
    channel = grpc.insecure_channel(address)
    yield proc, url, channel
    channel.close()


def test_health_reflection_and_models(srv):
    _, _, channel = srv
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "servelm.v1.Llm"):  # open, as GET /health is
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"servelm.v1.Llm", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    models = pb_grpc.LlmStub(channel).ListModels(pb.ListModelsRequest(), metadata=auth(ALICE)).models
    assert [(m.id, m.max_model_len) for m in models] == [("tiny", HOLD_CONTEXT), ("all-MiniLM-L6-v2", 0)]


def test_generate_and_chat_stream_what_http_returns(srv):
    _, url, channel = srv
    stub, head = pb_grpc.LlmStub(channel), {"Authorization": f"Bearer {ALICE}"}
    opts = pb.SamplingOptions(max_tokens=8, temperature=0)
    for rpc, req, path, body in [
            (stub.Generate, pb.GenerateRequest(prompt="The cat sat on", sampling=opts), "/generate",
             {"prompt": "The cat sat on"}),
            (stub.Chat, pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi there")], sampling=opts),
             "/chat", {"messages": [{"role": "user", "content": "Hi there"}]})]:
        want = httpx.post(url + path, json={**body, "max_tokens": 8, "temperature": 0}, headers=head).json()
        parts = list(rpc(req, metadata=auth(ALICE)))
        assert len(parts) > 1  # streamed, not one answer at the end
        assert "".join(x.text for x in parts) == want["text"]
        assert parts[-1].finish_reason == want["finish_reason"]
        assert (parts[-1].usage.prompt_tokens, parts[-1].usage.completion_tokens) == \
            (want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"])
        assert [x.index for x in parts] == sorted(x.index for x in parts)
    log = [e for e in server_log_lines(srv[0]) if e["path"] == "/servelm.v1.Llm/Generate"]
    assert log[-1]["key"] == "alice" and log[-1]["status"] == 200 and log[-1]["completion_tokens"] == 8


def test_generate_takes_the_native_apis_sampling_parameters(srv, hf_models):
    """Every SamplingOptions field reaches the sampler as the native HTTP field of its name: with a seed, the
    same stream of text as POST /generate (values that float32 holds exactly, as the .proto's floats)."""
    import torch

    _, url, channel = srv
    opts = {"max_tokens": 10, "temperature": 0.75, "top_k": 20, "min_p": 0.0625, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.25, "seed": 5, "ignore_eos": True, "min_tokens": 10}
    want = httpx.post(url + "/generate", json={"prompt": "The cat sat on", **opts}, headers=HEAD).json()
    parts = list(pb_grpc.LlmStub(channel).Generate(
        pb.GenerateRequest(prompt="The cat sat on", sampling=pb.SamplingOptions(**opts)), metadata=auth(ALICE)))
    assert "".join(x.text for x in parts) == want["text"] and parts[-1].usage.completion_tokens == 10
    plain = httpx.post(url + "/generate", json={"prompt": "The cat sat on", "max_tokens": 10, "temperature": 0.75,
                                                "seed": 5, "ignore_eos": True}, headers=HEAD).json()
    assert plain["text"] != want["text"]  # the other fields changed what was drawn: they were not dropped
    # stop_token_ids (repeated): greedy, the stream ends at transformers' third greedy token
    ids = httpx.post(url + "/tokenize", json={"prompt": "The cat sat on"}, headers=HEAD).json()["tokens"]
    with torch.no_grad():
        greedy = hf_models["llama"].generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                             min_new_tokens=4)[0, len(ids):].tolist()
    stop = pb.SamplingOptions(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[greedy[2]])
    parts = list(pb_grpc.LlmStub(channel).Generate(pb.GenerateRequest(prompt="The cat sat on", sampling=stop),
                                                   metadata=auth(ALICE)))
    assert parts[-1].finish_reason == "stop" and parts[-1].usage.completion_tokens == greedy.index(greedy[2]) + 1
    # the repeated allowed_token_ids and bad_words, greedy: the text of POST /generate with them
    for extra in ({"allowed_token_ids": [5, 17, 300, 777]}, {"bad_words": ["the cat", "dog"]}):
        body = {"prompt": "The cat sat on", "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
        want = httpx.post(url + "/generate", json=body, headers=HEAD).json()["text"]
        got = list(pb_grpc.LlmStub(channel).Generate(pb.GenerateRequest(
            prompt="The cat sat on", sampling=pb.SamplingOptions(max_tokens=6, temperature=0, ignore_eos=True,
                                                                 **extra)), metadata=auth(ALICE)))
        assert "".join(x.text for x in got) == want
    bad = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(top_k=-2))
    assert _code(lambda: list(pb_grpc.LlmStub(channel).Generate(bad, metadata=auth(ALICE))))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_embed_equals_http(srv):
    _, url, channel = srv
    r = pb_grpc.LlmStub(channel).Embed(pb.EmbedRequest(input=["hello", "a cat"]), metadata=auth(ALICE))
    want = httpx.post(url + "/v1/embeddings", json={"input": ["hello", "a cat"]},
                      headers={"Authorization": f"Bearer {ALICE}"}).json()
    assert r.model == want["model"] and r.prompt_tokens == want["usage"]["prompt_tokens"]
    for got, w in zip(r.embeddings, want["data"], strict=True):
        np.testing.assert_allclose(got.values, w["embedding"], rtol=1e-6)


def _code(call) -> tuple[grpc.StatusCode, dict]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), dict(e.value.trailing_metadata() or ())


def _requests(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.labels["key"], s.labels["status"]): s.value for f in text_string_to_metric_families(text)
            if f.name == "servelm:requests" for s in f.samples if s.name.endswith("_total")}


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name for s in f.samples
               if s.name.endswith("_total"))


def test_keys_rate_limits_and_priorities(srv):
    _, url, channel = srv
    stub = pb_grpc.LlmStub(channel)
    gen = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=2))
    before = _requests(url)
    code, md = _code(lambda: list(stub.Generate(gen)))
    assert code == grpc.StatusCode.UNAUTHENTICATED and md["x-servelm-error-code"] == "invalid_api_key"
    assert _code(lambda: stub.ListModels(pb.ListModelsRequest(), metadata=auth("sk-wrong-key")))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    assert _requests(url)[("anonymous", "401")] == before.get(("anonymous", "401"), 0) + 2  # the same metrics
    # a key may not raise its priority, nor use a model it is not given
    high = pb.GenerateRequest(prompt="hi", priority="high", sampling=pb.SamplingOptions(max_tokens=2))
    assert _code(lambda: list(stub.Generate(high, metadata=auth("sk-bronze-000006"))))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    list(stub.Generate(gen, metadata=auth("sk-bronze-000006")))
    assert server_log_lines(srv[0])[-1]["priority"] == "low"
    assert _code(lambda: list(stub.Generate(gen, metadata=auth("sk-boxed-000007"))))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    bad = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(temperature=7))
    code, md = _code(lambda: list(stub.Generate(bad, metadata=auth(ALICE))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # rpm 2: the third call in the minute is refused, with the retry delay in the trailing metadata
    for left in (1, 0):  # a success carries the key's rate-limit state, as the HTTP headers do
        _, call = stub.ListModels.with_call(pb.ListModelsRequest(), metadata=auth("sk-limited-0003"))
        assert dict(call.trailing_metadata())["x-ratelimit-remaining-requests"] == str(left)
    code, md = _code(lambda: stub.ListModels(pb.ListModelsRequest(), metadata=auth("sk-limited-0003")))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and md["x-servelm-error-code"] == "rate_limit_exceeded"
    assert int(md["retry-after"]) >= 1


def test_cancel_aborts_the_request_in_the_engine(srv):
    """A call cancelled after its first token is aborted in the engine: its blocks come back and it is logged as
    499. It asks for nearly the whole 65,536-token context, so it is still running whenever the cancel is noticed
    (a few hundred tokens a fast machine could finish first); had aborting broken, the waits would time out."""
    _, url, channel = srv
    total = stats(url, HEAD)["scheduler"]["num_kv_blocks"]
    generated = _counter(url, "servelm:generation_tokens")
    want = HOLD_CONTEXT - 64  # beside the prompt's 41 tokens
    # greedy from this prompt, the tiny model gives no end-of-sequence token in its first 400 tokens
    req = pb.GenerateRequest(prompt="Once upon a time " * 10, sampling=pb.SamplingOptions(max_tokens=want,
                                                                                          temperature=0))
    call = pb_grpc.LlmStub(channel).Generate(req, metadata=auth(ALICE))
    next(call)
    call.cancel()
    _wait(lambda: (s := stats(url, HEAD))["engine"]["in_flight"] == 0 and s["scheduler"]["num_running"] == 0
          and s["scheduler"]["num_free_blocks"] == total, 60, "the cancelled request's blocks to come back")
    assert _counter(url, "servelm:generation_tokens") - generated < want  # aborted, not run to its end
    _wait(lambda: any(e["path"] == "/servelm.v1.Llm/Generate" and e["status"] == 499
                      for e in server_log_lines(srv[0])), 10, "the cancelled call's log line")


def test_grpc_port_in_use_is_refused_before_anything_loads():
    import asyncio
    import socket
    from types import SimpleNamespace

    from servelm.server.serve import _bind_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        srv = SimpleNamespace(host="127.0.0.1", grpc_port=s.getsockname()[1])

        async def bind():
            return _bind_grpc(srv)
        assert "cannot listen for gRPC on 127.0.0.1:" in asyncio.run(bind())


def test_health_watch_follows_readiness():
    """A Watch stream sees the server's own services go NOT_SERVING while the engines are not ready (an
    engine died) and SERVING again once they are (a grpc.aio server with the standard health servicer,
    driven by servelm's readiness follower and a switchable readiness)."""
    import asyncio

    from grpc_health.v1 import health

    from servelm.server.rpc.server import follow_readiness

    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def scenario() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready = {"now": True}
        follow = asyncio.ensure_future(follow_readiness(servicer, lambda: ready["now"], ("", "x"), every_s=0.01))
        seen: list[int] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="x"))
            async for reply in stream:
                if reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
                    continue  # the watch began before the follower's first update
                seen.append(reply.status)
                if seen == [S]:
                    ready["now"] = False  # the engine went down
                elif seen[-1] == N:
                    ready["now"] = True  # and came back
                else:
                    break
            stream.cancel()
        follow.cancel()
        await server.stop(0)
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 60))  # a guard: without the follower the stream never moves
    assert seen == [S, N, S], seen
