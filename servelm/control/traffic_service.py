"""Traffic management: the pieces of the control plane (traffic policies, canary, experiments, shadow mirror,
prediction log, drift) kept per model and fed by every generation request.

The request path touches it three times: `attrs()` when the model is resolved (the policy picks the version
through DeploymentManager.route), `fault()` before the engine runs (a test hook), and `complete()` just before
the response's last byte (the server awaits it there: the prediction-log entry is durable before the client
has its answer, then canary windows, experiment arms, drift windows, the shadow mirror and metrics are fed).
The admin routes and the canary runner (control/canary_runner.py) change it.

What belongs to the process it runs in comes in through the seams of control/traffic_seams.py: the metrics
(built over this service, whose gauges read it), the operator's notifier (a webhook) and the request records;
the server's adapter (server/traffic.py) supplies them and answers the refusals raised here over HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from servelm.beam_search import generate_outputs
from servelm.config import env
from servelm.control.bandit_policy import BanditPolicy
from servelm.control.canary import CanaryController
from servelm.control.drift import DriftMonitor
from servelm.control.drift_watch import DriftSnapshot, DriftWatch
from servelm.control.errors import Conflict, ControlError, NotFound, Unavailable
from servelm.control.experiments import Experiment, ThompsonBandit
from servelm.control.policies import PolicyStore
from servelm.control.predictions import Prediction, PredictionLog
from servelm.control.shadow import ShadowMirror, ShadowResult
from servelm.control.traffic import RequestAttrs, TrafficPolicy
from servelm.control.traffic_seams import Notifier, ServedRequest, TrafficMetricsSink

logger = logging.getLogger("servelm.traffic")
FAULT_LABEL = "servelm.fault"  # on a version: "error" or "latency:SECONDS" (honoured with SERVELM_ALLOW_FAULTS=1)
REMEMBER = 100_000  # request ids kept for feedback attribution


def parse_modes(spec: str) -> tuple[str, dict[str, str]]:
    """'full' -> ('full', {}); 'm=full,*=off' -> ('off', {'m': 'full'})."""
    default, per = "off", {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, mode = part.rpartition("=")
        if not eq or name.strip() == "*":
            default = mode.strip()
        else:
            per[name.strip()] = mode.strip()
    return default, per


def split_ref(ref: str) -> tuple[str, int | None]:
    name, sep, ver = ref.rpartition(":")
    return (name, int(ver)) if sep and ver.isdigit() else (ref, None)


SHADOW_QUEUE_TIMEOUT_S = 30.0  # a shadow copy's queue timeout when primaries have none


class TrafficService:
    """Per-model traffic state over the control plane `cp` (its registry's database and audit trail).

    `metrics` builds the counters over this service (their gauges read it when scraped); `notifier` builds,
    given those counters, where operator events go (None: they are only logged)."""

    def __init__(self, cp: Any, server_config: Any, models: Any,
                 metrics: Callable[[TrafficService], TrafficMetricsSink],
                 notifier: Callable[[TrafficMetricsSink], Notifier | None] = lambda _: None,
                 queue_timeout_s: float | None = None, embedder: Any = None) -> None:
        self.cp, self.cfg, self.models = cp, server_config, models
        # a shadow copy is best effort: it waits no longer than a primary would, and never unbounded
        self.queue_timeout_s = queue_timeout_s or SHADOW_QUEUE_TIMEOUT_S
        reg = cp.registry
        self.store = PolicyStore(reg.engine, reg.audit)
        default, per = parse_modes(server_config.observability_config.prediction_log)
        sink = server_config.observability_config.prediction_log_file
        days = server_config.observability_config.prediction_log_retention_days or None
        otlp = None
        if server_config.observability_config.prediction_log_otlp_endpoint:
            from servelm.control.prediction_otlp import OtlpSink

            otlp = OtlpSink(server_config.observability_config.prediction_log_otlp_endpoint, server_config.observability_config.otlp_service_name)
        self.log = PredictionLog(reg.engine, sink=sink, modes=per, default_mode=default, default_retention_days=days,
                                 otlp=otlp)
        self._retention: asyncio.Task | None = None
        self._checkpoints: asyncio.Task | None = None
        self._changes = self._saved_changes = 0  # statistics updates made / covered by the last checkpoint
        self.policies: dict[str, TrafficPolicy | BanditPolicy] = {}
        for name, rec in self.store.all("policy").items():
            try:
                self.policies[name] = BanditPolicy.from_dict(rec) if "bandit" in rec else TrafficPolicy.from_dict(rec)
            except (ControlError, KeyError, TypeError, ValueError) as e:
                logger.warning("stored traffic policy of %s is invalid, ignored: %s", name, e)
        self.experiments: dict[str, Experiment] = {}
        self.experiment_of: dict[str, str] = {}  # model -> its running experiment
        for name, rec in self.store.all("experiment").items():  # back after a restart (statistics start again)
            try:
                exp = Experiment(name, rec["policy"], rec["arms"], started_at=rec["started_at"],
                                 baseline=rec["baseline"])
            except (ControlError, KeyError, TypeError) as e:  # stored by an older version that did not check
                logger.warning("stored experiment %s is invalid, ignored: %s", name, e)
                continue
            if rec.get("stopped_at") is not None:
                exp.stop(rec["stopped_at"])
            else:
                self.experiment_of[rec["policy"]["model"]] = name
            self.experiments[name] = exp
        for name, rec in self.store.all("logmode").items():  # modes set over the admin API outlive a restart
            try:
                self.log.set_mode(name, rec["mode"])
            except (ControlError, KeyError, TypeError) as e:
                logger.warning("stored prediction-log mode of %s is invalid, ignored: %s", name, e)
        self._state = self.store.load_state()
        self._restore_state()
        self.canaries: dict[str, Any] = {}  # model -> CanaryRun (control/canary_runner.py)
        self.mirrors: dict[str, ShadowMirror] = {}
        # request id -> [model, version, arm, key name, feedback given]: who may rate it, and only once
        self.served: OrderedDict[str, list] = OrderedDict()
        self.metrics = metrics(self)
        self.watch = DriftWatch(server_config, self.metrics, embedder, self.notify)
        self.webhook: Notifier | None = notifier(self.metrics)
        self.drift: dict[str, DriftMonitor] = self.watch.data
        self.allow_faults = env.allow_faults()
        cp.deployments.policy_of = self.policies.get  # DeploymentManager.route asks this per request

    def resume(self) -> list[str]:
        """In the running event loop: carry on the canaries that were running when the server stopped, and
        start the prediction log's retention job. Returns the models whose canary resumed."""
        from servelm.control.canary_runner import CanaryRun

        for name, rec in self.store.all("canary").items():
            if rec.get("status") == "running" and name not in self.canaries:
                run = self.canaries[name] = CanaryRun.resume(self, rec, self.cfg.rollout_config.canary_interval_s)
                saved = self._state.get(f"canary:{name}")
                if saved and run.controller.restore_windows(saved):
                    logger.info("canary of %s resumed with its step's windows (%s)", name,
                                {k: w.requests for k, w in run.controller.windows.items()})
        interval = self.cfg.rollout_config.traffic_state_interval_s
        if interval > 0 and self._checkpoints is None:
            self._checkpoints = asyncio.create_task(self._checkpoint_every(interval))
        self.watch.start(self.cfg.observability_config.drift_check_interval_s)
        if self.webhook is not None:
            self.webhook.start()
        if self.log.default_retention_days is not None and self._retention is None:
            self._retention = asyncio.create_task(self._purge_every(3600.0))
        return [n for n, r in self.canaries.items() if r.controller.status == "running"]

    async def _purge_every(self, seconds: float) -> None:
        while True:
            try:
                removed = await asyncio.to_thread(self.log.purge_expired)
                if any(removed.values()):
                    logger.info("prediction log retention removed %s", removed)
            except Exception:
                logger.exception("prediction log retention failed")
            await asyncio.sleep(seconds)

    def notify(self, event: dict) -> None:
        """An event for the operator (canary rollback or failed promotion, drift alert): logged, and sent to
        the webhook when one is configured (never waits; callable from any thread)."""
        logger.warning("traffic event: %s", event)
        if self.webhook is not None:
            self.webhook.send(event)

    # -- state across a restart --------------------------------------------------------------------
    def _restore_state(self) -> None:
        """Experiment windows and bandit posteriors from the last checkpoint (canary windows: `resume`)."""
        for name, exp in self.experiments.items():
            saved = self._state.get(f"experiment:{name}")
            if saved:
                exp.restore_windows(saved)
        for name, policy in self.policies.items():
            saved = self._state.get(f"bandit:{name}")
            if isinstance(policy, BanditPolicy) and saved and saved.get("versions") == policy.bandit.versions:
                policy.bandit = ThompsonBandit.from_dict(saved)

    def state_records(self) -> dict[str, dict | None]:
        """On the event loop: what the running canaries, experiments and bandits learned, as state records
        (None removes the record of a canary that no longer runs)."""
        out: dict[str, dict | None] = {}
        for name, run in self.canaries.items():
            running = run.controller.status == "running"
            out[f"canary:{name}"] = run.controller.windows_state() if running else None
        for name, exp in self.experiments.items():
            out[f"experiment:{name}"] = exp.windows_state()
        for name, policy in self.policies.items():
            if isinstance(policy, BanditPolicy):
                out[f"bandit:{name}"] = policy.bandit.to_dict()
        return out

    async def checkpoint(self) -> bool:
        """Save the state records (the database write in a thread) when anything changed since the last
        time; whether it wrote."""
        changes = self._changes
        if changes == self._saved_changes:
            return False
        await asyncio.to_thread(self.store.save_state, self.state_records())
        self._saved_changes = changes
        return True

    async def _checkpoint_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.checkpoint()
            except Exception:
                logger.exception("saving the traffic state failed")

    async def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.cancel()
        try:
            self._changes += 1  # a last checkpoint in any case: a canary may have changed step meanwhile
            await self.checkpoint()
        except Exception:
            logger.exception("saving the traffic state at shutdown failed")
        if self._retention is not None:
            self._retention.cancel()
        await self.watch.close()
        if self.webhook is not None:
            await self.webhook.close()
        for run in list(self.canaries.values()):
            await run.stop()
        for mirror in self.mirrors.values():
            await mirror.stop()
        await asyncio.to_thread(self.log.close)

    # -- policies ----------------------------------------------------------------------------------
    async def write(self, fn: Any, *args: Any) -> Any:
        """A policy-store write (`self.store.put`, ...) on the registry's one writer thread: the event loop
        never waits on the disk, and writes commit, and their callers resume, in the order they were asked."""
        return await self.cp.registry.io(fn, *args)

    def apply_policy(self, policy: TrafficPolicy | BanditPolicy) -> None:
        """Route by `policy` from now on, in this process (not stored: `set_policy` stores it)."""
        self.policies[policy.model] = policy
        self._changes += 1

    async def set_policy(self, policy: TrafficPolicy | BanditPolicy, actor: str, action: str = "policy.set") -> None:
        """Store (audited), then apply a model's policy."""
        await self.write(self.store.put, "policy", policy.model, policy.to_dict(), actor, action)
        if isinstance(policy, BanditPolicy):  # a new bandit starts from its own prior, not a saved posterior
            await self.write(self.store.save_state, {f"bandit:{policy.model}": None})
        self.apply_policy(policy)

    async def set_log_mode(self, name: str, mode: str, actor: str) -> str:
        """Change a model's prediction-log mode at run time; stored (audited), so it outlives a restart.
        Returns the mode before."""
        before = self.log.mode(name)
        self.log.set_mode(name, mode)  # InvalidRequest on an unknown mode, before anything is stored
        await self.write(self.store.put, "logmode", name, {"mode": mode}, actor, "predictions.mode")
        return before

    async def clear_policy(self, name: str, actor: str) -> dict:
        before = await self.write(self.store.delete, "policy", name, actor)
        self.policies.pop(name, None)
        return before

    async def set_shadow(self, name: str, shadow: dict, actor: str) -> TrafficPolicy:
        """Mirror `name`'s traffic to `shadow["version"]` on top of the split in force (or, without one, of
        all traffic to its PRODUCTION version); stored and audited as "shadow.set"."""
        self.cp.registry.get(name, shadow["version"])  # NotFound naming the versions that exist
        base = self.policies.get(name)
        if isinstance(base, BanditPolicy):
            raise Conflict(f"{name} is routed by a bandit; a shadow needs a split policy", code="bandit")
        if base is None:
            prod = self.cp.registry.production(name)
            if prod is None:
                raise Conflict(f"{name} has no PRODUCTION version and no traffic policy to mirror",
                               code="no_policy", param="name")
            d: dict = {"model": name, "arms": [{"version": prod.version, "weight": 100}]}
        else:
            d = base.to_dict()
        policy = TrafficPolicy.from_dict({**d, "shadow": shadow})
        await self.set_policy(policy, actor, "shadow.set")
        return policy

    async def clear_shadow(self, name: str, actor: str) -> None:
        """Stop mirroring `name`'s traffic (NotFound when it has no shadow); audited as "shadow.delete"."""
        policy = self.policies.get(name)
        if policy is None or policy.shadow is None:
            raise NotFound(f"{name} has no shadow", code="not_found", param="name")
        await self.set_policy(TrafficPolicy.from_dict({**policy.to_dict(), "shadow": None}), actor, "shadow.delete")

    # -- the request path --------------------------------------------------------------------------
    def attrs(self, headers: Mapping[str, str], rec: ServedRequest, metadata: Mapping[str, str] | None = None
              ) -> RequestAttrs:
        """What a policy may look at: the body's `user` and `metadata`, the headers, the API key's name and groups, and
        feature flags (the comma-separated x-servelm-flags header)."""
        key = rec.key_name if rec.api_key is not None else None
        groups = frozenset(getattr(rec.api_key, "groups", ()) or ())
        flags = {f.strip() for f in headers.get("x-servelm-flags", "").split(",") if f.strip()}
        return RequestAttrs(user=rec.user, key_name=key, key_groups=groups, headers=dict(headers),
                            metadata=dict(metadata or {}), flags=flags)

    def wants_output(self, name: str) -> bool:
        """Whether the completion text is needed: a full prediction log."""
        return self.log.mode(name) == "full"

    async def fault(self, m: Any) -> None:
        """The fault hook: a version labelled `servelm.fault=error` fails its requests (Unavailable), one
        labelled `latency:S` waits S seconds first. Only with SERVELM_ALLOW_FAULTS=1 (tests and drills)."""
        version = getattr(m, "version", None)
        spec = (version.labels or {}).get(FAULT_LABEL) if self.allow_faults and version is not None else None
        if not spec:
            return
        if spec == "error":
            raise Unavailable(f"injected fault in {version.ref}", code="injected_fault")
        if spec.startswith("latency:"):
            await asyncio.sleep(float(spec.split(":", 1)[1]))

    async def complete(self, rec: ServedRequest) -> None:
        """A generation request's response is about to complete: log it durably (awaited), then feed the
        canary, the experiment, drift, the shadow mirror and the metrics."""
        if rec.traffic_done or rec.model is None:
            return
        rec.traffic_done = True
        now = time.monotonic()
        name, version = split_ref(rec.model_version or rec.model)
        if rec.model_version is None:
            name = rec.model
        error = rec.status >= 500 or rec.error is not None
        arm = rec.arm or (f"v{version}" if version is not None else "default")
        ttft = rec.first_token - rec.start if rec.first_token is not None else None
        tpot = ((rec.last_token - rec.first_token) / (rec.completion_tokens - 1)
                if rec.first_token is not None and rec.last_token is not None and rec.completion_tokens > 1 else None)
        latency = now - rec.start
        await self.log.log(Prediction(
            request_id=rec.request_id, model=name, version=version, arm=arm,
            key_name=rec.key_name, user=rec.user or None, prompt=rec.prompt_text, output=rec.completion_text,
            prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens, latency_s=latency,
            ttft_s=ttft, finish_reason=rec.finish_reason, error=rec.error or (str(rec.status) if error else None)))
        try:
            self._observe(rec, name, version, arm, error, latency, ttft, tpot)
        except Exception:  # the answer stands whatever happens to the statistics
            logger.exception("traffic bookkeeping of request %s failed", rec.request_id)

    def _observe(self, rec: ServedRequest, name: str, version: int | None, arm: str, error: bool, latency: float,
                 ttft: float | None, tpot: float | None) -> None:
        self.metrics.request(name, version, arm, error, latency, ttft)
        kw = dict(error=error, prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens,
                  ttft=ttft, tpot=tpot, latency=latency)
        self._changes += 1
        run = self.canaries.get(name)
        if run is not None and version is not None:
            run.controller.record(version, **kw)
        exp = self.experiments.get(self.experiment_of.get(name, ""))
        if exp is not None:
            exp.record(arm, rec.request_id, **kw)
        self.served[rec.request_id] = [name, version, arm, rec.key_name, False]
        if len(self.served) > REMEMBER:
            self.served.popitem(last=False)
        if rec.prompt_ids is not None and not error:
            output = rec.completion_text if rec.completion_text is not None else rec.output_head
            self.watch.observe(name, version, text=_text(rec.prompt_text), prompt_ids=rec.prompt_ids,
                               output_tokens=rec.completion_tokens, output=output, finish_reason=rec.finish_reason)
        decision = rec.decision
        shadow = getattr(decision, "shadow_version", None)
        if shadow is not None and rec.prompt_ids is not None and not error:
            primary = ShadowResult(tokens=list(rec.output_ids), latency=latency)
            job = (f"{name}:{shadow}", rec.prompt_ids, rec.params, rec.cache_salt)
            if not self.mirror(name).offer(job, primary):
                self.metrics.shadow_dropped.labels(name, str(shadow)).inc()

    # -- feedback ----------------------------------------------------------------------------------
    async def feedback(self, request_id: str, score: float, key_name: str = "anonymous") -> dict:
        """Attach feedback to the arm (and canary window) that served `request_id`: NotFound when unknown or
        made with another API key than `key_name` (not revealing that it exists), Conflict when it was already
        rated.
        A request served before a restart is found in the prediction log (when its mode was not off)."""
        found = self.served.get(request_id)
        if found is None:
            entry = await asyncio.to_thread(self.log.find, request_id)
            if entry is not None and entry.get("error") is None:
                found = [entry["model"], entry["version"], entry["arm"] or "", entry["key_name"], entry["rated"]]
        if found is None or found[3] != key_name:
            raise NotFound(f"no served request {request_id!r} is known (feedback must name the x-request-id of "
                           "a generation request made with this API key)", code="not_found", param="request_id")
        if found[4]:
            raise Conflict(f"request {request_id!r} already has feedback (one per request)",
                           code="feedback_exists", param="request_id")
        found[4] = True  # before the await: a concurrent second rating sees it
        if not await asyncio.to_thread(self.log.record_feedback, request_id, score):
            raise Conflict(f"request {request_id!r} already has feedback (one per request)",
                           code="feedback_exists", param="request_id")
        self._changes += 1
        name, version, arm = found[:3]
        run = self.canaries.get(name)
        if run is not None and version is not None:
            run.controller.feedback(version, score)
        self.watch.feedback(name, version, score)
        policy = self.policies.get(name)
        if isinstance(policy, BanditPolicy) and version is not None:
            policy.reward(version, score)
        exp = self.experiments.get(self.experiment_of.get(name, ""))
        attached = exp.feedback(request_id, score) if exp is not None else False
        self.metrics.feedback.labels(name, str(version or ""), arm).inc()
        return {"request_id": request_id, "model": name, "version": version, "arm": arm, "score": score,
                "experiment": exp.name if attached else None}

    # -- bandit and canary -------------------------------------------------------------------------
    async def set_bandit(self, name: str, versions: list[int], actor: str, *, min_share: float, lo: float,
                         hi: float) -> BanditPolicy:
        """Route `name` by a Thompson-sampling bandit over `versions` (Conflict while a canary or an experiment
        steers it, NotFound for a version that does not exist); stored and audited as "bandit.set"."""
        self._check_free(name)
        for v in versions:
            self.cp.registry.get(name, v)
        policy = BanditPolicy(name, ThompsonBandit(versions, min_share=min_share, lo=lo, hi=hi))
        await self.set_policy(policy, actor, "bandit.set")
        return policy

    async def canary_status(self, name: str) -> dict:
        """The rollout this process runs, else the one stored in the database (run, or decided, by another
        server sharing it) as last saved; NotFound when there is neither."""
        run = self.canaries.get(name)
        if run is not None:
            return run.status()
        rec = await self.write(self.store.get, "canary", name)
        if rec is None:
            raise NotFound(f"{name} has no canary", code="not_found", param="name")
        c = CanaryController.from_dict(rec)
        return {"model": name, "status": c.status, "step": c.step, "percent": c.percent,
                "config": c.config.to_dict(), "windows": {}, "last_decision": None,
                "history": rec.get("history", []), "stored": True}

    # -- experiments -------------------------------------------------------------------------------
    async def start_experiment(self, name: str, policy: TrafficPolicy, baseline: str | None, actor: str
                               ) -> Experiment:
        if name in self.experiments and self.experiments[name].stopped_at is None:
            raise Conflict(f"experiment {name!r} is running", code="experiment_running")
        self._check_free(policy.model)
        arms = [a.label for a in policy.arms] + [r.label for r in policy.segments]
        exp = Experiment(name, policy.to_dict(), arms, started_at=time.time(), baseline=baseline)
        await self.write(self.store.put, "experiment", name, {
            "policy": policy.to_dict(), "arms": arms, "baseline": exp.baseline, "started_at": exp.started_at,
            "stopped_at": None}, actor, "experiment.start")
        await self.set_policy(policy, actor)
        self.experiments[name] = exp
        self.experiment_of[policy.model] = name
        return exp

    async def stop_experiment(self, name: str, actor: str) -> Experiment:
        exp = self.experiment(name)
        if exp.stopped_at is None:
            exp.stop(time.time())
            model = exp.policy["model"]
            rec = await self.write(self.store.get, "experiment", name) or {}
            await self.write(self.store.put, "experiment", name, {**rec, "stopped_at": exp.stopped_at}, actor,
                             "experiment.stop")
            if self.experiment_of.get(model) == name:
                del self.experiment_of[model]
                if model in self.policies:
                    await self.clear_policy(model, actor)
        return exp

    def experiment(self, name: str) -> Experiment:
        exp = self.experiments.get(name)
        if exp is None:
            raise NotFound(f"no experiment {name!r}; experiments: {', '.join(self.experiments) or 'none'}",
                           code="not_found", param="id")
        return exp

    def _check_free(self, model: str) -> None:
        """Conflict when a canary or an experiment already steers this model's traffic."""
        if model in self.canaries and self.canaries[model].controller.status == "running":
            raise Conflict(f"a canary of {model} is running; abort it first", code="canary_running")
        if model in self.experiment_of:
            raise Conflict(f"experiment {self.experiment_of[model]!r} runs on {model}; stop it first",
                           code="experiment_running")

    # -- shadow and drift --------------------------------------------------------------------------
    def mirror(self, name: str) -> ShadowMirror:
        m = self.mirrors.get(name)
        if m is None:
            m = self.mirrors[name] = ShadowMirror(self._run_shadow, maxsize=self.cfg.rollout_config.shadow_queue,
                                                  concurrency=self.cfg.rollout_config.shadow_concurrency)
            m.start()
        return m

    async def _run_shadow(self, job: tuple) -> ShadowResult:
        """Run a mirrored request on the shadow version (its answer goes nowhere but the comparison)."""
        ref, ids, params, salt = job
        t0 = time.monotonic()
        # pinned like a primary request: a swap or an unload of the shadow version waits for this copy to end
        m = self.models.resolve(ref, pin=True)
        tokens: list[int] = []
        try:
            await self.fault(m)
            # the primary's cache salt keeps the shadow inside the same prefix-cache namespace (per-key isolation)
            async for out in generate_outputs(m, f"shadow-{uuid.uuid4().hex}", list(ids), copy.deepcopy(params),
                                              None, 2, self.queue_timeout_s, salt):
                tokens.extend(t for c in out.outputs if c.index == 0 for t in c.token_ids)
        finally:
            m.release()
        self.metrics.shadow_requests.labels(split_ref(ref)[0], str(split_ref(ref)[1])).inc()
        return ShadowResult(tokens=tokens, latency=time.monotonic() - t0)

    def monitor(self, name: str) -> DriftMonitor:
        return self.watch.monitor(name)

    def drift_report(self, name: str, snap: DriftSnapshot | DriftMonitor | None = None, fresh: bool = True) -> dict:
        """The model's drift report (control/drift_watch.py; NotFound when it has served nothing yet)."""
        return self.watch.report(name, snap, fresh)


def _text(prompt_json: str | None) -> str | None:
    """The record keeps the prompt as JSON (a string, token ids, or a list of them): the text, if any."""
    import json

    if prompt_json is None:
        return None
    try:
        v = json.loads(prompt_json)
    except ValueError:
        return prompt_json
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return "\n".join(v)
    return None
