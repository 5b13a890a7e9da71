// Fused elementwise kernels for the bf16 decoder: RMSNorm (with the residual add), rotary embedding,
// SiLU-and-multiply. In PyTorch each is a chain of 3-6 ops, each a pass over memory and a dispatch;
// at batch 64 they cost more than their arithmetic, and in a 512-token prefill bf16 SiLU alone ran at
// ~1.5 GB/s. Each kernel rounds to bf16 wherever the transformers op chain does, so results are
// identical to it, not merely close.
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"
#include "tape.h"

namespace {

#ifdef SERVELM_AVX512_BF16
// Rows per parallel task: enough work that a task outweighs its scheduling.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

using servelm::bf16;
using servelm::exp512;
using servelm::lanes;
using servelm::load_bf16;
using servelm::round_bf16;
using servelm::store_bf16;

// out = w * bf16(x * rsqrt(mean(x^2) + eps)), as transformers' RMSNorm computes it in bf16.
inline void norm_row(const bf16* x, const bf16* w, bf16* out, int64_t D, float eps) {
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

// out[r] = RMSNorm(x[r]) * w for each row; out may be x.
void rms_norm(bf16* out, const Rows& ro, const bf16* x, const Rows& rx, const bf16* w, int64_t D, float eps) {
#ifdef SERVELM_AVX512_BF16
  parallel_for(0, rx.count(), grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + rx.offset(r), w, out + ro.offset(r), D, eps);
  });
#else
  (void)out, (void)ro, (void)x, (void)rx, (void)w, (void)D, (void)eps;
  check(false, "rms_norm_bf16 needs AVX512-BF16");
#endif
}

// residual = bf16(residual + delta) in place, out = RMSNorm(residual) * w: the residual add of one
// sublayer fused with the norm that opens the next. All [T, D] contiguous.
void add_rms_norm(bf16* out, const bf16* delta, bf16* residual, const bf16* w, int64_t T, int64_t D, float eps) {
#ifdef SERVELM_AVX512_BF16
  parallel_for(0, T, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* res = residual + r * D;
      const bf16* del = delta + r * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = lanes(D - d);
        store_bf16(res + d, _mm512_add_ps(load_bf16(res + d, m), load_bf16(del + d, m)), m);
      }
      norm_row(res, w, out + r * D, D, eps);
    }
  });
#else
  (void)out, (void)delta, (void)residual, (void)w, (void)T, (void)D, (void)eps;
  check(false, "add_rms_norm_bf16 needs AVX512-BF16");
#endif
}

// In place on x ([T, H, D], strides st, sh, unit last stride): x = bf16(x * cos) + bf16(rotate_half(x) * sin),
// rounded as transformers' bf16 ops round; cos/sin are [max_pos, D] tables read at pos[t].
void rotary(bf16* x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh, const int64_t* pos, const bf16* cos,
            const bf16* sin, int64_t max_pos) {
  for (int64_t t = 0; t < T; ++t)
    check(pos[t] >= 0 && pos[t] < max_pos, "rotary_bf16_: position ", pos[t], " beyond the table");
#ifdef SERVELM_AVX512_BF16
  const int64_t half = D / 2;
  parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cos + pos[t] * D;
      const bf16* s = sin + pos[t] * D;
      for (int64_t h = 0; h < H; ++h) {
        bf16* row = x + t * st + h * sh;
        for (int64_t d = 0; d < half; d += 16) {
          const __mmask16 m = lanes(half - d);
          const __m512 lo = load_bf16(row + d, m), hi = load_bf16(row + half + d, m);
          // first half: lo * cos - hi * sin; second half: hi * cos + lo * sin (rotate_half negates hi)
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
  (void)x, (void)H, (void)D, (void)st, (void)sh, (void)cos, (void)sin;
  check(false, "rotary_bf16_ needs AVX512-BF16");
#endif
}

// [T, 2I] -> [T, I]: bf16(bf16(silu(gate)) * up), gate and up the two halves of each row.
void silu_mul(bf16* out, const bf16* x, int64_t T, int64_t I) {
#ifdef SERVELM_AVX512_BF16
  parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const bf16* g = x + t * 2 * I;
      const bf16* u = g + I;
      for (int64_t d = 0; d < I; d += 16) {
        const __mmask16 m = lanes(I - d);
        const __m512 gv = load_bf16(g + d, m);
        const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store_bf16(out + t * I + d, _mm512_mul_ps(round_bf16(act), load_bf16(u + d, m)), m);
      }
    }
  });
#else
  (void)out, (void)x, (void)T, (void)I;
  check(false, "silu_mul_bf16 needs AVX512-BF16");
#endif
}

}  // namespace servelm

using servelm::bf16;
using servelm::guarded;
using servelm::Rows;

SERVELM_API int servelm_rms_norm(bf16* out, int64_t o_outer, int64_t o_inner, int64_t o_so, int64_t o_si,
                                 const bf16* x, int64_t x_outer, int64_t x_inner, int64_t x_so, int64_t x_si,
                                 const bf16* w, int64_t D, double eps) {
  return guarded([&] {
    servelm::rms_norm(out, Rows{o_outer, o_inner, o_so, o_si}, x, Rows{x_outer, x_inner, x_so, x_si}, w, D,
                      float(eps));
  });
}
SERVELM_TAPE_ENTRY(servelm_rms_norm)

SERVELM_API int servelm_add_rms_norm(bf16* out, const bf16* delta, bf16* residual, const bf16* w, int64_t T,
                                     int64_t D, double eps) {
  return guarded([&] { servelm::add_rms_norm(out, delta, residual, w, T, D, float(eps)); });
}
SERVELM_TAPE_ENTRY(servelm_add_rms_norm)

SERVELM_API int servelm_rotary(bf16* x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh, const int64_t* pos,
                               const bf16* cos, const bf16* sin, int64_t max_pos) {
  return guarded([&] { servelm::rotary(x, T, H, D, st, sh, pos, cos, sin, max_pos); });
}
SERVELM_TAPE_ENTRY(servelm_rotary)

SERVELM_API int servelm_silu_mul(bf16* out, const bf16* x, int64_t T, int64_t I) {
  return guarded([&] { servelm::silu_mul(out, x, T, I); });
}
SERVELM_TAPE_ENTRY(servelm_silu_mul)
