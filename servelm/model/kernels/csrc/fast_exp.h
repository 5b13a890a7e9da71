// exp for the kernels' softmaxes (attention, sampling) in plain float arithmetic that loops vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace servelm {

// The one exp polynomial of the kernels (here, vec.h's exp512, vec8.h's exp_nonpositive): 2^n * p(r) with
// n = round(x log2 e), r = x - n ln2 (ln2 split in two so that n ln2 is exact), p the degree-6 Taylor polynomial
// of e^r on [-ln2/2, ln2/2] evaluated by Horner's rule from kExpPoly[0]: ~1 ulp.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpPoly[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
constexpr int kExpTerms = sizeof(kExpPoly) / sizeof(kExpPoly[0]);

// exp(x) for x <= 0 (a softmax's x - max), 0 below -87 (where expf is denormal or 0: nothing a softmax can see).
// Plain float arithmetic, so that the loops that call it vectorize under `omp simd`; the C library's expf is one
// call per element and was most of a prompt chunk's attention time on AVX2 CPUs. The same code for every query
// of a build: a query's probabilities do not depend on its chunk or batch.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
#pragma GCC unroll 8
  for (int i = 1; i < kExpTerms; ++i) p = p * r + kExpPoly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x > -87.f ? p * two_n : 0.f;
}

}  // namespace servelm
