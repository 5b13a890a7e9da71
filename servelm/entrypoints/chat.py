"""`servelm chat`: an interactive chat in the terminal, with replies streamed as they are generated.

It runs the model in this process, or, with `--url`, talks to a running server's OpenAI chat API
(`/v1/chat/completions`, streamed), as `vllm chat` does: the whole conversation is sent with each message.

Ctrl-C works as in Ollama: during a reply it stops the reply and returns to the prompt; at the prompt it
quits, as does Ctrl-D.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import sys
import uuid
from collections.abc import Callable, Iterator

from servelm.config import env
from servelm.sampling_params import OutputKind, SamplingParams

HELLO = "servelm chat: type a message; Ctrl-C stops a reply, Ctrl-C or Ctrl-D (or /exit) quits, /reset forgets."
STOPPED = "[stopped]"  # the line after a reply Ctrl-C cut short (a reply's text may itself hold "> ")


@contextlib.contextmanager
def _interrupt_flag() -> Iterator[list[bool]]:
    """While generating, Ctrl-C only raises a flag that the loop checks between engine steps: an interrupt in
    the middle of a step could leave the scheduler or the KV cache half updated."""
    flag = [False]

    def on_sigint(signum, frame) -> None:
        flag[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _reply(llm, history: list[dict], params: SamplingParams) -> tuple[str, bool]:
    """Stream one reply to stdout; returns its text and whether Ctrl-C cut it short."""
    engine = llm.engine
    rid = uuid.uuid4().hex
    parts: list[str] = []
    with _interrupt_flag() as interrupted:
        engine.add_request(rid, llm.apply_chat_template(history), params)
        while engine.has_unfinished_requests():
            if interrupted[0]:
                engine.abort_request(rid)  # frees its KV blocks; the engine is ready for the next message
                break
            for out in engine.step():
                delta = out.outputs[0].text if out.outputs else ""
                parts.append(delta)
                print(delta, end="", flush=True)
    print(f"\n{STOPPED}" if interrupted[0] else "")
    return "".join(parts), interrupted[0]


def run_chat(llm, params: SamplingParams, system: str | None) -> int:
    params = dataclasses.replace(params, n=1, output_kind=OutputKind.DELTA)
    return _loop(lambda history: _reply(llm, history, params)[0], system)


def _read_line(prompt: str) -> str:
    """input(prompt), without losing a Ctrl-C pressed as the prompt appears. input() waits in a read() that a
    SIGINT arriving just before it does not interrupt, so such a Ctrl-C did nothing until Enter; here the wait
    also watches the signal's wakeup pipe, and the KeyboardInterrupt is raised as soon as it returns."""
    if not sys.stdin.isatty():  # piped input: no one to press Ctrl-C, and buffered lines select cannot see
        return input(prompt)
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while sys.stdin not in select.select([sys.stdin, r], [], [])[0]:  # a line, Ctrl-D, or a signal's byte
            os.read(r, 64)  # drained; the signal's handler runs here (Ctrl-C's raises KeyboardInterrupt)
        line = sys.stdin.readline()
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
    if not line:
        raise EOFError
    return line.removesuffix("\n")


def _loop(reply: Callable[[list[dict]], str | None], system: str | None) -> int:
    """The conversation: read a message, stream the reply, keep both. `reply` returns None when the turn
    failed (a server's error, already printed): the message is dropped, so the turns still alternate."""
    history = [{"role": "system", "content": system}] if system else []
    # Ctrl-C must reach the prompt even when this process was started with SIGINT ignored (as a shell does for
    # a background job, and as some process runners do): an ignored disposition is inherited across exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(HELLO, file=sys.stderr)
    while True:
        try:
            line = _read_line("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave cleanly
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = reply(history)
        if text is None:
            history.pop()
            continue
        # An interrupted reply stays in the conversation as far as it got, so the turns still alternate.
        history.append({"role": "assistant", "content": text})


# -- a running server ---------------------------------------------------------------------------------------

class RemoteError(Exception):
    """The server could not be reached, or refused before the chat began: one line, exit 1."""


def api_key_from_env() -> str | None:
    """The key a client sends when --api-key is not given: $SERVELM_API_KEY (what `servelm serve` reads), else
    $OPENAI_API_KEY (what OpenAI's clients and `vllm chat` read)."""
    return env.client_api_key()


def base_url(url: str) -> str:
    """The server's root: `http://host:8000`, `http://host:8000/` and `http://host:8000/v1` are the same server."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def request_fields(params: SamplingParams) -> dict:
    """The chat request's sampling fields: max_tokens and temperature always (the command's own defaults), the
    others only where they differ from the defaults, so that a server without vLLM's extensions (top_k, min_p,
    repetition_penalty, ...) is sent none of them unless asked."""
    body = {"max_tokens": params.max_tokens, "temperature": params.temperature}
    defaults = SamplingParams()
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "stop", "min_tokens", "ignore_eos"):
        value = getattr(params, name)
        if value != getattr(defaults, name):
            body[name] = value
    return body


def _error_message(raw: bytes | str) -> str:
    try:
        err = json.loads(raw)
        err = err.get("error", err)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        return text.strip()[:300]


class RemoteChat:
    """One conversation with a server's `/v1/chat/completions`, each reply streamed to stdout."""

    def __init__(self, url: str, model: str | None, api_key: str | None, fields: dict) -> None:
        import httpx

        self.url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # a reply may wait in the server's queue, or for its model to load: no limit between chunks but this one
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(600.0, connect=10.0))
        self.fields = fields
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        import httpx

        try:
            resp = self.client.get(self.url + "/v1/models")
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach {self.url}: {e}") from None
        if resp.status_code != 200:
            raise RemoteError(f"{self.url}/v1/models: HTTP {resp.status_code}: {_error_message(resp.content)}")
        models = resp.json().get("data") or []
        if not models:
            raise RemoteError(f"{self.url} serves no model")
        return models[0]["id"]

    def reply(self, history: list[dict]) -> str | None:
        """Stream one reply to stdout; its text (as far as it got when Ctrl-C stopped it), or None on an error.
        Ctrl-C closes the connection, and the server aborts the request."""
        import httpx

        body = {"model": self.model, "messages": history, "stream": True, **self.fields}
        parts: list[str] = []
        stopped = False
        try:
            with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    print(f"error: HTTP {resp.status_code}: {_error_message(resp.read())}", file=sys.stderr)
                    return None
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        print(f"\nerror: {_error_message(data)}", file=sys.stderr)
                        break
                    for choice in chunk.get("choices") or []:
                        delta = (choice.get("delta") or {}).get("content") or ""
                        parts.append(delta)
                        print(delta, end="", flush=True)
        except KeyboardInterrupt:
            stopped = True
        except httpx.HTTPError as e:
            print(f"\nerror: {type(e).__name__}: {e}", file=sys.stderr)
            if not parts:
                return None
        print(f"\n{STOPPED}" if stopped else "")
        return "".join(parts)

    def close(self) -> None:
        self.client.close()


def run_remote_chat(url: str, model: str | None, api_key: str | None, params: SamplingParams,
                    system: str | None) -> int:
    chat = RemoteChat(url, model, api_key, request_fields(params))
    try:
        print(f"servelm chat: {chat.model} at {chat.url}", file=sys.stderr)
        return _loop(chat.reply, system)
    finally:
        chat.close()
