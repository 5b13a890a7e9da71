"""Quantized linear weights: weight-only int8/int4 on PyTorch, GGUF blocks on servelm's kernels, and the Triton dequantizing matmul."""
