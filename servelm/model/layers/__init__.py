"""The decoder's building blocks (norms, rotary embedding, linears), tensor-parallel slicing, the batch-invariant mode and LoRA."""
