"""AsyncEngine: the API process's handle on the engine-core process.

It owns the engine process (start, watch, restart), the ZeroMQ sockets, and the output processor that
turns token outputs into text. Each request gets an asyncio queue of `RequestOutput`s; leaving the
generator early (client gone, error) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from servelm.config.engine import EngineConfig, RuntimeSettings
from servelm.engine.output_processor import OutputProcessor
from servelm.engine.step_outputs import EngineStats
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.worker import messages as m
from servelm.worker.process import run_engine

logger = logging.getLogger("servelm.server")

# Sample outputs detokenized between two returns to the event loop: a step of a few hundred sequences is
# turned into text in slices, so streams, health checks and new requests are served in between.
DETOKENIZE_SLICE = 64


class EngineDeadError(RuntimeError):
    """The engine process died while the request was in flight."""


class EngineStartError(RuntimeError):
    """The engine process could not start; `input_error` when the model or config is at fault."""

    def __init__(self, message: str, input_error: bool = False) -> None:
        super().__init__(message)
        self.input_error = input_error


class RequestRejected(ValueError):
    """The engine refused the request (e.g. it can never fit the context)."""


class QueueTimeout(TimeoutError):
    """The request got no first token within the queue timeout; it was removed from the engine."""


# Put on an aborted request's queue: its stream ends (no further output) rather than wait for outputs that
# the engine will never send.
_ABORTED = object()


PAUSE_MODES = ("abort", "wait", "keep")


class _Streams(dict):
    """The streams in flight by request id, which says when the last one has left (pause_generation's wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = asyncio.Event()
        self.empty.set()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.empty.clear()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._left()

    def pop(self, *args):
        value = super().pop(*args)
        self._left()
        return value

    def clear(self) -> None:
        super().clear()
        self._left()

    def _left(self) -> None:
        if not self:
            self.empty.set()


@dataclass
class _Stream:
    queue: asyncio.Queue
    finished: bool = False
    started: bool = False  # has produced output (no longer queued)
    samples: int = 1  # n
    finished_samples: int = 0


class AsyncEngine:
    """One engine process behind the EngineClient surface (worker/engine_client.py)."""

    def __init__(self, config: EngineConfig, tokenizer=None, start_timeout: float = 600.0,
                 progress_every_s: float = 15.0) -> None:
        self.config = config
        self.start_timeout = start_timeout  # 0: no limit
        self.progress_every_s = progress_every_s  # while starting, log what the engine is doing this often
        self.phase, self._phase_since, self._launched = "starting the engine process", time.monotonic(), 0.0
        self.set_tokenizer(tokenizer)
        self.streams: dict[str, _Stream] = _Streams()
        # pause_generation: its mode while paused, and the door new requests wait at until resumed
        self.paused: str | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        # sleep mode, as vLLM's engine_sleep_state reports it: awake, weights_offloaded (level 1), discard_all (2)
        self.sleep_state = "awake"
        self.ready = False
        self.info: m.Ready | None = None
        self.stats: EngineStats | None = None
        self.restarts = 0
        self.up_since: float | None = None  # wall-clock time the current engine became ready (None: down)
        self.last_heard = 0.0  # monotonic time of the engine's last message (health checks read it)
        self._ping_seq = 0
        self._proc: multiprocessing.Process | None = None
        self._stopping = False
        self._handled: multiprocessing.Process | None = None  # the dead engine process already dealt with
        self._killed: multiprocessing.Process | None = None  # the process kill() was asked to end (hung)
        self._replacing: dict | None = None  # the dead process a restart replaces, until the new one is ready
        self._tasks: list[asyncio.Task] = []
        base = os.path.join(tempfile.gettempdir(), f"servelm-{uuid.uuid4().hex[:12]}")
        self._in_addr, self._out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self._ctx = zmq.asyncio.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # never wait on unsent messages at close: a dropped engine never hangs
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(self._in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(self._out_addr)
        self._ready_event = asyncio.Event()
        # KV cache save/load and LoRA load/unload requests awaiting the engine's answer, by op id
        self._kv_ops: dict[int, asyncio.Future] = {}
        self._kv_op_ids = 0
        self._fatal: m.Fatal | None = None  # why the engine failed to start, if it did
        self.on_step = None  # optional callback(StepOutputs, outputs) for metrics
        self.on_ready = None  # optional callback(Ready, restarted: bool)
        self.on_down = None  # optional callback() when the engine process dies
        # optional callback(before, after) once an engine process that died (or was killed as hung) has been
        # replaced and the new one is ready: before {"pid", "exit_code", "cause": "died" | "hung"}, after
        # {"pid", "restarts"}
        self.on_replaced = None

    def set_tokenizer(self, tokenizer) -> None:
        """The tokenizer may come after launch(): no request is accepted before it is set."""
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self.launch()
        await self.wait_ready()

    def launch(self) -> None:
        """Start the engine process without waiting for it: the caller can load what it needs meanwhile."""
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch())]
        self._spawn()

    def _spawn(self) -> None:
        self.ready = False
        self._ready_event.clear()
        self._set_phase("starting the engine process")
        self._launched = time.monotonic()
        self._proc = self._new_process()
        self._proc.start()
        logger.info("engine process started (pid %s)", self._proc.pid)
        proc = self._proc
        with contextlib.suppress(RuntimeError, NotImplementedError, ValueError):  # no loop: the poll still works
            asyncio.get_running_loop().add_reader(proc.sentinel, self._on_sentinel, proc)

    def _on_sentinel(self, proc: multiprocessing.Process) -> None:
        """The process's sentinel became readable: it has exited (noticed at once, not at the next poll)."""
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        if proc is self._proc and proc is not self._handled and not self._stopping:
            proc.join(1)  # exited: reap it (returns at once in practice)
            self._engine_died(proc)

    def _new_process(self):
        ctx = multiprocessing.get_context("spawn")
        return ctx.Process(target=run_engine, args=(self.config, self._in_addr, self._out_addr),
                           name="servelm-engine", daemon=True)

    def _set_phase(self, phase: str) -> None:
        self.phase, self._phase_since = phase, time.monotonic()

    async def wait_ready(self) -> None:
        """Wait until the engine is ready, logging what it is doing every `progress_every_s` meanwhile; raise
        EngineStartError if it fails or is not ready within `start_timeout` seconds (0: no limit)."""
        while not self._ready_event.is_set():
            now = time.monotonic()
            left = self.start_timeout - (now - self._launched) if self.start_timeout > 0 else float("inf")
            if left <= 0:
                raise EngineStartError(
                    f"the engine did not become ready within {self.start_timeout:g}s (it was {self.phase}, for "
                    f"{now - self._phase_since:.0f}s); allow it longer with --engine-start-timeout-s "
                    "(SERVELM_ENGINE_START_TIMEOUT_S; 0 waits without limit)")
            try:
                await asyncio.wait_for(self._ready_event.wait(), min(left, self.progress_every_s))
            except asyncio.TimeoutError:
                if time.monotonic() - self._launched >= self.start_timeout > 0:
                    continue  # the check above raises
                now = time.monotonic()
                logger.info("engine still starting (pid %s): %s for %.0fs, %.0fs since launch%s", self.engine_pid,
                            self.phase, now - self._phase_since, now - self._launched,
                            f" (start timeout {self.start_timeout:g}s)" if self.start_timeout > 0 else "")
        if not self.ready:
            fatal = self._fatal or m.Fatal("the engine process exited before it was ready")
            raise EngineStartError(fatal.message, fatal.input_error)

    async def shutdown(self) -> None:
        self._stopping = True
        if self._proc is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._in.send(m.encoder.encode(m.Shutdown()), flags=zmq.NOBLOCK)
            # A ready engine finishes its step and exits; one still loading reads no messages: kill it now.
            # --kv-cache-persist: it saves the prefix cache before exiting, which may take a while for a large cache
            wait = (120 if self.config.cache_config.kv_cache_persist else 10) if self.ready else 0
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, wait)
            if self._proc.is_alive():
                self._proc.kill()
        for t in self._tasks:
            t.cancel()
        # Requests still in flight end with an error now rather than wait for outputs that will never come.
        self._fail_all(EngineDeadError("the engine was shut down; the request was not completed"))
        self._ctx.destroy(linger=0)
        self._ready_event.set()  # a wait_ready() under way returns now (and raises: not ready)
        for addr in (self._in_addr, self._out_addr):
            with contextlib.suppress(OSError):
                os.unlink(addr.removeprefix("ipc://"))

    async def ping(self) -> None:
        """Ask a ready engine for a Pong (it answers between steps): `last_heard` then moves on, unless hung."""
        if self.ready:
            self._ping_seq += 1
            with contextlib.suppress(zmq.ZMQError):
                await self._in.send(m.encoder.encode(m.Ping(self._ping_seq)), flags=zmq.NOBLOCK)

    def fail_queued(self, err: Exception) -> int:
        """End the requests that have no output yet with `err` (their callers abort them here and may send them
        elsewhere); those already streaming go on. Returns how many.

        Each is forgotten here and aborted in the engine: its caller's generator sees the error as the end of
        the stream and skips its own abort, and a request left in the engine would later run for nobody (or
        block the same id re-sent to this worker)."""
        queued = [rid for rid, st in self.streams.items() if not st.started]
        for rid in queued:
            stream = self.streams.pop(rid)
            stream.finished = True
            stream.queue.put_nowait(err)
            self.output_processor.abort(rid)
        if queued and self.ready:  # a paused engine reads it when it wakes, before anything sent later
            with contextlib.suppress(zmq.ZMQError):
                sent = self._in.send(m.encoder.encode(m.Abort(queued)), flags=zmq.NOBLOCK)
                sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # never an unretrieved error
        return len(queued)

    def kill(self) -> None:
        """Kill the engine process (a hung one): its death is handled as any other, and it is restarted."""
        if self._proc is not None and self._proc.is_alive():
            self._killed = self._proc
            self._proc.kill()

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def check_engine(self) -> bool:
        """Whether the engine can serve now: ready, and its process alive (checked directly, so a dead engine is
        noticed by whoever asks first: /ready, /metrics, /server/stats, the watcher)."""
        proc = self._proc
        if proc is not None and proc is not self._handled and not self._stopping and not proc.is_alive():
            self._engine_died(proc)
        return self.ready

    async def _watch(self) -> None:
        """A fallback to the sentinel: poll the engine process, so its death is always noticed."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            self.check_engine()

    def _engine_died(self, proc: multiprocessing.Process) -> None:
        """Fail in-flight requests (503), forget the dead engine's stats, then start a new one."""
        self._handled = proc
        was_ready = self.ready
        # the first engine died before it could say why: before importing servelm, as under a script whose engine
        # start is not inside `if __name__ == "__main__":` (the spawned process re-runs the script); a restart
        # would die the same way, over and over
        if not was_ready and self.info is None and self._fatal is None:
            self._fatal = m.Fatal(f"the engine process exited with code {proc.exitcode} before it was ready (its "
                                  "log is above; a script that starts an engine must do so under `if __name__ "
                                  "== \"__main__\":`, since the engine process imports the script's module)")
        gives_up = not was_ready and self._fatal is not None
        logger.error("engine process %s exited with code %s; failing %d in-flight requests%s", proc.pid,
                     proc.exitcode, len(self.streams), "" if gives_up else " and restarting")
        self.ready, self.up_since = False, None
        self.stats = None  # its figures describe a process that is gone
        if self.on_down is not None:
            self.on_down()
        self._fail_all(EngineDeadError("the engine process died; the request was not completed"))
        if gives_up:  # it never started: restarting would fail the same way
            self._ready_event.set()
            return
        self.restarts += 1
        if was_ready:  # a replacement that dies while starting leaves this the process being replaced
            self._replacing = {"pid": proc.pid, "exit_code": proc.exitcode,
                               "cause": "hung" if proc is self._killed else "died"}
        self._spawn()

    def _fail_all(self, err: Exception) -> None:
        for fut in self._kv_ops.values():
            if not fut.done():
                fut.set_exception(err)
        self._kv_ops.clear()
        for rid, stream in list(self.streams.items()):
            stream.queue.put_nowait(err)
            self.output_processor.abort(rid)
        self.streams.clear()

    # -- outputs -----------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = m.output_decoder.decode(await self._out.recv())
            self.last_heard = time.monotonic()
            if isinstance(msg, m.Pong):
                continue
            if isinstance(msg, m.Ready):
                self.info, self.stats, self.ready, self._fatal = msg, msg.stats, True, None
                self.sleep_state = "awake"  # a new engine process
                self.up_since = time.time()
                self._ready_event.set()
                if self.on_ready is not None:
                    self.on_ready(msg, self.restarts > 0)
                replaced, self._replacing = self._replacing, None
                if replaced is not None and self.on_replaced is not None:
                    try:
                        self.on_replaced(replaced, {"pid": msg.pid, "restarts": self.restarts})
                    except Exception:  # reporting it must never stop the engine's outputs being read
                        logger.exception("on_replaced failed")
                logger.info("engine ready (pid %s, max_model_len %d)", msg.pid, msg.max_model_len)
            elif isinstance(msg, (m.KVCacheDone, m.LoraDone, m.ResetDone, m.WeightsDone, m.SleepDone, m.HoldDone)):
                fut = self._kv_ops.pop(msg.op_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, m.Starting):
                self._set_phase(msg.phase)
            elif isinstance(msg, m.Fatal):
                self._fatal = msg
                if self.restarts:  # else wait_ready() raises it to whoever is starting the server
                    logger.error("engine failed to start: %s", msg.message)
            else:
                await self._on_step(msg)

    async def _on_step(self, msg: m.StepOutputs) -> None:
        self.stats = msg.stats
        for err in msg.errors:
            stream = self.streams.pop(err.request_id, None)
            self.output_processor.abort(err.request_id)
            if stream is not None:
                stream.queue.put_nowait(RequestRejected(err.message))
        all_outputs = []
        rows, dec = msg.outputs, msg.decodes
        for k in range(0, len(rows) + len(dec), DETOKENIZE_SLICE):
            if k:
                await asyncio.sleep(0)  # let the loop serve others between slices
            # a slice of the SeqOutputs, then of the running batch's columns
            a, b = max(0, k - len(rows)), max(0, k + DETOKENIZE_SLICE - len(rows))
            cols = m.DecodeOutputs(dec.request_ids[a:b], dec.token_ids[a:b]) if b > 0 else None
            outputs, stopped = self.output_processor.process(rows[k:k + DETOKENIZE_SLICE], cols)
            for rid, index, stop in stopped:
                await self._in.send(m.encoder.encode(m.FinishSample(rid, index, stop)))
            for out in outputs:
                stream = self.streams.get(out.request_id)
                if stream is None:
                    continue
                stream.started = True
                stream.finished_samples += sum(1 for c in out.outputs if c.finish_reason is not None)
                stream.queue.put_nowait(out)
                if out.finished:
                    stream.finished = True
                    del self.streams[out.request_id]
            all_outputs += outputs
        if self.on_step is not None:
            self.on_step(msg, all_outputs)

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, priority: int = 1,
                       queue_timeout: float | None = None,
                       cache_salt: str | None = None, *, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts it in the engine.

        With queue_timeout, a request with no output after that many seconds is aborted (QueueTimeout).
        `cache_salt`: the request shares prefix-cache blocks only with requests of the same salt. `lora`: the
        name of a LoRA adapter the engine holds, to run the request with.
        """
        if not self._resumed.is_set():  # paused: new requests wait here until resume_generation, in their queue time
            waited = time.monotonic()
            try:
                await asyncio.wait_for(self._resumed.wait(), queue_timeout)
            except asyncio.TimeoutError:
                raise QueueTimeout(f"the request waited {queue_timeout:g}s for generation to resume (the server "
                                   "is paused); try again later") from None
            if queue_timeout is not None:
                queue_timeout = max(queue_timeout - (time.monotonic() - waited), 1e-3)
        if not self.check_engine():
            raise EngineDeadError("the engine is not ready")
        if request_id in self.streams:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if params.bad_words and not params._bad_words_token_ids:  # the engine process has no tokenizer
            params.tokenize_bad_words(lambda text: self.tokenizer(text, add_special_tokens=False).input_ids)
        try:  # encode before registering: a value the wire cannot carry is the caller's input, and leaks nothing
            message = m.encoder.encode(m.AddRequest(request_id, prompt_token_ids, params, priority, cache_salt,
                                                       lora))
        except (OverflowError, TypeError, ValueError) as e:
            raise RequestRejected(f"the request holds a value out of range: {e}") from e
        stream = _Stream(asyncio.Queue(), samples=params.n)
        # Registration and release are one guarded unit: from here on, every exit (error, cancellation, a client
        # that leaves, the iterator closed early) goes through the finally, which frees the stream, the output
        # state and, via Abort, the engine's queue slot and KV blocks.
        self.streams[request_id] = stream
        try:
            self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
            await self._in.send(message)
            while True:
                if stream.started or queue_timeout is None:
                    item = await stream.queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(stream.queue.get(), queue_timeout)
                    except asyncio.TimeoutError:
                        raise QueueTimeout(f"the request waited {queue_timeout:g}s in the queue without being "
                                           "served; try again later") from None
                if item is _ABORTED:
                    return
                if isinstance(item, Exception):
                    stream.finished = True
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """End a request in flight: the engine frees it, and its stream ends after what it already holds."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        stream.queue.put_nowait(_ABORTED)
        try:
            self.output_processor.abort(request_id)
        except Exception:  # its detokenizer state may be what failed; the slot is free either way
            self.output_processor.states.pop(request_id, None)
            logger.exception("dropping the output state of request %s failed", request_id)
        if self.ready:
            await self._in.send(m.encoder.encode(m.Abort([request_id])))
        logger.info("aborted request %s", request_id)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info else 0

    def num_in_flight(self) -> int:
        return len(self.streams)

    def live_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences now: the samples the API has in flight, of which as many as the engine
        last reported running are running. Engine stats arrive only with a step, so they alone lag behind new
        requests (and describe a dead engine's last step); the API's own registry is current."""
        in_flight = sum(s.samples - s.finished_samples for s in self.streams.values())
        running = min(self.stats.num_running if self.stats else 0, in_flight)
        return running, in_flight - running

    def num_queued(self) -> int:
        """Requests sent to the engine that have no output yet."""
        return sum(1 for s in self.streams.values() if not s.started)

    async def update_config(self, settings: RuntimeSettings) -> None:
        """Change scheduler settings now, and for any engine restarted later (nothing changes if they cannot be
        sent)."""
        message = m.encoder.encode(m.UpdateConfig(settings))
        self.config = settings.apply(self.config)
        if self.ready:
            await self._in.send(message)

    async def lora_adapter(self, action: str, name: str, path: str = "") -> m.LoraDone:
        """Load (`action` "load", from the PEFT folder `path`) or unload a LoRA adapter between steps. A loaded
        adapter is also loaded by an engine restarted later. Raises EngineDeadError if the engine is not ready."""
        from servelm.config.engine import parse_lora_module

        done = await self._ask(lambda op_id: m.LoraOp(op_id, action, name, path))
        if done.error is None:
            kept = tuple(x for x in self.config.lora_config.lora_modules if parse_lora_module(x)[0] != name)
            if action == "load":
                kept += (f"{name}={path}",)
            self.config = self.config.replace(lora_modules=kept, enable_lora=True)
        return done

    async def kv_cache(self, action: str, path: str | None = None) -> m.KVCacheDone:
        """Have the engine save its prefix cache to `path` ("save") or restore it from there ("load"); it does so
        between steps. Raises EngineDeadError if the engine is not ready or dies meanwhile."""
        return await self._ask(lambda op_id: m.KVCacheOp(op_id, action, path))

    async def reset_prefix_cache(self) -> int | None:
        """Forget every cached prefix between steps: the blocks dropped, or None while requests are in flight.
        Raises EngineDeadError if the engine is not ready."""
        return (await self._ask(lambda op_id: m.ResetPrefixCache(op_id))).num_blocks

    async def update_weights_from_disk(self, path: str) -> int | None:
        """Have the engine copy a checkpoint's weights (a folder or a GGUF file on its machine, of the running
        model's architecture, shapes and settings) into its model between steps: the bytes copied, or None while
        requests are in flight. ValueError, changing nothing, where the checkpoint does not fit. A restarted
        engine loads the new checkpoint. Raises EngineDeadError if the engine is not ready."""
        done = await self._ask(lambda op_id: m.UpdateWeights(op_id, path))
        if done.error is not None:
            raise ValueError(done.error)
        if done.num_bytes is not None:  # a restart comes back with these weights
            self.config = self.config.replace(model=path, gguf_file=None)
        return done.num_bytes

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating, as vLLM's pause_generation, so that weights can change between requests: new requests
        wait until resume_generation. `mode` says what becomes of those in flight: "abort" ends them now
        (finish reason "abort"), "wait" lets them finish first, "keep" holds them where they are, blocks and
        all, to go on after the resume (a weight update meanwhile applies to the rest of their tokens).
        `clear_cache`: after abort or wait, forget every cached prefix. Raises EngineDeadError if the engine is
        not ready."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode is one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self._resumed.clear()
        self.paused = mode
        try:
            if mode == "keep":
                await self._ask(lambda op_id: m.HoldOp(op_id, hold=True))
                return
            if mode == "abort" and self.streams:
                await self._ask(lambda op_id: m.HoldOp(op_id, hold=False, abort=True))
            await self.streams.empty.wait()
        except BaseException:  # a dead engine, or a caller that gave up: no one would resume, so nothing pauses
            self.paused = None
            self._resumed.set()
            if mode == "keep" and self.ready:  # the hold may have reached the engine: release it (unanswered)
                with contextlib.suppress(Exception):
                    await self._in.send(m.encoder.encode(m.HoldOp(0, hold=False)), flags=zmq.NOBLOCK)
            raise
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        """Go on after pause_generation: held requests run again, and waiting ones are let in."""
        if self.paused == "keep" and self.check_engine():
            await self._ask(lambda op_id: m.HoldOp(op_id, hold=False))
        self.paused = None
        self._resumed.set()

    async def sleep(self, level: int = 1) -> int | None:
        """Put the engine to sleep (EngineCore.sleep): the bytes it gave back, or None while requests are in
        flight. ValueError where sleep mode is off or the level unknown. Raises EngineDeadError if the engine is
        not ready."""
        released = (await self._sleep_op("sleep", level=level)).num_bytes
        if released is not None:
            self.sleep_state = "weights_offloaded" if level == 1 else "discard_all"
        return released

    async def wake_up(self, tags: list[str] | None = None) -> list[str]:
        """Wake the parts `tags` names (None: all): the parts still asleep. ValueError where sleep mode is off,
        a tag is unknown or the checkpoint read again after a level-2 sleep cannot be."""
        asleep = (await self._sleep_op("wake_up", tags=tags)).asleep
        if not asleep:
            self.sleep_state = "awake"
        return asleep

    async def sleeping(self) -> list[str]:
        """The parts asleep ("weights", "kv_cache"): none for an awake engine, and for a restarted one."""
        return (await self._sleep_op("query")).asleep

    async def _sleep_op(self, action: str, level: int = 1, tags: list[str] | None = None) -> m.SleepDone:
        done = await self._ask(lambda op_id: m.SleepOp(op_id, action, level, tags))
        if done.error is not None:
            raise ValueError(done.error)
        return done

    async def _ask(self, message):
        """Send `message(op_id)` to the engine and wait for its answer with that op id (KVCacheDone, LoraDone).
        Raises EngineDeadError if the engine is not ready or dies meanwhile."""
        if not self.check_engine():
            raise EngineDeadError("the engine is not ready")
        self._kv_op_ids += 1
        op_id = self._kv_op_ids
        fut = self._kv_ops[op_id] = asyncio.get_running_loop().create_future()
        try:
            await self._in.send(m.encoder.encode(message(op_id)))
            return await fut
        finally:
            self._kv_ops.pop(op_id, None)
