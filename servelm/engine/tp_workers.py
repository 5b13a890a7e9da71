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
import dataclasses
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
from servelm.engine.kv_sizing import KVPlan
from servelm.logs import configure_logging
from servelm.model.decoder import DecoderLM

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0  # for a rank to exit after the stop message, before it is killed

# what the other ranks run each step (built by ModelRunner._prepare): ("eager", input ids, positions, attention
# metadata), host tensors each rank copies to its own device, or ("graph", capture sizes, unpadded decode inputs),
# which each rank pads and replays as the driver does (engine/cuda_graphs.py)
StepInputs = tuple


class TPWorkers:
    """The driver's handle on its ranks: starts them, sends them each step, stops them.

    Start-up runs in phases that every rank goes through together, because each holds collectives: `start`
    (load the shards, connect the group), `begin_plan`/`end_plan` (each rank's KV cache plan from its own
    device's memory, around the driver's own) and `begin_runners`/`end_runners` (each rank's KV cache and
    CUDA graphs, around the driver's own)."""

    def __init__(self, procs: list[subprocess.Popen], conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.tp = None  # the driver's group, once connected
        self._closing = threading.Event()
        # stops the ranks if the driver forgets to (garbage collection, interpreter exit)
        self._finalizer = weakref.finalize(self, _stop, procs, conns, self._closing)

    @classmethod
    def start(cls, config: EngineConfig, model: DecoderLM) -> TPWorkers:
        """Spawn ranks 1..N-1, wait until each has loaded its shard, then connect all N (the driver's `model`
        is rank 0's shard) into one group (gloo on the CPU, NCCL on CUDA: model/layers/parallel.py). Raises
        RuntimeError, naming the rank, if one fails to start."""
        size = config.parallel_config.tensor_parallel_size
        procs, conns = [], []
        workers = cls(procs, conns)
        try:
            for rank in range(1, size):
                conn, proc = _spawn(rank)
                procs.append(proc)
                conns.append(conn)
                conn.send_bytes(pickle.dumps({"config": config, "rank": rank, "size": size}))
            workers._expect("loaded")

            def tell(port: int) -> None:
                for conn in conns:
                    conn.send_bytes(pickle.dumps({"port": port}))

            model.tp.connect(0, on_port=tell)
            workers._expect("connected")
        except BaseException:
            workers.close()
            raise
        workers.tp = model.tp
        if model.tp.backend == "nccl":
            # NCCL never notices a dead peer (gloo's sockets close at once): without this the driver would wait
            # in its next collective until the timeout
            threading.Thread(target=workers._watch, name="tp-watch", daemon=True).start()
        logger.info("tensor parallel: %d ranks over %s (pids %s)", size, model.tp.backend,
                    [os.getpid()] + [p.pid for p in procs])
        return workers

    def begin_plan(self) -> None:
        """Every rank plans its KV cache from its own device (a profile run, whose all-reduces pair with the
        driver's: the driver plans its own between this and `end_plan`)."""
        self._send(("plan",))

    def end_plan(self, plan: KVPlan) -> KVPlan:
        """The driver's plan with the fewest blocks any rank can hold (every rank's cache has the same blocks)."""
        blocks = [reply[1] for reply in self._expect("planned")]
        fewest = min([plan.num_blocks, *blocks])
        if fewest < plan.num_blocks:
            logger.info("KV cache: %d blocks, the most every rank holds (ranks 0..%d: %s)", fewest,
                        len(blocks), [plan.num_blocks, *blocks])
            plan = dataclasses.replace(plan, num_blocks=fewest)
        return plan

    def begin_runners(self, num_blocks: int, num_cpu_blocks: int, max_model_len: int,
                      graph_sizes: list[int] | None) -> None:
        """Every rank allocates its cache and captures `graph_sizes` (None: no CUDA graphs), as the driver does
        between this and `end_runners`."""
        self._send({"num_blocks": num_blocks, "num_cpu_blocks": num_cpu_blocks, "max_model_len": max_model_len,
                    "graph_sizes": graph_sizes})

    def end_runners(self) -> None:
        self._expect("ready")

    def _send(self, msg) -> None:
        for conn in self.conns:
            conn.send_bytes(pickle.dumps(msg))

    def _expect(self, what: str) -> list[tuple]:
        """Every rank's next reply, which must be `what` (RuntimeError naming the rank otherwise)."""
        replies = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            reply = _wait_reply(conn, proc, rank)
            if reply[0] != what:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")
            replies.append(reply)
        return replies

    def _watch(self, poll_s: float = 0.5) -> None:
        """Abort the driver's NCCL group once a rank exits that was not told to: its collectives then fail."""
        while not self._closing.wait(poll_s):
            gone = [(rank, p.poll()) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if gone:
                logger.error("tensor-parallel rank %d exited (exit code %s): aborting the group", *gone[0])
                self.tp.abort()
                return

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


def _stop(procs: list[subprocess.Popen], conns: list[Connection], closing: threading.Event) -> None:
    closing.set()  # these exits are expected
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
    from servelm.engine.core import plan_kv_cache
    from servelm.engine.kv_sizing import CudaMemory
    from servelm.engine.model_runner import ModelRunner
    from servelm.engine.threads import configure_threads
    from servelm.model.loading.loader import load_engine_model

    init = pickle.loads(conn.recv_bytes())
    config: EngineConfig = init["config"]
    configure_logging(config.device_config.log_config_file)
    try:
        configure_threads(config, rank)
        loaded = load_engine_model(config, tp_rank=rank, tp_size=init["size"])
    except Exception as e:
        logger.error("rank %d failed to load the model:\n%s", rank, traceback.format_exc())
        conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
        return
    model = loaded.model
    device = model.embed.device  # this rank's own (model/layers/parallel.py: rank_device)
    conn.send_bytes(pickle.dumps(("loaded",)))
    model.tp.connect(pickle.loads(conn.recv_bytes())["port"])
    conn.send_bytes(pickle.dumps(("connected",)))
    if pickle.loads(conn.recv_bytes()) is None:  # the driver failed to connect and stops us
        return
    try:  # as the driver plans (engine/core.py), from this rank's own GPU
        plan = plan_kv_cache(config, model, CudaMemory(device) if device.type == "cuda" else None)
    except ValueError as e:  # no memory left for the KV cache on this GPU
        conn.send_bytes(pickle.dumps(("error", str(e))))
        return
    conn.send_bytes(pickle.dumps(("planned", plan.num_blocks)))
    cache = pickle.loads(conn.recv_bytes())
    if cache is None:  # the driver's own plan failed (its error says why) and stops us
        return
    runner = ModelRunner(model, cache["num_blocks"], config.cache_config.block_size, cache["num_cpu_blocks"], config.model_config.seed,
                         max_model_len=cache["max_model_len"], kv_cache_dtype=config.cache_config.kv_cache_dtype)
    if cache["graph_sizes"]:  # the driver's sizes, captured in the same order (without logits: see DecodeGraphs)
        runner.enable_decode_graphs(cache["graph_sizes"], capture=True, with_logits=False)
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
                run_step(runner, inputs)


def run_step(runner, inputs: StepInputs) -> None:
    """This rank's part of a step the driver runs with `inputs` (StepInputs): on its own device."""
    if inputs[0] == "graph":
        _, sizes, graph_inputs = inputs
        if runner.graphs is None or runner.graphs.sizes != sizes:
            # the driver runs padded buffers it did not capture (the CPU; tests): the same buffers here, eager.
            # Their all-reduces pair with the driver's by shape and order, captured or not
            runner.enable_decode_graphs(sizes, capture=False, with_logits=False)
        runner.graphs.run(*graph_inputs)
        return
    _, ids, positions, meta = inputs
    dev = runner.device
    runner.model.forward(ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True), runner.kv_caches,
                         meta.to(dev))


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
