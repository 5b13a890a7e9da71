// Paged attention for single-token (decode) queries on CPU, read straight from the block tables.
// The PyTorch fallback must gather every sequence's blocks into a contiguous copy first; this kernel
// reads each key/value row where it lies, so the only memory traffic is the cache itself.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "fast_exp.h"
#include "vec.h"
#include "vec8.h"
#include "tape.h"

namespace {

// Widen one row to float. bf16 is the top half of a float32, so a shift is exact and vectorizes.
template <typename scalar_t>
inline void load_row(const scalar_t* __restrict src, float* __restrict dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, servelm::bf16>) {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
      uint32_t bits = static_cast<uint32_t>(raw[d]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      dst[d] = f;
    }
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// The rows another work item will read next: its block table, head offset and length.
struct NextRows {
  const int64_t* table = nullptr;
  int64_t head_offset = 0, len = 0;
};

// What a walk over one item's rows prefetches into L2, one row's lines per row it reads, so that the
// misses spread over the walk instead of coming in bursts: the same positions of the next item
// (`next`), this walk's own rows `ahead` blocks further on (its blocks lie anywhere in the pool, which
// the hardware prefetcher cannot follow; with `ahead` > 1 also the next block's rows, into L1), and,
// for positions before `values_until`, the rows at the same offsets in `values` (a key walk fetching
// ahead for the value walk that follows it, whose own look-ahead cannot cover its first blocks).
// Prefetching each next block into L1 in a burst instead measured 1.25x slower (W1's batch-64 step,
// bench/decode_attention.py).
struct Prefetch {
  int64_t row_bytes = 0;  // 0: no prefetching
  NextRows next;
  int64_t ahead = 0;
  const void* values = nullptr;
  int64_t values_until = 0;
};

// The rows of the work item after `item` (sequence item / Hkv, kv head item % Hkv), if this thread's range
// [.., end) has one: what a walk over `item` prefetches for it.
inline NextRows next_item(int64_t item, int64_t end, int64_t Hkv, int64_t D, const int64_t* tables, int64_t max_blocks,
                          const int64_t* lens) {
  if (item + 1 >= end) return {};
  const int64_t nb = (item + 1) / Hkv;
  return {tables + nb * max_blocks, ((item + 1) % Hkv) * D, lens[nb]};
}

// Prefetch distances of the vector kernels. Each walk fetches its rows 3 blocks ahead into L2 and 1 block
// ahead into L1 (against 2 blocks into L2 only, cold caches, Emerald Rapids, bench/kernel_ab.py: W1's
// batch-64 step 1.05-1.06x, batch 1 at 600 positions 1.09-1.20x; W2 TPOT 1.02-1.03x); the key walk also
// fetches the value rows of up to 256 KB of positions (all of them up to 2048 positions at head size 64, bf16)
// so that the value walk starts on L2 hits. Against the next-item prefetch alone, cold caches, one thread
// (Zen 4): W2's batch-1 step at 600 positions 1.6x, W1's batch-64 step 1.38x, 4 x 2000 positions 1.62x;
// the key walk fetching only the first 2 or 8 blocks of values gave 1.24-1.51x.
constexpr int64_t kAheadBlocks = 3;
constexpr int64_t kValuePrefetchBytes = 256 << 10;

// Calls fn(row, t) for each context position t in [start, len) with a pointer to its row of head h,
// walking the block table one block at a time (one lookup per block, not a division per token).
template <typename scalar_t, typename Fn>
__attribute__((always_inline)) inline void for_each_row(const scalar_t* cache, const int64_t* table, int64_t bs,
                                                        int64_t row_stride, int64_t head_offset, int64_t start,
                                                        int64_t len, Fn&& fn, const Prefetch& pf = {}) {
  const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t t = start; t < len;) {
    const int64_t blk = t / bs, off = t % bs, n = std::min(bs - off, len - t);
    const int64_t at = (table[blk] * bs + off) * row_stride + head_offset;
    const scalar_t* row = cache + at;
    if (pf.row_bytes > 0) {
      const int64_t n_next = std::min(n, pf.next.len - t);
      const char* nrow = n_next > 0
          ? reinterpret_cast<const char*>(cache + (pf.next.table[blk] * bs + off) * row_stride + pf.next.head_offset)
          : nullptr;
      const int64_t t_ahead = (blk + pf.ahead) * bs + off;
      const int64_t n_ahead = pf.ahead > 0 ? std::min(n, len - t_ahead) : 0;
      const char* arow = n_ahead > 0
          ? reinterpret_cast<const char*>(cache + (table[blk + pf.ahead] * bs + off) * row_stride + head_offset)
          : nullptr;
      const int64_t n_values = pf.values != nullptr ? std::min(n, pf.values_until - t) : 0;
      const char* vrow = n_values > 0 ? reinterpret_cast<const char*>(static_cast<const scalar_t*>(pf.values) + at) : nullptr;
      const int64_t t_near = (blk + 1) * bs + off;
      const int64_t n_near = pf.ahead > 1 ? std::min(n, len - t_near) : 0;
      const char* near = n_near > 0
          ? reinterpret_cast<const char*>(cache + (table[blk + 1] * bs + off) * row_stride + head_offset)
          : nullptr;
      for (int64_t i = 0; i < n; ++i, row += row_stride) {
        const int64_t step = i * stride_bytes;
        for (int64_t byte = 0; byte < pf.row_bytes; byte += 64) {
          if (i < n_next) __builtin_prefetch(nrow + step + byte, 0, 2);
          if (i < n_ahead) __builtin_prefetch(arow + step + byte, 0, 2);
          if (i < n_near) __builtin_prefetch(near + step + byte, 0, 3);
          if (i < n_values) __builtin_prefetch(vrow + step + byte, 0, 2);
        }
        fn(row, t + i);
      }
    } else {
      for (int64_t i = 0; i < n; ++i, row += row_stride) fn(row, t + i);
    }
    t += n;
  }
}

// A cache row as float32: the row itself for a float32 cache, else widened into `buf`.
template <typename scalar_t>
inline const float* float_row(const scalar_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    (void)buf;
    (void)n;
    return src;
  } else {
    load_row(src, buf, n);
    return buf;
  }
}

template <typename scalar_t>
void decode_kernel(scalar_t* op, const scalar_t* qp, int64_t B, int64_t Hq, const servelm::Cache& cache,
                   const int64_t* tables, int64_t max_blocks, const int64_t* lens, double scale, int64_t window) {
  const int64_t D = cache.D, bs = cache.bs, Hkv = cache.Hkv, G = Hq / Hkv;
  const scalar_t* kp = static_cast<const scalar_t*>(cache.k);
  const scalar_t* vp = static_cast<const scalar_t*>(cache.v);
  const float fscale = static_cast<float>(scale);

  servelm::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t L = len - start;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(qp[(b * Hq + h * G + g) * D + d]) * fscale;
      const int64_t* table = tables + b * max_blocks;
      for_each_row(kp, table, bs, Hkv * D, h * D, start, len, [&](const scalar_t* kr, int64_t t) {
        const float* __restrict rp = float_row(kr, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * rp[d];
          scores[g * L + (t - start)] = s;
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        float* __restrict sg = scores.data() + g * L;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < L; ++j) m = std::max(m, sg[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = servelm::exp_nonpositive(sg[j] - m);
          sum += sg[j];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(vp, table, bs, Hkv * D, h * D, start, len, [&](const scalar_t* vr, int64_t t) {
        const float* __restrict rp = float_row(vr, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + (t - start)];
          float* __restrict ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += w * rp[d];
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * Hq + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

// The decode kernel in 8-lane vectors (vec8.h) for float32 and bf16 caches of any head size that is a multiple
// of 8, on every build: float32 models on every CPU, and bf16 on CPUs without AVX512-BF16 (AVX2 x86, ARM),
// where the generic loop above took ~7x the AVX512-BF16 kernel's time (one horizontal sum per score, the
// accumulators of P @ V reloaded and stored per position). Scores go 8 positions at a time into
// one register each and one transposing sum; P @ V keeps a tile of (query groups x 8-dim chunks) of the
// output in registers over the whole context. Each output is summed over the context in order, position by
// position, so a query's bits depend only on its own context, never on its batch.
namespace vec {

using namespace servelm::v8;

// One P @ V pass: output dims [8 * c0, 8 * (c0 + CT)) of query heads [0, GT) (probs and acc start at the
// pass's first head), kept in GT * CT registers over the positions `walk` visits, in its order: walk(fn) calls
// fn(row, j) with each position's value row (float32 or bf16) and its index j into probs. The sums go on from
// acc and end there: acc[g][d] += sum over the walk, in order, of probs[g * pstride + j] * row[d].
template <int GT, int CT, typename Walk>
void pv_pass(const Walk& walk, const float* probs, int64_t pstride, float* acc, int64_t D, int64_t c0) {
  F8 a[GT][CT];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < CT; ++c) a[g][c] = load(acc + g * D + (c0 + c) * 8);
  walk([&](const auto* row, int64_t j) {
    F8 w[GT];
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) w[g] = splat(probs[g * pstride + j]);
#pragma GCC unroll 8
    for (int c = 0; c < CT; ++c) {
      const F8 v = load(row + (c0 + c) * 8);
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) a[g][c] = fmadd(w[g], v, a[g][c]);
    }
  });
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < CT; ++c) store(acc + g * D + (c0 + c) * 8, a[g][c]);
}

template <typename Walk>
using PvPass = void (*)(const Walk&, const float*, int64_t, float*, int64_t, int64_t);

// Output registers a P @ V pass keeps: 12 of AVX2's 16 (the rest hold the broadcasts and a row) and of
// ARM's 32 (a vector is two there); 6 where a vector is two of x86's 16 SSE registers.
#if defined(__AVX2__) || defined(__aarch64__)
constexpr int64_t kAccumulators = 12;
#else
constexpr int64_t kAccumulators = 6;
#endif

// The pass for GT heads and ct chunks (GT * ct <= kAccumulators, ct <= 8).
template <typename Walk, int GT, int CT = 1>
PvPass<Walk> pv_pass_for(int64_t ct) {
  if constexpr (CT > 8 || GT * CT > kAccumulators) {
    return nullptr;
  } else {
    return ct == CT ? pv_pass<GT, CT, Walk> : pv_pass_for<Walk, GT, CT + 1>(ct);
  }
}

// P @ V of G query heads over D dims, in passes of up to 3 heads by as many 8-dim chunks as registers allow;
// each pass walks the positions again (walk, probs, pstride, acc as pv_pass's).
template <typename Walk>
void pv(const Walk& walk, int64_t G, int64_t D, const float* probs, int64_t pstride, float* acc) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gt = std::min<int64_t>(G - g0, 3);
    for (int64_t c0 = 0; c0 < D / 8;) {
      const int64_t ct = std::min<int64_t>({D / 8 - c0, kAccumulators / gt, 8});
      const PvPass<Walk> pass = gt == 1 ? pv_pass_for<Walk, 1>(ct) : gt == 2 ? pv_pass_for<Walk, 2>(ct)
                                                                           : pv_pass_for<Walk, 3>(ct);
      pass(walk, probs + g0 * pstride, pstride, acc + g0 * D, D, c0);
      c0 += ct;
    }
    g0 += gt;
  }
}

// The scores of one query (qg, scaled, D floats) against 8 key rows (float32): per row, one register of
// partial sums over the 8-dim chunks in order, then one transposing sum for all 8.
inline F8 score8(const float* qg, const float* const* rows, int64_t D) {
  F8 s[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) s[i] = zero();
  for (int64_t c = 0; c < D; c += 8) {
    const F8 q = load(qg + c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s[i] = fmadd(q, load(rows[i] + c), s[i]);
  }
  return hsum8(s);
}

// Softmax over sg[0, L) in place, in passes of 8 over [0, Lp) (the padding past L is set to -inf and gives 0).
inline void softmax_row(float* sg, int64_t L, int64_t Lp) {
  for (int64_t j = L; j < Lp; ++j) sg[j] = -INFINITY;
  F8 mv = splat(-INFINITY);
  for (int64_t j = 0; j < Lp; j += 8) mv = max(mv, load(sg + j));
  const F8 m = splat(hmax(mv));
  F8 sv = zero();
  for (int64_t j = 0; j < Lp; j += 8) {
    const F8 e = exp_nonpositive(load(sg + j) - m);
    store(sg + j, e);
    sv += e;
  }
  const F8 inv = splat(1.f / hadd(sv));
  for (int64_t j = 0; j < Lp; j += 8) store(sg + j, load(sg + j) * inv);
}

// Attention of one sequence's row b (its G query heads of kv head h) over its context: scores, softmax, then
// P @ V in register tiles, prefetching the rows of `next` (the next work item) as it walks.
template <typename T>
void attend_row(T* op, const T* qp, int64_t b, int64_t h, int64_t Hq, const servelm::Cache& cache,
                const int64_t* table, const int64_t* lens, float fscale, int64_t window, const NextRows& next,
                std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores, std::vector<float>& wide,
                const float* zeros) {
  const int64_t D = cache.D, bs = cache.bs, Hkv = cache.Hkv, G = Hq / Hkv, row_stride = Hkv * D;
  const T* kp = static_cast<const T*>(cache.k);
  const T* vp = static_cast<const T*>(cache.v);
  const int64_t len = lens[b];
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t L = len - start, Lp = (L + 7) & ~int64_t(7);
  scores.resize(G * Lp);
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qp[(b * Hq + h * G) * D + i]) * fscale;
  // Scores 8 positions at a time.
  const float* rows[8];
  int64_t n = 0;
  auto flush = [&](int64_t t_next) {  // scores of positions [t_next - n, t_next)
    for (int64_t i = n; i < 8; ++i) rows[i] = zeros;
    for (int64_t g = 0; g < G; ++g) store(scores.data() + g * Lp + (t_next - n - start), score8(qf.data() + g * D, rows, D));
    n = 0;
  };
  for_each_row(kp, table, bs, row_stride, h * D, start, len, [&](const T* kr, int64_t t) {
    if constexpr (!std::is_same_v<T, float>) {
      float* w = wide.data() + n * D;
      for (int64_t c = 0; c < D; c += 8) store(w + c, load(kr + c));
      rows[n] = w;
    } else {
      rows[n] = kr;
    }
    if (++n == 8) flush(t + 1);
  }, Prefetch{D * int64_t(sizeof(T)), next, kAheadBlocks, vp, start + kValuePrefetchBytes / (D * int64_t(sizeof(T)))});
  if (n > 0) flush(len);
  for (int64_t g = 0; g < G; ++g) softmax_row(scores.data() + g * Lp, L, Lp);
  // P @ V from zero, the table walked once per pass; the first pass prefetches
  std::fill(acc.begin(), acc.begin() + G * D, 0.f);
  bool first = true;
  const auto walk = [&](auto&& fn) {
    const Prefetch pf = first ? Prefetch{D * int64_t(sizeof(T)), next, kAheadBlocks} : Prefetch{};
    first = false;
    for_each_row(vp, table, bs, row_stride, h * D, start, len, [&](const T* vr, int64_t t) { fn(vr, t - start); }, pf);
  };
  pv(walk, G, D, scores.data(), Lp, acc.data());
  T* o = op + (b * Hq + h * G) * D;
  for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<T>(acc[i]);
}

// Rows of one sequence in one call (a prompt chunk's queries, one position each) are walked together: the
// context in blocks of kGroupBlock positions, each block's keys and values read (bf16: widened) once for every
// query of the group, where each row alone streamed its whole context from memory again (a 4096-token float32
// prompt spent 62% of its time here). Every score, softmax and P @ V sum is attend_row's, in its order (P @ V
// carried across blocks in memory), so each query gets the bits it gets alone.
constexpr int64_t kGroupRows = 32;
constexpr int64_t kGroupBlock = 64;

struct RowGroup {
  int64_t first = 0, n = 1, ref = 0;  // rows [first, first + n); ref: the longest, whose table the group walks
};

// Consecutive rows from b (at most kGroupRows) whose block tables agree on every block each of them reads.
inline RowGroup row_group(const int64_t* tables, int64_t max_blocks, const int64_t* lens, int64_t bs, int64_t b,
                          int64_t B) {
  RowGroup g{b, 1, b};
  for (; g.n < kGroupRows && b + g.n < B; ++g.n) {
    const int64_t c = b + g.n, common = (std::min(lens[c], lens[g.ref]) + bs - 1) / bs;
    if (std::memcmp(tables + c * max_blocks, tables + g.ref * max_blocks, common * sizeof(int64_t)) != 0) break;
    if (lens[c] > lens[g.ref]) g.ref = c;
  }
  return g;
}

template <typename T>
void attend_group(T* op, const T* qp, const RowGroup& grp, int64_t h, int64_t Hq, const servelm::Cache& cache,
                  const int64_t* tables, int64_t max_blocks, const int64_t* lens, float fscale, int64_t window,
                  std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores,
                  std::vector<float>& wide, const float* zeros) {
  const int64_t D = cache.D, bs = cache.bs, Hkv = cache.Hkv, G = Hq / Hkv, row_stride = Hkv * D;
  const int64_t* table = tables + grp.ref * max_blocks;
  int64_t start[kGroupRows], len[kGroupRows], Lp[kGroupRows], off[kGroupRows], lo = INT64_MAX, hi = 0, total = 0;
  for (int64_t i = 0; i < grp.n; ++i) {  // each row's scores: G rows of Lp + 8 (the last pass of 8 may overrun)
    len[i] = lens[grp.first + i];
    start[i] = window > 0 ? std::max<int64_t>(0, len[i] - window) : 0;
    Lp[i] = (len[i] - start[i] + 7) & ~int64_t(7);
    off[i] = total;
    total += G * (Lp[i] + 8);
    lo = std::min(lo, start[i]);
    hi = std::max(hi, len[i]);
  }
  scores.resize(total);
  qf.resize(grp.n * G * D);
  acc.assign(grp.n * G * D, 0.f);
  for (int64_t i = 0; i < grp.n * G * D; ++i)
    qf[i] = static_cast<float>(qp[((grp.first + i / (G * D)) * Hq + h * G) * D + i % (G * D)]) * fscale;
  const float* block_rows[kGroupBlock];
  // The block's rows of one cache as float32: pointers into a float32 cache, else rows widened into `wide`.
  auto rows_of = [&](const T* cache_base, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* r = cache_base + (table[t / bs] * bs + t % bs) * row_stride + h * D;
      if constexpr (std::is_same_v<T, float>) {
        block_rows[t - t0] = r;
      } else {
        float* w = wide.data() + (t - t0) * D;
        for (int64_t c = 0; c < D; c += 8) store(w + c, load(r + c));
        block_rows[t - t0] = w;
      }
    }
  };
  const T* kp = static_cast<const T*>(cache.k);
  const T* vp = static_cast<const T*>(cache.v);
  for (int64_t t0 = lo; t0 < hi; t0 += kGroupBlock) {  // scores, 8 positions at a time within each block
    const int64_t t1 = std::min(hi, t0 + kGroupBlock);
    rows_of(kp, t0, t1);
    for (int64_t i = 0; i < grp.n; ++i) {
      const int64_t a = std::max(t0, start[i]), e = std::min(t1, len[i]);
      for (int64_t t = a; t < e; t += 8) {
        const float* rows[8];
        for (int64_t j = 0; j < 8; ++j) rows[j] = t + j < e ? block_rows[t + j - t0] : zeros;
        for (int64_t g = 0; g < G; ++g)
          store(scores.data() + off[i] + g * (Lp[i] + 8) + (t - start[i]),
                score8(qf.data() + (i * G + g) * D, rows, D));
      }
    }
  }
  for (int64_t i = 0; i < grp.n; ++i)
    for (int64_t g = 0; g < G; ++g) softmax_row(scores.data() + off[i] + g * (Lp[i] + 8), len[i] - start[i], Lp[i]);
  for (int64_t t0 = lo; t0 < hi; t0 += kGroupBlock) {  // P @ V, block by block, each row's sums in order
    const int64_t t1 = std::min(hi, t0 + kGroupBlock);
    rows_of(vp, t0, t1);
    for (int64_t i = 0; i < grp.n; ++i) {
      const int64_t a = std::max(t0, start[i]), e = std::min(t1, len[i]);
      if (a >= e) continue;
      const auto walk = [&](auto&& fn) {
        for (int64_t t = a; t < e; ++t) fn(block_rows[t - t0], t - a);
      };
      pv(walk, G, D, scores.data() + off[i] + (a - start[i]), Lp[i] + 8, acc.data() + i * G * D);
    }
  }
  for (int64_t i = 0; i < grp.n; ++i) {
    T* o = op + ((grp.first + i) * Hq + h * G) * D;
    for (int64_t j = 0; j < G * D; ++j) o[j] = static_cast<T>(acc[i * G * D + j]);
  }
}

template <typename T>
void decode(T* op, const T* qp, int64_t B, int64_t Hq, const servelm::Cache& cache, const int64_t* tables,
            int64_t max_blocks, const int64_t* lens, double scale, int64_t window) {
  const int64_t D = cache.D, Hkv = cache.Hkv, G = Hq / Hkv;
  const float fscale = static_cast<float>(scale);
  std::vector<RowGroup> groups;
  for (int64_t b = 0; b < B;) {
    groups.push_back(row_group(tables, max_blocks, lens, cache.bs, b, B));
    b += groups.back().n;
  }
  // Work items (group, kv head). A prompt chunk's later rows have longer contexts: the items go first, last,
  // second, second to last..., so that each thread's contiguous share of them holds as much context as another's.
  const int64_t items = static_cast<int64_t>(groups.size()) * Hkv;
  const bool grouped = static_cast<int64_t>(groups.size()) < B;
  auto item_at = [&](int64_t k) { return !grouped ? k : k % 2 == 0 ? k / 2 : items - 1 - k / 2; };
  servelm::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, wide((grouped ? kGroupBlock : 8) * D), zeros(D);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = item_at(k);
      const RowGroup& grp = groups[item / Hkv];
      const int64_t h = item % Hkv;
      if (grp.n > 1) {
        attend_group(op, qp, grp, h, Hq, cache, tables, max_blocks, lens, fscale, window, qf, acc, scores, wide,
                     zeros.data());
        continue;
      }
      NextRows next;
      if (k + 1 < end) {
        const int64_t nitem = item_at(k + 1), nb = groups[nitem / Hkv].ref;
        next = {tables + nb * max_blocks, (nitem % Hkv) * D, lens[nb]};
      }
      qf.resize(G * D);
      acc.resize(G * D);
      attend_row(op, qp, grp.first, h, Hq, cache, tables + grp.first * max_blocks, lens, fscale, window, next, qf, acc,
                 scores, wide, zeros.data());
    }
  });
}

}  // namespace vec


#ifdef SERVELM_AVX512_BF16
using servelm::exp512;
using servelm::bf16;

// Lane i of the result is the sum of all lanes of v[i]: 16 horizontal sums in 45 instructions where
// 16 separate reductions take ~130, which is most of the score loop's cost.
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// P @ V for query groups [g0, g0 + GT) of one KV head, as bf16 dot products over pairs of positions:
// interleaving two value rows puts (v[t][d], v[t+1][d]) in one 32-bit lane, and one broadcast
// (p[t], p[t+1]) weighs both. GT and C are compile-time so the 2 * GT * C accumulators stay in
// registers (a runtime group count left them on the stack: a store-load chain per pair).
template <int C, int GT>
void pv_groups(const bf16* vp, const int64_t* table, int64_t bs, int64_t row_stride, int64_t head_offset,
               int64_t start, int64_t len, const bf16* probs, int64_t Lp, const bf16* zeros, bf16* out,
               const Prefetch& pf) {
  __m512 lo[GT][C], hi[GT][C];
#pragma GCC unroll 8
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  auto pair = [&](const bf16* r0, const bf16* r1, int64_t j) __attribute__((always_inline)) {
    __m512bh w[GT];
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g) {
      int32_t pp;
      std::memcpy(&pp, probs + g * Lp + j, sizeof(pp));
      w[g] = (__m512bh)_mm512_set1_epi32(pp);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + c * 32), b = _mm512_loadu_si512(r1 + c * 32);
      const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(a, b), vh = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
      for (int g = 0; g < GT; ++g) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], w[g], vl);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], w[g], vh);
      }
    }
  };
  const bf16* held = nullptr;  // the even position of a pair, waiting for its odd partner
  auto visit = [&](const bf16* vr, int64_t t) __attribute__((always_inline)) {
    if (held == nullptr) {
      held = vr;
    } else {
      pair(held, vr, t - 1 - start);
      held = nullptr;
    }
  };
  for_each_row(vp, table, bs, row_stride, head_offset, start, len, visit, pf);
  if (held != nullptr) pair(held, zeros, len - 1 - start);  // its partner's probability is 0
  // Lane i of an unpacklo result holds dim 8*(i/4) + i%4 of its 32, unpackhi the next 4.
  const __m512i idx0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i idx1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
#pragma GCC unroll 8
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {  // round to nearest even, as a float -> bf16 cast does
      servelm::store_bf16(out + g * C * 32 + c * 32, _mm512_permutex2var_ps(lo[g][c], idx0, hi[g][c]));
      servelm::store_bf16(out + g * C * 32 + c * 32 + 16, _mm512_permutex2var_ps(lo[g][c], idx1, hi[g][c]));
    }
}

// Query groups per P @ V pass: as many as keep 2 * GT * C accumulators within 16 registers.
template <int C>
constexpr int kGroupsPerPass = C <= 2 ? 4 : (C == 4 ? 2 : 1);

template <int C, int GT = kGroupsPerPass<C>>
void pv_dispatch(int64_t groups, const bf16* vp, const int64_t* table, int64_t bs, int64_t row_stride,
                 int64_t head_offset, int64_t start, int64_t len, const bf16* probs, int64_t Lp,
                 const bf16* zeros, bf16* out, const Prefetch& pf) {
  if constexpr (GT > 1) {
    if (groups < GT)
      return pv_dispatch<C, GT - 1>(groups, vp, table, bs, row_stride, head_offset, start, len, probs, Lp,
                                    zeros, out, pf);
  }
  pv_groups<C, GT>(vp, table, bs, row_stride, head_offset, start, len, probs, Lp, zeros, out, pf);
}

// bf16 with head_dim = 32 * C: q.k with AVX512-BF16 dot products (bf16 pairs, exact products,
// float32 sums), softmax with a vector exp, probabilities rounded to bf16 and P @ V as bf16 dot products
// over pairs of positions (half the float32 FMAs and no widening of the values).
template <int C>
void decode_bf16_avx512(bf16* op, const bf16* qp, int64_t B, int64_t Hq, const servelm::Cache& cache,
                        const int64_t* tables, int64_t max_blocks, const int64_t* lens, double scale,
                        int64_t window) {
  const int64_t D = cache.D, bs = cache.bs, Hkv = cache.Hkv;
  const int64_t G = Hq / Hkv, row_stride = Hkv * D;
  const bf16* kp = static_cast<const bf16*>(cache.k);
  const bf16* vp = static_cast<const bf16*>(cache.v);
  const float fscale = static_cast<float>(scale);

  servelm::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<bf16> probs;
    const std::vector<bf16> zeros(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t L = len - start;
      const int64_t Lp = (L + 15) & ~int64_t(15);
      scores.assign(G * Lp, -INFINITY);
      probs.resize(G * Lp);
      const bf16* qh = qp + (b * Hq + h * G) * D;
      const int64_t* table = tables + b * max_blocks;
      const NextRows next = next_item(item, end, Hkv, D, tables, max_blocks, lens);
      // Scores 16 positions at a time: per group, 16 register accumulators, then one transposing sum.
      const bf16* rows[16];
      int64_t n = 0;
      auto flush = [&](int64_t t_next) {  // scores of positions [t_next - n, t_next)
        for (int64_t i = n; i < 16; ++i) rows[i] = zeros.data();
        for (int64_t g = 0; g < G; ++g) {
          __m512bh qv[C];
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + g * D + c * 32);
          __m512 acc[16];
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
              a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(rows[i] + c * 32));
            acc[i] = a;
          }
          const __m512 sc = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(fscale));
          _mm512_mask_storeu_ps(scores.data() + g * Lp + (t_next - n - start), servelm::lanes(n), sc);
        }
        n = 0;
      };
      for_each_row(kp, table, bs, row_stride, h * D, start, len, [&](const bf16* kr, int64_t t) {
        rows[n] = kr;
        if (++n == 16) flush(t + 1);
      }, Prefetch{D * 2, next, kAheadBlocks, vp, start + kValuePrefetchBytes / (D * 2)});
      if (n > 0) flush(len);
      for (int64_t g = 0; g < G; ++g) {  // softmax over L (padding lanes hold -inf and give 0)
        float* sg = scores.data() + g * Lp;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < Lp; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sv = _mm512_setzero_ps();
        for (int64_t j = 0; j < Lp; j += 16) {
          const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m));
          _mm512_storeu_ps(sg + j, e);
          sv = _mm512_add_ps(sv, e);
        }
        // Probabilities rounded to bf16, as transformers' eager attention casts them before P @ V.
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
        for (int64_t j = 0; j < Lp; j += 16)
          servelm::store_bf16(probs.data() + g * Lp + j, _mm512_mul_ps(_mm512_loadu_ps(sg + j), inv));
      }
      for (int64_t g0 = 0; g0 < G; g0 += kGroupsPerPass<C>)  // only the first pass prefetches
        pv_dispatch<C>(std::min<int64_t>(G - g0, kGroupsPerPass<C>), vp, table, bs, row_stride, h * D, start, len,
                       probs.data() + g0 * Lp, Lp, zeros.data(), op + (b * Hq + h * G + g0) * D,
                       g0 == 0 ? Prefetch{C * 64, next, kAheadBlocks} : Prefetch{});
    }
  });
}
#endif

}  // namespace

namespace servelm {

// out, q: [B, Hq, D] contiguous; block tables [B, max_blocks]; lens [B] (context length including the new
// token); window <= 0 means none.
void paged_decode_attention(DType dtype, void* out, const void* q, int64_t B, int64_t Hq, const Cache& cache,
                            const int64_t* tables, int64_t max_blocks, const int64_t* lens, double scale,
                            int64_t window) {
  check(Hq % cache.Hkv == 0, "query heads must be a multiple of kv heads");
#ifdef SERVELM_AVX512_BF16
  if (dtype == kBFloat16) {
    auto* o = static_cast<bf16*>(out);
    const auto* qb = static_cast<const bf16*>(q);
    switch (cache.D) {
      case 64: return decode_bf16_avx512<2>(o, qb, B, Hq, cache, tables, max_blocks, lens, scale, window);
      case 128: return decode_bf16_avx512<4>(o, qb, B, Hq, cache, tables, max_blocks, lens, scale, window);
      case 256: return decode_bf16_avx512<8>(o, qb, B, Hq, cache, tables, max_blocks, lens, scale, window);
      case 32: return decode_bf16_avx512<1>(o, qb, B, Hq, cache, tables, max_blocks, lens, scale, window);
      default: break;  // other head sizes take the generic path
    }
  }
#endif
  if (cache.D % 8 == 0 && dtype == kFloat32)
    return vec::decode(static_cast<float*>(out), static_cast<const float*>(q), B, Hq, cache, tables, max_blocks,
                       lens, scale, window);
  if (cache.D % 8 == 0 && dtype == kBFloat16)
    return vec::decode(static_cast<bf16*>(out), static_cast<const bf16*>(q), B, Hq, cache, tables, max_blocks, lens,
                       scale, window);
  switch (dtype) {
    case kFloat32:
      return decode_kernel(static_cast<float*>(out), static_cast<const float*>(q), B, Hq, cache, tables, max_blocks,
                           lens, scale, window);
    case kBFloat16:
      return decode_kernel(static_cast<bf16*>(out), static_cast<const bf16*>(q), B, Hq, cache, tables, max_blocks,
                           lens, scale, window);
    case kFloat16:
      return decode_kernel(static_cast<f16*>(out), static_cast<const f16*>(q), B, Hq, cache, tables, max_blocks,
                           lens, scale, window);
  }
  check(false, "paged_decode_attention: float32, bfloat16 or float16");
}

// Writes this step's keys and values into their cache slots: one row copy per token (index_copy_ does the
// same element by element and cost ~4% of a prefill).
void write_kv(void* k_cache, void* v_cache, int64_t num_slots, int64_t row_bytes, const void* k, int64_t k_stride,
              const void* v, int64_t v_stride, const int64_t* slots, int64_t T) {
  for (int64_t t = 0; t < T; ++t) check(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t], " out of range");
  char* kc = static_cast<char*>(k_cache);
  char* vc = static_cast<char*>(v_cache);
  const char* kp = static_cast<const char*>(k);
  const char* vp = static_cast<const char*>(v);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + slots[t] * row_bytes, kp + t * k_stride, row_bytes);
    std::memcpy(vc + slots[t] * row_bytes, vp + t * v_stride, row_bytes);
  }
}

}  // namespace servelm

SERVELM_API int servelm_paged_decode_attention(int32_t dtype, void* out, const void* q, int64_t B, int64_t Hq,
                                               const void* k_cache, const void* v_cache, int64_t num_blocks,
                                               int64_t bs, int64_t Hkv, int64_t D, const int64_t* tables,
                                               int64_t max_blocks, const int64_t* lens, double scale,
                                               int64_t window) {
  return servelm::guarded([&] {
    servelm::paged_decode_attention(servelm::DType(dtype), out, q, B, Hq,
                                    servelm::Cache{k_cache, v_cache, num_blocks, bs, Hkv, D}, tables, max_blocks,
                                    lens, scale, window);
  });
}
SERVELM_TAPE_ENTRY(servelm_paged_decode_attention)

SERVELM_API int servelm_write_kv(void* k_cache, void* v_cache, int64_t num_slots, int64_t row_bytes, const void* k,
                                 int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots, int64_t T) {
  return servelm::guarded([&] { servelm::write_kv(k_cache, v_cache, num_slots, row_bytes, k, k_stride, v, v_stride, slots, T); });
}
SERVELM_TAPE_ENTRY(servelm_write_kv)
