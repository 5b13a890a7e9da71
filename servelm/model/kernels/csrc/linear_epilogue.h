// What the bf16 linear kernels do with a finished block of 32 output columns (float32 sums): add the bias
// and round to bf16 (or keep float32, for logits), or, for a gate/up weight packed with
// `pack_weight_for_tiles(..., gate_up=True)`, turn each block's 16 gate and 16 up columns into 16 columns of
// bf16(silu(gate) * up). Shared by the AMX tile matmul, the AVX512 matrix-vector kernel, which read the same
// packed weights, and the GGUF int8 kernel.
#pragma once

#include "kernels.h"
#include "vec.h"

#ifdef SERVELM_AVX512_BF16
namespace servelm {

constexpr int64_t kBlockCols = 32;  // output columns per packed weight block

// Finished float32 results of one block, stored while the tile unit works on the next block.
struct Pending {
  const float* c = nullptr;
  int64_t rows = 0, n0 = 0;
  void* out = nullptr;  // the block's first row of output (LinearOut::at)
};

// What becomes of a block's float32 results (Store): bias added and rounded to bf16, or kept in float32
// (`N` output columns); or, for a gate/up projection packed with `pack_weight_for_tiles(..., gate_up=True)`,
// each block's 16 gate and 16 up columns turned into 16 columns of bf16(silu(gate) * up) (`N / 2` columns).
struct Epilogue {
  const bf16* bias = nullptr;
  int64_t N = 0;
  Store store = kStoreBf16;
};

// c [rows][32] float32 -> output columns n0.. (bias added in float32, one rounding to bf16, as oneDNN does;
// none for float32). The SiLU product rounds where the unfused chain does: the projection's bf16 output, the
// SiLU, the product.
inline void store_rows(const Pending& p, const Epilogue& e) {
  if (e.store == kStoreSiluMul) {
    const int64_t I = e.N / 2;
    bf16* out = static_cast<bf16*>(p.out);
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = 0; r < p.rows; ++r) {
      const __m512 g = round_bf16(_mm512_load_ps(p.c + r * kBlockCols));
      const __m512 u = round_bf16(_mm512_load_ps(p.c + r * kBlockCols + 16));
      const __m512 act = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      store_bf16(out + r * I + p.n0 / 2, _mm512_mul_ps(round_bf16(act), u));
    }
    return;
  }
  const int64_t N = e.N;
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t h = 0; h < kBlockCols && p.n0 + h < N; h += 16) {
      const __mmask16 m = lanes(N - p.n0 - h);
      __m512 v = _mm512_load_ps(p.c + r * kBlockCols + h);
      if (e.bias) v = _mm512_add_ps(v, load_bf16(e.bias + p.n0 + h, m));
      const int64_t at = r * N + p.n0 + h;
      if (e.store == kStoreFloat32) _mm512_mask_storeu_ps(static_cast<float*>(p.out) + at, m, v);
      else store_bf16(static_cast<bf16*>(p.out) + at, v, m);
    }
}

}  // namespace servelm
#endif
