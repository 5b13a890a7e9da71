"""The engine-core process: receives requests over ZeroMQ, runs `EngineCore.step()`, streams token outputs.

It never touches text; the API process tokenizes, detokenizes and applies stop strings, so the model loop
only ever waits for the model.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING

import zmq

from servelm.config.engine import EngineConfig
from servelm.engine.sequence import Request
from servelm.logs import configure_logging
from servelm.lora import LoRARequest
from servelm.worker import messages as m

if TYPE_CHECKING:  # the API process imports this module; torch is loaded in the engine process only
    from servelm.engine.core import EngineCore

logger = logging.getLogger("servelm.engine")


def run_engine(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the engine process."""
    configure_logging(config.device_config.log_config_file, "%(asctime)s %(levelname)s engine: %(message)s")
    _exit_with_parent()
    if config.device_config.cpu_nice:  # before torch starts its threads: they inherit it
        os.nice(config.device_config.cpu_nice)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    def phase(what: str) -> None:
        out.send(m.encoder.encode(m.Starting(what)))

    try:
        phase("importing torch and the engine")
        from servelm.engine.core import EngineCore
        from servelm.engine.threads import configure_threads
        from servelm.model.loading.loader import load_engine_model
        from servelm.model.loading.metadata import sampling_defaults

        configure_threads(config)
        phase(f"loading the model {config.model_config.model or '(default)'}")
        loaded = load_engine_model(config)  # no tokenizer: the API process tokenizes
        phase("allocating the KV cache")
        core = EngineCore(config, loaded.model)
        eos = loaded.eos_token_ids
        mc = config.model_config
        defaults = sampling_defaults(loaded.source, mc.generation_config, mc.override_generation_config)
        phase("warming up (one short request through every code path)")
        _warmup(core, eos)
        from servelm.worker.kv_store import KVStore

        kv_store = KVStore(core, loaded.source, config.cache_config.kv_cache_persist)
        if config.cache_config.kv_cache_persist:
            phase(f"restoring the prefix cache from {config.cache_config.kv_cache_persist}")
            kv_store.restore_at_start()
    except (ValueError, FileNotFoundError) as e:  # a model servelm cannot run: the message says it all
        out.send(m.encoder.encode(m.Fatal(str(e), input_error=True)))
        ctx.destroy(linger=5000)  # deliver it before exiting
        return
    except Exception as e:  # tell the API process why, instead of dying silently
        logger.error("engine failed to start:\n%s", traceback.format_exc())
        out.send(m.encoder.encode(m.Fatal(f"{type(e).__name__}: {e}")))
        ctx.destroy(linger=5000)
        return
    settle_heap(config.device_config.gc_young_threshold)
    model = core.model
    out.send(m.encoder.encode(m.Ready(core.max_model_len, model.spec.vocab_size, os.getpid(), core.stats(),
                                      model.spec.architecture, getattr(model, "num_params", 0),
                                      str(model.dtype).removeprefix("torch."),
                                      getattr(model, "quantization", "none"), sorted(eos), defaults,
                                      core.max_logprobs)))
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        # Block while idle; otherwise only drain what has already arrived between steps.
        timeout = 0 if core.has_unfinished_requests() and not core.holds_requests else 1000
        errors: list[m.RequestError] = []
        handled = False
        while poller.poll(timeout):
            msg = m.input_decoder.decode(inp.recv())
            if isinstance(msg, m.Shutdown):
                kv_store.save_at_shutdown()  # --kv-cache-persist: the cache outlives the process
                core.close()
                # the frozen heap back to the collector, so that the interpreter's exit frees it: extensions
                # that count their objects at exit (Triton's, loaded by torch) would list each one as leaked
                gc.unfreeze()
                return
            if isinstance(msg, m.KVCacheOp):  # between steps: the cache's blocks are all computed
                done = m.KVCacheDone(msg.op_id, "invalid", "the engine is asleep (sleep mode): wake it first") \
                    if core.is_sleeping else kv_store.handle(msg)
                out.send(m.encoder.encode(done))
                continue
            if isinstance(msg, m.LoraOp):
                out.send(m.encoder.encode(_lora_op(core, msg)))
                continue
            if isinstance(msg, m.ResetPrefixCache):
                out.send(m.encoder.encode(m.ResetDone(msg.op_id, core.reset_prefix_cache())))
                continue
            if isinstance(msg, m.UpdateWeights):
                out.send(m.encoder.encode(_update_weights(core, kv_store, msg)))
                continue
            if isinstance(msg, m.HoldOp):
                _hold(core, msg, out)
                continue
            if isinstance(msg, m.SleepOp):
                out.send(m.encoder.encode(_sleep_op(core, msg)))
                continue
            if isinstance(msg, m.Ping):  # answered between steps: a hung step goes unanswered
                out.send(m.encoder.encode(m.Pong(msg.seq)))
                continue
            handled = True
            _handle(core, msg, eos, errors)
            timeout = 0
        if not core.has_unfinished_requests() or core.holds_requests:  # a sleeping or held engine's requests wait
            if handled:  # e.g. an abort emptied the engine: report errors and fresh stats anyway
                out.send(m.encoder.encode(m.StepOutputs([], errors, core.stats())))
            continue
        t = time.perf_counter()
        try:
            outputs, decodes = core.step()
        except Exception:
            logger.error("engine step failed:\n%s", traceback.format_exc())
            raise
        errors += [m.RequestError(rid, why) for rid, why in core.take_errors()]
        out.send(m.encoder.encode(m.StepOutputs(outputs, errors, core.stats(), 1000 * (time.perf_counter() - t),
                                                core.last_num_batched_tokens, decodes)))


def settle_heap(young_threshold: int) -> None:
    """Tune the garbage collector for the serving loop, once the engine is built.

    Everything built so far (modules, model, KV manager, warm-up leftovers) lives as long as the process: a
    frozen heap is never traversed again, where a full collection walked ~190k objects (0.1-0.2 s) in the
    middle of a step (bench/engine_overheads.py --gc-freeze: GC per scheduler iteration 843 -> 313 us). A young
    collection runs whenever tracked objects outnumber freed ones by the threshold: with Python's 700 a step of
    256 decodes crossed it about once a step (~40 us on an idle core), though what a step allocates is freed by
    reference counting when it ends; a larger threshold leaves collections to the garbage that needs them
    (finished requests' reference cycles).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *gc.get_threshold()[1:])


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit when the API process dies, however it dies (SIGKILL included): an orphaned engine would keep its
    memory and threads forever. A thread rather than a check in the loop, because loading (compiling kernels,
    reading weights) can take minutes before the loop starts."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.warning("API process %d is gone; engine exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _handle(core: EngineCore, msg, eos: frozenset[int], errors: list[m.RequestError]) -> None:
    if isinstance(msg, m.AddRequest):
        params = msg.params
        params._eos_token_ids = eos
        try:
            lora = None if msg.lora_name is None else LoRARequest(msg.lora_name, 1)  # one the engine holds
            core.add_request(Request(msg.request_id, msg.prompt_token_ids, params, priority=msg.priority,
                                     cache_salt=msg.cache_salt, lora=lora))
        except ValueError as e:
            errors.append(m.RequestError(msg.request_id, str(e)))
    elif isinstance(msg, m.Abort):
        for rid in msg.request_ids:
            core.abort_request(rid)
    elif isinstance(msg, m.FinishSample):
        core.finish_seq(msg.request_id, msg.index, "stop", msg.stop)
    elif isinstance(msg, m.UpdateConfig):
        core.update_config(msg.settings)
        logger.info("scheduler settings changed: %s", msg.settings)


def _update_weights(core: EngineCore, kv_store, msg: m.UpdateWeights) -> m.WeightsDone:
    """New weights from a checkpoint's path, between steps; a checkpoint that does not fit, or cannot be read
    (damaged files), is answered, and changes nothing: every file is read and checked before the first copy.
    A KV cache saved from now on is the new weights' (its file name is their hash)."""
    try:
        copied = core.update_weights(msg.path)
    except (ValueError, OSError) as e:
        return m.WeightsDone(msg.op_id, error=str(e))
    except Exception as e:  # a reader's own error type (safetensors, gguf): the checkpoint is the caller's input
        logger.warning("weights from %s refused: %s: %s", msg.path, type(e).__name__, e)
        return m.WeightsDone(msg.op_id, error=f"{msg.path} cannot be read as a checkpoint ({type(e).__name__}: {e})")
    if copied is not None:
        from servelm.model.loading.source import resolve_model

        kv_store.source = resolve_model(msg.path, None)
        kv_store.reset_digest()
        logger.info("weights updated from %s (%.1f MB copied); prefix cache emptied", msg.path, copied / 2**20)
    return m.WeightsDone(msg.op_id, copied)


def _hold(core: EngineCore, msg: m.HoldOp, out) -> None:
    """Abort every request and/or hold or release them; a step in flight is collected (and its outputs sent)
    before the answer, so that what follows (a weight update) finds no step running."""
    outputs = core.abort_all() if msg.abort else []
    core.held = msg.hold
    while core.inflight is not None:
        stepped, decodes = core.step()
        out.send(m.encoder.encode(m.StepOutputs(stepped, [], core.stats(), decodes=decodes)))
    if outputs:
        out.send(m.encoder.encode(m.StepOutputs(outputs, [], core.stats())))
    out.send(m.encoder.encode(m.HoldDone(msg.op_id, len(core.requests))))


def _sleep_op(core: EngineCore, msg: m.SleepOp) -> m.SleepDone:
    """Sleep, wake or say what sleeps; a refusal is the answer's error, never the engine's end (a checkpoint
    that has gone from disk when a level-2 wake reads it again included: its weights then stay asleep)."""
    try:
        released = None
        if msg.action == "sleep":
            released = core.sleep(msg.level)
        elif msg.action == "wake_up":
            core.wake_up(msg.tags)
        return m.SleepDone(msg.op_id, core.sleeping(), released)
    except (ValueError, OSError) as e:
        return m.SleepDone(msg.op_id, core.sleeping(), error=str(e))
    except Exception as e:  # a reader's own error type (safetensors, gguf) for a damaged checkpoint
        logger.warning("waking the engine failed: %s: %s", type(e).__name__, e)
        return m.SleepDone(msg.op_id, core.sleeping(), error=f"{type(e).__name__}: {e}")


def _lora_op(core: EngineCore, msg: m.LoraOp) -> m.LoraDone:
    """Load or unload an adapter; what went wrong is the answer's error, never the engine's end."""
    if core.loras is None:
        return m.LoraDone(msg.op_id, "this engine serves no LoRA adapters (start it with --enable-lora)")
    try:
        if msg.action == "load":
            core.loras.add(LoRARequest(msg.name, 1, msg.path))
        elif not core.loras.remove(msg.name):
            return m.LoraDone(msg.op_id, f"no adapter named {msg.name!r} is loaded", adapters(core))
    except ValueError as e:  # LoraError: a bad adapter, or one in use
        return m.LoraDone(msg.op_id, str(e), adapters(core))
    except OSError as e:
        return m.LoraDone(msg.op_id, f"cannot read {msg.path}: {e}", adapters(core))
    return m.LoraDone(msg.op_id, None, adapters(core))


def adapters(core: EngineCore) -> list[dict]:
    if core.loras is None:
        return []
    return [{"name": a.name, "path": a.path, "rank": a.rank, "nbytes": a.nbytes, "load_s": a.load_s}
            for a in core.loras.adapters()]


def _warmup(core: EngineCore, eos: frozenset[int]) -> None:
    """One short request through every code path (prefill, decode, sampling) before serving."""
    from servelm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    params._eos_token_ids = eos
    core.add_request(Request("__warmup__", [1] * 8, params))
    while core.has_unfinished_requests():
        core.step()
    core.kv.pool.reset_prefix_cache()
