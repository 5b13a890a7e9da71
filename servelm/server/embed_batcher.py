"""The embedding batcher now lives in servelm/worker/embed_batcher.py; the name stays importable from here."""

from servelm.worker.embed_batcher import FairBatcher

__all__ = ["FairBatcher"]
