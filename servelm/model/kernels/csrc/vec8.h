// 8-lane float32 vectors for the kernels that every build compiles: one AVX2 register on x86-64-v3 and
// later, two 4-lane vectors elsewhere (NEON registers on ARM, SSE registers on a baseline x86-64 build).
// The kernels written on them (the decode attention for float32 caches and for bf16 ones without
// AVX512-BF16, the dense linear kernel) are one source for every CPU.
//
// Each operation rounds one way on a build and adds in one fixed order: fmadd and fnmadd round once on CPUs
// with a fused multiply-add (x86-64-v3, ARMv8) and twice elsewhere, and the horizontal sums pair the same
// lanes in both forms. So a build's results depend only on its inputs, never on the batch or the thread that
// computes them.
//
// Off AVX2 the vector is a struct of two native 4-lane vectors, not one 32-byte vector extension: GCC lowers
// a 32-byte vector on a 16-byte machine through the stack (every accumulator of the dense kernel stored and
// reloaded at every step), while pairs of native vectors stay in registers.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"
#include "fast_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SERVELM_VEC8_AVX2 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace servelm::v8 {

#ifdef SERVELM_VEC8_AVX2

using F8 = __m256;

inline F8 splat(float x) { return _mm256_set1_ps(x); }
inline F8 zero() { return _mm256_setzero_ps(); }
inline F8 load(const float* p) { return _mm256_loadu_ps(p); }
inline F8 load(const bf16* p) {  // bf16 widens exactly by a shift
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline void store(float* p, F8 v) { _mm256_storeu_ps(p, v); }
inline F8 fmadd(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
inline F8 fnmadd(F8 a, F8 b, F8 c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
inline F8 max(F8 a, F8 b) { return _mm256_max_ps(a, b); }

// Lane i of the result is the sum of all lanes of v[i].
inline F8 hsum8(const F8* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The largest lane, and the sum of the lanes: halves, then pairs, then neighbours.
inline float hmax(F8 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  return _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1))));
}
inline float hadd(F8 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  return _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1))));
}

inline F8 round_nearest(F8 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F8 live_lanes(F8 x, F8 lo, F8 v) { return _mm256_and_ps(v, _mm256_cmp_ps(x, lo, _CMP_GT_OQ)); }  // v where x > lo
inline F8 exp2_int(F8 n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

#else  // two 4-lane vectors

typedef float V4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));

// Lanes of a and b (b's numbered from a's count on) in the order of the indices; Mask is the integer vector
// type of a's shape (GCC's builtin takes the indices as one).
#if defined(__clang__)
#define SERVELM_SHUFFLE(Mask, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SERVELM_SHUFFLE(Mask, a, b, ...) __builtin_shuffle(a, b, Mask{__VA_ARGS__})
#endif

struct F8 {
  V4 lo, hi;
};
inline F8 operator+(F8 a, F8 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline F8 operator-(F8 a, F8 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline F8 operator*(F8 a, F8 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline F8& operator+=(F8& a, F8 b) { return a = a + b; }

inline F8 splat(float x) { return {V4{x, x, x, x}, V4{x, x, x, x}}; }
inline F8 zero() { return splat(0.f); }
inline F8 load(const float* p) {
  F8 v;
  std::memcpy(&v.lo, p, sizeof(V4));
  std::memcpy(&v.hi, p + 4, sizeof(V4));
  return v;
}
inline F8 load(const bf16* p) {  // bf16 widens exactly by a shift: each lane's 16 bits above 16 zero bits
  U16x8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const U16x8 z = {};
  return {reinterpret_cast<V4>(SERVELM_SHUFFLE(U16x8, z, raw, 0, 8, 1, 9, 2, 10, 3, 11)),
          reinterpret_cast<V4>(SERVELM_SHUFFLE(U16x8, z, raw, 4, 12, 5, 13, 6, 14, 7, 15))};
}
inline void store(float* p, F8 v) {
  std::memcpy(p, &v.lo, sizeof(V4));
  std::memcpy(p + 4, &v.hi, sizeof(V4));
}

inline V4 fmadd4(V4 a, V4 b, V4 c) {
#if defined(__aarch64__)
  return vfmaq_f32(c, a, b);  // ARMv8's vectors always fuse
#else
  return a * b + c;  // -std=c++17 does not contract this: a multiply, then an add
#endif
}
inline F8 fmadd(F8 a, F8 b, F8 c) { return {fmadd4(a.lo, b.lo, c.lo), fmadd4(a.hi, b.hi, c.hi)}; }
inline F8 fnmadd(F8 a, F8 b, F8 c) { return {fmadd4(-a.lo, b.lo, c.lo), fmadd4(-a.hi, b.hi, c.hi)}; }

inline V4 select4(I4 m, V4 a, V4 b) {  // a where m, else b
  return reinterpret_cast<V4>((reinterpret_cast<I4>(a) & m) | (reinterpret_cast<I4>(b) & ~m));
}
inline V4 max4(V4 a, V4 b) { return select4(a > b, a, b); }  // b where either is NaN, as x86's max
inline F8 max(F8 a, F8 b) { return {max4(a.lo, b.lo), max4(a.hi, b.hi)}; }

// [a0+a1, a2+a3, b0+b1, b2+b3] (NEON's pairwise add, x86's hadd)
inline V4 hadd_pairs(V4 a, V4 b) { return SERVELM_SHUFFLE(I4, a, b, 0, 2, 4, 6) + SERVELM_SHUFFLE(I4, a, b, 1, 3, 5, 7); }

// Lane i of the result is the sum of all lanes of v[i], added as the AVX2 form adds them.
inline F8 hsum8(const F8* v) {
  const F8 a = {hadd_pairs(hadd_pairs(v[0].lo, v[1].lo), hadd_pairs(v[2].lo, v[3].lo)),
                hadd_pairs(hadd_pairs(v[0].hi, v[1].hi), hadd_pairs(v[2].hi, v[3].hi))};
  const F8 b = {hadd_pairs(hadd_pairs(v[4].lo, v[5].lo), hadd_pairs(v[6].lo, v[7].lo)),
                hadd_pairs(hadd_pairs(v[4].hi, v[5].hi), hadd_pairs(v[6].hi, v[7].hi))};
  return {a.lo + a.hi, b.lo + b.hi};
}

// The largest lane, and the sum of the lanes, paired as the AVX2 form pairs them.
inline float hmax(F8 v) {
  V4 w = max4(v.lo, v.hi);
  w = max4(w, SERVELM_SHUFFLE(I4, w, w, 2, 3, 0, 1));
  return max4(w, SERVELM_SHUFFLE(I4, w, w, 1, 0, 3, 2))[0];
}
inline float hadd(F8 v) {
  V4 w = v.lo + v.hi;
  w += SERVELM_SHUFFLE(I4, w, w, 2, 3, 0, 1);
  return (w + SERVELM_SHUFFLE(I4, w, w, 1, 0, 3, 2))[0];
}

// Round to the nearest integer (ties to even): adding and subtracting 1.5 * 2^23 leaves no fraction bits for
// |x| < 2^22, and without -ffast-math the compiler keeps both.
inline V4 round4(V4 x) {
  const V4 magic = {12582912.f, 12582912.f, 12582912.f, 12582912.f};
  return (x + magic) - magic;
}
inline F8 round_nearest(F8 x) { return {round4(x.lo), round4(x.hi)}; }
inline F8 live_lanes(F8 x, F8 lo, F8 v) {  // v where x > lo, else 0
  return {select4(x.lo > lo.lo, v.lo, V4{}), select4(x.hi > lo.hi, v.hi, V4{})};
}
inline V4 exp2_int4(V4 n) { return reinterpret_cast<V4>((__builtin_convertvector(n, I4) + 127) << 23); }
inline F8 exp2_int(F8 n) { return {exp2_int4(n.lo), exp2_int4(n.hi)}; }  // 2^n for integral n in [-126, 127]

#endif

// fast_exp.h's exp_nonpositive on 8 lanes (its polynomial; 0 at and below -87, -inf included).
inline F8 exp_nonpositive(F8 x) {
  const F8 lo = splat(-87.f);
  const F8 y = max(x, lo);
  const F8 n = round_nearest(y * splat(kLog2e));
  F8 r = fnmadd(n, splat(kLn2Hi), y);
  r = fnmadd(n, splat(kLn2Lo), r);
  F8 p = splat(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kExpTerms; ++i) p = fmadd(p, r, splat(kExpPoly[i]));
  return live_lanes(x, lo, p * exp2_int(n));
}

}  // namespace servelm::v8
