"""Send the validation prompts (validation_prompts.yaml) to a running servelm and exit 1 unless every answer
contains what it should: the pipeline's check of a deployment before its model version is promoted.

    python deploy/ci/validation_prompts.py --url http://localhost:8000 --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx
import yaml

HERE = Path(__file__).parent


def check(client: httpx.Client, model: str, case: dict) -> str | None:
    """One prompt; None when the answer is right, else what was wrong."""
    body = {"model": model, "temperature": 0, "max_tokens": case.get("max_tokens", 32)}
    if "messages" in case:
        r = client.post("/v1/chat/completions", json={**body, "messages": case["messages"]})
    else:
        r = client.post("/v1/completions", json={**body, "prompt": case["prompt"]})
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:300]}"
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "messages" in case else choice["text"]
    missing = [e for e in case.get("expect", []) if e.lower() not in text.lower()]
    if not text.strip() or missing:
        return f"answer {text!r} lacks {missing or 'any text'}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default=str(HERE / "validation_prompts.yaml"))
    ap.add_argument("--api-key-env", default="", help="the env var holding the API key, if the server wants one")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {os.environ[a.api_key_env]}"} if a.api_key_env else {}
    cases = yaml.safe_load(Path(a.prompts).read_text())
    failures = 0
    with httpx.Client(base_url=a.url, headers=headers, timeout=a.timeout) as client:
        try:
            ready = client.get("/ready")
        except httpx.HTTPError as e:
            print(f"FAIL {a.url} cannot be reached: {e}")
            return 1
        if ready.status_code != 200:
            print(f"FAIL /ready answered {ready.status_code}")
            return 1
        for i, case in enumerate(cases):
            try:
                problem = check(client, a.model, case)
            except httpx.HTTPError as e:
                problem = f"request failed: {e}"
            failures += problem is not None
            print(f"{'FAIL' if problem else 'ok  '} prompt {i}" + (f": {problem}" if problem else ""))
    print(f"{len(cases) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
