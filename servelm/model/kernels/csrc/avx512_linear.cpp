// bf16 linear layers on CPUs with AVX512-BF16 but no AMX, for any number of rows: the
// weight is read in the AMX kernel's packed order (`pack_weight_for_tiles`), one sequential stream with
// 16 output columns x one input pair per 64-byte line, so each line feeds dot-product instructions with
// no horizontal sums. Every row's sums run in the same order whatever the number of rows, so a row's
// result does not depend on the rows beside it. Over SmolLM2's weights (cache-cold, one thread, Zen 4):
// one row at the plain-read bandwidth (26 GB/s; oneDNN 12), 64 rows at ~205 GFLOP/s (oneDNN ~180),
// prefill-sized inputs ~222 GFLOP/s (oneDNN ~216), so oneDNN's copy of the weight is not kept.
//
// Two ways to multiply a bf16 pair, chosen once per process (`set_bf16_dot`; prefill attention follows
// it): AVX512-BF16's dot-product instruction, or two float FMAs per pair on widened operands, taken on
// Intel CPUs, where the instruction issues at half the rate of float FMAs (measured on Emerald Rapids:
// 86 vs 175 GFLOP/s per core, `bench/dot_rate.cpp`; on Zen 4 it is the faster one). The FMAs add the odd
// element's product first, then the even one's, which is the instruction's own order (products of bf16
// values are exact in float32), so on Intel the two give the same sums.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels.h"
#include "linear_epilogue.h"
#include "tape.h"

using servelm::bf16;

namespace {
#ifdef SERVELM_AVX512_BF16
using servelm::bf16;
using servelm::kBlockCols;

// The next block, fetched into L2 while this one computes: each of a block's `groups` row groups
// fetches every groups-th 2 KB step of it, so the stream is spread over the whole block's compute.
struct Ahead {
  const bf16* block = nullptr;
  int64_t groups = 1, group = 0;
};

// Input pair (x0, x1) of a row times a weight line (16 columns x pair) into acc, in one of four forms:
// X = bf16, AVX512-BF16's dot-product instruction; X = float, the float-FMA form, the line split into its
// even and odd elements (servelm::split_pairs) and the odd product added first, as the instruction does;
// X = WidenedBf16, the same FMAs on bf16 inputs widened pair by pair as they are broadcast; X = SplitFloat,
// the same FMAs on a line split beforehand (split_buffer). `In` is the input's element type, `W` the
// weight line's.
struct WidenedBf16 {};
struct SplitFloat {};

template <typename X>
struct Line;

// The float-FMA form's pair product: the odd elements' product first, as the instruction adds them.
inline __m512 fma_pair(__m512 acc, __m512 x0, __m512 x1, __m512 even, __m512 odd) {
  return _mm512_fmadd_ps(x0, even, _mm512_fmadd_ps(x1, odd, acc));
}

template <>
struct Line<bf16> {
  using In = bf16;
  using W = bf16;
  __m512bh w;
  explicit Line(const bf16* p) : w((__m512bh)_mm512_loadu_si512(p)) {}
  static __m512bh pair(const bf16* x) { return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)); }
  __m512 madd(__m512 acc, __m512bh xp) const { return _mm512_dpbf16_ps(acc, xp, w); }
};

template <>
struct Line<float> {
  using In = float;
  using W = bf16;
  __m512 even, odd;
  explicit Line(const bf16* p) { servelm::split_pairs(p, even, odd); }
  explicit Line(const float* split) : even(_mm512_load_ps(split)), odd(_mm512_load_ps(split + 16)) {}
  static const float* pair(const float* x) { return x; }
  __m512 madd(__m512 acc, const float* xp) const {
    return fma_pair(acc, _mm512_set1_ps(xp[0]), _mm512_set1_ps(xp[1]), even, odd);
  }
};

template <>
struct Line<WidenedBf16> {
  using In = bf16;
  using W = bf16;
  struct Pair {
    __m512 x0, x1;
  };
  Line<float> f;
  explicit Line(const bf16* p) : f(p) {}
  static Pair pair(const bf16* x) {
    __m512 x0, x1;
    servelm::broadcast_pair(x, x0, x1);
    return {x0, x1};
  }
  __m512 madd(__m512 acc, const Pair& xp) const { return fma_pair(acc, xp.x0, xp.x1, f.even, f.odd); }
};

// A line already split into a split_buffer: its 16 even elements, then its 16 odd ones, as float32.
template <>
struct Line<SplitFloat> : Line<float> {
  using W = float;
  using Line<float>::Line;
};

// Room for a block's K lines split into float32 even and odd elements ([line][16 even | 16 odd], the same
// element offsets as the packed block's), one buffer per thread. When several row groups reuse a block,
// the first group stores the lines it splits there and the others read them, which spares each of them
// the 4 vector ops per 48 FMAs that splitting takes on the ports the FMAs issue from.
float* split_buffer(int64_t K) {
  struct Buffer {  // 64-byte aligned (std::vector<__m512> drops the type's alignment attribute)
    float* p = nullptr;
    int64_t floats = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buf;
  if (buf.floats < 32 * K) {
    std::free(buf.p);
    buf.p = static_cast<float*>(std::aligned_alloc(64, 32 * K * sizeof(float)));  // a multiple of 64 bytes
    buf.floats = buf.p != nullptr ? 32 * K : 0;
    servelm::check(buf.p != nullptr, "avx512_linear: out of memory for a split weight block");
  }
  return buf.p;
}

// Rows [0, R) of x times one packed 32-column block -> c [R][32] float32: both 16-column halves per
// input pair, so each broadcast of x feeds two products; one sum per row and half (2R accumulators).
// With `keep` (the float-FMA form) the split lines are also stored there for the groups that follow.
template <typename X, int R>
void block_rows(const typename Line<X>::In* x, int64_t ldx, const typename Line<X>::W* b, int64_t K, float* c,
                const Ahead& ahead, float* keep) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t turn = ahead.group;  // this group's k steps of the next block: every groups-th, from its own
  for (int64_t k = 0; k < K; k += 32) {
    const auto* bk = b + k * 32;  // [k step][half][16 pairs][16 columns][2]
    // Off this group's turn the prefetches touch the lines being read (L1 hits): no branch in the loop.
    const char* pf = ahead.block != nullptr && turn == 0 ? reinterpret_cast<const char*>(ahead.block + k * 32)
                                                         : reinterpret_cast<const char*>(bk);
    turn = turn == 0 ? ahead.groups - 1 : turn - 1;
#pragma GCC unroll 4
    for (int p = 0; p < 16; ++p) {
      _mm_prefetch(pf + p * 64, _MM_HINT_T1);  // the next block's lines p and 16 + p of this k step
      _mm_prefetch(pf + 1024 + p * 64, _MM_HINT_T1);
      const Line<X> w0(bk + p * 32), w1(bk + 512 + p * 32);
      if constexpr (std::is_same_v<X, float>) {
        if (keep != nullptr) {
          float* kk = keep + k * 32 + p * 32;
          _mm512_store_ps(kk, w0.even);
          _mm512_store_ps(kk + 16, w0.odd);
          _mm512_store_ps(kk + 512, w1.even);
          _mm512_store_ps(kk + 512 + 16, w1.odd);
        }
      }
      for (int r = 0; r < R; ++r) {
        const auto xp = Line<X>::pair(x + r * ldx + k + 2 * p);
        acc[r][0] = w0.madd(acc[r][0], xp);
        acc[r][1] = w1.madd(acc[r][1], xp);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(c + r * kBlockCols, acc[r][0]);
    _mm512_store_ps(c + r * kBlockCols + 16, acc[r][1]);
  }
}

// How far ahead the FMA form prefetches in few_rows, in elements: each line into L2 16 KB ahead, then
// into L1 8 KB ahead (its extra instructions per line keep fewer loads in flight than the instruction
// form). One row, one thread, Emerald Rapids (bench/few_rows_read.cpp), from DRAM: no prefetch 13.1 GB/s,
// L1 only 14.1, L2 only 15.5, both 16.6 (plain read 16.4); SmolLM2's batch-1 TPOT 1.10-1.12x. Weights
// that fit the L3 read ~15% slower with both than with L1 only in that benchmark (noisy), but the
// L3-resident llama-rand-60m's TPOT stayed level (0.98-1.03x).
constexpr int64_t kFewAheadL2 = 8192, kFewAheadL1 = 4096;

// The same sums for a few rows (batch-1 decode): one half at a time, so the weight is read in address
// order; with the two halves interleaved one row read 10 GB/s instead of 25 (Zen 4; 20% slower on
// Emerald Rapids).
template <typename X, int R>
void few_rows(const typename Line<X>::In* x, int64_t ldx, const bf16* b, int64_t K, float* c) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    for (int h = 0; h < 2; ++h) {
      const bf16* bh = b + k * 32 + h * 512;
      for (int p = 0; p < 16; ++p) {
        if constexpr (!std::is_same_v<X, bf16>) {
          _mm_prefetch(reinterpret_cast<const char*>(bh + p * 32 + kFewAheadL2), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(bh + p * 32 + kFewAheadL1), _MM_HINT_T0);
        }
        const Line<X> w(bh + p * 32);
        for (int r = 0; r < R; ++r) acc[r][h] = w.madd(acc[r][h], Line<X>::pair(x + r * ldx + k + 2 * p));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(c + r * kBlockCols, acc[r][0]);
    _mm512_store_ps(c + r * kBlockCols + 16, acc[r][1]);
  }
}

constexpr int64_t kRowGroup = 12;  // 24 accumulators; 8 measured level, 11, 14 and 16 slower
constexpr int64_t kChunkRows = 16 * kRowGroup;

// X: the pair-product form (Line); `keep`, the float-FMA form's split_buffer to fill (see block_rows).
template <typename X, int R = kRowGroup>
void group_times_block(int64_t rows, const typename Line<X>::In* x, int64_t ldx, const typename Line<X>::W* b,
                       int64_t K, float* c, const Ahead& ahead, float* keep = nullptr) {
  if constexpr (R > 1) {
    if (rows < R) return group_times_block<X, R - 1>(rows, x, ldx, b, K, c, ahead, keep);
  }
  block_rows<X, R>(x, ldx, b, K, c, ahead, keep);
}

template <typename X>
void few_times_block(int64_t rows, const typename Line<X>::In* x, int64_t ldx, const bf16* b, int64_t K, float* c) {
  switch (rows) {
    case 1: return few_rows<X, 1>(x, ldx, b, K, c);
    case 2: return few_rows<X, 2>(x, ldx, b, K, c);
    case 3: return few_rows<X, 3>(x, ldx, b, K, c);
    default: return few_rows<X, 4>(x, ldx, b, K, c);
  }
}

// Where packed_matmul gets each 32-column block (32 x K bf16 in pack_weight_for_tiles order), per thread
// (`cursor`), and the next block to prefetch while this one computes (null: none). A bf16 model's weight is
// already packed: a block is an address.
struct Bf16Blocks {
  const bf16* w;
  int64_t K;
  Bf16Blocks cursor() const { return *this; }
  const bf16* block(int64_t nb) const { return w + nb * kBlockCols * K; }
  const bf16* ahead(int64_t nb) const { return block(nb); }
};

// A GGUF weight: each block dequantized when the loop reaches it into a per-thread buffer that stays in L2
// (32 x K bf16) while the row groups run over it, instead of the whole weight into memory first and read
// back. Nothing to prefetch: the vector units that would run ahead are the ones doing the products.
struct QuantBlocks {
  const servelm::QuantWeight& w;
  int64_t K;
  servelm::DequantizeRecord record;
  bf16* buf = nullptr;
  QuantBlocks cursor() const {
    struct Buffer {  // this thread's, 64-byte aligned
      bf16* p = nullptr;
      int64_t n = 0;
      ~Buffer() { std::free(p); }
    };
    thread_local Buffer b;
    if (b.n < kBlockCols * K) {
      std::free(b.p);
      b.p = static_cast<bf16*>(std::aligned_alloc(64, kBlockCols * K * sizeof(bf16)));  // a multiple of 64 bytes
      b.n = b.p ? kBlockCols * K : 0;
      servelm::check(b.p != nullptr, "avx512_linear: out of memory for a dequantized weight block");
    }
    return {w, K, record, b.p};
  }
  const bf16* block(int64_t nb) const {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* run = w.run(nb, h, K);
      for (int64_t g = 0; g < K / 32; ++g) record(run + g * w.stride, buf + (2 * g + h) * 512);
    }
    return buf;
  }
  const bf16* ahead(int64_t) const { return nullptr; }
};

// Up to 4 rows the weight streams once at memory speed (one row: 26 GB/s, the plain-read bandwidth).
// Beyond, each 32-column block is reused from cache by groups of 12 rows while the groups fetch the
// next block into L2 (without: 160 instead of ~205 GFLOP/s at 64 rows; all of it by the first group:
// 1.6% slower than spread; with a few rows prefetching measured slower, the loads keep memory busy).
// Prefill-sized inputs pass over the blocks in chunks of 192 rows, whose inputs stay in L2.
// X: the pair-product form; the FMA form takes up to 4 rows as WidenedBf16, more as float.
// `src` gives each thread's blocks (Bf16Blocks, QuantBlocks).
template <typename X, typename Source>
void packed_matmul(const typename Line<X>::In* x, int64_t M, int64_t ldx, const Source& src, int64_t K,
                   const servelm::Epilogue& ep, servelm::LinearOut out) {
  const int64_t blocks = (ep.N + kBlockCols - 1) / kBlockCols, ldo = out.cols(ep.N);
  servelm::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kRowGroup * kBlockCols];
    auto cursor = src.cursor();
    if constexpr (!std::is_same_v<X, float>) {
      if (M <= 4) {
        for (int64_t nb = begin; nb < end; ++nb) {
          few_times_block<X>(M, x, ldx, cursor.block(nb), K, c);
          servelm::store_rows(servelm::Pending{c, M, nb * kBlockCols, out.p}, ep);
        }
        return;
      }
    }
    if constexpr (!std::is_same_v<X, WidenedBf16>) {
      for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t m1 = std::min<int64_t>(M, m0 + kChunkRows), groups = (m1 - m0 + kRowGroup - 1) / kRowGroup;
        // The FMA form, 3 or more groups: the first group over a block splits its lines and keeps them for
        // the others (with 2, the stores cost what the second group saves: 16 rows 0.98x).
        float* split = nullptr;
        if constexpr (std::is_same_v<X, float>) split = groups >= 3 ? split_buffer(K) : nullptr;
        for (int64_t nb = begin; nb < end; ++nb) {
          const bf16* b = cursor.block(nb);
          for (int64_t r = m0; r < m1; r += kRowGroup) {
            const int64_t rows = std::min<int64_t>(kRowGroup, m1 - r);
            const Ahead ahead{nb + 1 < end ? cursor.ahead(nb + 1) : nullptr, groups, (r - m0) / kRowGroup};
            if (split == nullptr || r == m0) {
              group_times_block<X>(rows, x + r * ldx, ldx, b, K, c, ahead, split);
            } else if constexpr (std::is_same_v<X, float>) {
              group_times_block<SplitFloat>(rows, x + r * ldx, ldx, split, K, c, ahead);
            }
            servelm::store_rows(servelm::Pending{c, rows, nb * kBlockCols, out.at(r * ldo).p}, ep);
          }
        }
      }
    }
  });
}
#endif

}  // namespace

#ifdef SERVELM_AVX512_BF16
namespace servelm {
bool& fma_dot() {
  static bool on = __builtin_cpu_is("intel");  // see the top of this file
  return on;
}
}  // namespace servelm
#endif

// Checks shared by the two packed-weight kernels (this one and amx_linear.cpp).
void servelm::check_packed_linear(const char* name, int64_t M, int64_t K, int64_t N, bool bias, Store store) {
  check(M >= 0 && K > 0 && K % 32 == 0 && N > 0, name, ": [M, K] input with K a multiple of 32 and N > 0");
  check(store != kStoreSiluMul || (N % 32 == 0 && !bias), name,
        "_silu_mul: gate and up widths must be multiples of 16, no bias");
}

#ifdef SERVELM_AVX512_BF16
namespace {
template <typename Source>
void avx512_matmul(servelm::LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const Source& src,
                   int64_t N, const bf16* bias) {
  using namespace servelm;
  const Epilogue ep{bias, N, out.store};
  if (!fma_dot()) {
    packed_matmul<bf16>(x, M, ldx, src, K, ep, out);
  } else if (M <= 4) {  // widened as broadcast: a float copy per call cost 1.6% of a batch-1 step
    packed_matmul<WidenedBf16>(x, M, ldx, src, K, ep, out);
  } else {  // widened once: M * K, against M * K * N multiplies
    float* xf = static_cast<float*>(std::aligned_alloc(64, (M * K * sizeof(float) + 63) / 64 * 64));
    check(xf != nullptr, "avx512_linear: out of memory");
    parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t k = 0; k < K; ++k) xf[r * K + k] = x[r * ldx + k];
    });
    try {
      packed_matmul<float>(xf, M, K, src, K, ep, out);
    } catch (...) {
      std::free(xf);
      throw;
    }
    std::free(xf);
  }
}
}  // namespace
#endif

void servelm::avx512_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed,
                            int64_t N, const bf16* bias) {
  check_packed_linear("avx512_linear", M, K, N, bias != nullptr, out.store);
#ifdef SERVELM_AVX512_BF16
  if (M == 0) return;
  avx512_matmul(out, x, M, K, ldx, Bf16Blocks{packed, K}, N, bias);
#else
  (void)out, (void)x, (void)ldx, (void)packed;
  check(false, "avx512_linear needs AVX512-BF16");
#endif
}

void servelm::avx512_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const QuantWeight& w,
                            int64_t N, const bf16* bias) {
  check_packed_linear("avx512_linear", M, K, N, bias != nullptr, out.store);
#ifdef SERVELM_AVX512_BF16
  if (M == 0) return;
  avx512_matmul(out, x, M, K, ldx, QuantBlocks{w, K, record_dequantizer(w.fmt)}, N, bias);
#else
  (void)out, (void)x, (void)ldx, (void)w;
  check(false, "avx512_linear needs AVX512-BF16");
#endif
}

// How the AVX512 linear and prefill attention kernels multiply bf16 pairs: 1 for two float FMAs per pair,
// 0 for the dot-product instruction, -1 where this build has no AVX512-BF16.
SERVELM_API int servelm_bf16_dot() {
#ifdef SERVELM_AVX512_BF16
  return servelm::fma_dot() ? 1 : 0;
#else
  return -1;
#endif
}

SERVELM_API void servelm_set_bf16_dot(int fma) {
#ifdef SERVELM_AVX512_BF16
  servelm::fma_dot() = fma != 0;
#else
  (void)fma;
#endif
}

// Whether avx512_linear takes an input of K features here (K % 32 == 0, AVX512-BF16 compiled in).
SERVELM_API int servelm_avx512_linear_supported(int64_t K) {
#ifdef SERVELM_AVX512_BF16
  return K > 0 && K % 32 == 0;
#else
  (void)K;
  return 0;
#endif
}

// x: [M, K] bf16 (row stride ldx), packed: the weight in `pack_weight_for_tiles` order, bias: [N] bf16 or
// null; out [M, N] bf16 or float32, or [M, N / 2] bf16 for a [gate; up] weight packed with gate_up=True, as
// `store` (servelm::Store) says.
SERVELM_API int servelm_avx512_linear(void* out, const bf16* x, int64_t M, int64_t K, int64_t ldx,
                                      const bf16* packed, int64_t N, const bf16* bias, int store) {
  return servelm::guarded([&] {
    servelm::check(servelm::valid_store(store), "avx512_linear: store must be 0, 1 or 2");
    servelm::avx512_linear({out, servelm::Store(store)}, x, M, K, ldx, packed, N, bias);
  });
}
SERVELM_TAPE_ENTRY(servelm_avx512_linear)
