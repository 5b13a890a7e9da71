// Linear layers over GGUF block-quantized weights that stay quantized in memory (Q8_0, Q4_0, Q4_1, Q4_K, Q5_0,
// Q5_1, Q5_K, Q6_K): y = x W^T for bf16 rows x, bf16 out, float32 sums.
//
// The weight is repacked once at load (servelm/model/gguf_quant.py, `pack_blocks`), codes and scales exact,
// into runs of 16 output rows: per 16 rows and per group of 32 inputs, one record of
//   codes: 8 quads of inputs (4k .. 4k+3), each [16 rows][4 codes] = 64 bytes (8-bit formats: 512 bytes);
//          4-bit formats hold quad t in the low nibbles and quad t + 4 in the high nibbles of 4 x 64 bytes;
//          5-bit formats (Q5_*) the 4-bit layout of their low 4 bits, then 8 words of 64 fifth bits, word j
//          bit i for byte i of quad j (320 bytes: 5 bits a weight, as the file)
//   d:     16 scales (float16 for the 32-block formats, float32 for Q4_K's and Q5_K's d * sub-scale)
//   m:     16 offsets where the format has them (Q4_1, Q5_1: float16 m; Q4_K, Q5_K: float32 -dmin * sub-min)
// so that w = d * u + m (Q4_1, Q4_K, Q5_1, Q5_K) or w = d * (u - o) (Q4_0: o = 8, Q5_0: o = 16, Q8_0 stored as
// q + 128: o = 128), every value exactly what gguf's dequantization gives in float32. Q6_K (a scale per 16
// inputs) keeps its 6-bit codes as bytes (the 8-bit layout) and two sets of 16 float32 scales d * sc, for
// inputs 0-15 and 16-31 of the group, o = 32. Blocks of 32 rows (two runs) pad N.
//
// Few rows (decode): llama.cpp's scheme. Each row of x is quantized once per call to int8 in blocks of 32
// (scale = max|x| / 127, round to nearest even), and each group's dot products are integer (AVX512-VNNI
// vpdpbusd, 16 rows in the lanes; AVX2 maddubs), scaled once per group in float32. The result is the exact
// product of the dequantized weight with the int8-rounded x, up to float32 rounding of the per-group sums.
// Many rows (batches over int_rows, prefill), where a bf16 tile kernel exists (AMX, AVX512-BF16): that kernel
// (amx_linear.cpp, avx512_linear.cpp) runs over the weight's 32-column blocks, each dequantized when its loop
// reaches it into a small per-thread buffer in `pack_weight_for_tiles` order (the bf16 model's packed block,
// bit for bit; `record_dequantizer`), so the bf16 values never go through memory (the AMX loop dequantizes
// the next block between this one's tile ops). The results are the bf16 model's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "linear_epilogue.h"
#include "tape.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

using servelm::bf16;

namespace {

enum Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kQ5_0 = 5, kQ5_1 = 6, kQ5_K = 7 };

struct Layout {
  int code_bytes;   // per 16 rows and 32 inputs
  int scale_bytes;  // of one of d, m (16 of them)
  bool has_min;
  int offset;  // o in d * (u - o) for the formats without m
  bool halves = false;  // Q6_K: a second set of d for inputs 16-31 where m would be
  bool five = false;    // Q5: the 4-bit layout, then 8 words of 64 fifth bits (one per quad, bit i: byte i)
  int stride() const { return code_bytes + scale_bytes * (has_min || halves ? 2 : 1); }
};

// The same facts at compile time, for the kernels' templates.
template <int FMT>
struct Traits {
  static constexpr bool kFive = FMT == kQ5_0 || FMT == kQ5_1 || FMT == kQ5_K;
  static constexpr bool kFour = FMT != kQ8_0 && FMT != kQ6_K;  // nibbles (Q5: plus the plane of fifth bits)
  static constexpr bool kMin = FMT == kQ4_1 || FMT == kQ4_K || FMT == kQ5_1 || FMT == kQ5_K;
  static constexpr bool kHalves = FMT == kQ6_K;
  static constexpr bool kF32 = FMT == kQ4_K || FMT == kQ5_K || kHalves;  // float32 scales (else float16)
  static constexpr int kCodes = kFive ? 320 : kFour ? 256 : 512, kScale = kF32 ? 64 : 32;
  static constexpr int kStride = kCodes + kScale * (kMin || kHalves ? 2 : 1);
  static constexpr int kOffset = FMT == kQ8_0 ? 128 : FMT == kQ6_K ? 32 : FMT == kQ5_0 ? 16 : 8;
};

Layout layout(int fmt) {
  switch (fmt) {
    case kQ8_0: return {512, 32, false, 128};
    case kQ4_0: return {256, 32, false, 8};
    case kQ4_1: return {256, 32, true, 0};
    case kQ4_K: return {256, 64, true, 0};
    case kQ6_K: return {512, 64, false, 32, true};
    case kQ5_0: return {320, 32, false, 16, false, true};
    case kQ5_1: return {320, 32, true, 0, false, true};
    case kQ5_K: return {320, 64, true, 0, false, true};
    default: servelm::check(false, "quant_linear: unknown format ", fmt); return {};
  }
}

float half_to_float(const uint8_t* p) {
  servelm::f16 h;
  std::memcpy(&h.x, p, 2);
  return float(h);
}

// The scale and offset of row c (0..15), input kk (0..31) in a record: w = d * u + m.
void scale_min(const uint8_t* rec, const Layout& L, int c, int kk, float& d, float& m) {
  const uint8_t* s = rec + L.code_bytes;
  if (L.halves) {
    std::memcpy(&d, s + (kk < 16 ? 0 : 64) + 4 * c, 4);
    m = -float(L.offset) * d;
  } else if (L.scale_bytes == 32) {
    d = half_to_float(s + 2 * c);
    m = L.has_min ? half_to_float(s + 32 + 2 * c) : -float(L.offset) * d;
  } else {
    std::memcpy(&d, s + 4 * c, 4);
    if (L.has_min) std::memcpy(&m, s + 64 + 4 * c, 4);
    else m = -float(L.offset) * d;
  }
}

// Code of row c (0..15), input kk (0..31) of a record.
int code_at(const uint8_t* rec, const Layout& L, int c, int kk) {
  if (L.code_bytes == 512) return rec[64 * (kk / 4) + 4 * c + kk % 4];
  const int byte = rec[64 * ((kk % 16) / 4) + 4 * c + kk % 4];
  const int u = kk < 16 ? byte & 15 : byte >> 4;
  if (!L.five) return u;
  const int i = 4 * c + kk % 4;  // the code's byte in its quad's 64
  return u | ((rec[256 + 8 * (kk / 4) + i / 8] >> (i % 8)) & 1) << 4;
}

// x rows quantized to int8 in blocks of 32: q [M][K], d [M][G] (x ~ d * q), s [M][G] (sum of each block's q),
// h [M][2G] (the sums of its two halves).
struct QRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s, h;
  int64_t K = 0, G = 0;
  const int32_t* quads(int64_t r) const { return reinterpret_cast<const int32_t*>(q.data() + r * K); }
};

#ifdef SERVELM_AVX512_BF16
// One block of 32: the same arithmetic as the portable loop below (float32 max, d = amax / 127, x * (1 / d)
// rounded to nearest even by the conversion), 16 lanes at a time.
inline void quantize_block(const bf16* x, int8_t* q, float& d_out, int32_t& s_out, int32_t* h_out) {
  const __m512 a = servelm::load_bf16(x), b = servelm::load_bf16(x + 16);
  const __m512 amax_v = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
  const float amax = _mm512_reduce_max_ps(amax_v);
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(a, _mm512_set1_ps(id)))));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(b, _mm512_set1_ps(id)))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  d_out = d;
  h_out[0] = _mm512_reduce_add_epi32(qa);
  h_out[1] = _mm512_reduce_add_epi32(qb);
  s_out = h_out[0] + h_out[1];
}
#endif

void quantize_rows(QRows& out, const bf16* x, int64_t M, int64_t K, int64_t ldx) {
  out.K = K, out.G = K / 32;
  out.q.resize(M * K), out.d.resize(M * out.G), out.s.resize(M * out.G), out.h.resize(2 * M * out.G);
#ifdef SERVELM_AVX512_BF16
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < out.G; ++g)
      quantize_block(x + r * ldx + g * 32, out.q.data() + r * K + g * 32, out.d[r * out.G + g], out.s[r * out.G + g],
                     out.h.data() + 2 * (r * out.G + g));
  return;
#endif
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < out.G; ++g) {
      float v[32], amax = 0.f;
      for (int i = 0; i < 32; ++i) {
        v[i] = float(x[r * ldx + g * 32 + i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int32_t half[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int32_t q = int32_t(std::max(-127.f, std::min(127.f, std::nearbyint(v[i] * id))));
        out.q[r * K + g * 32 + i] = int8_t(q);
        half[i / 16] += q;
      }
      out.d[r * out.G + g] = d;
      out.s[r * out.G + g] = half[0] + half[1];
      out.h[2 * (r * out.G + g)] = half[0], out.h[2 * (r * out.G + g) + 1] = half[1];
    }
}

// c [R][32] float32 -> bf16 or float32 (bias added; or SiLU(gate) * up for a gate/up weight): the portable
// form of servelm::store_rows, with the same roundings.
void store_portable(const float* c, int64_t R, int64_t n0, servelm::LinearOut o, const bf16* bias, int64_t N) {
  if (o.store == servelm::kStoreSiluMul) {
    const int64_t I = N / 2;
    bf16* out = static_cast<bf16*>(o.p);
    for (int64_t r = 0; r < R; ++r)
      for (int j = 0; j < 16; ++j) {
        const float g = float(bf16(c[r * 32 + j])), u = float(bf16(c[r * 32 + 16 + j]));
        const float act = float(bf16(g / (1.f + std::exp(-g))));
        out[r * I + n0 / 2 + j] = bf16(act * u);
      }
    return;
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 32 && n0 + j < N; ++j) {
      const float v = c[r * 32 + j] + (bias ? float(bias[n0 + j]) : 0.f);
      if (o.store == servelm::kStoreFloat32) static_cast<float*>(o.p)[r * N + n0 + j] = v;
      else static_cast<bf16*>(o.p)[r * N + n0 + j] = bf16(v);
    }
}

#if defined(SERVELM_AVX512_BF16)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#define SERVELM_QUANT_VNNI 1

// Rows [0, R) of the quantized x times one run of 16 output rows (records of `stride` bytes per group) ->
// c[r * 32 + 0..15].
constexpr int kAhead = 12;  // records prefetched ahead (3.5-7.7 KB)

// A Q5 quad's 64 fifth bits (bit i: byte i of the quad's 64 code bytes) as a byte mask.
inline __mmask64 fifth_bits(const uint8_t* p) {
  uint64_t bits;
  std::memcpy(&bits, p, 8);
  return _cvtu64_mask64(bits);
}

template <int FMT, int R>
void run16_vnni(const uint8_t* w, int64_t G, const QRows& xq, int64_t r0, float* c) {
  using T = Traits<FMT>;
  constexpr bool kFour = T::kFour, kMin = T::kMin, kHalves = T::kHalves, kF32 = T::kF32;
  constexpr int kCodes = T::kCodes, kStride = T::kStride, kOffset = T::kOffset;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = w + g * kStride;
    // the record kAhead groups on, every line of it (the hardware prefetcher alone left the stream at ~80%
    // of the plain-read speed); past the run's end it fetches the next run's start, where the loop goes next
#pragma GCC unroll 10
    for (int l = 0; l < kStride; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * kStride + l), _MM_HINT_T0);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    if constexpr (kFour) {  // two chains per row (low and high nibbles), added at the end
      __m512i s2[R];
      for (int r = 0; r < R; ++r) s2[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(p + 64 * t);
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (T::kFive) {  // + 16 where the fifth bit is set
          lo = _mm512_mask_add_epi8(lo, fifth_bits(p + 256 + 8 * t), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, fifth_bits(p + 256 + 8 * (t + 4)), hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = xq.quads(r0 + r) + g * 8;
          s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(xr[t]));
          s2[r] = _mm512_dpbusd_epi32(s2[r], hi, _mm512_set1_epi32(xr[t + 4]));
        }
      }
      for (int r = 0; r < R; ++r) s[r] = _mm512_add_epi32(s[r], s2[r]);
    } else if constexpr (kHalves) {  // inputs 0-15 into s, 16-31 into s2: each half has its own scales
      __m512i s2[R];
      for (int r = 0; r < R; ++r) s2[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j), v2 = _mm512_loadu_si512(p + 64 * (j + 4));
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = xq.quads(r0 + r) + g * 8;
          s[r] = _mm512_dpbusd_epi32(s[r], v, _mm512_set1_epi32(xr[j]));
          s2[r] = _mm512_dpbusd_epi32(s2[r], v2, _mm512_set1_epi32(xr[j + 4]));
        }
      }
      const __m512 da = _mm512_loadu_ps(p + kCodes), db = _mm512_loadu_ps(p + kCodes + 64);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * xq.G + g;
        const __m512 dx = _mm512_set1_ps(xq.d[i]);
        const __m512i sa = _mm512_sub_epi32(s[r], _mm512_set1_epi32(kOffset * xq.h[2 * i]));
        const __m512i sb = _mm512_sub_epi32(s2[r], _mm512_set1_epi32(kOffset * xq.h[2 * i + 1]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa), _mm512_mul_ps(da, dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb), _mm512_mul_ps(db, dx), acc[r]);
      }
      continue;
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        for (int r = 0; r < R; ++r)
          s[r] = _mm512_dpbusd_epi32(s[r], v, _mm512_set1_epi32(xq.quads(r0 + r)[g * 8 + j]));
      }
    }
    __m512 d, m = _mm512_setzero_ps();
    if constexpr (kF32) {
      d = _mm512_loadu_ps(p + kCodes);
      m = _mm512_loadu_ps(p + kCodes + 64);
    } else {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCodes)));
      if constexpr (kMin) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCodes + 32)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * xq.G + g;
      const float dx = xq.d[i];
      if constexpr (kMin) {  // d dx sum(u q) + m dx sum(q)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * float(xq.s[i])), acc[r]);
      } else {  // d dx (sum(u q) - o sum(q)), the integer part exact
        const __m512i si = _mm512_sub_epi32(s[r], _mm512_set1_epi32(kOffset * xq.s[i]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * 32, acc[r]);
}

template <int FMT>
void run16_rows_vnni(int64_t R, const uint8_t* w, int64_t G, const QRows& xq, int64_t r0, float* c) {
  switch (R) {
    case 1: return run16_vnni<FMT, 1>(w, G, xq, r0, c);
    case 2: return run16_vnni<FMT, 2>(w, G, xq, r0, c);
    case 3: return run16_vnni<FMT, 3>(w, G, xq, r0, c);
    default: return run16_vnni<FMT, 4>(w, G, xq, r0, c);
  }
}

// One record (16 rows x 32 inputs) dequantized into its place in the bf16 tile order: 16 lines of
// [16 rows][input pair], pair p at dst + p * 32.
template <int FMT>
void dequantize_record(const uint8_t* p, bf16* dst) {
  using T = Traits<FMT>;
  constexpr bool kFour = T::kFour, kMin = T::kMin, kF32 = T::kF32 && !T::kHalves;
  constexpr int kCodes = T::kCodes, kOffset = T::kOffset;
  __m512 d, m, d2 = _mm512_setzero_ps(), m2 = _mm512_setzero_ps();
  if constexpr (FMT == kQ6_K) {  // the first half's scales, and the second's for quads 4-7
    d = _mm512_loadu_ps(p + kCodes);
    d2 = _mm512_loadu_ps(p + kCodes + 64);
    m = _mm512_mul_ps(d, _mm512_set1_ps(-float(kOffset)));
    m2 = _mm512_mul_ps(d2, _mm512_set1_ps(-float(kOffset)));
  } else if constexpr (kF32) {
    d = _mm512_loadu_ps(p + kCodes);
    m = _mm512_loadu_ps(p + kCodes + 64);
  } else {
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCodes)));
    m = kMin ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCodes + 32)))
             : _mm512_mul_ps(d, _mm512_set1_ps(-float(kOffset)));  // exact: a float16 times a power of two
  }
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const __m512 d1 = d, m1 = m;
  auto value = [&](__m512i v, int i) {  // d * u + m, one rounding: gguf's float32 value (d * u is exact)
    const __m512i u = i == 3 ? _mm512_srli_epi32(v, 24) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), byte);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), d, m);
  };
  // Rows 0-15 of inputs 2p (lo) and 2p + 1 (hi) as one line of [16 rows][pair] bf16: both rounded by one
  // instruction (the same rounding as one at a time), then interleaved; a third fewer vector ops per
  // record than widening each and shifting one into place, which made the dequantization the tile path's
  // bottleneck.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  auto line = [&](__m512 lo, __m512 hi) {
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  };
  for (int j = 0; j < 8; ++j) {
    if constexpr (FMT == kQ6_K) d = j < 4 ? d1 : d2, m = j < 4 ? m1 : m2;
    __m512i v;
    if constexpr (kFour) {
      v = _mm512_loadu_si512(p + 64 * (j % 4));
      v = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
      if constexpr (T::kFive) v = _mm512_mask_add_epi8(v, fifth_bits(p + 256 + 8 * j), v, _mm512_set1_epi8(16));
    } else {
      v = _mm512_loadu_si512(p + 64 * j);
    }
    _mm512_storeu_si512(dst + 2 * j * 32, line(value(v, 0), value(v, 1)));
    _mm512_storeu_si512(dst + (2 * j + 1) * 32, line(value(v, 2), value(v, 3)));
  }
}

#pragma GCC pop_options
#endif  // SERVELM_AVX512_BF16

}  // namespace

servelm::DequantizeRecord servelm::record_dequantizer(int fmt) {
#ifdef SERVELM_QUANT_VNNI
  switch (fmt) {
    case kQ8_0: return dequantize_record<kQ8_0>;
    case kQ4_0: return dequantize_record<kQ4_0>;
    case kQ4_1: return dequantize_record<kQ4_1>;
    case kQ4_K: return dequantize_record<kQ4_K>;
    case kQ6_K: return dequantize_record<kQ6_K>;
    case kQ5_0: return dequantize_record<kQ5_0>;
    case kQ5_1: return dequantize_record<kQ5_1>;
    case kQ5_K: return dequantize_record<kQ5_K>;
  }
#endif
  check(false, "quant_linear: no bf16 dequantization of format ", fmt, " in this build");
  return nullptr;
}

namespace {

#if defined(__AVX2__) && !defined(SERVELM_AVX512_BF16)
#define SERVELM_QUANT_AVX2 1

inline __m256 cvt_scales(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 32 of a Q5 quad's fifth bits (bit b: byte b of the half) as bytes of 16 or 0.
inline __m256i fifth_bytes(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(  // byte b: the bits' byte b / 8
      _mm256_set1_epi32(int(bits)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));  // byte b: bit b % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// As run16_vnni, 8 of the 16 rows per 256-bit half: maddubs (u8 x s8 pairs into int16) then madd into int32.
template <int FMT, int R>
void run16_avx2(const uint8_t* w, int64_t G, const QRows& xq, int64_t r0, float* c) {
  using T = Traits<FMT>;
  constexpr bool kFour = T::kFour, kMin = T::kMin, kHalves = T::kHalves, kF32 = T::kF32;
  constexpr int kCodes = T::kCodes, kStride = T::kStride;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = w + g * kStride;
    _mm_prefetch(reinterpret_cast<const char*>(p + 8 * kStride), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i s[R];
      if constexpr (kFour) {  // |u q| <= 15 * 127: 8 pair sums stay within int16 (Q5, 31 * 127: 4 of them)
        __m256i s16[R];
        for (int r = 0; r < R; ++r) s16[r] = s[r] = _mm256_setzero_si256();
        for (int t = 0; t < 4; ++t) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t + 32 * h));
          __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if constexpr (T::kFive) {
            lo = _mm256_or_si256(lo, fifth_bytes(p + 256 + 8 * t + 4 * h));
            hi = _mm256_or_si256(hi, fifth_bytes(p + 256 + 8 * (t + 4) + 4 * h));
          }
          for (int r = 0; r < R; ++r) {
            const int32_t* xr = xq.quads(r0 + r) + g * 8;
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[t])));
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[t + 4])));
          }
          if (!T::kFive ? t == 3 : t % 2 == 1)
            for (int r = 0; r < R; ++r) {
              s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(s16[r], ones));
              s16[r] = _mm256_setzero_si256();
            }
        }
      } else if constexpr (kHalves) {  // 6-bit codes: u q pairs fit int16 as they are; a sum per half
        __m256i s2[R];
        for (int r = 0; r < R; ++r) s[r] = s2[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
          for (int r = 0; r < R; ++r) {
            const __m256i prod = _mm256_madd_epi16(
                _mm256_maddubs_epi16(v, _mm256_set1_epi32(xq.quads(r0 + r)[g * 8 + j])), ones);
            if (j < 4) s[r] = _mm256_add_epi32(s[r], prod);
            else s2[r] = _mm256_add_epi32(s2[r], prod);
          }
        }
        const __m256 da = _mm256_loadu_ps(reinterpret_cast<const float*>(p + kCodes) + 8 * h);
        const __m256 db = _mm256_loadu_ps(reinterpret_cast<const float*>(p + kCodes + 64) + 8 * h);
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * xq.G + g;
          const __m256 dx = _mm256_set1_ps(xq.d[i]);
          const __m256i sa = _mm256_sub_epi32(s[r], _mm256_set1_epi32(32 * xq.h[2 * i]));
          const __m256i sb = _mm256_sub_epi32(s2[r], _mm256_set1_epi32(32 * xq.h[2 * i + 1]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_mul_ps(da, dx), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_mul_ps(db, dx), acc[r][h]);
        }
        continue;
      } else {  // signed codes (u ^ 0x80 = u - 128) times q: |q| times q's sign on the codes, as llama.cpp
        for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i v = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h)), flip);
          for (int r = 0; r < R; ++r) {
            const __m256i xb = _mm256_set1_epi32(xq.quads(r0 + r)[g * 8 + j]);
            const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(v, xb));
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(prod, ones));
          }
        }
      }
      __m256 d, m = _mm256_setzero_ps();
      if constexpr (kF32) {
        d = _mm256_loadu_ps(reinterpret_cast<const float*>(p + kCodes) + 8 * h);
        m = _mm256_loadu_ps(reinterpret_cast<const float*>(p + kCodes + 64) + 8 * h);
      } else {
        d = cvt_scales(p + kCodes + 16 * h);
        if constexpr (kMin) m = cvt_scales(p + kCodes + 32 + 16 * h);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * xq.G + g;
        const float dx = xq.d[i];
        __m256i si = s[r];
        if constexpr (kFour && !kMin) si = _mm256_sub_epi32(si, _mm256_set1_epi32(T::kOffset * xq.s[i]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r][h]);
        if constexpr (kMin) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * float(xq.s[i])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * 32, acc[r][0]);
    _mm256_storeu_ps(c + r * 32 + 8, acc[r][1]);
  }
}

template <int FMT>
void run16_rows_avx2(int64_t R, const uint8_t* w, int64_t G, const QRows& xq, int64_t r0, float* c) {
  switch (R) {
    case 1: return run16_avx2<FMT, 1>(w, G, xq, r0, c);
    case 2: return run16_avx2<FMT, 2>(w, G, xq, r0, c);
    case 3: return run16_avx2<FMT, 3>(w, G, xq, r0, c);
    default: return run16_avx2<FMT, 4>(w, G, xq, r0, c);
  }
}
#endif  // AVX2

#if defined(SERVELM_QUANT_VNNI) || defined(SERVELM_QUANT_AVX2)
#define SERVELM_QUANT_INT 1

bool int_kernel_available() {
#ifdef SERVELM_QUANT_VNNI
  static const bool ok = __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return true;
#endif
}

// The int8-activation path for any number of rows: per block of 32 outputs (two runs), rows 4 at a time
// (the block's records stay in L1 for the next 4).
template <int FMT>
void int_matmul(servelm::LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
                int64_t N, const bf16* bias) {
  thread_local QRows rows;  // the caller's; the pool's threads read it through this reference (a thread_local
  QRows& xq = rows;          // named inside the lambda would be each thread's own, empty one)
  quantize_rows(xq, x, M, K, ldx);
  const int64_t G = K / 32, blocks = (N + 31) / 32, ldo = out.cols(N);
  const int stride = layout(FMT).stride();
  servelm::parallel_for(0, blocks, 2, [&](int64_t b, int64_t e) {
    alignas(64) float c[4 * 32];
    for (int64_t nb = b; nb < e; ++nb)
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t R = std::min<int64_t>(4, M - r0);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* run = packed + (2 * nb + h) * G * stride;
#ifdef SERVELM_QUANT_VNNI
          run16_rows_vnni<FMT>(R, run, G, xq, r0, c + 16 * h);
#else
          run16_rows_avx2<FMT>(R, run, G, xq, r0, c + 16 * h);
#endif
        }
#ifdef SERVELM_AVX512_BF16
        servelm::store_rows(servelm::Pending{c, R, nb * 32, out.at(r0 * ldo).p}, servelm::Epilogue{bias, N, out.store});
#else
        store_portable(c, R, nb * 32, out.at(r0 * ldo), bias, N);
#endif
      }
  });
}
#endif

}  // namespace

// Whether this build runs format `fmt` (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K, 5 Q5_0, 6 Q5_1, 7 Q5_K) for inputs
// of K features:
// 1 with the int8-activation kernel only, 2 with the bf16 tile path for many rows as well, 0 not at all.
SERVELM_API int servelm_quant_linear_supported(int fmt, int64_t K) {
  if (fmt < kQ8_0 || fmt > kQ5_K || K <= 0 || K % 32 != 0) return 0;
#ifdef SERVELM_QUANT_INT
  if (!int_kernel_available()) return 0;
#ifdef SERVELM_QUANT_VNNI
  return 2;
#else
  return 1;
#endif
#else
  return 0;
#endif
}

// out [M, N] bf16 or float32 (or [M, N / 2] bf16 for SiLU(gate) * up, the weight's rows packed gate/up
// interleaved 16 at a time), as `store` (servelm::Store) says, = x [M, K] (row stride ldx) times the packed
// weight (+ bias). M <= int_rows takes the int8-activation kernel, more rows the bf16 tile path where this
// build has it.
SERVELM_API int servelm_quant_linear(void* out, const bf16* x, int64_t M, int64_t K, int64_t ldx, int fmt,
                                     const uint8_t* packed, int64_t N, const bf16* bias, int store,
                                     int64_t int_rows) {
  return servelm::guarded([&] {
    servelm::check(servelm::valid_store(store), "quant_linear: store must be 0, 1 or 2");
    servelm::quant_linear({out, servelm::Store(store)}, x, M, K, ldx, fmt, packed, N, bias, int_rows);
  });
}
SERVELM_TAPE_ENTRY(servelm_quant_linear)

void servelm::quant_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, int fmt,
                           const uint8_t* packed, int64_t N, const bf16* bias, int64_t int_rows) {
  {
    servelm::check(servelm_quant_linear_supported(fmt, K) != 0, "quant_linear: format ", fmt, " with K = ", K,
                   " is not supported by this build or CPU");
    servelm::check(M >= 0 && N > 0 && (out.store != kStoreSiluMul || (N % 32 == 0 && bias == nullptr)),
                   "quant_linear: bad shape (silu_mul needs N % 32 == 0 and no bias)");
    if (M == 0) return;
#ifdef SERVELM_QUANT_INT
#ifdef SERVELM_QUANT_VNNI
    if (M > int_rows) {
      const QuantWeight w{fmt, packed, layout(fmt).stride()};
      if (servelm::amx_available()) servelm::amx_linear(out, x, M, K, ldx, w, N, bias);
      else servelm::avx512_linear(out, x, M, K, ldx, w, N, bias);
      return;
    }
#endif
    (void)int_rows;
    switch (fmt) {
      case kQ8_0: return int_matmul<kQ8_0>(out, x, M, K, ldx, packed, N, bias);
      case kQ4_0: return int_matmul<kQ4_0>(out, x, M, K, ldx, packed, N, bias);
      case kQ4_1: return int_matmul<kQ4_1>(out, x, M, K, ldx, packed, N, bias);
      case kQ4_K: return int_matmul<kQ4_K>(out, x, M, K, ldx, packed, N, bias);
      case kQ5_0: return int_matmul<kQ5_0>(out, x, M, K, ldx, packed, N, bias);
      case kQ5_1: return int_matmul<kQ5_1>(out, x, M, K, ldx, packed, N, bias);
      case kQ5_K: return int_matmul<kQ5_K>(out, x, M, K, ldx, packed, N, bias);
      default: return int_matmul<kQ6_K>(out, x, M, K, ldx, packed, N, bias);
    }
#else
    (void)out, (void)x, (void)ldx, (void)packed, (void)bias, (void)int_rows;
#endif
  }
}

// The packed weight dequantized to float32 [N, K] row-major (every build; for tests): gguf's values exactly.
SERVELM_API int servelm_quant_unpack(float* out, int fmt, const uint8_t* packed, int64_t N, int64_t K) {
  return servelm::guarded([&] {
    servelm::check(K > 0 && K % 32 == 0 && N > 0, "quant_unpack: K a multiple of 32");
    const Layout L = layout(fmt);
    const int64_t G = K / 32;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* rec = packed + ((n / 16) * G + g) * L.stride();
        for (int kk = 0; kk < 32; ++kk) {
          float d, m;
          scale_min(rec, L, int(n % 16), kk, d, m);
          out[n * K + g * 32 + kk] = std::fma(float(code_at(rec, L, int(n % 16), kk)), d, m);
        }
      }
  });
}
