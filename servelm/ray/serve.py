"""`python -m servelm.ray [MODEL] [servelm serve options] --ray-address ADDR --replicas N ...`: servelm serve
with its engine workers as Ray Serve replicas. Every `servelm serve` option applies to the API process (keys,
admission, registry, metrics); the --ray-* options say where the replicas run and how many."""

from __future__ import annotations

import argparse
import logging
import sys

from servelm.ray.app import DEPLOYMENT_NAME, RAY_METRICS_INTERVAL_S, RayOptions, build_app, check_look_back

logger = logging.getLogger("servelm.ray")


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray")
    g.add_argument("--ray-address", default="auto",
                   help="the Ray cluster to join (default auto: RAY_ADDRESS or the local `ray start` head)")
    g.add_argument("--ray-app-name", default="servelm", help="the Ray Serve application's name")
    g.add_argument("--ray-attach", action="store_true",
                   help="serve an application already deployed under --ray-app-name (e.g. by a KubeRay "
                        "RayService with servelm.ray.app:app_builder) instead of deploying one")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (the autoscaling floor with --max-replicas)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling floor if not --replicas; 0 opts in to scale-to-zero")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="running + waiting sequences per replica the autoscaler aims at")
    g.add_argument("--upscale-delay-s", type=float, default=30.0)
    g.add_argument("--downscale-delay-s", type=float, default=300.0)
    g.add_argument("--look-back-period-s", type=_look_back, default=RayOptions.look_back_period_s,
                   help="seconds over which Ray Serve averages the replicas' load figures for the autoscaler "
                        f"(default {RayOptions.look_back_period_s:g}, Ray's own; longer than Ray's "
                        f"{RAY_METRICS_INTERVAL_S:g} s metrics interval)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves for each replica")
    g.add_argument("--replica-memory-gb", type=float, default=None, help="memory Ray reserves for each replica")


def _look_back(value: str) -> float:
    try:
        return check_look_back(float(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def options(args) -> RayOptions:
    return RayOptions(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      target_ongoing_requests=args.target_ongoing_requests, upscale_delay_s=args.upscale_delay_s,
                      downscale_delay_s=args.downscale_delay_s, look_back_period_s=args.look_back_period_s,
                      num_cpus=args.replica_cpus, num_gpus=args.replica_gpus, memory_gb=args.replica_memory_gb)


def engine_factory(args):
    """What `servelm serve` calls to make the model's engine: a RayServeEngine deploying the replicas."""
    from servelm.ray.engine import RayServeEngine

    opts = options(args)

    def make(config, start_timeout: float = 600.0):
        def deploy():
            import ray
            from ray import serve

            if not ray.is_initialized():
                ray.init(address=args.ray_address, namespace="servelm", log_to_driver=False)
            if args.ray_attach:
                return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=args.ray_app_name)
            serve.start(proxy_location="Disabled")  # servelm's own API process is the HTTP front
            app = build_app(config, opts, start_timeout)
            logger.info("deploying %s on Ray: %s", DEPLOYMENT_NAME, opts)
            return serve.run(app, name=args.ray_app_name, route_prefix=None)

        return RayServeEngine(config, deploy, start_timeout=start_timeout)

    return make


def main(argv: list[str] | None = None) -> int:
    from servelm.server.serve import add_args, cmd_serve

    p = argparse.ArgumentParser(prog="python -m servelm.ray", description=__doc__.splitlines()[0])
    add_args(p)
    add_ray_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_replicas is not None and args.max_replicas < max(args.min_replicas or 0, args.replicas):
        p.error("--max-replicas must be at least --replicas (and --min-replicas)")
    try:
        return cmd_serve(args, engine_factory(args))
    except (ValueError, FileNotFoundError) as e:  # a config error, as `servelm serve` reports it
        print(f"servelm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
