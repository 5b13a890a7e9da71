"""Tensor-parallel ranks 1..N-1: processes that each hold one shard of the model and its KV heads' cache.

The engine process is rank 0, the driver: the scheduler, the KV cache manager and the sampler live there
only. Each step it sends every rank the step's block copies/swaps and model inputs (the same block ids its
manager chose, so prefix hits, copy-on-write and swapped-out blocks are the same on every rank); the ranks run
the same forward pass on their shards, joined by the all-reduces inside it (model/layers/parallel.py), and the driver
alone computes logits from the hidden states, which are the same on every rank.

A rank is a plain subprocess (`python -m servelm.engine.tp_workers FD`: the engine process may itself be a
daemonic multiprocessing child, which may not have multiprocessing children) talking to the driver over a
socket pair. It exits when the driver closes the socket, when the driver process is gone, or when a
collective fails because another rank is gone: no orphans.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection

import torch

from servelm.config.engine import EngineConfig
from servelm.engine.kv_cache_manager import BlockOps
from servelm.model.attention import AttentionMetadata
from servelm.model.decoder import DecoderLM

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0  # for a rank to exit after the stop message, before it is killed

StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]  # input ids, positions, attention metadata


class TPWorkers:
    """The driver's handle on its ranks: starts them, sends them each step, stops them."""

    def __init__(self, procs: list[subprocess.Popen], conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        # stops the ranks if the driver forgets to (garbage collection, interpreter exit)
        self._finalizer = weakref.finalize(self, _stop, procs, conns)

    @classmethod
    def start(cls, config: EngineConfig, model: DecoderLM, num_blocks: int, num_cpu_blocks: int,
              max_model_len: int) -> TPWorkers:
        """Spawn ranks 1..N-1, wait until each has loaded its shard, then connect all N (the driver's `model`
        is rank 0's shard) into one gloo group. Raises RuntimeError, naming the rank, if one fails to start."""
        size = config.tensor_parallel_size
        procs, conns = [], []
        workers = cls(procs, conns)
        try:
            for rank in range(1, size):
                conn, proc = _spawn(rank)
                procs.append(proc)
                conns.append(conn)
                conn.send_bytes(pickle.dumps({"config": config, "rank": rank, "size": size}))
            for rank, (conn, proc) in enumerate(zip(conns, procs, strict=True), start=1):
                reply = _wait_reply(conn, proc, rank)
                if reply[0] != "loaded":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")
            cache = {"num_blocks": num_blocks, "num_cpu_blocks": num_cpu_blocks, "max_model_len": max_model_len}

            def tell(port: int) -> None:
                for conn in conns:
                    conn.send_bytes(pickle.dumps({**cache, "port": port}))

            model.tp.connect(0, on_port=tell)
            for rank, (conn, proc) in enumerate(zip(conns, procs, strict=True), start=1):
                reply = _wait_reply(conn, proc, rank)
                if reply[0] != "ready":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")
        except BaseException:
            workers.close()
            raise
        logger.info("tensor parallel: %d ranks (pids %s)", size, [os.getpid()] + [p.pid for p in procs])
        return workers

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def step(self, ops: BlockOps, inputs: StepInputs | None) -> None:
        """Send every rank this step's block operations and (unless None: block operations only) inputs."""
        data = pickle.dumps((ops, inputs), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code {proc.poll()})") from e

    def close(self) -> None:
        """Stop every rank and wait for it to exit (killed if it does not in a few seconds)."""
        self._finalizer()


def _spawn(rank: int) -> tuple[Connection, subprocess.Popen]:
    ours, theirs = multiprocessing.Pipe(duplex=True)  # a socket pair
    env = dict(os.environ)
    # the rank imports the same servelm as the driver, wherever that came from
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    fd = theirs.fileno()
    proc = subprocess.Popen([sys.executable, "-m", "servelm.engine.tp_workers", str(fd), str(rank)],
                            pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    return ours, proc


def _wait_reply(conn: Connection, proc: subprocess.Popen, rank: int) -> tuple:
    """The rank's next message; RuntimeError if it exits first."""
    while not conn.poll(0.2):
        if proc.poll() is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up (exit code {proc.returncode}); "
                               "its log is above")
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        proc.wait()
        raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up (exit code {proc.returncode})"
                           ) from None


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # a rank already gone
            conn.send_bytes(pickle.dumps(None))
        conn.close()
    deadline = time.monotonic() + _STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the rank's side --------------------------------------------------------------------------------------------
def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit once the driver process is gone, however it went (a rank blocked in a collective included)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(conn: Connection, rank: int) -> None:
    from servelm.engine.model_runner import ModelRunner
    from servelm.engine.threads import configure_threads
    from servelm.model.loading.loader import load_model

    init = pickle.loads(conn.recv_bytes())
    config: EngineConfig = init["config"]
    try:
        configure_threads(config, rank)
        loaded = load_model(config.model, config.gguf_file, config.tokenizer, config.dtype, config.device,
                            with_tokenizer=False, sliding_window=config.sliding_window,
                            quantization=config.quantization, quantization_group_size=config.quantization_group_size,
                            tp_rank=rank, tp_size=init["size"])
    except Exception as e:
        logger.error("rank %d failed to load the model:\n%s", rank, traceback.format_exc())
        conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
        return
    model = loaded.model
    conn.send_bytes(pickle.dumps(("loaded",)))
    cache = pickle.loads(conn.recv_bytes())
    model.tp.connect(cache["port"])
    runner = ModelRunner(model, cache["num_blocks"], config.block_size, cache["num_cpu_blocks"], config.seed,
                         max_model_len=cache["max_model_len"], kv_cache_dtype=config.kv_cache_dtype)
    conn.send_bytes(pickle.dumps(("ready",)))
    with torch.inference_mode():
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:  # the driver closed its end without a word: it is gone
                return
            if msg is None:
                return
            ops, inputs = msg
            runner.apply_block_ops(ops)
            if inputs is not None:
                ids, positions, meta = inputs
                model.forward(ids, positions, runner.kv_caches, meta)


def main(argv: list[str]) -> None:
    fd, rank = int(argv[0]), int(argv[1])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp rank {rank}: %(message)s")
    _exit_with_parent()
    conn = Connection(fd)
    driver = os.getppid()
    code = 0
    try:
        _serve(conn, rank)
    except (EOFError, ConnectionError) as e:  # the driver went away mid-conversation (it exited or was killed)
        logger.warning("rank %d: the engine process is gone (%s); exiting", rank, type(e).__name__)
        code = 1
    except Exception as e:  # a failed step: exiting closes this rank's sockets, which fails the driver's collective
        if os.getppid() != driver:  # a collective failed because the driver died: not this rank's error
            logger.warning("rank %d: the engine process is gone (%s); exiting", rank, e)
        else:
            logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        code = 1
    # At once, without the interpreter's teardown (seconds of module and gloo clean-up on a busy machine):
    # the rank holds nothing that needs it, and the driver waits for this exit.
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
