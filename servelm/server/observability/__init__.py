"""Prometheus metrics, the request log and traces, drift windows and the operator's webhook."""
