// exp for the kernels' softmaxes (attention, sampling) in plain float arithmetic that loops vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace servelm {

// exp(x) for x <= 0 (a softmax's x - max): 2^n * p(r), r = x - n ln2, the degree-6 polynomial of vec.h's
// exp512 (~1 ulp), 0 below -87 (where expf is denormal or 0: nothing a softmax can see). Plain float arithmetic,
// so that the loops that call it vectorize under `omp simd`; the C library's expf is one call per element and was
// most of a prompt chunk's attention time on AVX2 CPUs. The same code for every query of a build: a query's
// probabilities do not depend on its chunk or batch.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x > -87.f ? p * two_n : 0.f;
}

}  // namespace servelm
