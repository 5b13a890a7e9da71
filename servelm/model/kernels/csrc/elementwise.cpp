// Fused elementwise kernels of the decoder, float32 or bf16: RMSNorm (with the residual add), rotary
// embedding, SiLU-and-multiply. In PyTorch each is a chain of 3-6 ops, each a pass over memory and a dispatch;
// at batch 64 they cost more than their arithmetic, and in a 512-token prefill bf16 SiLU alone ran at
// ~1.5 GB/s. With them, every op of a decode step is a kernel call, which is what lets the step be replayed
// from a tape (tape.h). Each kernel rounds to the dtype wherever the transformers op chain does, so bf16
// results are identical to it, not merely close; in float32 only RMSNorm's sum of squares may differ from
// PyTorch's, in its last bits (its order). bf16 runs in AVX512-BF16 vectors where the build has them; the
// generic loops (float32 everywhere, bf16 on the other builds) are left to the compiler to vectorize. Each
// row is computed by itself, in one order, whatever the rows beside it.
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"
#include "tape.h"

namespace {

using servelm::bf16;

// Rows per parallel task: enough work that a task outweighs its scheduling.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// The value an element of type T holds (float32: itself; bf16: rounded to nearest even).
template <typename T>
inline float as(float v) {
  return float(T(v));
}

// The generic row kernels, float32 or bf16 (T), rounding to T where the op chain rounds.
// out = w * T(x * rsqrt(mean(x^2) + eps)); out may be x.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) ss += float(x[d]) * float(x[d]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = T(float(w[d]) * as<T>(float(x[d]) * inv));
}

template <typename T>
void rms_norm(T* out, const servelm::Rows& ro, const T* x, const servelm::Rows& rx, const T* w, int64_t D, float eps) {
  servelm::parallel_for(0, rx.count(), grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + rx.offset(r), w, out + ro.offset(r), D, eps);
  });
}

template <typename T>
void add_rms_norm(T* out, const T* delta, T* residual, const T* w, int64_t T_, int64_t D, float eps) {
  servelm::parallel_for(0, T_, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * D;
      const T* del = delta + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) res[d] = T(float(res[d]) + float(del[d]));
      norm_row(res, w, out + r * D, D, eps);
    }
  });
}

// first half: lo * cos - hi * sin; second half: hi * cos + lo * sin (rotate_half negates hi), each product
// rounded to T before the sum, as the op chain's separate multiplies round
template <typename T>
void rotary(T* x, int64_t T_, int64_t H, int64_t D, int64_t st, int64_t sh, const int64_t* pos, const T* cos,
            const T* sin) {
  const int64_t half = D / 2;
  servelm::parallel_for(0, T_, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + pos[t] * D;
      const T* s = sin + pos[t] * D;
      for (int64_t h = 0; h < H; ++h) {
        T* row = x + t * st + h * sh;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float lo = float(row[d]), hi = float(row[half + d]);
          const float a = as<T>(lo * float(c[d])), b = as<T>(hi * float(s[d]));
          const float e = as<T>(hi * float(c[half + d])), f = as<T>(lo * float(s[half + d]));
          row[d] = T(a - b);
          row[half + d] = T(e + f);
        }
      }
    }
  });
}

// [T, 2I] -> [T, I]: T(T(silu(gate)) * up), SiLU as g / (1 + exp(-g)) with the C library's expf.
template <typename T>
void silu_mul(T* out, const T* x, int64_t T_, int64_t I) {
  servelm::parallel_for(0, T_, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = x + t * 2 * I;
      const T* u = g + I;
      for (int64_t d = 0; d < I; ++d) {
        const float gv = float(g[d]);
        out[t * I + d] = T(as<T>(gv / (1.f + std::exp(-gv))) * float(u[d]));
      }
    }
  });
}

#ifdef SERVELM_AVX512_BF16
using servelm::exp512;
using servelm::lanes;
using servelm::load_bf16;
using servelm::round_bf16;
using servelm::store_bf16;

// out = w * bf16(x * rsqrt(mean(x^2) + eps)), as transformers' RMSNorm computes it in bf16.
inline void norm_row_avx512(const bf16* x, const bf16* w, bf16* out, int64_t D, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = load_bf16(x + d, lanes(D - d));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(D - d);
    const __m512 n = round_bf16(_mm512_mul_ps(load_bf16(x + d, m), iv));
    store_bf16(out + d, _mm512_mul_ps(load_bf16(w + d, m), n), m);
  }
}
#endif

}  // namespace


namespace servelm {

void rms_norm(DType dtype, void* out, const Rows& ro, const void* x, const Rows& rx, const void* w, int64_t D,
              float eps) {
  if (dtype == kFloat32)
    return ::rms_norm(static_cast<float*>(out), ro, static_cast<const float*>(x), rx, static_cast<const float*>(w), D,
                      eps);
  check(dtype == kBFloat16, "rms_norm: float32 or bfloat16");
  auto* o = static_cast<bf16*>(out);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
#ifdef SERVELM_AVX512_BF16
  parallel_for(0, rx.count(), grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row_avx512(xb + rx.offset(r), wb, o + ro.offset(r), D, eps);
  });
#else
  ::rms_norm(o, ro, xb, rx, wb, D, eps);
#endif
}

void add_rms_norm(DType dtype, void* out, const void* delta, void* residual, const void* w, int64_t T, int64_t D,
                  float eps) {
  if (dtype == kFloat32)
    return ::add_rms_norm(static_cast<float*>(out), static_cast<const float*>(delta), static_cast<float*>(residual),
                          static_cast<const float*>(w), T, D, eps);
  check(dtype == kBFloat16, "add_rms_norm: float32 or bfloat16");
  auto* o = static_cast<bf16*>(out);
  const auto* del = static_cast<const bf16*>(delta);
  auto* resid = static_cast<bf16*>(residual);
  const auto* wb = static_cast<const bf16*>(w);
#ifdef SERVELM_AVX512_BF16
  parallel_for(0, T, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* res = resid + r * D;
      const bf16* dl = del + r * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = lanes(D - d);
        store_bf16(res + d, _mm512_add_ps(load_bf16(res + d, m), load_bf16(dl + d, m)), m);
      }
      norm_row_avx512(res, wb, o + r * D, D, eps);
    }
  });
#else
  ::add_rms_norm(o, del, resid, wb, T, D, eps);
#endif
}

// In place on x ([T, H, D], strides st, sh, unit last stride); cos/sin are [max_pos, D] tables read at pos[t].
void rotary(DType dtype, void* x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh, const int64_t* pos,
            const void* cos, const void* sin, int64_t max_pos) {
  for (int64_t t = 0; t < T; ++t) check(pos[t] >= 0 && pos[t] < max_pos, "rotary_: position ", pos[t], " beyond the table");
  if (dtype == kFloat32)
    return ::rotary(static_cast<float*>(x), T, H, D, st, sh, pos, static_cast<const float*>(cos),
                    static_cast<const float*>(sin));
  check(dtype == kBFloat16, "rotary_: float32 or bfloat16");
  auto* xb = static_cast<bf16*>(x);
  const auto* cb = static_cast<const bf16*>(cos);
  const auto* sb = static_cast<const bf16*>(sin);
#ifdef SERVELM_AVX512_BF16
  const int64_t half = D / 2;
  parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cb + pos[t] * D;
      const bf16* s = sb + pos[t] * D;
      for (int64_t h = 0; h < H; ++h) {
        bf16* row = xb + t * st + h * sh;
        for (int64_t d = 0; d < half; d += 16) {
          const __mmask16 m = lanes(half - d);
          const __m512 lo = load_bf16(row + d, m), hi = load_bf16(row + half + d, m);
          const __m512 a = round_bf16(_mm512_mul_ps(lo, load_bf16(c + d, m)));
          const __m512 b = round_bf16(_mm512_mul_ps(hi, load_bf16(s + d, m)));
          const __m512 e = round_bf16(_mm512_mul_ps(hi, load_bf16(c + half + d, m)));
          const __m512 f = round_bf16(_mm512_mul_ps(lo, load_bf16(s + half + d, m)));
          store_bf16(row + d, _mm512_sub_ps(a, b), m);
          store_bf16(row + half + d, _mm512_add_ps(e, f), m);
        }
      }
    }
  });
#else
  ::rotary(xb, T, H, D, st, sh, pos, cb, sb);
#endif
}

// [T, 2I] -> [T, I]: silu(gate) * up, gate and up the two halves of each row.
void silu_mul(DType dtype, void* out, const void* x, int64_t T, int64_t I) {
  if (dtype == kFloat32) return ::silu_mul(static_cast<float*>(out), static_cast<const float*>(x), T, I);
  check(dtype == kBFloat16, "silu_mul: float32 or bfloat16");
  auto* o = static_cast<bf16*>(out);
  const auto* xb = static_cast<const bf16*>(x);
#ifdef SERVELM_AVX512_BF16
  parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const bf16* g = xb + t * 2 * I;
      const bf16* u = g + I;
      for (int64_t d = 0; d < I; d += 16) {
        const __mmask16 m = lanes(I - d);
        const __m512 gv = load_bf16(g + d, m);
        const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store_bf16(o + t * I + d, _mm512_mul_ps(round_bf16(act), load_bf16(u + d, m)), m);
      }
    }
  });
#else
  ::silu_mul(o, xb, T, I);
#endif
}

}  // namespace servelm

using servelm::guarded;
using servelm::Rows;

// dtype: servelm::DType, float32 or bfloat16 (every tensor of a call in it)
SERVELM_API int servelm_rms_norm(int32_t dtype, void* out, int64_t o_outer, int64_t o_inner, int64_t o_so, int64_t o_si,
                                 const void* x, int64_t x_outer, int64_t x_inner, int64_t x_so, int64_t x_si,
                                 const void* w, int64_t D, double eps) {
  return guarded([&] {
    servelm::rms_norm(servelm::DType(dtype), out, Rows{o_outer, o_inner, o_so, o_si}, x,
                      Rows{x_outer, x_inner, x_so, x_si}, w, D, float(eps));
  });
}
SERVELM_TAPE_ENTRY(servelm_rms_norm)

SERVELM_API int servelm_add_rms_norm(int32_t dtype, void* out, const void* delta, void* residual, const void* w,
                                     int64_t T, int64_t D, double eps) {
  return guarded([&] { servelm::add_rms_norm(servelm::DType(dtype), out, delta, residual, w, T, D, float(eps)); });
}
SERVELM_TAPE_ENTRY(servelm_add_rms_norm)

SERVELM_API int servelm_rotary(int32_t dtype, void* x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh,
                               const int64_t* pos, const void* cos, const void* sin, int64_t max_pos) {
  return guarded([&] { servelm::rotary(servelm::DType(dtype), x, T, H, D, st, sh, pos, cos, sin, max_pos); });
}
SERVELM_TAPE_ENTRY(servelm_rotary)

SERVELM_API int servelm_silu_mul(int32_t dtype, void* out, const void* x, int64_t T, int64_t I) {
  return guarded([&] { servelm::silu_mul(servelm::DType(dtype), out, x, T, I); });
}
SERVELM_TAPE_ENTRY(servelm_silu_mul)
