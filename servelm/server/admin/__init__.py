"""The operator's API under /admin (models, versions, deployments, traffic, KV cache, LoRA) and /metrics, /server/stats."""
