"""Admission: may this request enter the engine now, and at what priority?

Every API call counts against the key's requests per minute (`take_request`, from the gateway). A
generation request then passes, in order: the key may use the model (403), the requested priority is
allowed (403), the queue is not over its watermark (503, with hysteresis between the high and low
watermarks), and the key's tokens per minute have room for prompt + max_tokens (429). Every check reads the live
config, so PATCH /admin/config applies to the next request.

The queue a watermark is held against counts every admitted request that has no output yet, from the moment
`admit` returns: a burst's requests are counted one by one as they pass, not once they reach the engine (which
is after an await, by when a thousand of them could have passed a check that saw an empty queue).
"""

from __future__ import annotations

import contextlib
import logging
import time

from servelm.config.settings import PRIORITIES, ServeConfig
from servelm.server.middleware.auth import ApiKey
from servelm.server.middleware.ratelimit import (
    InMemoryRateLimitStore,
    Limits,
    RateLimitStore,
    RateLimitUnavailable,
)
from servelm.server.observability.telemetry import RequestRecord
from servelm.server.openai.protocol import APIError

logger = logging.getLogger("servelm.server")
FAIL_OPEN_WARN_S = 10.0  # with rate_limit_fail_open: one warning per this long while the store is down


class Admission:
    def __init__(self, config: ServeConfig, metrics, queue_depth, store: RateLimitStore | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.queue_depth = queue_depth  # () -> requests in the engine with no output yet (the default model's)
        self.store = store or InMemoryRateLimitStore()
        self._shedding: dict[str | None, bool] = {}  # per model: each has its own queue and watermarks' state
        self._waiting: dict[str, int] = {}  # per model: admitted requests with no output yet
        self._warned_open = 0.0  # when the last fail-open warning was logged

    @property
    def shedding(self) -> bool:
        """Whether new generation requests are being refused (for any model) until its queue drains."""
        return any(self._shedding.values())

    def limits(self, key: ApiKey | None) -> Limits:
        a = self.config.admission
        if key is None:
            return Limits(a.rate_limit_rpm, a.rate_limit_tpm)
        return Limits(key.rpm if key.rpm is not None else a.rate_limit_rpm,
                      key.tpm if key.tpm is not None else a.rate_limit_tpm)

    def priority(self, key: ApiKey | None, requested: str | int | None) -> int:
        base = PRIORITIES.index((key.priority if key else None) or self.config.admission.default_priority)
        if requested is None:
            return base
        want = requested if isinstance(requested, int) else PRIORITIES.index(requested)
        if want < base and not (key and key.allow_priority_raise):
            raise APIError(403, f"this key may not raise priority above {PRIORITIES[base]!r}", "priority",
                           "priority_not_allowed")
        return want

    def default_max_tokens(self, prompt_tokens: int, n: int, context_left: int, max_model_len: int) -> int:
        """max_tokens for a request that gives none: the rest of the context, but no more than lets the request
        fit max_request_tokens (when it is set lower than the model's max_model_len x max_n, n=16 without
        max_tokens does not ask for 16 whole contexts)."""
        fits = (self.config.admission.request_token_cap(max_model_len) - prompt_tokens) // max(1, n)
        return max(1, min(context_left, fits))

    def check_work(self, n: int, prompt_tokens: int, cost: int, max_model_len: int) -> None:
        """Refuse (400) a request over the per-request caps: n, and prompt + n x max_tokens over its prompts
        (max_request_tokens, by default the model's max_model_len x max_n)."""
        a = self.config.admission
        if n > a.max_n:
            raise APIError(400, f"n={n} is over this server's limit of {a.max_n} samples per request "
                                "(admission.max_n)", "n", "limit_exceeded")
        cap = a.request_token_cap(max_model_len)
        if cost > cap:
            why = "admission.max_request_tokens" if a.max_request_tokens is not None else \
                f"admission.max_request_tokens, by default max_model_len {max_model_len} x max_n {a.max_n}"
            raise APIError(400, f"this request asks for up to {cost} tokens ({prompt_tokens} prompt tokens plus "
                                f"n x max_tokens = {cost - prompt_tokens}), over this server's limit of "
                                f"{cap} tokens per request ({why}); lower max_tokens or n", "max_tokens",
                           "limit_exceeded")

    def admit(self, rec: RequestRecord, model: str, tokens: int, requested_priority: str | int | None,
              queue_depth=None, metrics=None) -> int:
        """Check a generation request costing `tokens` (prompt + max_tokens); returns its engine priority.
        `queue_depth` and `metrics` are the model's own (default: the server's default model's). A key limited
        to some models may use `name` for any of its versions (`name:version`)."""
        rec.model = model
        key = rec.api_key
        check_model(key, model)
        prio = self.priority(key, requested_priority)
        rec.priority = PRIORITIES[prio]
        held = rec.waiting_for == model  # its place taken before its text work (hold_place)
        if not held:
            self._refuse_when_shedding(model, queue_depth, metrics)
        limits = self.limits(key)
        if limits.tpm is not None and self._take(rec, limits, 0, tokens):
            rec.reserved_tokens = tokens  # given back in part at the end (not when none was taken: fail-open)
        if not held:
            self._count(rec, model)  # no await since the check: the count is exact
        return prio

    def hold_place(self, rec: RequestRecord, model: str, queue_depth=None, metrics=None) -> None:
        """Take a generation request's place in `model`'s queue before its text work (tokenizing, the chat
        template), which runs one request at a time: in a burst the requests still waiting for the tokenizer count
        against the watermark too, so the ones beyond it are answered 503 at once instead of after the tokenizer's
        queue. `admit` then checks the rest and counts it no second time; the place is given back at its first
        output or its end (`started`, `settle`)."""
        if rec.waiting_for != model:
            self._refuse_when_shedding(model, queue_depth, metrics)
            self._count(rec, model)

    def _refuse_when_shedding(self, model: str, queue_depth=None, metrics=None) -> None:
        """503 with Retry-After while `model`'s queue is at its high watermark, until it is back below the low one."""
        a = self.config.admission
        depth = max((queue_depth or self.queue_depth)(), self._waiting.get(model, 0))
        shedding = self._shedding.get(model, False)
        if shedding and depth < a.queue_low_watermark:
            shedding = False
        elif not shedding and depth >= a.queue_high_watermark:
            shedding = True
        self._shedding[model] = shedding
        if shedding:
            (metrics or self.metrics).backpressure.inc()
            raise APIError(503, f"the server is overloaded ({depth} requests queued); retry later", code="overloaded",
                           headers={"Retry-After": "1"})

    def _count(self, rec: RequestRecord, model: str) -> None:
        self._waiting[model] = self._waiting.get(model, 0) + 1
        rec.waiting_for = model

    def started(self, rec: RequestRecord) -> None:
        """The request has its first output, or has ended without one: it no longer counts as queued."""
        if rec.waiting_for is not None:
            model, rec.waiting_for = rec.waiting_for, None
            self._waiting[model] -= 1

    def num_waiting(self, model: str) -> int:
        """Admitted requests for `model` with no output yet."""
        return self._waiting.get(model, 0)

    def take_request(self, rec: RequestRecord) -> None:
        """Count one API call against the caller's requests-per-minute (429 when over)."""
        limits = self.limits(rec.api_key)
        if limits.rpm is not None:
            self._take(rec, limits, 1, 0)

    def _take(self, rec: RequestRecord, limits: Limits, requests: int, tokens: int) -> bool:
        """Take from the key's buckets (429 when they lack room); False when nothing could be taken because
        the store is down and rate_limit_fail_open admits the request anyway."""
        try:
            d = self.store.acquire(rec.key_name, limits, requests, tokens)
        except RateLimitUnavailable as e:
            self._unavailable(e)
            return False
        if not d.allowed:
            self.metrics.rate_limited.labels(rec.key_name, d.reason).inc()
            what, limit = ("requests", limits.rpm) if d.reason == "requests" else ("tokens", limits.tpm)
            extra = f"; this request needs {tokens} tokens" if d.reason == "tokens" else ""
            raise APIError(429, f"rate limit reached for {what} per minute (limit {limit}{extra}); retry in "
                                f"{d.retry_after:.1f}s", code="rate_limit_exceeded", headers=d.headers())
        return True

    def _unavailable(self, e: RateLimitUnavailable) -> None:
        """The shared store is down: refuse (503, the default: no key can exceed its limit meanwhile), or with
        rate_limit_fail_open admit the request unlimited, saying so in the log."""
        if not self.config.admission.rate_limit_fail_open:
            raise APIError(503, f"rate limits cannot be checked now: {e}; retry later", code="rate_limit_unavailable",
                           headers={"Retry-After": "1"})
        now = time.monotonic()
        if now - self._warned_open >= FAIL_OPEN_WARN_S:
            self._warned_open = now
            logger.warning("admitting requests without rate limits (admission.rate_limit_fail_open): %s", e)

    def settle(self, rec: RequestRecord) -> None:
        """At the end of a request: it no longer counts as queued, and the key gets back the tokens it reserved
        but did not use."""
        self.started(rec)
        if rec.reserved_tokens:
            used = rec.prompt_tokens + rec.completion_tokens
            # with the store down the tokens stay taken: they refill within the minute (the store logged it)
            with contextlib.suppress(RateLimitUnavailable):
                self.store.settle(rec.key_name, self.limits(rec.api_key), rec.reserved_tokens - used)
            rec.reserved_tokens = 0

    def limit_headers(self, rec: RequestRecord) -> dict[str, str]:
        limits = self.limits(rec.api_key)
        if limits.rpm is None and limits.tpm is None:
            return {}
        try:
            return self.store.peek(rec.key_name, limits).headers()
        except RateLimitUnavailable:
            return {}  # the response itself was admitted; it goes out without the x-ratelimit-* headers


def check_model(key, model: str | None) -> None:
    """403 unless the API key may use `model`; a key limited to some models may use `name` for any of its
    versions (`name:version`). None (the server's default model) is checked once it is resolved."""
    if key is None or key.models is None or model is None:
        return
    if model not in key.models and model.rpartition(":")[0] not in key.models:
        raise APIError(403, f"this key may not use model {model!r}", "model", "model_not_allowed")
