// The kernels' C++ interface inside the library (raw pointers and sizes): what the C entry points
// (`servelm_*`, called from servelm/model/kernel_ops.py and replayed from tapes, tape.h) wrap. Every function
// exists in every build variant; one whose instructions a variant lacks raises when called, and the
// `*_supported` entry points tell the caller beforehand.
#pragma once

#include <cstdint>

#include "common.h"

namespace servelm {

// Rows of D elements, [outer, inner, D] with strides (so, si) in elements, or [outer, D] with inner = 1.
struct Rows {
  int64_t outer = 0, inner = 1, so = 0, si = 0;
  int64_t offset(int64_t r) const { return (r / inner) * so + (r % inner) * si; }
  int64_t count() const { return outer * inner; }
};

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

bool avx512_bf16_compiled();
bool amx_available();

// Fused elementwise kernels, float32 or bf16 (elementwise.cpp).
void rms_norm(DType dtype, void* out, const Rows& ro, const void* x, const Rows& rx, const void* w, int64_t D,
              float eps);
void add_rms_norm(DType dtype, void* out, const void* delta, void* residual, const void* w, int64_t T, int64_t D,
                  float eps);
void rotary(DType dtype, void* x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh, const int64_t* pos,
            const void* cos, const void* sin, int64_t max_pos);
void silu_mul(DType dtype, void* out, const void* x, int64_t T, int64_t I);

// What a bf16 linear kernel stores from each finished block of float32 sums (the C entry points' `store`).
enum Store : int {
  kStoreBf16 = 0,     // the sums (+ bias) rounded once to bf16: [M, N]
  kStoreSiluMul = 1,  // silu(gate) * up of a [gate; up] weight, bf16: [M, N / 2]
  kStoreFloat32 = 2,  // the sums (+ bias) as they are, float32: [M, N]. A model's logits: rounding them to
                      // bf16 would tie candidates up to one bf16 ulp (1/128 of the logit's power of two) apart
};
inline bool valid_store(int store) { return store == kStoreBf16 || store == kStoreSiluMul || store == kStoreFloat32; }

// Where a bf16 linear kernel's output rows go: the array and what is stored into it.
struct LinearOut {
  void* p = nullptr;
  Store store = kStoreBf16;
  int64_t cols(int64_t N) const { return store == kStoreSiluMul ? N / 2 : N; }
  // the output `elems` elements further on
  LinearOut at(int64_t elems) const { return {static_cast<char*>(p) + elems * (store == kStoreFloat32 ? 4 : 2), store}; }
};

// out = x [M, K] (row stride ldx) times a weight packed by pack_weight_for_tiles (avx512_linear.cpp,
// amx_linear.cpp), as out.store says.
void check_packed_linear(const char* name, int64_t M, int64_t K, int64_t N, bool bias, Store store);
void avx512_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed, int64_t N,
                   const bf16* bias);
void amx_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* packed, int64_t N,
                const bf16* bias);

// A GGUF weight packed by gguf_quant.pack_blocks (quant_linear.cpp): format fmt, records of `stride` bytes
// (16 rows x 32 inputs); a 32-column block is two runs of K / 32 records, contiguous.
struct QuantWeight {
  int fmt = 0;
  const uint8_t* packed = nullptr;
  int64_t stride = 0;
  const uint8_t* run(int64_t nb, int h, int64_t K) const { return packed + (2 * nb + h) * (K / 32) * stride; }
};
// One record dequantized into its place in the bf16 tile order (16 lines of [16 rows][input pair], 1 KB):
// the bf16 model's weight bit for bit. The AVX512-BF16 one of format fmt (null in other builds).
using DequantizeRecord = void (*)(const uint8_t* record, bf16* dst);
DequantizeRecord record_dequantizer(int fmt);
// amx_linear over a GGUF weight, each block dequantized as the tile loop reaches it: the same results as
// amx_linear over the dequantized, packed weight.
void amx_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const QuantWeight& w, int64_t N,
                const bf16* bias);
// The same with avx512_linear (CPUs with AVX512-BF16 but no AMX).
void avx512_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, const QuantWeight& w, int64_t N,
                   const bf16* bias);

// The same over a GGUF block-quantized weight packed by gguf_quant.pack_blocks (quant_linear.cpp): format
// fmt (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K); up to int_rows rows the int8-activation kernel.
void quant_linear(LinearOut out, const bf16* x, int64_t M, int64_t K, int64_t ldx, int fmt, const uint8_t* packed,
                  int64_t N, const bf16* bias, int64_t int_rows);

// Paged attention (paged_attention.cpp): caches [num_blocks, bs, Hkv, D] contiguous.
struct Cache {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t num_blocks = 0, bs = 0, Hkv = 0, D = 0;
};
void paged_decode_attention(DType dtype, void* out, const void* q, int64_t B, int64_t Hq, const Cache& cache,
                            const int64_t* tables, int64_t max_blocks, const int64_t* lens, double scale,
                            int64_t window);
// k, v: T rows of row_bytes (each token's heads contiguous) at k_stride / v_stride bytes apart.
void write_kv(void* k_cache, void* v_cache, int64_t num_slots, int64_t row_bytes, const void* k, int64_t k_stride,
              const void* v, int64_t v_stride, const int64_t* slots, int64_t T);

}  // namespace servelm
