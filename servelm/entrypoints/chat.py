"""`servelm chat`: an interactive chat in the terminal, with replies streamed as they are generated.

Ctrl-C works as in Ollama: during a reply it stops the reply and returns to the prompt; at the prompt it
quits, as does Ctrl-D.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import uuid
from collections.abc import Iterator

from servelm.sampling_params import OutputKind, SamplingParams

HELLO = "servelm chat: type a message; Ctrl-C stops a reply, Ctrl-C or Ctrl-D (or /exit) quits, /reset forgets."


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
    print()
    return "".join(parts), interrupted[0]


def run_chat(llm, params: SamplingParams, system: str | None) -> int:
    params = dataclasses.replace(params, n=1, output_kind=OutputKind.DELTA)
    history = [{"role": "system", "content": system}] if system else []
    print(HELLO, file=sys.stderr)
    while True:
        try:
            line = input("> ")
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
        text, _ = _reply(llm, history, params)
        # An interrupted reply stays in the conversation as far as it got, so the turns still alternate.
        history.append({"role": "assistant", "content": text})
