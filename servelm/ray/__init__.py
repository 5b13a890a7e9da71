"""servelm on a Ray cluster (`pip install servelm[ray]`): each engine worker is a Ray Serve replica, placed by Ray
on any node with the resources it asks for, and servelm's own API process stays in front (the same HTTP layer,
keys, admission, metrics and registry), reaching the replicas through a Ray Serve handle.

- `replica.py`: EngineReplica, the body of one replica (an engine-core process on the replica's node).
- `engine.py`: RayServeEngine, the AsyncEngine surface the HTTP layer uses, over the replicas' handle.
- `app.py`: the Ray Serve application (autoscaling config, resources) and `app_builder` for `serve run` /
  KubeRay's RayService.
- `serve.py`: `python -m servelm.ray`, i.e. `servelm serve` with the engine on Ray.

Nothing here is imported by the one-machine server: Ray is never a dependency of it.
"""
