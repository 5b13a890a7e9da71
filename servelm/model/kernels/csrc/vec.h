// AVX512 helpers shared by the kernels: bf16 <-> float32 lanes and a vector exp.
#pragma once

#include <cstdint>

#include "common.h"
#include "fast_exp.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SERVELM_AVX512_BF16 1

namespace servelm {

// Lanes [0, n) of a 16-lane vector (n may exceed 16).
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// bf16 is the top half of a float32, so widening is an exact shift.
inline __m512 load_bf16(const bf16* p, __mmask16 m = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Rounds to nearest even, as a float -> bf16 cast in PyTorch does.
inline void store_bf16(bf16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// The float32 value a bf16 tensor would hold after this op: rounding between ops is what makes
// a fused kernel agree bit for bit with the chain of bf16 PyTorch ops it replaces.
inline __m512 round_bf16(__m512 v) {
  const __m256i raw = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 bf16 pairs (one per 32-bit lane) split into float32 even and odd elements (the even one is a lane's
// low half; bf16 widens by a shift): the operands of the float-FMA form of the pair products.
inline void split_lanes(__m512i w, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// A weight line of 16 pairs, split.
inline void split_pairs(const void* line, __m512& even, __m512& odd) { split_lanes(_mm512_loadu_si512(line), even, odd); }

// One input pair (x0, x1), split and broadcast to every lane.
inline void broadcast_pair(const void* pair, __m512& x0, __m512& x1) {
  split_lanes(_mm512_set1_epi32(*static_cast<const int32_t*>(pair)), x0, x1);
}

// Whether the kernels multiply bf16 pairs with float FMAs rather than AVX512-BF16's dot-product
// instruction (avx512_linear.cpp says why; on by default on Intel CPUs). Settable for benchmarks and tests.
bool& fma_dot();

// exp(x) by fast_exp.h's polynomial. Overflows to inf and underflows to 0 like expf (the clamp keeps +-inf
// from turning into inf - inf = NaN).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}

}  // namespace servelm
#endif
