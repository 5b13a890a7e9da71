"""The model layer: checkpoints (HF folders, GGUF), the shared decoder, attention backends."""
