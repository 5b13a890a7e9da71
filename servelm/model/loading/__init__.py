"""Reading checkpoints: finding a model's files (HF folder, GGUF, the Hub cache), their config and tokenizer, and loading weights."""
