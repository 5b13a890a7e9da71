// Peak issue rate of AVX512-BF16's dot-product instruction against float32 FMAs on one core, in
// GFLOP/s (12 independent accumulators each; a dot product counts 4 flops per lane, an FMA 2). Where the
// first is not clearly above the second, the CPU kernels' float-FMA form of bf16 products wins
// (servelm/model/kernels/csrc/avx512_linear.cpp). A benchmark, not a test:
//
//   g++ -O2 -march=native bench/dot_rate.cpp -o /tmp/dot_rate && /tmp/dot_rate
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <class Step>
double rate(Step step, double flops_per_op) {
  constexpr long kIters = 200000000;
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) step(acc);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
  std::fprintf(stderr, "%s", sink == 1.f ? " " : "");  // keeps the sums alive
  return kIters * 12 * flops_per_op / s / 1e9;
}

int main() {
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  __m512 f = _mm512_set1_ps(1.0001f);
  const double dot = rate([&](__m512* acc) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], x, x);
    asm volatile("" : "+v"(x));
  }, 64);
  const double fma = rate([&](__m512* acc) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(f, f, acc[j]);
    asm volatile("" : "+v"(f));
  }, 32);
  std::printf("{\"dpbf16_gflop_s\": %.1f, \"fma_f32_gflop_s\": %.1f, \"ratio\": %.2f}\n", dot, fma, dot / fma);
}
