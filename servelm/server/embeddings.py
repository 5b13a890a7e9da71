"""The embedding worker now lives in servelm/worker/embedder.py (the control plane deploys it too); these names
stay importable from here."""

from servelm.worker.embedder import (
                                     DEFAULT_EMBED_NAME,
                                     DEFAULT_EMBED_PACKAGE,
                                     BatchStats,
                                     Embedder,
                                     EmbedderDown,
                                     default_embedding_path,
)

__all__ = ["DEFAULT_EMBED_NAME", "DEFAULT_EMBED_PACKAGE", "BatchStats", "Embedder", "EmbedderDown",
           "default_embedding_path"]
