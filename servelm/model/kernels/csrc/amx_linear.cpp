// y = x W^T (+ b) for bf16 on AMX tiles, for the few rows of a decode step (and, with SiLU-and-multiply
// fused into the store, for a gate/up projection of any number of rows). W is prepacked in tile order
// (`pack_weight_for_tiles` in layers.py): per block of 32 output columns, per step of 32 inputs, two
// 16-row B tiles, 2 KB contiguous, so a block's weights stream from memory as one sequential run.
//
// Why not oneDNN here: over a model's worth of cache-cold weights, its bf16 matmul for 1-32 rows ran
// 1.2-1.8x slower than this loop (and the AVX512 matrix-vector kernel 1.4x slower at one row); at 64
// rows the two are level and beyond that oneDNN's blocking wins, so the caller switches there.
// Each output row is summed over K in the same order whatever the other rows are, so a sequence's
// logits do not depend on what it is batched with.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "amx.h"
#include "kernels.h"
#include "linear_epilogue.h"
#include "tape.h"

using servelm::bf16;

namespace {
// Outside the AMX guard: the argument checks use the block width on every CPU.
constexpr int64_t kN = 32;    // output columns per weight block (two B tiles)
constexpr int64_t kMc = 256;  // rows of x per pass: that slice of x stays in L2 while the weights stream by
#ifdef SERVELM_AMX
using servelm::bf16;
using servelm::Epilogue;
using servelm::Pending;
using servelm::store_rows;
static_assert(kN == servelm::kBlockCols, "the epilogue's block width");

// Converts `pending` once the first products of a block are issued, so the conversion overlaps them.
inline void drain(Pending& pending, const Epilogue& e) {
  if (pending.c) store_rows(pending, e);
  pending.c = nullptr;
}

// Prefetches `bytes` of the next weight block into L2 while this block computes. Callers spread a k-step's
// lines over its tile instructions, a few at a time: issued as one burst before the step, the weight
// stream and the products ran one after the other (the burst seemingly holding the line fill buffers
// the step's tile loads need); spread, 32 and 64 rows ran 1.13-1.3x faster (bench/kernel_ab.py).
inline void prefetch_step(const bf16* next, int64_t offset, int bytes) {
  if (!next) return;
  const char* p = reinterpret_cast<const char*>(next + offset);
  for (int l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
}

// What the tile kernels prefetch of the next block, a k-step's share at a time (a quarter per call in
// tile_block32, a sixteenth in tile_block64). BF16: the next bf16 block (2 KB per k-step), at the same
// constant offsets as before the source of blocks was pluggable.
struct Bf16Ahead {
  const bf16* next = nullptr;
  void quarter(int64_t k, int q) const { prefetch_step(next, k * kN + q * 256, 512); }
  void sixteenth(int64_t k, int j) const { prefetch_step(next, k * kN + j * 64, 128); }
};

// A GGUF weight's next block, dequantized into `dst` a k-step at a time (its two records, one per 16-row
// run) between this block's tile ops, so that the vector units' dequantization overlaps the tile unit's
// products; with the block dequantized before its products, the two ran one after the other.
struct QuantAhead {
  servelm::DequantizeRecord record = nullptr;
  const uint8_t* run0 = nullptr;  // the block's first run; the second follows it
  int64_t run_bytes = 0, stride = 0;
  bf16* dst = nullptr;
  void step(int64_t k, int h) const {
    if (!record) return;
    const int64_t g = k / 32;
    const uint8_t* p = run0 + h * run_bytes + g * stride;
    for (int64_t l = 0; l < stride; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 4 * stride + l), _MM_HINT_T0);
    record(p, dst + (2 * g + h) * 512);
  }
  void quarter(int64_t k, int q) const {
    if (q % 2 == 0) step(k, q / 2);
  }
  void sixteenth(int64_t k, int j) const {
    if (j % 8 == 0) step(k, j / 8);
  }
};

// Up to 32 rows x one 32-column block. Tiles: C 0-3 (rows 0-15 / 16-31 x columns 0-15 / 16-31),
// A 4-5, B 6-7. `a` is x in tile order (see amx_linear), `c` receives float32 [32][32].
template <bool kTwoRowTiles, typename Ahead>
void tile_block32(const bf16* a, const bf16* b, int64_t K, float* c, const Ahead& next, Pending& pending,
                  const Epilogue& ep) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    const bf16* bk = b + k * kN;
    // the next block's k-step, prefetched a quarter at a time between tile ops
    _tile_loadd(6, bk, 64);
    next.quarter(k, 0);
    _tile_loadd(4, a + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    next.quarter(k, 1);
    _tile_loadd(7, bk + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    next.quarter(k, 2);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, a + K * 16 + k * 16, 64);
      _tile_dpbf16ps(2, 5, 6);
      next.quarter(k, 3);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      next.quarter(k, 3);
    }
    if (k == 0) drain(pending, ep);
  }
  _tile_stored(0, c, kN * 4);
  _tile_stored(1, c + 16, kN * 4);
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, c + 16 * kN, kN * 4);
    _tile_stored(3, c + 16 * kN + 16, kN * 4);
  }
}

// 64 rows x one block, as two 16-column halves with C 0-3 one row tile each: every weight tile is loaded
// once and used by four products; x's tiles come from L1/L2. `c` receives float32 [64][32].
template <typename Ahead>
void tile_block64(const bf16* a, const bf16* b, int64_t K, float* c, const Ahead& next, Pending& pending,
                  const Epilogue& ep) {
  for (int h = 0; h < 2; ++h) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      const bf16* bk = b + k * kN + h * 512;
      const int j = 8 * h;  // this half's share of the next block's k-step, a sixteenth per tile op
      _tile_loadd(6, bk, 64);
      next.sixteenth(k, j);
      _tile_loadd(4, a + k * 16, 64);
      next.sixteenth(k, j + 1);
      _tile_dpbf16ps(0, 4, 6);
      next.sixteenth(k, j + 2);
      _tile_loadd(5, a + K * 16 + k * 16, 64);
      next.sixteenth(k, j + 3);
      _tile_dpbf16ps(1, 5, 6);
      next.sixteenth(k, j + 4);
      _tile_loadd(4, a + 2 * K * 16 + k * 16, 64);
      next.sixteenth(k, j + 5);
      _tile_dpbf16ps(2, 4, 6);
      next.sixteenth(k, j + 6);
      _tile_loadd(5, a + 3 * K * 16 + k * 16, 64);
      next.sixteenth(k, j + 7);
      _tile_dpbf16ps(3, 5, 6);
      if (k == 0) drain(pending, ep);
    }
    _tile_stored(0, c + h * 16, kN * 4);
    _tile_stored(1, c + 16 * kN + h * 16, kN * 4);
    _tile_stored(2, c + 32 * kN + h * 16, kN * 4);
    _tile_stored(3, c + 48 * kN + h * 16, kN * 4);
  }
}

// Where the tile loop gets each 32-column block (32 x K bf16 in tile order) and what it does ahead for the
// next one, per thread (`cursor`). A bf16 model's weight is already packed: a block is an address, and the
// next one is prefetched.
struct Bf16Blocks {
  using Ahead = Bf16Ahead;
  const bf16* w;
  int64_t K;
  Bf16Blocks cursor() const { return *this; }
  const bf16* block(int64_t nb) const { return w + nb * kN * K; }
  Bf16Ahead ahead(int64_t nb) const { return {block(nb)}; }
};

// A GGUF weight: each block is dequantized into one of two per-thread buffers that stay in L2 (32 x K bf16:
// 36 KB at K = 576, 96 KB at 1536), the next one during this one's first tile pass (QuantAhead). The
// whole weight dequantized into memory first and read back made 17-100 rows slower than the bf16 model,
// whose weight is read once.
class QuantBlocks {
 public:
  using Ahead = QuantAhead;
  QuantBlocks(const servelm::QuantWeight& w, int64_t K) : w_(w), K_(K), record_(servelm::record_dequantizer(w.fmt)) {}
  QuantBlocks cursor() const {
    QuantBlocks c = *this;
    c.buf_ = buffers(K_);
    return c;
  }
  const bf16* block(int64_t nb) {
    if (ready_ == nb) {
      cur_ ^= 1;
    } else {
      for (int h = 0; h < 2; ++h) {
        const uint8_t* run = w_.run(nb, h, K_);
        for (int64_t g = 0; g < K_ / 32; ++g) record_(run + g * w_.stride, buf_ + cur_ * kN * K_ + (2 * g + h) * 512);
      }
    }
    ready_ = -1;
    return buf_ + cur_ * kN * K_;
  }
  // Dequantizes block nb into the other buffer during the pass it is handed to, which covers every k-step.
  QuantAhead ahead(int64_t nb) {
    ready_ = nb;
    return {record_, w_.run(nb, 0, K_), w_.run(nb, 1, K_) - w_.run(nb, 0, K_), w_.stride, buf_ + (cur_ ^ 1) * kN * K_};
  }

 private:
  static bf16* buffers(int64_t K) {  // this thread's two, 64-byte aligned
    struct Buffer {
      bf16* p = nullptr;
      int64_t n = 0;
      ~Buffer() { std::free(p); }
    };
    thread_local Buffer buf;
    if (buf.n < 2 * kN * K) {
      std::free(buf.p);
      buf.p = static_cast<bf16*>(std::aligned_alloc(64, 2 * kN * K * sizeof(bf16)));  // a multiple of 64 bytes
      buf.n = buf.p ? 2 * kN * K : 0;
      servelm::check(buf.p != nullptr, "amx_linear: out of memory for dequantized weight blocks");
    }
    return buf.p;
  }
  servelm::QuantWeight w_;
  int64_t K_;
  servelm::DequantizeRecord record_;
  bf16* buf_ = nullptr;
  int64_t ready_ = -1;  // the block the other buffer holds
  int cur_ = 0;
};

// out = x W^T (+ bias, or the SiLU product) over the blocks `src` gives, in chunks of kMc rows.
template <typename Source>
void tile_matmul(servelm::LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, int64_t N, const bf16* bias,
                 const Source& src) {
  const int64_t blocks = (N + kN - 1) / kN, ldo = out.cols(N);
  // x in tile order, zero padded to whole 32-row groups: [row tile][K / 32][16][32]. Tile loads of rows
  // K apart (a power of two in most models) crowd into a few L1 sets and ran at half speed; 1 KB
  // contiguous tiles do not.
  const int64_t Mp = (M + 31) / 32 * 32;
  bf16* ap = static_cast<bf16*>(std::aligned_alloc(64, Mp * K * sizeof(bf16)));  // K % 32 == 0: whole lines
  servelm::check(ap != nullptr, "amx_linear: out of memory");
  struct Free {
    void* p;
    ~Free() { std::free(p); }
  } free_ap{ap};
  const bf16* xp = x;
  // a decode step's few rows are copied inline: a parallel region would cost more than the copy
  servelm::parallel_for(0, Mp / 16, 8, [&](int64_t begin, int64_t end) {
    for (int64_t mt = begin; mt < end; ++mt)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = mt * 16 + i;
        for (int64_t k = 0; k < K; k += 32) {
          bf16* dst = ap + mt * 16 * K + k * 16 + i * 32;
          if (r < M) std::memcpy(static_cast<void*>(dst), xp + r * ldx + k, 64);
          else std::memset(static_cast<void*>(dst), 0, 64);
        }
      }
  });
  const Epilogue ep{bias, N, out.store};
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t m1 = std::min(M, m0 + kMc);
    servelm::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      servelm::TileConfig cfg;
      _tile_loadconfig(&cfg);
      alignas(64) float c[2][64 * kN];  // two, so one converts while the other fills
      Pending pending;
      int flip = 0;
      auto cursor = src.cursor();
      for (int64_t nb = begin; nb < end; ++nb) {
        const bf16* w = cursor.block(nb);
        for (int64_t r = m0; r < m1;) {
          const int64_t rows = std::min<int64_t>(64, m1 - r);
          // the next block, on the first pass over this one only
          const auto next = r == m0 && nb + 1 < end ? cursor.ahead(nb + 1) : typename Source::Ahead{};
          if (rows == 64) tile_block64(ap + r * K, w, K, c[flip], next, pending, ep);
          else if (rows > 16) tile_block32<true>(ap + r * K, w, K, c[flip], next, pending, ep);
          else tile_block32<false>(ap + r * K, w, K, c[flip], next, pending, ep);
          const int64_t done = rows == 64 ? 64 : std::min<int64_t>(rows, 32);
          pending = Pending{c[flip], done, nb * kN, out.at(r * ldo).p};
          flip ^= 1;
          r += done;
        }
      }
      drain(pending, ep);
      _tile_release();
    });
  }
}
#endif
}  // namespace

bool servelm::amx_available() {
#ifdef SERVELM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

SERVELM_API int servelm_amx_linear_supported(int64_t K) { return K > 0 && K % 32 == 0 && servelm::amx_available(); }

void servelm::amx_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed,
                         int64_t N, const bf16* bias) {
  check(amx_available(), "amx_linear needs AMX");
  check_packed_linear("amx_linear", M, K, N, bias != nullptr, out.store);
  if (M == 0) return;
#ifdef SERVELM_AMX
  tile_matmul(out, x, M, K, ldx, N, bias, Bf16Blocks{packed, K});
#else
  (void)out, (void)x, (void)ldx, (void)packed;
#endif
}

void servelm::amx_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const QuantWeight& w,
                         int64_t N, const bf16* bias) {
  check(amx_available(), "amx_linear needs AMX");
  check_packed_linear("amx_linear", M, K, N, bias != nullptr, out.store);
  if (M == 0) return;
#ifdef SERVELM_AMX
  tile_matmul(out, x, M, K, ldx, N, bias, QuantBlocks(w, K));
#else
  (void)out, (void)x, (void)ldx, (void)w;
#endif
}

// x: [M, K] bf16 (row stride ldx), packed: the weight in `pack_weight_for_tiles` order, bias: [N] bf16 or
// null; out [M, N] bf16 or float32, or [M, N / 2] bf16, as `store` (servelm::Store) says.
SERVELM_API int servelm_amx_linear(void* out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed,
                                   int64_t N, const bf16* bias, int store) {
  return servelm::guarded([&] {
    servelm::check(servelm::valid_store(store), "amx_linear: store must be 0, 1 or 2");
    servelm::amx_linear({out, servelm::Store(store)}, x, M, K, ldx, packed, N, bias);
  });
}
SERVELM_TAPE_ENTRY(servelm_amx_linear)
