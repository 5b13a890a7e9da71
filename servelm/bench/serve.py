"""`servelm bench serve`: an async load generator for any OpenAI-compatible server.

It sends workload S1 (see shared/workloads.md) as streamed /v1/completions with token-id prompts, or the
text prompts of a dataset file (--dataset-path: JSONL or ShareGPT) as string prompts, at Poisson arrivals of
a given rate or at a fixed concurrency, and prints TTFT, TPOT, inter-token latency and end-to-end latency
(mean, p50, p90, p99), throughput and goodput under an SLO as one JSON object. vLLM's `vllm bench serve`
option names are accepted too (--num-prompts, --request-rate, --max-concurrency, --dataset-name,
--dataset-path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from servelm.bench.workloads import (
    DATASETS,
    Workload,
    dataset_name_for,
    load_jsonl,
    load_sharegpt,
    make_serving_workload,
    make_workload,
)
from servelm.config import env


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    p.add_argument("--rate", "--request-rate", dest="rate", type=float, default=2.0,
                   help="Poisson arrival rate in requests/s (inf: all at once)")
    p.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                   help="fixed concurrency instead of a rate")
    p.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=200,
                   help="the request count of S1 or of a dataset (the W workloads have theirs)")
    p.add_argument("--workload", default="S1", choices=["S1", "W1", "W2", "W3", "W4"],
                   help="S1 (default), or an offline workload sent to the server: W1 with --rate inf is a "
                        "server's batch throughput")
    d = p.add_argument_group("dataset (instead of a synthetic workload)")
    d.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="send this file's text prompts: JSONL lines of {\"prompt\": ...} (with an optional "
                        "\"output_len\" or \"max_tokens\"), in file order; or a ShareGPT JSON list, shuffled with "
                        "--seed, whose first human turn is the prompt and the gpt reply's token count max_tokens. "
                        "Fewer prompts than --num-requests are repeated at random")
    d.add_argument("--dataset-name", default=None, choices=DATASETS,
                   help="the file's format (custom: JSONL, as vLLM names it; default: jsonl for a .jsonl file, "
                        "else sharegpt)")
    d.add_argument("--output-len", type=int, default=None,
                   help="max_tokens of JSONL prompts that give none (default: 128); with sharegpt, replaces the "
                        "gpt reply's token count")
    d.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder or .gguf file to count ShareGPT tokens with (default: the server's "
                        "/tokenize)")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy; the sampled variant uses 0.8)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of every request (the sampled variant: 0.95)")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are drawn from [4, vocab-size)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--label", default="servelm", help="the system's name in the JSON")
    p.add_argument("--output", default=None, help="also append the JSON line to this file")
    p.set_defaults(func=run)


@dataclass
class Result:
    ok: bool = False
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


async def _one(client, url: str, model: str, prompt: list[int] | str, max_tokens: int, sampling: dict) -> Result:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    r = Result(start=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"].get("message")
                    return r
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
                    r.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                if not chunk.get("choices"):
                    continue
                if last is None:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last)
                last = now
        r.e2e = time.perf_counter() - r.start
        r.ok = r.tokens > 0
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {}
    a = np.asarray(xs) * 1000
    return {"mean": round(float(a.mean()), 2), "p50": round(float(np.percentile(a, 50)), 2),
            "p90": round(float(np.percentile(a, 90)), 2), "p95": round(float(np.percentile(a, 95)), 2),
            "p99": round(float(np.percentile(a, 99)), 2)}


def auth_headers() -> dict:
    """An Authorization header from $SERVELM_API_KEY or $OPENAI_API_KEY (what vLLM's benchmark reads), if set."""
    key = env.client_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _server_counter(url: str, model: str):
    """Token counts from the server's /tokenize (servelm's and vLLM's), and its max_model_len."""
    import httpx

    seen: dict = {}

    def count(texts: list[str], special: bool) -> list[int]:
        out = []
        with httpx.Client(headers=auth_headers(), timeout=60.0) as client:
            for text in texts:
                resp = client.post(url + "/tokenize", json={"model": model, "prompt": text,
                                                           "add_special_tokens": special})
                if resp.status_code != 200:
                    raise ValueError(f"{url}/tokenize: HTTP {resp.status_code} (give --tokenizer to count "
                                     "the dataset's tokens here)")
                body = resp.json()
                seen.setdefault("max_model_len", body.get("max_model_len"))
                out.append(int(body["count"]) if "count" in body else len(body["tokens"]))
        return out

    return count, seen


def _local_counter(path: str):
    """Token counts from a local tokenizer: a folder with tokenizer files, or a .gguf file's own."""
    from pathlib import Path

    from servelm.model.loading import hf_files
    from servelm.model.loading.metadata import load_tokenizer
    from servelm.model.loading.source import resolve_model

    p = Path(path).expanduser()
    tok = load_tokenizer(resolve_model(str(p))) if p.suffix == ".gguf" else hf_files.tokenizer_from_folder(p)

    def count(texts: list[str], special: bool) -> list[int]:
        return [len(tok(t, add_special_tokens=special)["input_ids"]) for t in texts]

    return count


def dataset_workload(args, url: str, model: str) -> Workload:
    """The prompts of --dataset-path, in its format."""
    name = dataset_name_for(args.dataset_path, args.dataset_name)
    if name == "jsonl":
        return load_jsonl(args.dataset_path, args.num_requests, args.seed, args.output_len)
    if args.tokenizer:
        count, max_len = _local_counter(args.tokenizer), None
    else:
        count, seen = _server_counter(url, model)
        # the server's context is known after its first answer: probe it before sampling
        count(["a"], True)
        max_len = seen.get("max_model_len")
    return load_sharegpt(args.dataset_path, args.num_requests, count, args.seed, args.output_len, max_len)


async def _run(args) -> dict:
    import httpx

    url = args.base_url.rstrip("/")
    dataset = getattr(args, "dataset_path", None)  # bench/capacity.py and concurrency.py build their own args
    if getattr(args, "dataset_name", None) and not dataset:
        raise ValueError("--dataset-name needs --dataset-path")
    if dataset and getattr(args, "workload", "S1") != "S1":
        raise ValueError("--dataset-path replaces --workload: give one of them")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None),
                                 headers=auth_headers()) as client:
        if args.model:
            model = args.model
        else:
            resp = await client.get(url + "/v1/models")
            if resp.status_code != 200:
                raise ValueError(f"{url}/v1/models: HTTP {resp.status_code}: {resp.text[:200]}")
            model = resp.json()["data"][0]["id"]
        name = getattr(args, "workload", "S1")
        if dataset:
            wl = dataset_workload(args, url, model)
            name = wl.name
        else:
            wl = (make_serving_workload(args.vocab_size, args.num_requests, args.seed) if name == "S1"
                  else make_workload(name, args.vocab_size))
        rng = np.random.Generator(np.random.PCG64(args.seed))
        gaps = rng.exponential(1.0 / args.rate, wl.num_requests) if args.rate != float("inf") else \
            np.zeros(wl.num_requests)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        sampling = {"temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0)}

        async def gated(p, n):
            if sem is None:
                return await _one(client, url, model, p, n, sampling)
            async with sem:
                return await _one(client, url, model, p, n, sampling)

        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(wl.prompts, wl.output_lens, gaps, strict=True):
            tasks.append(asyncio.create_task(gated(p, n)))
            if sem is None and gap:
                await asyncio.sleep(gap)  # Poisson arrivals: this is the load's schedule, not a test wait
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft * 1000 <= args.slo_ttft_ms and (r.tpot or 0) * 1000 <= args.slo_tpot_ms]
    report = {
        "bench": "serve", "system": args.label, "workload": name, "model": model, "requests": wl.num_requests,
        "rate": args.rate if not args.concurrency else None, "concurrency": args.concurrency,
        "temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": round(wall, 2),
        "request_throughput": round(len(ok) / wall, 3),
        "output_tok_per_s": round(sum(r.tokens for r in ok) / wall, 2),
        "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": sum(r.tokens for r in ok),
        "ttft_ms": _summary([r.ttft for r in ok]), "tpot_ms": _summary([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _summary([x for r in ok for x in r.itl]), "e2e_ms": _summary([r.e2e for r in ok]),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "goodput_req_per_s": round(len(good) / wall, 3), "slo_attainment": round(len(good) / max(1, len(results)), 3),
    }
    if dataset:
        report["dataset"] = str(dataset)
    return report


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(_run(args))
    line = json.dumps(report)
    print(line)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(line + "\n")
    return 0 if report["completed"] else 1
