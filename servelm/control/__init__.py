"""The control plane: registry, lifecycle, audit, deployments, routing. It knows workers, never HTTP."""
