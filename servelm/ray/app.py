"""The Ray Serve application of a servelm model: EngineReplicas with servelm's autoscaling policy, and
`app_builder` for `serve run servelm.ray.app:app_builder model=...` and KubeRay's RayService."""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelm.config.engine import EngineConfig
from servelm.ray.replica import EngineReplica

DEPLOYMENT_NAME = "servelm-engine"
KV_CACHE_HIGH = 0.9  # mean KV cache usage over which the policy adds a replica while requests wait
# Ray Serve's AutoscalingConfig.metrics_interval_s default: the averaging window must be longer (Ray warns
# at equal and says a future release will refuse it)
RAY_METRICS_INTERVAL_S = 10.0


def check_look_back(seconds: float) -> float:
    """look_back_period_s as Ray Serve accepts it: longer than its metrics interval."""
    if not seconds > RAY_METRICS_INTERVAL_S:
        raise ValueError(f"look_back_period_s must be greater than Ray Serve's metrics interval "
                         f"({RAY_METRICS_INTERVAL_S:g} s), not {seconds:g}")
    return seconds


@dataclass
class RayOptions:
    """Where and how many replicas: Ray places each on a node with these resources free."""

    replicas: int = 1  # fixed count, unless max_replicas > replicas (then autoscaled)
    min_replicas: int | None = None  # autoscaling floor (default: replicas); 0 is scale-to-zero, opt-in
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0  # sequences per replica the policy aims at (running + waiting)
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    look_back_period_s: float = 30.0  # the window Ray Serve averages the replicas' figures over (its default)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_gb: float | None = None
    max_ongoing_requests: int = 256  # per replica; above it Ray Serve holds requests in the API process
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_look_back(self.look_back_period_s)

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > (self.min_replicas or self.replicas)


def autoscaling_config(opts: RayOptions) -> dict:
    """Ray Serve's autoscaling_config with servelm's policy (waiting requests and KV usage, not Ray's own
    ongoing-request count alone)."""
    floor = opts.replicas if opts.min_replicas is None else opts.min_replicas
    return {"min_replicas": floor, "initial_replicas": max(floor, 1), "max_replicas": opts.max_replicas,
            "target_ongoing_requests": opts.target_ongoing_requests,
            "upscale_delay_s": opts.upscale_delay_s, "downscale_delay_s": opts.downscale_delay_s,
            "look_back_period_s": opts.look_back_period_s,
            "policy": {"policy_function": "servelm.ray.app:waiting_requests_policy"}}


def waiting_requests_policy(ctx, kv_cache_high: float = KV_CACHE_HIGH) -> tuple[int, dict]:
    """servelm's autoscaling decision from the replicas' own figures (EngineReplica.record_autoscaling_stats,
    averaged by Ray Serve over look_back_period_s): enough replicas for every running and waiting sequence at
    `target_ongoing_requests` each, and one more than now while requests wait and mean KV cache usage is
    over `kv_cache_high`. Ray Serve applies min/max_replicas and upscale/downscale_delay_s to the answer."""
    metrics = ctx.aggregated_metrics or {}
    waiting = sum((metrics.get("num_requests_waiting") or {}).values())
    running = sum((metrics.get("num_requests_running") or {}).values())
    kv = list((metrics.get("kv_cache_usage") or {}).values())
    desired = math.ceil((waiting + running) / ctx.config.target_ongoing_requests)
    if waiting and kv and sum(kv) / len(kv) > kv_cache_high:
        desired = max(desired, ctx.current_num_replicas + 1)
    return desired, {"waiting": waiting, "running": running}


def build_app(config: EngineConfig, opts: RayOptions | None = None, start_timeout: float = 600.0):
    """The Ray Serve application: EngineReplicas of `config`, fixed or autoscaled per `opts`."""
    from ray import serve

    opts = opts or RayOptions()
    actor: dict = {"num_cpus": opts.num_cpus, "num_gpus": opts.num_gpus}
    if opts.memory_gb:
        actor["memory"] = int(opts.memory_gb * 2**30)
    kwargs: dict = {"name": DEPLOYMENT_NAME, "ray_actor_options": actor,
                    "max_ongoing_requests": opts.max_ongoing_requests,
                    "health_check_period_s": opts.health_check_period_s,
                    "health_check_timeout_s": opts.health_check_timeout_s,
                    "graceful_shutdown_timeout_s": 30}
    if opts.autoscaled:
        kwargs["autoscaling_config"] = autoscaling_config(opts)
    else:
        kwargs["num_replicas"] = opts.replicas
    engine = config.to_dict()  # flat names: EngineReplica rebuilds it
    return serve.deployment(EngineReplica, **kwargs).bind(engine, start_timeout)


def app_builder(args: dict):
    """For `serve run servelm.ray.app:app_builder model=PATH` and a RayService's serveConfigV2: the replicas
    of one model, autoscaled between min_replicas and max_replicas (the API process runs beside, see
    servelm.ray.serve)."""
    config = EngineConfig(model=args["model"])
    opts = RayOptions(replicas=int(args.get("min_replicas", 1)), min_replicas=int(args.get("min_replicas", 1)),
                      max_replicas=int(args.get("max_replicas", 1)),
                      target_ongoing_requests=float(args.get("target_ongoing_requests", 8)),
                      look_back_period_s=float(args.get("look_back_period_s", RayOptions.look_back_period_s)),
                      num_cpus=float(args.get("num_cpus", 1)), num_gpus=float(args.get("num_gpus", 0)))
    return build_app(config, opts)
