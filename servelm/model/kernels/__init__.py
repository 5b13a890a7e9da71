"""Kernels: the C++ CPU kernels (sources in csrc/, built into lib/), their Python wrappers, kernel tapes and Triton elementwise kernels."""
