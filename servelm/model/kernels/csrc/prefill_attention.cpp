// Prefill attention: a chunk of queries against its own sequence's paged keys and values (a cached prefix
// included), causal, with an optional sliding window. bf16 in and out, float32 softmax. Two engines for
// the matrix products: AMX tiles where the CPU has them, else AVX512-BF16 dot products (PyTorch's CPU
// flash attention reached 50-90 GFLOP/s on this work with AMX, and 18 on Zen 4 without).
//
// Layout, per (query head, 16 queries), queries as the 16 lanes of a vector:
//   S^T = K . Q^T  (keys x 16 queries): the online softmax's running max and sum over keys are vertical
//                  operations on 16-query vectors, with no transposes;
//   O^T += V^T . P^T (head_dim x 16 queries), rescaled in vector registers between key blocks.
// Keys and values are first copied out of the paged cache into contiguous per-head buffers (K rows, and
// V transposed per block of 32 keys: [block][dim][32], so that a tile's rows are 64 bytes apart rather
// than a context apart, where they all fell in one L1 set), O(context x head_dim) work that every query
// block then reuses. A work item takes a kv head's query heads together (GQA) and, where that leaves room,
// several query blocks of each, so that the kv head's keys and values stream once per item (attend_group).
// Each query's result depends only on its own keys: any chunking, grouping or thread count gives the
// same bits.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "amx.h"
#include "kernels.h"
#include "tape.h"

using servelm::bf16;

namespace {

#ifdef SERVELM_AVX512_BF16
constexpr int64_t kQ = 16;  // queries per work item (vector lanes; tile columns)
constexpr int64_t kK = 32;  // keys per block (two tiles of S^T, one bf16 K-step of P^T)
constexpr int64_t kSuper = 128;  // keys per super-block: a group's lanes take turns over them (see attend_group)
constexpr int64_t kMaxLanes = 6;  // lanes (heads x query blocks) per work item that share a kv head

// Copies keys [t_begin, t_end) (multiples of kK) of one kv head, of its first `len`, into K[len_pad][D] and
// the values into VT[len_pad / kK][D][kK], zero padded past `len`. Values go through a 32-row staging
// block so that each VT row receives one whole cache line at a time.
void pack_keys(const bf16* k_cache, const bf16* v_cache, const int64_t* table, int64_t bs, int64_t row_stride,
               int64_t head_off, int64_t len, int64_t t_begin, int64_t t_end, int64_t D, bf16* K, bf16* VT) {
  alignas(64) bf16 stage[kK][256];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kK) {
    const int64_t n = std::min(kK, std::max<int64_t>(0, len - t0));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j, off = (table[t / bs] * bs + t % bs) * row_stride + head_off;
      std::memcpy(K + t * D, k_cache + off, D * sizeof(bf16));
      std::memcpy(stage[j], v_cache + off, D * sizeof(bf16));
    }
    for (int64_t j = n; j < kK; ++j) {
      std::memset(static_cast<void*>(K + (t0 + j) * D), 0, D * sizeof(bf16));
      std::memset(static_cast<void*>(stage[j]), 0, D * sizeof(bf16));
    }
    for (int64_t d = 0; d < D; ++d) {
      bf16* dst = VT + t0 * D + d * kK;
      for (int64_t j = 0; j < kK; ++j) dst[j] = stage[j][d];
    }
  }
}

// Query rows q0.. (n of them) of one head as Q^T in the tile's pair-interleaved layout:
// QP[step][r][query][2] = Q[query][32 * step + 2r + {0, 1}], missing queries zero.
void pack_queries(const bf16* q, int64_t row_stride, int64_t n, int64_t D, uint32_t* QP) {
  std::memset(QP, 0, D / 2 * kQ * sizeof(uint32_t));
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q + i * row_stride);
    for (int64_t p = 0; p < D / 2; ++p) QP[(p / 16) * 16 * kQ + (p % 16) * kQ + i] = row[p];
  }
}

// Per work item: where its queries sit, the running softmax state (lanes = queries) and one key block's
// scores S[key][query] and probabilities P^T (bf16 key pairs).
struct SoftmaxState {
  alignas(64) float S[kK][16];
  alignas(64) uint32_t PB[kK / 2][16];
  int64_t pos0, last, window;
  __m512i pos;  // each lane's query position (padding lanes copy the last query's)
  __m512 scale, m, l;  // scale: the softmax scale times log2(e); m: the running max in those units
  SoftmaxState() = default;
  SoftmaxState(int64_t pos0_, int64_t n, int64_t window_, float s) : pos0(pos0_), last(pos0_ + n - 1), window(window_) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // padding lanes copy the last query's position: harmless, and they never see an all-masked row
    pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(int(pos0)), lane), _mm512_set1_epi32(int(last)));
    scale = _mm512_set1_ps(s * 1.44269504088896341f);
    m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l = _mm512_setzero_ps();
  }
  int64_t first_block() const { return (window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0) / kK * kK; }
};

// One head's up to 16 queries within a work item: its queries as Q^T (pack_queries), its O^T accumulators
// and softmax state, and where its output rows go.
struct Lane {
  alignas(64) uint32_t QP[256 / 2 * kQ];
  alignas(64) float O[256 * 16];
  SoftmaxState st;
  int64_t pos0, n;
  bf16* out;
};

// 2^x as 2^n * 2^r, x = n + r with n an integer and r in [-1/2, 1/2], 2^r by a degree-4 polynomial:
// relative error under 3e-6, far below the bf16 rounding of the probabilities it makes. (The FMAs share
// a port with the tile unit's products, so each one saved counts.)
// kClamp: x may be -inf (a running max not yet set), which the clamp turns into 2^-150 -> 0. Unclamped,
// x below -150 gives 0 or the smallest denormal, which neither a bf16 probability (the conversion
// flushes denormals) nor a running sum of at least 2^-12 can tell apart from 0.
template <bool kClamp>
inline __m512 exp2_512(__m512 x) {
  if constexpr (kClamp) x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.560510516e-3f);  // least squares on Chebyshev nodes, relative error
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.591703951e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402498126e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931219697e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999991655e-1f));
  return _mm512_scalef_ps(p, n);
}

// One key block's softmax, in base 2: scores s in S (left as they are), each query's running max m of
// s * scale * log2(e) moved when needed (rescale(alpha) then scales the output accumulators), p =
// 2^(s * scale * log2(e) - m) (one FMA and exp2_512: exp(s * scale - max) up to rounding) out in PB as
// bf16 key pairs (the layout both engines' P^T . V^T products take), its sums added to the running sum.
// kEdge: the block crosses the diagonal or the window's edge, so some scores are masked; elsewhere
// every score counts and the masks are skipped. Both compute a query's unmasked p the same way, so a
// query's result does not depend on which of its blocks are edges for the others in its block.
template <bool kEdge, class Rescale>
inline void softmax_block_impl(SoftmaxState& st, int64_t kb, Rescale&& rescale, float (*S)[16], uint32_t (*PB)[16]) {
  // word 2q <- p0[q] (word q), word 2q + 1 <- p1[q] (word 16 + q)
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Lazy rescaling: exponents taken against a max up to 2^11.5 (e^8) below the true one still fit
  // float32 and bf16 comfortably, so the running max (and with it the accumulators) moves only when a
  // score exceeds it by more: a few times per query, not every block.
  const __m512 slack = _mm512_set1_ps(11.5f);
  __mmask16 valid[kK];
  __m512 mbs[4] = {neg_inf, neg_inf, neg_inf, neg_inf};  // four chains: a max is 4 cycles of latency
  for (int64_t j = 0; j < kK; ++j) {
    __m512 sj = _mm512_load_ps(S[j]);
    if constexpr (kEdge) {
      const __m512i key = _mm512_set1_epi32(int(kb + j));
      __mmask16 ok = _mm512_cmple_epi32_mask(key, st.pos);
      if (st.window > 0) ok &= _mm512_cmpgt_epi32_mask(_mm512_add_epi32(key, _mm512_set1_epi32(int(st.window))), st.pos);
      valid[j] = ok;
      sj = _mm512_mask_mov_ps(neg_inf, ok, sj);
    }
    mbs[j % 4] = _mm512_max_ps(mbs[j % 4], sj);
  }
  // scaling by a positive factor keeps the order: the max of the scaled scores is the scaled max
  const __m512 mb = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(mbs[0], mbs[1]), _mm512_max_ps(mbs[2], mbs[3])), st.scale);
  const __mmask16 grow = _mm512_cmp_ps_mask(mb, _mm512_add_ps(st.m, slack), _CMP_GT_OQ);
  if (grow) {
    const __m512 m_new = _mm512_mask_max_ps(st.m, grow, st.m, mb);
    const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), grow, exp2_512<true>(_mm512_sub_ps(st.m, m_new)));
    st.l = _mm512_mul_ps(st.l, alpha);
    rescale(alpha);
    st.m = m_new;
  }
  // a query with no key yet (its window starts further on) still has max -inf and all p masked to 0
  const __m512 m_use =
      kEdge ? _mm512_mask_mov_ps(st.m, _mm512_cmp_ps_mask(st.m, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps()) : st.m;
  const __m512i interleave = _mm512_load_si512(kInterleave);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < kK; j += 2) {
    __m512 p0 = exp2_512<false>(_mm512_fmsub_ps(_mm512_load_ps(S[j]), st.scale, m_use));
    __m512 p1 = exp2_512<false>(_mm512_fmsub_ps(_mm512_load_ps(S[j + 1]), st.scale, m_use));
    if constexpr (kEdge) {
      p0 = _mm512_maskz_mov_ps(valid[j], p0);
      p1 = _mm512_maskz_mov_ps(valid[j + 1], p1);
    }
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in words 0-15, p1 in 16-31
    _mm512_store_si512(PB[j / 2], _mm512_permutexvar_epi16(interleave, packed));
  }
  st.l = _mm512_add_ps(st.l, _mm512_add_ps(sum0, sum1));
}

template <class Rescale>
inline void softmax_block(SoftmaxState& st, int64_t kb, Rescale&& rescale, float (*S)[16], uint32_t (*PB)[16]) {
  // masks only where the block crosses the diagonal or the window's edge
  if (kb + kK - 1 > st.pos0 || (st.window > 0 && kb <= st.last - st.window))
    softmax_block_impl<true>(st, kb, rescale, S, PB);
  else
    softmax_block_impl<false>(st, kb, rescale, S, PB);
}

// O^T [dim][query] float32 -> each query's output row: scaled by 1 / sum, then gathered 16 dims at a
// time (the scalar loop this replaces, with its bf16 conversions, was a sixth of the kernel's time).
inline void write_rows(const SoftmaxState& st, float* O, int64_t D, int64_t n, bf16* out, int64_t out_stride) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), st.l);
  for (int64_t d = 0; d < D; ++d) _mm512_store_ps(O + d * 16, _mm512_mul_ps(_mm512_load_ps(O + d * 16), inv));
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i dims = _mm512_slli_epi32(lane, 4);  // lane * 16: the next dim's entry for this query
  for (int64_t i = 0; i < n; ++i) {
    bf16* row = out + i * out_stride;
    for (int64_t d = 0; d < D; d += 16) servelm::store_bf16(row + d, _mm512_i32gather_ps(dims, O + d * 16 + i, 4));
  }
}

// One head, up to 16 queries at positions pos0.. against keys [0, ctx) of the packed buffers, on AVX512:
// scores 8 keys at a time (one Q^T pair vector, eight broadcast key pairs), O^T 16 dims at a time in
// registers (one P^T pair vector, sixteen broadcast value pairs).
// With `Kf` and `VTf` (the same buffers widened to float32) it runs the float-FMA form of the pair
// products (see avx512_linear.cpp): odd element first, as the dot-product instruction adds them, so the
// same sums where that instruction is the slow one.
void attend_block_avx512(const uint32_t* QP, const bf16* K, const bf16* VT, const float* Kf, const float* VTf,
                         int64_t len_pad, int64_t D, int64_t pos0, int64_t n, int64_t window, float scale, float* O,
                         bf16* out, int64_t out_stride) {
  SoftmaxState st(pos0, n, window, scale);
  std::memset(O, 0, D * 16 * sizeof(float));
  const __m512bh* q = reinterpret_cast<const __m512bh*>(QP);
  const bool fma = Kf != nullptr;
  alignas(64) float QE[128][16], QO[128][16];  // Q^T's even and odd elements per pair, for the FMA form
  if (fma) {
    for (int64_t p = 0; p < D / 2; ++p) {
      __m512 e, o;
      servelm::split_pairs(QP + p * kQ, e, o);
      _mm512_store_ps(QE[p], e);
      _mm512_store_ps(QO[p], o);
    }
  }
  for (int64_t kb = st.first_block(); kb <= st.last; kb += kK) {
    for (int64_t j0 = 0; j0 < kK; j0 += 8) {
      __m512 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
      if (fma) {
        const float* kr = Kf + (kb + j0) * D;
        for (int64_t p = 0; p < D / 2; ++p) {
          const __m512 qe = _mm512_load_ps(QE[p]), qo = _mm512_load_ps(QO[p]);
          for (int u = 0; u < 8; ++u)
            acc[u] = _mm512_fmadd_ps(qe, _mm512_set1_ps(kr[u * D + 2 * p]),
                                     _mm512_fmadd_ps(qo, _mm512_set1_ps(kr[u * D + 2 * p + 1]), acc[u]));
        }
      } else {
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(K + (kb + j0) * D);
        for (int64_t p = 0; p < D / 2; ++p) {
          const __m512bh qv = q[p];
          for (int u = 0; u < 8; ++u) acc[u] = _mm512_dpbf16_ps(acc[u], qv, (__m512bh)_mm512_set1_epi32(int(krow[u * D / 2 + p])));
        }
      }
      for (int u = 0; u < 8; ++u) _mm512_store_ps(st.S[j0 + u], acc[u]);
    }
    softmax_block(st, kb, [&](__m512 alpha) {
      for (int64_t d = 0; d < D; ++d) _mm512_store_ps(O + d * 16, _mm512_mul_ps(_mm512_load_ps(O + d * 16), alpha));
    }, st.S, st.PB);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 o[16];
      for (int u = 0; u < 16; ++u) o[u] = _mm512_load_ps(O + (d0 + u) * 16);
      if (fma) {
        for (int64_t jp = 0; jp < kK / 2; ++jp) {
          __m512 pe, po;
          servelm::split_pairs(st.PB[jp], pe, po);
          for (int u = 0; u < 16; ++u) {
            const float* vr = VTf + kb * D + (d0 + u) * kK + 2 * jp;
            o[u] = _mm512_fmadd_ps(pe, _mm512_set1_ps(vr[0]), _mm512_fmadd_ps(po, _mm512_set1_ps(vr[1]), o[u]));
          }
        }
      } else {
        for (int64_t jp = 0; jp < kK / 2; ++jp) {
          const __m512bh pv = (__m512bh)_mm512_load_si512(st.PB[jp]);
          for (int u = 0; u < 16; ++u) {
            const int32_t vpair = *reinterpret_cast<const int32_t*>(VT + kb * D + (d0 + u) * kK + 2 * jp);
            o[u] = _mm512_dpbf16_ps(o[u], pv, (__m512bh)_mm512_set1_epi32(vpair));
          }
        }
      }
      for (int u = 0; u < 16; ++u) _mm512_store_ps(O + (d0 + u) * 16, o[u]);
    }
  }
  write_rows(st, O, D, n, out, out_stride);
}
#endif  // SERVELM_AVX512_BF16

#ifdef SERVELM_AMX
using servelm::TileConfig;

// Tile registers (macros: the intrinsics paste the number into the instruction): S^T for keys 0-15 and
// 16-31 of a block, a K slice, a Q^T slice (later P^T), and 4-7 for O^T: with head_dim 64 all of O^T
// stays in tiles 4-7 (V^T slices then go through tile 2); otherwise 4-5 hold O^T slices loaded from
// memory and 6-7 V^T slices.
#define T_S0 0
#define T_S1 1
#define T_K 2
#define T_Q 3
#define T_P 3
#define T_O0 4
#define T_O1 5
#define T_V0 6
#define T_V1 7

// A group of lanes (a lane: one head's up to 16 queries, with its own Q^T, O^T and softmax state) that read
// the same kv head, against keys [0, ctx) of its packed buffers, on AMX tiles. The lanes take turns over
// super-blocks of kSuper keys: the lane that comes first brings the super-block's keys and values into L1,
// where the others find them, so that the kv head's whole context streams from L2 (or beyond) once per
// group rather than once per head and query block. Within a super-block a lane runs as it would alone,
// so its result is the same whatever lanes it shares a group with.
// kResident: head_dim is 64 and a lane's O^T lives in tiles 4-7 for the super-block's key loop (stored
// to its O between super-blocks).
template <bool kResident>
void attend_group(Lane* lanes, int64_t nl, const bf16* K, const bf16* VT, int64_t D) {
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  for (int64_t l = 0; l < nl; ++l) {
    std::memset(lanes[l].O, 0, D * 16 * sizeof(float));
    lo = std::min(lo, lanes[l].st.first_block());
    hi = std::max(hi, lanes[l].st.last);
  }
  const uint32_t* QP = nullptr;
  // S^T for one key block into tiles S0/S1. Issued one block ahead (software pipelining): the tile unit
  // computes the next block's scores while the vector units run this block's softmax.
  auto scores = [&](int64_t kb) {
    _tile_zero(T_S0);
    _tile_zero(T_S1);
    for (int64_t s = 0; s < D / 32; ++s) {
      _tile_loadd(T_Q, QP + s * 16 * kQ, kQ * 4);
      _tile_loadd(T_K, K + kb * D + s * 32, D * 2);
      _tile_dpbf16ps(T_S0, T_K, T_Q);
      _tile_loadd(T_K, K + (kb + 16) * D + s * 32, D * 2);
      _tile_dpbf16ps(T_S1, T_K, T_Q);
    }
  };
  auto store_o = [](float* O) {
    _tile_stored(4, O, 64);
    _tile_stored(5, O + 256, 64);
    _tile_stored(6, O + 512, 64);
    _tile_stored(7, O + 768, 64);
  };
  auto load_o = [](const float* O) {
    _tile_loadd(4, O, 64);
    _tile_loadd(5, O + 256, 64);
    _tile_loadd(6, O + 512, 64);
    _tile_loadd(7, O + 768, 64);
  };
  for (int64_t sb = lo; sb <= hi; sb += kSuper) {
    for (int64_t l = 0; l < nl; ++l) {
      SoftmaxState& st = lanes[l].st;
      float* O = lanes[l].O;
      const int64_t kb0 = std::max(sb, st.first_block()), kb_last = std::min(st.last, sb + kSuper - 1);
      if (kb0 > kb_last) continue;
      QP = lanes[l].QP;
      if constexpr (kResident) load_o(O);
      scores(kb0);
      for (int64_t kb = kb0; kb <= kb_last; kb += kK) {
        _tile_stored(T_S0, st.S[0], 64);
        _tile_stored(T_S1, st.S[16], 64);
        if (kb + kK <= kb_last) scores(kb + kK);
        softmax_block(st, kb, [&](__m512 alpha) {
          if constexpr (kResident) store_o(O);
          for (int64_t d = 0; d < D; ++d) _mm512_store_ps(O + d * 16, _mm512_mul_ps(_mm512_load_ps(O + d * 16), alpha));
          if constexpr (kResident) load_o(O);
        }, st.S, st.PB);
        _tile_loadd(T_P, st.PB, 64);
        if constexpr (kResident) {  // O^T += V^T . P^T in tiles 4-7
          _tile_loadd(T_K, VT + kb * D, kK * 2);
          _tile_dpbf16ps(4, T_K, T_P);
          _tile_loadd(T_K, VT + kb * D + 16 * kK, kK * 2);
          _tile_dpbf16ps(5, T_K, T_P);
          _tile_loadd(T_K, VT + kb * D + 32 * kK, kK * 2);
          _tile_dpbf16ps(6, T_K, T_P);
          _tile_loadd(T_K, VT + kb * D + 48 * kK, kK * 2);
          _tile_dpbf16ps(7, T_K, T_P);
          continue;
        }
        // O^T += V^T . P^T, accumulated in memory 16 dims at a time; two tile pairs so loads overlap products
        for (int64_t dg = 0; dg < D / 16; dg += 2) {
          float* o0 = O + dg * 256;
          float* o1 = o0 + 256;
          _tile_loadd(T_O0, o0, 64);
          _tile_loadd(T_V0, VT + kb * D + dg * 16 * kK, kK * 2);
          _tile_loadd(T_O1, o1, 64);
          _tile_loadd(T_V1, VT + kb * D + (dg + 1) * 16 * kK, kK * 2);
          _tile_dpbf16ps(T_O0, T_V0, T_P);
          _tile_dpbf16ps(T_O1, T_V1, T_P);
          _tile_stored(T_O0, o0, 64);
          _tile_stored(T_O1, o1, 64);
        }
      }
      if constexpr (kResident) store_o(O);
    }
  }
}
#endif  // SERVELM_AMX

}  // namespace

namespace {

// A 64-byte aligned scratch array, freed on scope exit (the kernels' vector loads expect whole lines).
template <typename T>
struct Scratch {
  T* p;
  explicit Scratch(int64_t n) : p(static_cast<T*>(std::aligned_alloc(64, std::max<int64_t>(64, (n * sizeof(T) + 63) / 64 * 64)))) {
    servelm::check(p != nullptr, "paged_prefill_attention: out of memory for ", n * sizeof(T), " bytes");
  }
  ~Scratch() { std::free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

}  // namespace

// Whether paged_prefill_attention takes bf16 queries of this head size: a multiple of 32 up to 256, on a
// build with AVX512-BF16 (AMX tiles used where present and permitted).
SERVELM_API int servelm_prefill_attention_supported(int64_t D) {
#ifdef SERVELM_AVX512_BF16
  return D % 32 == 0 && D > 0 && D <= 256;
#else
  (void)D;
  return 0;
#endif
}

// q, out: [Q, H, D] bf16 with unit last stride (row strides q_s0/q_s1, o_s0/o_s1); caches [blocks, bs, KV, D]
// contiguous bf16; block_table covers ctx_len positions, the last Q of which are the queries.
SERVELM_API int servelm_paged_prefill_attention(bf16* out, int64_t o_s0, int64_t o_s1, const bf16* q, int64_t q_s0,
                                                int64_t q_s1, int64_t Q, int64_t H, int64_t D, const bf16* k_cache,
                                                const bf16* v_cache, int64_t num_blocks, int64_t bs, int64_t KV,
                                                const int64_t* table, int64_t table_len, int64_t ctx_len,
                                                double scale, int64_t window) {
  return servelm::guarded([&] {
    using servelm::check;
    check(servelm_prefill_attention_supported(D), "paged_prefill_attention: needs AVX512-BF16, bf16 and head_dim % 32 == 0");
    check(H % KV == 0, "paged_prefill_attention: query heads must be a multiple of kv heads");
    check(table_len * bs >= ctx_len && Q <= ctx_len && Q > 0,
          "paged_prefill_attention: the block table must cover ctx_len >= number of queries");
    for (int64_t b = 0; b < (ctx_len + bs - 1) / bs; ++b)
      check(table[b] >= 0 && table[b] < num_blocks, "paged_prefill_attention: block ", table[b], " out of range");
#ifdef SERVELM_AVX512_BF16
    const int64_t G = H / KV;
    const int64_t len_pad = (ctx_len + kK - 1) / kK * kK;
    Scratch<bf16> kbuf(KV * len_pad * D), vbuf(KV * D * len_pad);
    bf16* K = kbuf.p;
    bf16* VT = vbuf.p;
    // the FMA form reads widened copies (cache-resident: 2 x 4 bytes per key and dim of one kv head)
    const bool fma = servelm::fma_dot();
    const int64_t per_head = len_pad * D;
    Scratch<float> kf(fma ? KV * per_head : 0), vf(fma ? KV * per_head : 0);
    // in pieces of kPack keys, so that a few kv heads still split evenly across the threads
    constexpr int64_t kPack = 512;
    const int64_t pieces = (len_pad + kPack - 1) / kPack;
    servelm::parallel_for(0, KV * pieces, 1, [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        const int64_t h = item / pieces, t0 = item % pieces * kPack, t1 = std::min(len_pad, t0 + kPack);
        pack_keys(k_cache, v_cache, table, bs, KV * D, h * D, ctx_len, t0, t1, D, K + h * per_head, VT + h * per_head);
        if (!fma) continue;
        for (int64_t i = h * per_head + t0 * D; i < h * per_head + t1 * D; ++i) {  // exact: bf16 is a float32's top half
          kf.p[i] = K[i];
          vf.p[i] = VT[i];
        }
      }
    });
    const float* Kf = fma ? kf.p : nullptr;
    const float* VTf = fma ? vf.p : nullptr;
    const int64_t nqb = (Q + kQ - 1) / kQ, first_pos = ctx_len - Q;
    const float fscale = static_cast<float>(scale);
    [[maybe_unused]] bool tiles = false;
#ifdef SERVELM_AMX
    tiles = servelm::amx_permitted();
#endif
    // A work item: a kv head's query heads (up to kMaxLanes of them; more heads split into subgroups) and,
    // where that leaves room, several query blocks of each (`span` of them), as the lanes of one group.
    const int64_t heads_per_item = std::min(G, kMaxLanes), nsub = (G + heads_per_item - 1) / heads_per_item;
    const int64_t span = std::max<int64_t>(1, kMaxLanes / heads_per_item), nspan = (nqb + span - 1) / span;
    servelm::parallel_for(0, KV * nsub * nspan, 1, [&](int64_t b, int64_t e) {
#ifdef SERVELM_AMX
      TileConfig cfg;
      if (tiles) _tile_loadconfig(&cfg);
#endif
      std::unique_ptr<Lane[]> lanes(new Lane[kMaxLanes]);
      for (int64_t item = b; item < e; ++item) {
        // query spans in the order first, last, second, second last, ...: a thread's contiguous range of
        // items then holds as much causal work as the other's
        const int64_t c = item / nspan, j = item % nspan, sp = j % 2 == 0 ? j / 2 : nspan - 1 - j / 2;
        const int64_t kvh = c / nsub, h0 = kvh * G + (c % nsub) * heads_per_item;
        const int64_t nh = std::min(heads_per_item, (kvh + 1) * G - h0);
        int64_t nl = 0;
        for (int64_t qb = sp * span; qb < std::min(nqb, (sp + 1) * span); ++qb) {
          for (int64_t h = h0; h < h0 + nh; ++h, ++nl) {
            Lane& ln = lanes[nl];
            const int64_t q0 = qb * kQ;
            ln.n = std::min(kQ, Q - q0);
            ln.pos0 = first_pos + q0;
            ln.out = out + q0 * o_s0 + h * o_s1;
            ln.st = SoftmaxState(ln.pos0, ln.n, window, fscale);
            pack_queries(q + q0 * q_s0 + h * q_s1, q_s0, ln.n, D, ln.QP);
          }
        }
        const bf16* Kh = K + kvh * len_pad * D;
        const bf16* VTh = VT + kvh * D * len_pad;
#ifdef SERVELM_AMX
        if (tiles) {
          (D == 64 ? attend_group<true> : attend_group<false>)(lanes.get(), nl, Kh, VTh, D);
          for (int64_t l = 0; l < nl; ++l) write_rows(lanes[l].st, lanes[l].O, D, lanes[l].n, lanes[l].out, o_s0);
          continue;
        }
#endif
        for (int64_t l = 0; l < nl; ++l)
          attend_block_avx512(lanes[l].QP, Kh, VTh, fma ? Kf + kvh * len_pad * D : nullptr,
                              fma ? VTf + kvh * D * len_pad : nullptr, len_pad, D, lanes[l].pos0, lanes[l].n, window,
                              fscale, lanes[l].O, lanes[l].out, o_s0);
      }
#ifdef SERVELM_AMX
      if (tiles) _tile_release();
#endif
    });
#else
    (void)out, (void)o_s0, (void)o_s1, (void)q, (void)q_s0, (void)q_s1, (void)k_cache, (void)v_cache, (void)scale,
        (void)window;
#endif
  });
}
SERVELM_TAPE_ENTRY(servelm_paged_prefill_attention)
