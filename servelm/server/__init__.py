"""The HTTP service: an API process (FastAPI) in front of an engine-core process (ZeroMQ + msgspec)."""
