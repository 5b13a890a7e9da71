"""`servelm run-batch`: a file of requests in OpenAI's Batch API format run through the server's own routes, as
`vllm run-batch` does.

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`; each
output line, in the input's order, `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`. The requests go through the same app `servelm serve` serves (in this process, with no socket), so a
line's body is exactly what the server would answer it, error shapes included; all of them are in flight at
once, up to --max-concurrency, and the engine batches them. A line that is no request (not JSON, no body, a
route that is not a batch endpoint, a stream) gets `error` and no response.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from typing import Any

logger = logging.getLogger("servelm.batch")

# the routes a batch line may name (OpenAI's batch endpoints, and vLLM's scoring ones)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score",
              "/v1/rerank", "/score", "/rerank", "/classify")


def add_args(sub) -> None:
    from servelm.server.serve import add_args as add_serve_args

    p = sub.add_parser("run-batch", help="run a file of OpenAI Batch API requests, as vllm run-batch",
                       description="Run a JSONL file of requests in OpenAI's Batch API format (one "
                       '{"custom_id", "method", "url", "body"} per line) through the server\'s routes in this '
                       "process, and write one result per line in the input's order. Takes every `serve` "
                       "setting for the model and engine; the HTTP listener's are not used.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="the requests, one JSON object per line ('-': standard input)")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE",
                   help="where the results go, one JSON object per line ('-': standard output)")
    p.add_argument("--max-concurrency", type=int, default=256, metavar="N",
                   help="requests in flight at once (default 256); the engine batches those it runs together")
    add_serve_args(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args) -> int:
    from servelm.server.serve import check_before_start, load_config
    from servelm.worker.client import EngineStartError

    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    # every line is the caller's own: no keys, and no shedding of what the file itself queues
    args.api_key = args.api_keys_file = args.admin_key = None
    if not hasattr(args, "log_requests"):  # a line per request is the output file's job here
        args.log_requests = False
    args.queue_high_watermark = args.max_concurrency + 1
    args.queue_low_watermark = args.max_concurrency
    config = load_config(args)
    if args.print_config:
        print(json.dumps(config.describe(), indent=2))
        return 0
    lines = _read_lines(args.input_file)  # a file that cannot be read stops the run before anything loads
    problem = check_before_start(config, args)
    if problem is not None:
        print(f"servelm: error: {problem}", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(_run(config, lines, args.max_concurrency))
    except EngineStartError as e:
        print(f"servelm: error: the engine could not start: {e}", file=sys.stderr)
        return 2 if e.input_error else 1
    _write_lines(args.output_file, results)
    failed = sum(1 for r in results if r["error"] is not None or r["response"]["status_code"] >= 400)
    logger.info("run-batch: %d requests, %d succeeded, %d failed", len(results), len(results) - failed, failed)
    return 0


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return [line for line in sys.stdin.read().splitlines() if line.strip()]
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def _write_lines(path: str, results: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_request(line: str) -> tuple[str | None, str, dict]:
    """(custom_id, url, body) of one input line; ValueError saying what is wrong with it."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"the line is not JSON ({e})") from None
    if not isinstance(item, dict):
        raise ValueError("the line is not a JSON object")
    custom_id = item.get("custom_id")
    if custom_id is not None and not isinstance(custom_id, str):
        raise ValueError("custom_id must be a string")
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if method != "POST":
        raise ValueError(f"method must be POST, not {method!r}")
    if url not in BATCH_URLS:
        raise ValueError(f"url must be one of {', '.join(BATCH_URLS)}, not {url!r}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the request)")
    if body.get("stream"):
        raise ValueError("a batch request cannot stream (its result is written whole)")
    return custom_id, url, body


async def _run(config, lines: list[str], max_concurrency: int) -> list[dict]:
    import httpx

    from servelm.progress import progress
    from servelm.server.serve import open_stack

    stack = await open_stack(config)
    try:
        gate = asyncio.Semaphore(max_concurrency)
        transport = httpx.ASGITransport(app=stack.app, client=("127.0.0.1", 0))
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            with progress(total=len(lines), desc="run-batch", unit="req") as bar:
                async def one(line: str) -> dict:
                    async with gate:
                        result = await _one(client, line)
                    bar.update(1)
                    return result
                return list(await asyncio.gather(*(one(line) for line in lines)))
    finally:
        await stack.close()


async def _one(client: Any, line: str) -> dict:
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None, "response": None,
                           "error": None}
    try:
        out["custom_id"], url, body = read_request(line)
    except ValueError as e:
        try:  # name the line's custom_id where it has one
            item = json.loads(line)
            out["custom_id"] = item.get("custom_id") if isinstance(item, dict) else None
        except json.JSONDecodeError:
            pass
        out["error"] = {"code": "invalid_request", "message": str(e)}
        return out
    r = await client.post(url, json=body)
    try:
        answer = r.json()
    except json.JSONDecodeError:
        answer = {"error": {"message": r.text, "type": "server_error"}}
    out["response"] = {"status_code": r.status_code, "request_id": r.headers.get("x-request-id"), "body": answer}
    return out
