"""The serving config tree, loaded with precedence CLI > env > file: the engine's sections (model, cache,
scheduler, parallel, device, speculative, lora, structured_outputs: config/engine.py), the server's (api, oip,
embedding, lifecycle, auth, storage, rollout, observability) and admission.

Every field has a default, a help text, one env var (`SERVELM_<FIELD>`) and one flag (`--field-name`).
`load()` records where each value came from, so `--print-config` and `GET /admin/config` can say.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli before it joined the standard library
    import tomli as tomllib

from servelm.config import env as env_vars
from servelm.config.engine import (
    ENGINE_SECTIONS,
    ConfigError,
    EngineConfig,
    SectionedConfig,
    _f,
    choices,
    one_of,
    require,
    section_map,
    token_count,
)
from servelm.config.models import ModelSpec, parse_models

Priority = typing.Literal["high", "normal", "low"]
PRIORITIES = choices(Priority)  # index = the engine's Priority value
WebUi = typing.Literal["chat", "none"]
PrefixCacheIsolation = typing.Literal["key", "none"]
ToolCallParser = typing.Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "phi4_mini_json",
                                "granite"]
ReasoningParser = typing.Literal["none", "deepseek_r1", "qwen3", "mistral", "granite"]
MetricNames = typing.Literal["servelm", "vllm"]
UvicornLogLevel = typing.Literal["critical", "error", "warning", "info", "debug", "trace"]
SECRETS = frozenset({"api_key", "admin_key"})  # never printed, logged or returned
REDACTED = SECRETS | {"hf_token"}  # the fields `describe` never shows
# URLs that may carry a password (postgresql://user:PASSWORD@host/db): printed with the password masked
URL_SECRETS = frozenset({"database_url", "registry_url", "redis_url"})


# apply_chat_template's own arguments, which every rendering sets: not template variables a server default may set
# apply_chat_template's own arguments, which requests set through their own fields: never through
# default_chat_template_kwargs or a request's chat_template_kwargs
CHAT_TEMPLATE_ARGUMENTS = frozenset({"conversation", "add_generation_prompt", "continue_final_message", "tokenize",
                                      "tools", "documents", "chat_template", "return_dict"})


_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")  # package.module.Name


def _json_object(text: str) -> dict | None:
    """The JSON object `text` holds, or None when it holds something else."""
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


@dataclass
class ApiConfig:
    """The API's front end: where it listens (HTTP, gRPC), the model ids it answers to, limits on the request itself, CORS, the web page, stored responses and how tool calls are read."""

    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on")
    uds: str | None = _f(None, "listen on this Unix domain socket (a file path) instead of --host and --port, as "
                         "vLLM's --uds: for a proxy or sidecar on the same machine. The socket file is open to "
                         "every local user (mode 0666, as uvicorn makes it; API keys still apply) and removed at "
                         "exit; a stale one left by a server that died is replaced")
    grpc_port: int | None = _f(None, "also serve gRPC on this port (servelm.v1.Llm, the Open Inference Protocol, "
                               "health checking and reflection; needs the grpc extra); None: no gRPC")
    served_model_name: tuple[str, ...] | None = _f(None, "the model id clients use, or several (as vLLM's: "
                                                   "--served-model-name a b): the first is the id /v1/models "
                                                   "lists first and responses carry, the others are aliases a "
                                                   "request may name too (default: derived from the model)")
    ssl_keyfile: str | None = _f(None, "serve HTTPS: the server's private key (a PEM file), with --ssl-certfile "
                                 "(as vLLM's)")
    ssl_certfile: str | None = _f(None, "serve HTTPS: the server's certificate, or its chain (a PEM file), with "
                                  "--ssl-keyfile")
    ssl_ca_certs: str | None = _f(None, "with --ssl-certfile: the CA certificates (a PEM file) client certificates "
                                  "are checked against")
    ssl_cert_reqs: int = _f(0, "with --ssl-certfile: client certificates, numbered as Python's ssl module does: 0 "
                            "not asked for, 1 checked when given, 2 required (mutual TLS); 1 and 2 need "
                            "--ssl-ca-certs")
    max_request_body_bytes: int = _f(4 * 2**20, "larger request bodies get 413")
    header_timeout_s: float = _f(10.0, "close a connection whose request head (request line and headers) is not "
                                 "complete this long after it opened or after its last response (slow clients, "
                                 "slowloris); 0 turns it off")
    http_keep_alive_s: float = _f(75.0, "close a kept-alive connection idle this long (or header_timeout_s, when "
                                  "smaller); keep it above clients' own idle expiry (5 s in httpx and the openai "
                                  "SDK), or a client can reuse a connection the server is closing and get a reset")
    allowed_origins: tuple[str, ...] = _f((), "origins (scheme://host[:port]) whose web pages may call this server "
                                          "from a browser (CORS), '*' for any; several as --allowed-origins a b, "
                                          "or vLLM's JSON list '[\"a\", \"b\"]' (default: none; vLLM's is any)")
    allowed_methods: tuple[str, ...] = _f(("*",), "with --allowed-origins: the HTTP methods cross-origin requests "
                                          "may use ('*': any, as vLLM's default)")
    allowed_headers: tuple[str, ...] = _f(("*",), "with --allowed-origins: the request headers cross-origin "
                                          "requests may send ('*': any, as vLLM's default)")
    allow_credentials: bool = _f(False, "with --allowed-origins: let browsers send cookies and HTTP "
                                 "authentication with cross-origin requests (as vLLM's --allow-credentials)")
    ui: WebUi = _f("chat", "the web chat page at / : chat (served, no login of its own: it asks for an API key when "
                 "the server needs one) or none")
    return_tokens_as_token_ids: bool = _f(False, "logprobs name each token 'token_id:N' instead of by its text "
                                          "(vLLM's flag; a request's return_tokens_as_token_ids overrides it)")
    enable_force_include_usage: bool = _f(False, "every streamed completion and chat completion ends with a usage "
                                          "chunk, as if each asked for stream_options.include_usage (vLLM's "
                                          "flag: for gateways that bill by it)")
    responses_store_size: int = _f(1000, "responses of /v1/responses kept in memory for previous_response_id and "
                                   "GET /v1/responses/{id} (the oldest go first; 0: none kept); with "
                                   "--redis-url they are kept in Redis instead, for every replica, bounded by "
                                   "--responses-store-ttl-s")
    responses_store_ttl_s: float = _f(30 * 86400.0, "seconds a stored response is kept (OpenAI's 30 days; 0: until "
                                      "dropped for room)")
    tool_call_parser: ToolCallParser = _f("auto", "auto | hermes | llama3_json | mistral | qwen3_coder | pythonic | "
                                          "phi4_mini_json | granite: how tool calls are read from a chat reply (auto: the "
                                          "format the model's chat template uses, else hermes)")
    reasoning_parser: ReasoningParser = _f("none", "none | deepseek_r1 | qwen3 | mistral | granite: split a thinking model's "
                                           "chat reply into its reasoning (<think>...</think>, Magistral's "
                                           "[THINK]...[/THINK]; returned as message.reasoning and Ollama's "
                                           "thinking) and its content (none: all content)")
    default_chat_template_kwargs: str | None = _f(None, "a JSON object of keyword arguments every chat template "
                                                  "rendering gets, e.g. '{\"enable_thinking\": false}' for Qwen3 "
                                                  "(as vLLM's); a request's chat_template_kwargs win over them")
    uvicorn_log_level: UvicornLogLevel = _f("warning", "critical | error | warning | info | debug | trace: the "
                                            "HTTP server's own log (info adds its start and shutdown lines, debug "
                                            "its connections); the request log is --log-requests")
    disable_fastapi_docs: bool = _f(False, "serve no API documentation: /docs, /redoc and /openapi.json answer 404 "
                                    "(as vLLM's flag)")
    response_role: str = _f("assistant", "the role chat completions give their reply when the request sets "
                            "add_generation_prompt (the default), as vLLM's --response-role; without it the reply "
                            "continues the last message and takes its role")
    trust_request_chat_template: bool = _f(False, "render a chat request's own chat_template (a Jinja template in "
                                           "the body) instead of the model's, as vLLM's flag; without it such a "
                                           "request is a 400. Templates run in transformers' Jinja sandbox, but a "
                                           "template can still loop for long: set it only for trusted clients")
    middleware: tuple[str, ...] = _f((), "ASGI middleware for the HTTP app, each an import path "
                                     "(package.module.Name), as vLLM's --middleware: a class is added with "
                                     "app.add_middleware, an async function (request, call_next) as an HTTP "
                                     "middleware; the first given is the outermost. They run inside the "
                                     "server's gateway, so after its API key checks and rate limits")
    root_path: str = _f("", "the path prefix a reverse proxy serves this server under and strips before "
                        "forwarding, as vLLM's --root-path (e.g. /llm): the web page, /docs and the OpenAPI "
                        "document link through it; routes stay where they are")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        for name in ("served_model_name", "allowed_origins", "allowed_methods", "allowed_headers", "middleware"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, strings(name, value))
        if not self.served_model_name:
            self.served_model_name = None
        names = self.served_model_name or ()
        need(all(n and not any(c.isspace() for c in n) for n in names) and len(set(names)) == len(names),
             "served_model_name", "names with no spaces, each given once")
        if isinstance(self.default_chat_template_kwargs, dict):  # from Python or a config file's mapping
            self.default_chat_template_kwargs = json.dumps(self.default_chat_template_kwargs)
        need(self.default_chat_template_kwargs is None or _json_object(self.default_chat_template_kwargs) is not None,
             "default_chat_template_kwargs", "a JSON object, e.g. '{\"enable_thinking\": false}'")
        reserved = sorted(set(self.chat_template_defaults()) & CHAT_TEMPLATE_ARGUMENTS)
        need(not reserved, "default_chat_template_kwargs", "template variables other than the arguments each request "
             f"sets itself ({', '.join(sorted(CHAT_TEMPLATE_ARGUMENTS))}; not {', '.join(reserved)})")
        need(all(o == "*" or o.startswith(("http://", "https://")) for o in self.allowed_origins),
             "allowed_origins", "origins like http://localhost:3000, or '*'")
        need(bool(self.response_role) and self.response_role.isprintable() and self.response_role.strip() ==
             self.response_role, "response_role", "a role name such as assistant")
        self.root_path = self.root_path.rstrip("/")
        need(not self.root_path or (self.root_path.startswith("/") and "//" not in self.root_path and not any(
            c.isspace() or c in "?#\"'<>" for c in self.root_path)), "root_path",
             "a path such as /llm (a leading /, no spaces, quotes, ? or #)")
        need(all(_IMPORT_PATH.match(m) for m in self.middleware), "middleware",
             "import paths such as my_package.middleware.AddHeader")
        need(self.uds is None or (bool(self.uds) and "\0" not in self.uds and len(self.uds.encode()) < 108),
             "uds", "a socket file path under 108 bytes")
        need(0 <= self.port <= 65535, "port", "in [0, 65535]")
        need(self.grpc_port is None or 0 < self.grpc_port <= 65535, "grpc_port", "in [1, 65535] or None")
        need(self.header_timeout_s >= 0, "header_timeout_s", ">= 0")
        need(self.http_keep_alive_s > 0, "http_keep_alive_s", "> 0")
        need(self.ui in choices(WebUi), "ui", one_of(WebUi))
        need(self.responses_store_size >= 0, "responses_store_size", ">= 0")
        need(self.responses_store_ttl_s >= 0, "responses_store_ttl_s", ">= 0 (0: kept until dropped for room)")
        need(self.max_request_body_bytes >= 1024, "max_request_body_bytes", ">= 1024")
        self._check_tls()
        need(self.tool_call_parser in choices(ToolCallParser), "tool_call_parser", one_of(ToolCallParser))
        need(self.reasoning_parser in choices(ReasoningParser), "reasoning_parser", one_of(ReasoningParser))
        need(self.uvicorn_log_level in choices(UvicornLogLevel), "uvicorn_log_level", one_of(UvicornLogLevel))

    def chat_template_defaults(self) -> dict:
        """default_chat_template_kwargs as a mapping (empty when unset)."""
        return (_json_object(self.default_chat_template_kwargs) or {}) if self.default_chat_template_kwargs else {}

    def _check_tls(self) -> None:
        """HTTPS settings that go together, and files that load (a bad key stops the start, naming it)."""
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need((self.ssl_keyfile is None) == (self.ssl_certfile is None), "ssl_keyfile",
             "given with ssl_certfile (both or neither)")
        need(self.ssl_cert_reqs in (0, 1, 2), "ssl_cert_reqs", "0 (none), 1 (optional) or 2 (required)")
        need(self.ssl_certfile is not None or (self.ssl_ca_certs is None and self.ssl_cert_reqs == 0),
             "ssl_ca_certs", "given only with ssl_certfile and ssl_keyfile (HTTPS)")
        need(self.ssl_cert_reqs == 0 or self.ssl_ca_certs is not None, "ssl_cert_reqs",
             "0 unless ssl_ca_certs names the CAs that client certificates are checked against")
        if self.ssl_certfile is None:
            return
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            need(path is None or Path(path).expanduser().is_file(), name, "a readable PEM file")
        try:
            ctx.load_cert_chain(str(Path(self.ssl_certfile).expanduser()), str(Path(self.ssl_keyfile).expanduser()))
        except (ssl.SSLError, OSError) as e:
            raise ConfigError("ssl_certfile", self.ssl_certfile, f"a PEM certificate matching ssl_keyfile ({e})") \
                from None
        if self.ssl_ca_certs is not None:
            try:
                ctx.load_verify_locations(str(Path(self.ssl_ca_certs).expanduser()))
            except (ssl.SSLError, OSError) as e:
                raise ConfigError("ssl_ca_certs", self.ssl_ca_certs, f"PEM CA certificates ({e})") from None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


@dataclass
class OipConfig:
    """Open Inference Protocol models: how their requests are batched and queued."""

    oip_batch_window_ms: float = _f(2.0, "Open Inference Protocol models: how long a batch's first request waits "
                                    "for others (0: no wait); a version's label batch_window_ms overrides it")
    oip_max_batch_size: int = _f(64, "Open Inference Protocol models: most rows in one batch (label "
                                 "max_batch_size overrides it)")
    oip_max_queue: int = _f(256, "Open Inference Protocol models: most requests waiting per model; more get 503 "
                            "(label max_queue overrides it)")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.oip_batch_window_ms >= 0, "oip_batch_window_ms", ">= 0")
        need(self.oip_max_batch_size >= 1 and self.oip_max_queue >= 1, "oip_max_batch_size", ">= 1 (and "
             "oip_max_queue >= 1)")


@dataclass
class EmbeddingConfig:
    """The embedding model of /v1/embeddings and how its batches form."""

    embedding_model: str = _f("default", "the embedding model, a cross-encoder reranker or a classifier: a folder or "
                              "a Hugging Face repo id (as MODEL), 'default' (the packaged all-MiniLM-L6-v2 if "
                              "installed) or 'none'")
    embedding_batch_window_ms: float = _f(5.0, "how long the embedding batcher waits for more texts")
    embedding_max_batch_size: int = _f(32, "most texts in one embedding batch")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.embedding_batch_window_ms >= 0, "embedding_batch_window_ms", ">= 0")
        need(self.embedding_max_batch_size >= 1, "embedding_max_batch_size", ">= 1")


@dataclass
class LifecycleConfig:
    """Starting, draining, loading on demand and unloading models."""

    drain_timeout: float = _f(30.0, "on SIGTERM, seconds to let in-flight requests finish before exiting")
    swap_drain_timeout_s: float = _f(600.0, "on a swap, scale-down or unload, seconds the old workers may take to "
                                     "finish their in-flight requests before they are stopped (those left "
                                     "then end with an error)")
    engine_start_timeout_s: float = _f(600.0, "seconds the engine may take to load and warm up before the start "
                                       "is given up (0: no limit); meanwhile its progress is logged")
    load_on_demand: bool = _f(True, "with a registry: a request naming a registered version that no deployment "
                              "serves loads it first (the wait is in the x-servelm-load-wait-s header)")
    keep_alive_s: float = _f(300.0, "an on-demand loaded model is unloaded after this many idle seconds (0: kept)")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.drain_timeout >= 0, "drain_timeout", ">= 0")
        need(self.swap_drain_timeout_s >= 0, "swap_drain_timeout_s", ">= 0")
        need(self.engine_start_timeout_s >= 0, "engine_start_timeout_s", ">= 0 (0: no limit)")
        need(self.keep_alive_s >= 0, "keep_alive_s", ">= 0 (0: kept loaded)")


@dataclass
class AuthConfig:
    """Who may call: the API keys, the admin key, and what is shared between keys."""

    api_key: str | None = _f(None, "one API key every caller must present (Bearer or x-api-key); as a flag it is "
                             "visible in the process list: prefer --api-key-file or SERVELM_API_KEY")
    api_key_file: str | None = _f(None, "file holding the one API key (instead of --api-key)")
    api_keys_file: str | None = _f(None, "YAML/JSON file of API keys: name, key or key_hash, rpm, tpm, "
                                   "priority, models, allow_priority_raise, admin, groups")
    admin_key: str | None = _f(None, "key that guards /admin routes (keys marked admin in the keys file also work); "
                               "prefer --admin-key-file or SERVELM_ADMIN_KEY")
    admin_key_file: str | None = _f(None, "file holding the admin key (instead of --admin-key)")
    metrics_require_key: bool = _f(False, "require an API key for GET /metrics")
    prefix_cache_isolation: PrefixCacheIsolation = _f("key", "key | none: with key, requests share prefix-cache blocks only "
                                     "with requests made with the same API key (one tenant cannot time-probe "
                                     "another's prompts); none shares them across all callers")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        for name in SECRETS:
            path = getattr(self, f"{name}_file")
            if path is not None:
                need(getattr(self, name) is None, f"{name}_file", f"not given together with {name}")
                need(Path(path).is_file(), f"{name}_file", "an existing file holding the key")
            key = self.secret(name)
            if key is not None and (len(key) < 8 or any(c.isspace() for c in key)):
                raise ConfigError(name, "<redacted>", "at least 8 characters, with no spaces or line breaks")
        need(self.api_keys_file is None or Path(self.api_keys_file).is_file(), "api_keys_file", "an existing file")
        need(self.prefix_cache_isolation in choices(PrefixCacheIsolation), "prefix_cache_isolation",
             one_of(PrefixCacheIsolation))

    def secret(self, name: str) -> str | None:
        """api_key or admin_key: as given, or read from its *_file (surrounding whitespace dropped)."""
        path = getattr(self, f"{name}_file")
        return Path(path).read_text().strip() if path is not None else getattr(self, name)


@dataclass
class StorageConfig:
    """Where the control plane keeps its state: the data directory, the database, Redis, and the folders models may be registered from."""

    data_dir: str | None = _f(None, "directory holding the model registry and its artifact store (default: "
                              "$XDG_DATA_HOME/servelm or ~/.local/share/servelm); setting it (or declaring "
                              "models in the config file) turns on the registry and the /admin model routes")
    database_url: str | None = _f(None, "SQLAlchemy URL of the control-plane database (model registry, audit "
                                  "trail, traffic policies, canary and experiment state, prediction log), e.g. "
                                  "postgresql+psycopg://USER:PASSWORD@HOST/DB to share one between servers (the "
                                  "postgres extra); default: SQLite in the data directory")
    registry_url: str | None = _f(None, "the older name of database_url (same meaning; give one of the two)")
    registry_refresh_s: float = _f(5.0, "how often each model's PRODUCTION version is re-read from the database, "
                                   "so a promotion or rollback made by another server sharing it is followed "
                                   "(0: only this server's own changes)")
    database_auto_upgrade: bool = _f(True, "at start, migrate the database's schema to this version's (as "
                                     "`servelm db upgrade`); with --no-database-auto-upgrade a server facing an "
                                     "older schema refuses to start, naming that command")
    redis_url: str | None = _f(None, "Redis URL, e.g. redis://HOST:6379/0: per-key rate limits and token quotas "
                               "are kept there, shared by every server using it, so a key gets its limit once "
                               "across replicas (the redis extra); default: in this process's memory")
    redis_timeout_s: float = _f(0.5, "with redis_url: how long one rate-limit call may wait for Redis before it "
                                "counts as down (connect and reply)")
    model_roots: str | None = _f(None, "directories (separated by ':') under which POST /admin/models may register "
                                 "model folders and files, besides the folders of the models the server was "
                                 "started with and the packaged defaults; any other path gets 403")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.database_url is None or self.registry_url is None or self.database_url == self.registry_url,
             "registry_url", "unset when database_url is set (registry_url is its older name)")
        need(self.redis_url is None or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
             "redis_url", "a redis://, rediss:// or unix:// URL")
        need(self.redis_timeout_s > 0, "redis_timeout_s", "> 0")
        need(self.registry_refresh_s >= 0, "registry_refresh_s", ">= 0 (0: only this server's own changes)")

    def database(self) -> str | None:
        """The control-plane database's URL: database_url, else its older name registry_url (None: SQLite in
        the data directory)."""
        return self.database_url or self.registry_url

    def data_path(self) -> Path:
        """The data directory: data_dir, else $XDG_DATA_HOME/servelm, else ~/.local/share/servelm."""
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        xdg = env_vars.xdg_data_home()
        return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "servelm"


@dataclass
class RolloutConfig:
    """Deployments and traffic: deployment specs and the reconciler, shadow traffic, canaries, saved traffic state and the webhook told of rollbacks and alerts."""

    deployment_spec: str | None = _f(None, "with a registry: a YAML or JSON file of deployment specs (one, a list, "
                                     "or {deployments: [...]}) applied at start, as `servelm apply -f` would; the "
                                     "reconciler then drives the deployments to them")
    reconcile_interval_s: float = _f(5.0, "how often the reconciler compares every deployment spec with what is "
                                     "deployed and acts (it also runs at once after a spec changes)")
    traffic_state_interval_s: float = _f(10.0, "how often running canary and experiment windows and bandit "
                                         "posteriors are saved to the registry database (and at shutdown), so a "
                                         "restart carries on from them; at most this much is lost in a crash "
                                         "(0: only at shutdown)")
    shadow_queue: int = _f(64, "mirrored (shadow) requests waiting at most, per model; more are dropped and counted")
    shadow_concurrency: int = _f(1, "shadow requests run at once, per model")
    canary_interval_s: float = _f(1.0, "how often a running canary's step is evaluated")
    webhook_url: str | None = _f(None, "with a registry: URL the server POSTs a JSON event to on a canary "
                                 "rollback, a canary promotion that failed, and a drift alert that starts")
    webhook_timeout_s: float = _f(2.0, "timeout of one webhook delivery attempt")
    webhook_retries: int = _f(2, "webhook delivery attempts after the first, with exponential backoff")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.shadow_queue >= 1 and self.shadow_concurrency >= 1, "shadow_queue", ">= 1 (and concurrency >= 1)")
        need(self.canary_interval_s > 0, "canary_interval_s", "> 0")
        need(self.reconcile_interval_s > 0, "reconcile_interval_s", "> 0")
        need(self.webhook_url is None or self.webhook_url.startswith(("http://", "https://")), "webhook_url",
             "an http:// or https:// URL")
        need(self.webhook_timeout_s > 0 and self.webhook_retries >= 0, "webhook_timeout_s",
             "> 0 (and webhook_retries >= 0)")
        need(self.traffic_state_interval_s >= 0, "traffic_state_interval_s", ">= 0 (0: only at shutdown)")


@dataclass
class ObservabilityConfig:
    """What the server records: request logs, traces, the prediction log and drift detection."""

    log_requests: bool = _f(True, "one JSON log line per request at completion")
    log_prompts: bool = _f(False, "include prompt and completion text in the request log lines")
    max_log_len: int | None = _f(None, "with --log-prompts: the most characters of the prompt and of the completion "
                                 "a request log line holds (as vLLM's; None: all of them)")
    otlp_endpoint: str | None = _f(None, "OTLP/HTTP collector, e.g. http://localhost:4318/v1/traces: turns "
                                   "on OpenTelemetry tracing")
    otlp_service_name: str = _f("servelm", "service.name of the exported spans")
    metric_names: MetricNames = _f("servelm", "servelm | vllm: the names of the engine and request metrics on "
                                   "/metrics; vllm gives them vLLM's (vllm:num_requests_waiting, "
                                   "vllm:kv_cache_usage_perc, ...) for autoscalers, routers and dashboards built for "
                                   "vLLM; the platform's own metrics keep servelm: names")
    prediction_log: str = _f("off", "with a registry: the prediction log's mode, off | metadata | full (prompt and "
                             "output, redacted), for every model or per model: 'm=full,other=off,*=metadata'")
    prediction_log_file: str | None = _f(None, "also append prediction-log entries to this JSON-lines file")
    prediction_log_otlp_endpoint: str | None = _f(None, "also export each prediction-log entry as an "
                                                  "OpenTelemetry log record to this OTLP/HTTP endpoint, e.g. "
                                                  "http://localhost:4318/v1/logs (asynchronous, batched)")
    prediction_log_retention_days: float = _f(0.0, "delete prediction-log entries older than this many days "
                                              "(hourly; 0: keep them)")
    drift_window: int = _f(5000, "requests in each drift window (reference and live), per model")
    drift_min_samples: int = _f(50, "requests each drift window needs before a feature is judged")
    drift_embedding_sample: float = _f(0.05, "share of prompts embedded (by the served embedding model, off the "
                                       "request path) for prompt-embedding drift (MMD); 0 turns it off")
    drift_check_interval_s: float = _f(60.0, "how often every model's drift (data, concept, embedding) is "
                                       "evaluated in the background, so alerts fire unasked (0: only on request)")

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(all(m.rpartition("=")[2].strip() in ("off", "metadata", "full")
                 for m in self.prediction_log.split(",") if m.strip()), "prediction_log",
             "off | metadata | full, or model=mode pairs separated by commas")
        need(self.prediction_log_retention_days >= 0, "prediction_log_retention_days", ">= 0 (0: kept)")
        need(self.drift_window >= 2 and self.drift_min_samples >= 2, "drift_window", ">= 2 (and min samples >= 2)")
        need(0 <= self.drift_embedding_sample <= 1, "drift_embedding_sample", "in [0, 1]")
        need(self.prediction_log_otlp_endpoint is None
             or self.prediction_log_otlp_endpoint.startswith(("http://", "https://")),
             "prediction_log_otlp_endpoint", "an http:// or https:// URL")
        need(self.drift_check_interval_s >= 0, "drift_check_interval_s", ">= 0 (0: only on request)")
        need(self.metric_names in choices(MetricNames), "metric_names", one_of(MetricNames))
        need(self.max_log_len is None or self.max_log_len >= 0, "max_log_len", ">= 0 or None (all of the text)")


SERVER_SECTIONS: dict[str, type] = {
    "api": ApiConfig,
    "oip": OipConfig,
    "embedding": EmbeddingConfig,
    "lifecycle": LifecycleConfig,
    "auth": AuthConfig,
    "storage": StorageConfig,
    "rollout": RolloutConfig,
    "observability": ObservabilityConfig,
}


@dataclass(init=False)
class ServerConfig(SectionedConfig):
    """Everything `servelm serve` accepts about the server besides admission, in sections
    (`config.server.api_config.port`), built from flat names (`ServerConfig(port=8080)`, `--port`,
    SERVELM_PORT) as SectionedConfig says."""

    SECTIONS: typing.ClassVar[dict[str, type]] = SERVER_SECTIONS
    FIELDS: typing.ClassVar[dict[str, str]] = section_map(SERVER_SECTIONS)

    api_config: ApiConfig
    oip_config: OipConfig
    embedding_config: EmbeddingConfig
    lifecycle_config: LifecycleConfig
    auth_config: AuthConfig
    storage_config: StorageConfig
    rollout_config: RolloutConfig
    observability_config: ObservabilityConfig

    def database(self) -> str | None:
        return self.storage_config.database()

    def secret(self, name: str) -> str | None:
        return self.auth_config.secret(name)

    def data_path(self) -> Path:
        return self.storage_config.data_path()


@dataclass
class AdmissionConfig:
    """What the API admits and when it sheds load; all of it can change at run time."""

    # with a queue timeout, about capacity x queue_timeout_s: more queued requests than the server can start before
    # the timeout only wait to get 408 (the default model on 2 cores: ~3.75 req/s x 30 s = ~110)
    queue_high_watermark: int = _f(128, "queued requests at which new ones get 503", runtime=True)
    queue_low_watermark: int = _f(64, "after shedding, admit again once the queue is below this", runtime=True)
    queue_timeout_s: float = _f(0.0, "a request with no first token after this long is removed (408); 0 (the "
                                "default, as vLLM): none, since a request that waits is one the server will "
                                "serve, and a client that gives up disconnects, which aborts it", runtime=True)
    rate_limit_rpm: int | None = _f(None, "requests per minute per key, for keys without their own limit",
                                    runtime=True)
    rate_limit_tpm: int | None = _f(None, "tokens (prompt + max_tokens) per minute per key, for keys without "
                                    "their own limit", runtime=True)
    default_priority: Priority = _f("normal", "priority of requests whose key sets none: high | normal | low",
                               runtime=True)
    max_n: int = _f(16, "most samples (n) one generation request may ask for (400 above)", runtime=True)
    max_request_tokens: int | None = _f(None, "most tokens one generation request may ask for: its prompt tokens "
                                        "plus n x max_tokens, over all its prompts (400 above); a request that "
                                        "omits max_tokens gets a default that fits (default: the model's "
                                        "max_model_len x max_n, which admits every single-prompt request whose "
                                        "samples fit the context)", runtime=True)
    rate_limit_fail_open: bool = _f(False, "while the rate-limit store (Redis) cannot be reached: false refuses "
                                    "requests that a limit applies to with 503 (no key can go over its limit); "
                                    "true admits them unlimited and logs a warning", runtime=True)
    auth_failures_per_minute: int | None = _f(10, "failed authentications (a wrong API key) allowed per client "
                                              "address per minute; beyond, that address gets 429 (None: no limit)",
                                              runtime=True)
    max_embedding_inputs: int = _f(2048, "most inputs in one embedding request (400 above)", runtime=True)

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            require(self, ok, name, allowed)

        need(self.queue_high_watermark >= 1, "queue_high_watermark", ">= 1")
        need(0 <= self.queue_low_watermark <= self.queue_high_watermark, "queue_low_watermark",
             f"in [0, queue_high_watermark={self.queue_high_watermark}]")
        need(self.queue_timeout_s >= 0, "queue_timeout_s", ">= 0 (0: none)")
        need(self.rate_limit_rpm is None or self.rate_limit_rpm >= 1, "rate_limit_rpm", ">= 1 or None")
        need(self.rate_limit_tpm is None or self.rate_limit_tpm >= 1, "rate_limit_tpm", ">= 1 or None")
        need(self.default_priority in PRIORITIES, "default_priority", one_of(Priority))
        need(self.auth_failures_per_minute is None or self.auth_failures_per_minute >= 1,
             "auth_failures_per_minute", ">= 1 or None")
        for cap in ("max_n", "max_embedding_inputs"):
            need(getattr(self, cap) >= 1, cap, ">= 1")
        need(self.max_request_tokens is None or self.max_request_tokens >= 1, "max_request_tokens",
             ">= 1 or None (the model's max_model_len x max_n)")

    def request_token_cap(self, max_model_len: int) -> int:
        """max_request_tokens for a model with this context length: as set, else max_model_len x max_n."""
        return self.max_request_tokens if self.max_request_tokens is not None else max_model_len * self.max_n


# The serve config tree: the engine (its sections), the server (its sections) and admission (one section). Every
# section has a name unique across the tree (the config file's section, --help's group, the first part of a source
# key "section.field"), and every field a flat name unique across the tree (its env var SERVELM_<FIELD> and its
# --flag, as before the split), so a flat name says which section it sets.
GROUPS: dict[str, type] = {"engine": EngineConfig, "server": ServerConfig}
SECTIONS: dict[str, type] = {**ENGINE_SECTIONS, **SERVER_SECTIONS, "admission": AdmissionConfig}
GROUP_OF: dict[str, str] = {sec: group for group, cls in GROUPS.items() for sec in cls.SECTIONS} | {
    "admission": "admission"}
FIELDS: dict[str, str] = section_map(SECTIONS)  # flat name -> section name
# integer fields that also take vLLM's 32k / 32K forms, in files and env vars as on the command line
TOKEN_COUNTS = frozenset(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)
                         if f.metadata.get("token_count"))


@dataclass
class ServeConfig:
    engine: EngineConfig
    server: ServerConfig
    admission: AdmissionConfig
    sources: dict[str, str]  # "section.field" -> default | file | env | cli | runtime
    models: list[ModelSpec] = dataclasses.field(default_factory=list)  # the config file's `models:` list

    @property
    def control_plane(self) -> bool:
        """Whether the server keeps a model registry: models declared in the file, or a data dir or registry
        URL given. Without, `servelm serve MODEL` runs as it always has, writing nothing."""
        return bool(self.models) or self.sources["storage.data_dir"] != "default" or \
            self.server.database() is not None

    def section(self, name: str):
        """The section called `name` (cache, api, admission, ...), wherever in the tree it is."""
        group = GROUP_OF[name]
        return self.admission if group == "admission" else getattr(self, group).section(name)

    def to_dict(self) -> dict:
        return {sec: dataclasses.asdict(self.section(sec)) for sec in SECTIONS}

    def describe(self) -> dict:
        """The effective config by section, each value with where it came from (and the declared models, if
        any)."""
        out = {sec: {k: {"value": "<redacted>" if k in REDACTED and v is not None else
                          redact_url(v) if k in URL_SECRETS else v,
                          "source": self.sources[f"{sec}.{k}"],
                          "runtime": _field(sec, k).metadata.get("runtime", False)}
                      for k, v in vals.items()} for sec, vals in self.to_dict().items()}
        if self.models:
            out["models"] = [m.to_dict() for m in self.models]
        return out

    def patch(self, changes: dict) -> dict:
        """Apply run-time changes, all or nothing: {field: value}, {section: {field: value}}, or the older
        {engine|server: {field: value}}.

        Returns {"section.field": new value}. Raises ConfigError naming the first bad key or value.
        """
        flat = {}
        for k, v in changes.items():
            if (k in SECTIONS or k in GROUPS) and isinstance(v, dict):
                flat.update({(_section_in(k, f), f): x for f, x in v.items()})
            else:
                flat[(_section_of(k), k)] = v
        updates: dict[str, dict] = {}
        for (sec, name), value in flat.items():
            f = _field(sec, name)
            if not f.metadata.get("runtime"):
                raise ConfigError(f"{sec}.{name}", value, "changed only at start-up (not a run-time setting)")
            updates.setdefault(GROUP_OF[sec], {})[name] = _coerce(f"{sec}.{name}", value, _hints(sec)[name])
        new = {}
        for group, vals in updates.items():
            try:
                if group == "admission":
                    new[group] = dataclasses.replace(self.admission, **vals)
                    new[group].validate()
                else:
                    new[group] = getattr(self, group).replace(**vals)  # validates every section
            except ConfigError as e:
                raise _located(e, "runtime") from None
        for group, obj in new.items():
            setattr(self, group, obj)
        applied = {}
        for vals in updates.values():
            for name in vals:
                sec = FIELDS[name]
                self.sources[f"{sec}.{name}"] = "runtime"
                applied[f"{sec}.{name}"] = getattr(self.section(sec), name)
        return applied


def redact_url(url: str | None) -> str | None:
    """`url` with its password (if any) replaced by ***: what may be printed or logged."""
    if not url:
        return url
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def env_var(name: str) -> str:
    return "SERVELM_" + name.upper()


def all_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) for every field of the tree, section by section."""
    return [(sec, f) for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def load(cli: dict | None = None, env: dict | None = None, file: str | None = None) -> ServeConfig:
    """Merge defaults < file < env < cli; validate; raise ConfigError naming key, value and source."""
    env = env_vars.settings_values() if env is None else env
    cli = cli or {}
    file = file or env.get("SERVELM_CONFIG")
    values: dict[str, dict] = {sec: {} for sec in SECTIONS}
    sources = {f"{sec}.{f.name}": "default" for sec, f in all_fields()}
    models: list[ModelSpec] = []
    if file:
        for sec, name, value in _read_file(file):
            if sec == "models":
                models = parse_models(value, f"file {file}")
                continue
            values[sec][name] = _coerce(f"{sec}.{name}", value, _hints(sec)[name], f"file {file}")
            sources[f"{sec}.{name}"] = "file"
    for sec, f in all_fields():
        var = env_var(f.name)
        if var in env:
            values[sec][f.name] = _coerce(f"{sec}.{f.name}", env[var], _hints(sec)[f.name], f"env {var}")
            sources[f"{sec}.{f.name}"] = "env"
    for name, value in cli.items():
        sec = _section_of(name)
        values[sec][name] = value  # typed by argparse already; several values are normalized by validate()
        sources[f"{sec}.{name}"] = "cli"
    built = {group: _build(cls, values, sources) for group, cls in GROUPS.items()}
    admission = _build(AdmissionConfig, values, sources)
    return ServeConfig(sources=sources, models=models, admission=admission, **built)


def _build(cls: type, values: dict, sources: dict):
    """A group (EngineConfig, ServerConfig: from its sections) or the admission section, validated."""
    try:
        if issubclass(cls, SectionedConfig):
            return cls(**{f"{sec}_config": sc(**values[sec]) for sec, sc in cls.SECTIONS.items()})
        obj = cls(**values["admission"])
        obj.validate()
        return obj
    except ConfigError as e:
        raise _located(e, sources.get(f"{FIELDS.get(e.key)}.{e.key}", "default")) from None


def _located(e: ConfigError, source: str) -> ConfigError:
    """The error with its key as "section.field" and where the value came from."""
    where = {"env": f"env {env_var(e.key)}", "cli": f"--{e.key.replace('_', '-')}"}.get(source, source)
    key = f"{FIELDS[e.key]}.{e.key}" if e.key in FIELDS else e.key
    return ConfigError(key, e.value, f"{e.allowed} (set by {where})")


def _read_file(path: str):
    """(section, field, value) for each setting in the file, and ("models", "models", list) for its models.
    A setting is written under its section (`cache: {block_size: 32}`) or, as before the sections, flat under
    engine or server (`engine: {block_size: 32}`); both forms may be mixed, but one setting given twice with
    different values is refused."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", path, "an existing YAML, JSON or TOML file")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as e:
        raise ConfigError("config", path, f"valid {p.suffix.lstrip('.') or 'YAML'} ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError("config", path, "a mapping of sections (" + ", ".join([*SECTIONS, *GROUPS]) + ", models)")
    seen: dict[str, tuple[str, object]] = {}
    for group, vals in data.items():
        if group == "models":
            yield "models", "models", vals
            continue
        if (group not in SECTIONS and group not in GROUPS) or not isinstance(vals, dict):
            raise ConfigError(f"config section {group!r}", vals, "one of " + ", ".join(SECTIONS) + " (or engine "
                              "or server, holding their fields flat) holding a mapping, or models holding a list")
        for name, value in vals.items():
            sec = _section_in(group, name)
            if name in seen and seen[name][1] != value:
                raise ConfigError(f"{sec}.{name}", value, f"given once, or the same in both places (the file's "
                                  f"{seen[name][0]} section says {seen[name][1]!r})")
            seen[name] = (group, value)
            yield sec, name, value


def _field(sec: str, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(SECTIONS[sec]):
        if f.name == name:
            return f
    raise ConfigError(f"{sec}.{name}", name, f"a known key of [{sec}]")


def _section_in(where: str, name: str) -> str:
    """The section of field `name` written under `where`: a section, which must hold it, or a group (engine,
    server), whose sections one must."""
    if where in GROUPS:
        if name not in GROUPS[where].FIELDS:
            raise ConfigError(f"{where}.{name}", name, f"a known key of [{where}]" + _lives_in(name))
        return GROUPS[where].FIELDS[name]
    if FIELDS.get(name) != where:
        raise ConfigError(f"{where}.{name}", name, f"a known key of [{where}]" + _lives_in(name))
    return where


def _lives_in(name: str) -> str:
    return f" ({name} is in [{FIELDS[name]}])" if name in FIELDS else ""


def _section_of(name: str) -> str:
    if name in FIELDS:
        return FIELDS[name]
    raise ConfigError(name, name, "a known config key")


def _hints(sec: str) -> dict:
    return typing.get_type_hints(SECTIONS[sec])


def strings(key: str, value) -> tuple[str, ...]:
    """A field of several strings from a list, a JSON list ('["a", "b"]', as vLLM's --allowed-origins takes), or
    a string of comma-separated values; a list's items may be either kind of string (--flag a,b c)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError:
                raise ConfigError(key, value, "a JSON list of strings, or values separated by commas") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ConfigError(key, value, "a JSON list of strings, or values separated by commas")
            return tuple(i.strip() for i in items if i.strip())
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(i, str) for i in value):
        return tuple(x for i in value for x in strings(key, i))
    raise ConfigError(key, value, "a list of strings, or a string of values separated by commas")


def _coerce(key: str, value, tp, source: str = "runtime"):
    """Turn a file/env/JSON value into the field's type, or raise ConfigError."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), tp) if args else tp
    name = key.rpartition(".")[2]
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(key, value, f"{_type_name(base)} (from {source})")
    if choices(base) is not None:  # one of a few names: checked against them by the section's validation
        if not isinstance(value, str):
            raise ConfigError(key, value, f"{_type_name(base)} (from {source})")
        return value.strip()
    if typing.get_origin(base) is tuple:
        try:
            return strings(key, value)
        except ConfigError as e:
            raise ConfigError(key, value, f"{e.allowed} (from {source})") from None
    if base is int and name in TOKEN_COUNTS and isinstance(value, str):
        try:
            return token_count(value, auto=optional)
        except ValueError as e:
            raise ConfigError(key, value, f"an integer like 32000, 32k or 32K ({e}; from {source})") from None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            if not -2**63 <= int(value) < 2**63:  # what the engine's messages (and any sane setting) hold
                raise ConfigError(key, value, f"an integer in [-2**63, 2**63) (from {source})")
            return int(value)
        if base is float:
            if isinstance(value, bool) or not math.isfinite(float(value)):
                raise ValueError
            return float(value)
        return json.dumps(value) if isinstance(value, dict) else str(value)  # a mapping: JSON text (the CLI's form)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        raise ConfigError(key, value, f"{_TYPE_NAMES[base]} (from {source})") from None


_TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a finite number", str: "a string"}


def _type_name(tp) -> str:
    return f"one of {one_of(tp)}" if choices(tp) is not None else _TYPE_NAMES.get(tp, "a list of strings")
