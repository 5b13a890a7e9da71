"""Typed messages between the API process and the engine-core process (msgpack over ZeroMQ)."""

from __future__ import annotations

import msgspec

from servelm.config.engine import RuntimeSettings
from servelm.engine.step_outputs import DecodeOutputs, EngineStats, SeqOutput
from servelm.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 1
    cache_salt: str | None = None
    lora_name: str | None = None  # a LoRA adapter the engine holds (None: the base model)


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class FinishSample(msgspec.Struct, tag="finish"):
    """A sample hit a stop string (found by the API process's detokenizer): end it in the engine."""

    request_id: str
    index: int
    stop: str


class UpdateConfig(msgspec.Struct, tag="update"):
    """Run-time scheduler settings (PATCH /admin/config)."""

    settings: RuntimeSettings


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ping(msgspec.Struct, tag="ping"):
    """A health check: the engine answers Pong between steps, so one that stops answering is hung."""

    seq: int


class KVCacheOp(msgspec.Struct, tag="kv"):
    """POST /admin/kv/save or /load: save the prefix cache to a file, or restore it from one."""

    op_id: int
    action: str  # "save" | "load"
    path: str | None = None  # a file, or a directory holding one file per model (None: --kv-cache-persist)


class LoraOp(msgspec.Struct, tag="lora"):
    """Load a LoRA adapter (from a PEFT folder) or unload one, between steps."""

    op_id: int
    action: str  # "load" | "unload"
    name: str
    path: str = ""


class ResetPrefixCache(msgspec.Struct, tag="resetcache"):
    """Forget every cached prefix, between steps (refused while requests are in flight)."""

    op_id: int


class UpdateWeights(msgspec.Struct, tag="updateweights"):
    """New weights from a checkpoint on the engine's machine, copied in place between steps (refused while
    requests are in flight)."""

    op_id: int
    path: str


class SleepOp(msgspec.Struct, tag="sleep"):
    """Sleep mode, between steps: put the engine to sleep at `level` (refused while requests are in flight), wake
    the parts `tags` names (None: all), or only say what sleeps."""

    op_id: int
    action: str  # "sleep" | "wake_up" | "query"
    level: int = 1
    tags: list[str] | None = None


class HoldOp(msgspec.Struct, tag="hold"):
    """Pausing (vLLM's pause_generation), between steps: `abort` ends every request (finish reason "abort");
    `hold` keeps the requests where they are and runs no step until a HoldOp releases them."""

    op_id: int
    hold: bool
    abort: bool = False


EngineInput = AddRequest | Abort | FinishSample | UpdateConfig | Shutdown | Ping | KVCacheOp | LoraOp | \
    ResetPrefixCache | UpdateWeights | SleepOp | HoldOp


class RequestError(msgspec.Struct):
    request_id: str
    message: str


class Ready(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    pid: int
    stats: EngineStats  # so /server/stats has engine figures from the moment it is ready
    # what the model is (Ollama's /api/tags and /api/show details)
    architecture: str = ""
    num_params: int = 0
    dtype: str = ""
    quantization: str = "none"
    eos_token_ids: list[int] = msgspec.field(default_factory=list)  # the model's end-of-sequence ids (beam search)
    # the defaults of a request's unset sampling fields (the model's generation config, --generation-config)
    sampling_defaults: dict[str, int | float] = msgspec.field(default_factory=dict)
    max_logprobs: int = 20  # the most logprobs a request may ask for (--max-logprobs, resolved)


class StepOutputs(msgspec.Struct, tag="step"):
    outputs: list[SeqOutput]
    errors: list[RequestError]
    stats: EngineStats
    step_ms: float = 0.0
    num_batched_tokens: int = 0
    decodes: DecodeOutputs = msgspec.field(default_factory=DecodeOutputs)  # the running batch's plain rows


class Starting(msgspec.Struct, tag="starting"):
    """What the engine process is doing while it starts, so a slow start can be reported, not just waited on."""

    phase: str


class Fatal(msgspec.Struct, tag="fatal"):
    message: str
    input_error: bool = False  # the model or its config is at fault (the user's to fix), not servelm


class Pong(msgspec.Struct, tag="pong"):
    seq: int


class KVCacheDone(msgspec.Struct, tag="kvdone"):
    """The answer to a KVCacheOp: what it did, or why not (`error`: mismatch, corrupt, not_found, invalid)."""

    op_id: int
    error: str | None = None
    message: str = ""
    path: str = ""
    num_blocks: int = 0
    num_skipped: int = 0
    size_bytes: int = 0
    seconds: float = 0.0


class LoraDone(msgspec.Struct, tag="loradone"):
    """The answer to a LoraOp: `error` says why it failed (None: done); `adapters` what the engine holds now,
    each {name, path, rank, nbytes, load_s}."""

    op_id: int
    error: str | None = None
    adapters: list[dict] = msgspec.field(default_factory=list)


class ResetDone(msgspec.Struct, tag="resetdone"):
    """The answer to a ResetPrefixCache: the blocks dropped, or None where requests held blocks."""

    op_id: int
    num_blocks: int | None = None


class WeightsDone(msgspec.Struct, tag="weightsdone"):
    """The answer to an UpdateWeights: the bytes copied; None where requests were in flight; or why the
    checkpoint was refused (nothing changed)."""

    op_id: int
    num_bytes: int | None = None
    error: str | None = None


class SleepDone(msgspec.Struct, tag="sleepdone"):
    """The answer to a SleepOp: the parts asleep now; the bytes a sleep gave back (None where requests were in
    flight); or why it was refused."""

    op_id: int
    asleep: list[str] = msgspec.field(default_factory=list)
    num_bytes: int | None = None
    error: str | None = None


class HoldDone(msgspec.Struct, tag="holddone"):
    """The answer to a HoldOp, once no step is in flight: the requests the engine holds."""

    op_id: int
    num_requests: int = 0


EngineOutput = Ready | StepOutputs | Starting | Fatal | Pong | KVCacheDone | LoraDone | ResetDone | WeightsDone | \
    SleepDone | HoldDone

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_decoder = msgspec.msgpack.Decoder(EngineOutput)
