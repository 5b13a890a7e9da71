"""The Open Inference Protocol (KServe v2) for non-LLM models: tensors, the model runtime and the /v2 routes."""
