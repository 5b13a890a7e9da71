// Dense linear layers for every CPU and build variant, float32 or bf16 (weights and activations alike):
// y = x W^T (+ bias), or silu(gate) * up for a gate/up weight, with float32 sums.
//
// The point of this kernel is its summation order, not a new speed record: every output element is summed
// over the K inputs one after another (acc = fma(x[k], w[k], acc), k = 0, 1, ..., K - 1), whatever the
// number of rows, the rows beside it or the number of threads (the work is split over output columns,
// never over K). A token's result is then the same bits in a decode batch of any size and in a prompt chunk
// of any length, which oneDNN's and MKL's matmuls do not promise: they pick their blocking by shape and by
// CPU (they did change rows' sums with the row count on AMD Zen and on AVX2 CPUs). The AMX and AVX512-BF16
// tile kernels (amx_linear.cpp, avx512_linear.cpp) have the same property for bf16 where they run; this one
// covers everything else: float32 models on any CPU, and bf16 on CPUs without AVX512-BF16.
//
// The weight is packed once at load (layers.pack_dense_weight): panels of 16 output columns, [N/16][K][16],
// zero padded to whole blocks of 32 columns, in the weight's own dtype (bf16 widens exactly by a shift).
// A gate/up weight is packed with its rows in gate_up_order (16 gate rows, then the matching 16 up rows,
// per block of 32), so that each block's epilogue holds matching gate and up columns.
//
// The micro-kernel keeps RB rows x 16 columns of sums in registers (AVX512: one vector per row; elsewhere two
// of vec8.h's 8-lane vectors: AVX2 registers, or pairs of NEON or SSE ones, with a fused multiply-add where
// the CPU has one: AVX2 and ARM, not baseline x86-64). Rows
// go 64 at a time (their float32 copy stays in L2) against every block of the thread's columns.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "tape.h"

#include "vec8.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

using servelm::bf16;

namespace {

constexpr int kPanel = 16;      // output columns per packed panel
constexpr int kBlock = 32;      // output columns per epilogue block (two panels: gate and up for silu_mul)
constexpr int kRows = 6;        // rows per micro-kernel call
constexpr int64_t kChunk = 64;  // rows per pass over the thread's columns

// 16 lanes of float32 sums and the operations the micro-kernel needs, per instruction set.
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Lanes load(const bf16* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
  }
  void fma(float x, const Lanes& w) { v = _mm512_fmadd_ps(_mm512_set1_ps(x), w.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#else
struct Lanes {  // two 8-lane vectors (vec8.h): AVX2 registers, NEON pairs on ARM, SSE pairs on baseline x86-64
  servelm::v8::F8 lo, hi;
  static Lanes zero() { return {servelm::v8::zero(), servelm::v8::zero()}; }
  template <typename T>
  static Lanes load(const T* p) { return {servelm::v8::load(p), servelm::v8::load(p + 8)}; }
  void fma(float x, const Lanes& w) {  // fused where the CPU has FMA; a multiply, then an add, elsewhere
    const servelm::v8::F8 b = servelm::v8::splat(x);
    lo = servelm::v8::fmadd(b, w.lo, lo);
    hi = servelm::v8::fmadd(b, w.hi, hi);
  }
  void store(float* p) const {
    servelm::v8::store(p, lo);
    servelm::v8::store(p + 8, hi);
  }
};
#endif

// c[r * kBlock + 0..15] = rows [0, R) of x (float32, row stride K) times one panel (K lines of 16).
template <int R, typename W>
void panel(const float* x, int64_t K, const W* w, float* c) {
  // unrolled before the compiler places acc: kept in registers, where a loop over it stored each row's
  // sums to the stack at every k (GCC, ARM)
  Lanes acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = Lanes::zero();
  for (int64_t k = 0; k < K; ++k) {
    const Lanes line = Lanes::load(w + k * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r].fma(x[r * K + k], line);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r].store(c + r * kBlock);
}

template <typename W>
void panel_rows(int64_t R, const float* x, int64_t K, const W* w, float* c) {
  switch (R) {
    case 1: return panel<1>(x, K, w, c);
    case 2: return panel<2>(x, K, w, c);
    case 3: return panel<3>(x, K, w, c);
    case 4: return panel<4>(x, K, w, c);
    case 5: return panel<5>(x, K, w, c);
    default: return panel<kRows>(x, K, w, c);
  }
}

// The float32 value an output of type T would hold (bf16 rounds to nearest even, as PyTorch's cast).
template <typename T>
inline float as(float v) {
  return float(T(v));
}

// A finished block: c [R][32] float32 sums of output columns n0.. -> rows of O (row stride ldo), bias added
// in float32 and rounded once to O; or, with silu_mul, 16 columns silu(gate) * up per row, rounded where the
// unfused chain of ops in the model's dtype rounds (the projection, the SiLU, the product). SiLU as
// g / (1 + exp(-g)) with the C library's expf, the same bits for every element.
template <typename T, typename O>
void store_block(const float* c, int64_t R, int64_t n0, O* out, int64_t ldo, const T* bias, int64_t N,
                 bool silu_mul) {
  for (int64_t r = 0; r < R; ++r) {
    const float* cr = c + r * kBlock;
    O* o = out + r * ldo;
    if (silu_mul) {
      for (int j = 0; j < kPanel; ++j) {
        const float g = as<T>(cr[j]), u = as<T>(cr[kPanel + j]);
        o[n0 / 2 + j] = O(as<T>(g / (1.f + std::exp(-g))) * u);
      }
      continue;
    }
    for (int64_t j = 0; j < kBlock && n0 + j < N; ++j)
      o[n0 + j] = O(cr[j] + (bias != nullptr ? float(bias[n0 + j]) : 0.f));
  }
}

// O: the output's element type, T's or float32 (a bf16 model's logits).
template <typename T, typename O, typename W>
void dense_linear(O* out, const T* x, int64_t M, int64_t K, int64_t ldx, const W* packed, int64_t N, const T* bias,
                  bool silu_mul) {
  // the rows as float32, contiguous (exact for bf16): the micro-kernel broadcasts one element per input
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = float(x[m * ldx + k]);
  const int64_t blocks = (N + kBlock - 1) / kBlock, ldo = silu_mul ? N / 2 : N;
  servelm::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    alignas(64) float c[kRows * kBlock];
    for (int64_t m0 = 0; m0 < M; m0 += kChunk)
      for (int64_t nb = b; nb < e; ++nb)
        for (int64_t r0 = m0; r0 < std::min(M, m0 + kChunk); r0 += kRows) {
          const int64_t R = std::min<int64_t>(kRows, std::min(M, m0 + kChunk) - r0);
          for (int h = 0; h < 2; ++h)
            panel_rows(R, xf.data() + r0 * K, K, packed + (2 * nb + h) * K * kPanel, c + h * kPanel);
          store_block(c, R, nb * kBlock, out + r0 * ldo, ldo, bias, N, silu_mul);
        }
  });
}

}  // namespace

// out = x [M, K] (row stride ldx) times a weight packed by layers.pack_dense_weight (+ bias), as `store`
// (servelm::Store) says: [M, N] in the dtype, [M, N / 2] silu(gate) * up, or [M, N] float32 whatever the dtype.
// dtype: 0 float32 (weight, x, bias), 1 bf16 (all bf16); bf16 activations with a float32 weight are not
// offered: a model's weights and activations share a dtype.
SERVELM_API int servelm_dense_linear(int32_t dtype, void* out, const void* x, int64_t M, int64_t K, int64_t ldx,
                                     const void* packed, int64_t N, const void* bias, int store) {
  return servelm::guarded([&] {
    const bool silu_mul = store == servelm::kStoreSiluMul;
    servelm::check(servelm::valid_store(store), "dense_linear: store must be 0, 1 or 2");
    servelm::check(M >= 0 && K > 0 && N > 0 && (!silu_mul || (N % kBlock == 0 && bias == nullptr)),
                   "dense_linear: bad shape (silu_mul needs N % 32 == 0 and no bias)");
    if (M == 0) return;
    if (dtype == servelm::kFloat32)
      return dense_linear(static_cast<float*>(out), static_cast<const float*>(x), M, K, ldx,
                          static_cast<const float*>(packed), N, static_cast<const float*>(bias), silu_mul);
    servelm::check(dtype == servelm::kBFloat16, "dense_linear: float32 or bfloat16");
    const auto* xb = static_cast<const bf16*>(x);
    const auto* wb = static_cast<const bf16*>(packed);
    const auto* bb = static_cast<const bf16*>(bias);
    if (store == servelm::kStoreFloat32) dense_linear(static_cast<float*>(out), xb, M, K, ldx, wb, N, bb, false);
    else dense_linear(static_cast<bf16*>(out), xb, M, K, ldx, wb, N, bb, silu_mul);
  });
}
SERVELM_TAPE_ENTRY(servelm_dense_linear)
