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

// Up to 32 rows x one 32-column block. Tiles: C 0-3 (rows 0-15 / 16-31 x columns 0-15 / 16-31),
// A 4-5, B 6-7. `a` is x in tile order (see amx_linear), `c` receives float32 [32][32].
template <bool kTwoRowTiles>
void tile_block32(const bf16* a, const bf16* b, int64_t K, float* c, const bf16* next, Pending& pending,
                  const Epilogue& ep) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    const bf16* bk = b + k * kN;
    const int64_t po = k * kN;  // the next block's k-step, prefetched a quarter at a time between tile ops
    _tile_loadd(6, bk, 64);
    prefetch_step(next, po, 512);
    _tile_loadd(4, a + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    prefetch_step(next, po + 256, 512);
    _tile_loadd(7, bk + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    prefetch_step(next, po + 512, 512);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, a + K * 16 + k * 16, 64);
      _tile_dpbf16ps(2, 5, 6);
      prefetch_step(next, po + 768, 512);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      prefetch_step(next, po + 768, 512);
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
void tile_block64(const bf16* a, const bf16* b, int64_t K, float* c, const bf16* next, Pending& pending,
                  const Epilogue& ep) {
  for (int h = 0; h < 2; ++h) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      const bf16* bk = b + k * kN + h * 512;
      const int64_t po = k * kN + h * 512;  // this half's share of the next block, 128 B per tile op
      _tile_loadd(6, bk, 64);
      prefetch_step(next, po, 128);
      _tile_loadd(4, a + k * 16, 64);
      prefetch_step(next, po + 64, 128);
      _tile_dpbf16ps(0, 4, 6);
      prefetch_step(next, po + 128, 128);
      _tile_loadd(5, a + K * 16 + k * 16, 64);
      prefetch_step(next, po + 192, 128);
      _tile_dpbf16ps(1, 5, 6);
      prefetch_step(next, po + 256, 128);
      _tile_loadd(4, a + 2 * K * 16 + k * 16, 64);
      prefetch_step(next, po + 320, 128);
      _tile_dpbf16ps(2, 4, 6);
      prefetch_step(next, po + 384, 128);
      _tile_loadd(5, a + 3 * K * 16 + k * 16, 64);
      prefetch_step(next, po + 448, 128);
      _tile_dpbf16ps(3, 5, 6);
      if (k == 0) drain(pending, ep);
    }
    _tile_stored(0, c + h * 16, kN * 4);
    _tile_stored(1, c + 16 * kN + h * 16, kN * 4);
    _tile_stored(2, c + 32 * kN + h * 16, kN * 4);
    _tile_stored(3, c + 48 * kN + h * 16, kN * 4);
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

void servelm::amx_linear(bf16* out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed, int64_t N,
                         const bf16* bias, bool silu_mul) {
  check(amx_available(), "amx_linear needs AMX");
  check_packed_linear("amx_linear", M, K, N, bias != nullptr, silu_mul);
  const int64_t blocks = (N + kN - 1) / kN, ldo = silu_mul ? N / 2 : N;
  if (M == 0) return;
#ifdef SERVELM_AMX
  // x in tile order, zero padded to whole 32-row groups: [row tile][K / 32][16][32]. Tile loads of rows
  // K apart (a power of two in most models) crowd into a few L1 sets and ran at half speed; 1 KB
  // contiguous tiles do not.
  const int64_t Mp = (M + 31) / 32 * 32;
  bf16* ap = static_cast<bf16*>(std::aligned_alloc(64, Mp * K * sizeof(bf16)));  // K % 32 == 0: whole lines
  check(ap != nullptr, "amx_linear: out of memory");
  struct Free {
    void* p;
    ~Free() { std::free(p); }
  } free_ap{ap};
  const bf16* xp = x;
  // a decode step's few rows are copied inline: a parallel region would cost more than the copy
  parallel_for(0, Mp / 16, 8, [&](int64_t begin, int64_t end) {
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
  const bf16* wp = packed;
  const Epilogue ep{bias, N, silu_mul};
  bf16* op = out;
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t m1 = std::min(M, m0 + kMc);
    parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      TileConfig cfg;
      _tile_loadconfig(&cfg);
      alignas(64) float c[2][64 * kN];  // two, so one converts while the other fills
      Pending pending;
      int flip = 0;
      for (int64_t nb = begin; nb < end; ++nb) {
        const bf16* w = wp + nb * kN * K;
        for (int64_t r = m0; r < m1;) {
          const int64_t rows = std::min<int64_t>(64, m1 - r);
          const bf16* next = r == m0 && nb + 1 < end ? w + kN * K : nullptr;  // first pass over the block only
          if (rows == 64) tile_block64(ap + r * K, w, K, c[flip], next, pending, ep);
          else if (rows > 16) tile_block32<true>(ap + r * K, w, K, c[flip], next, pending, ep);
          else tile_block32<false>(ap + r * K, w, K, c[flip], next, pending, ep);
          const int64_t done = rows == 64 ? 64 : std::min<int64_t>(rows, 32);
          pending = Pending{c[flip], done, nb * kN, op + r * ldo};
          flip ^= 1;
          r += done;
        }
      }
      drain(pending, ep);
      _tile_release();
    });
  }
#else
  (void)out, (void)x, (void)ldx, (void)packed, (void)blocks, (void)ldo;
#endif
}

// x: [M, K] bf16 (row stride ldx), packed: the weight in `pack_weight_for_tiles` order, bias: [N] bf16 or
// null; out [M, N], or [M, N / 2] with silu_mul.
SERVELM_API int servelm_amx_linear(bf16* out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed,
                                   int64_t N, const bf16* bias, int silu_mul) {
  return servelm::guarded([&] { servelm::amx_linear(out, x, M, K, ldx, packed, N, bias, silu_mul != 0); });
}
SERVELM_TAPE_ENTRY(servelm_amx_linear)
