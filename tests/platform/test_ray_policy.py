"""servelm's Ray Serve autoscaling policy (servelm.ray.app) decides from the replicas' own load figures; it is
plain Python, so it is checked here without Ray (tests/platform/test_ray.py runs it on a real Ray cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from servelm.ray.app import RayOptions, autoscaling_config, waiting_requests_policy


def ctx(waiting: list[float], running: list[float], kv: list[float], current: int, target: float = 4):
    ids = [f"r{i}" for i in range(len(waiting))]
    metrics = {"num_requests_waiting": dict(zip(ids, waiting, strict=True)),
               "num_requests_running": dict(zip(ids, running, strict=True)),
               "kv_cache_usage": dict(zip(ids, kv, strict=True))}
    return SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=current,
                           config=SimpleNamespace(target_ongoing_requests=target))


@pytest.mark.parametrize(("waiting", "running", "kv", "current", "want"), [
    ([0, 0], [4, 4], [0.2, 0.2], 2, 2),  # exactly at target: stay
    ([6, 6], [4, 4], [0.2, 0.2], 2, 5),  # a 3x surge queues up: 20 sequences at 4 each
    ([0, 0], [1, 0], [0.1, 0.0], 2, 1),  # load fits on one replica: down (Ray applies the floor and delay)
    ([0, 0], [0, 0], [0.0, 0.0], 2, 0),  # idle: nothing needed (scale-to-zero only if min_replicas is 0)
    ([1, 1], [3, 3], [0.95, 0.95], 2, 3),  # at target by count, but the KV cache is full and requests wait
    ([0, 0], [4, 4], [0.95, 0.95], 2, 2),  # a full cache with nothing waiting is no reason to grow
])
def test_policy_sizes_for_running_plus_waiting_and_kv_pressure(waiting, running, kv, current, want):
    desired, state = waiting_requests_policy(ctx(waiting, running, kv, current))
    assert desired == want
    assert state == {"waiting": sum(waiting), "running": sum(running)}


def test_autoscaling_config_names_the_policy_and_bounds():
    opts = RayOptions(replicas=2, max_replicas=6, target_ongoing_requests=8, upscale_delay_s=0)
    assert opts.autoscaled and not RayOptions(replicas=2).autoscaled
    cfg = autoscaling_config(opts)
    assert cfg["policy"] == {"policy_function": "servelm.ray.app:waiting_requests_policy"}
    assert (cfg["min_replicas"], cfg["initial_replicas"], cfg["max_replicas"]) == (2, 2, 6)
    assert cfg["target_ongoing_requests"] == 8 and cfg["upscale_delay_s"] == 0
    zero = autoscaling_config(RayOptions(replicas=1, min_replicas=0, max_replicas=3))
    assert (zero["min_replicas"], zero["initial_replicas"]) == (0, 1)  # scale-to-zero opts in, starts with one


def test_look_back_window_is_one_ray_serve_accepts():
    """Ray Serve averages over look_back_period_s and warns (a future release refuses) when it is not longer than
    its metrics interval: servelm's default must pass its validation cleanly, and a bad value is refused at start-up
    by name, from Python and from the command line."""
    config = pytest.importorskip("ray.serve.config")
    import argparse
    import warnings

    from servelm.ray.app import RAY_METRICS_INTERVAL_S
    from servelm.ray.serve import add_ray_args

    assert config.AutoscalingConfig().metrics_interval_s == RAY_METRICS_INTERVAL_S  # servelm's copy of Ray's default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config.AutoscalingConfig(**autoscaling_config(RayOptions(replicas=2, max_replicas=4)))
    assert cfg.look_back_period_s == RayOptions().look_back_period_s
    assert not [w for w in caught if "look_back_period_s" in str(w.message)]
    with pytest.raises(ValueError, match="look_back_period_s must be greater"):
        RayOptions(look_back_period_s=10)
    p = argparse.ArgumentParser()
    add_ray_args(p)
    assert p.parse_args(["--look-back-period-s", "12"]).look_back_period_s == 12
    with pytest.raises(SystemExit):
        p.parse_args(["--look-back-period-s", "10"])
