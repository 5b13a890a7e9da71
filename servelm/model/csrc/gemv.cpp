// bf16 linear layers for a few rows (batch-1 decode, mostly) on CPUs with AVX512-BF16 but no AMX: the
// weight is read in the AMX kernel's packed order (`pack_weight_for_tiles`), which is one sequential
// stream with 16 output columns x one input pair per 64-byte line, so each line feeds one dot-product
// instruction with no horizontal sums. Over SmolLM2's weights (cache-cold, one thread, Zen 4) that ran at
// the plain-read bandwidth (26 GB/s) where a row-major kernel (four rows at a time, one reduction per
// row) reached 11 GB/s, as did oneDNN.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "linear_epilogue.h"

namespace {
#ifdef SERVELM_AVX512_BF16
using servelm::bf16;
using servelm::kBlockCols;

// Rows [0, R) of x times one packed 32-column block -> c [R][32] float32. Per row and 16-column half,
// two sums (even and odd input pairs of each 32-input step) added at the end: a fixed order whatever
// the number of rows or threads.
template <int R>
void block_rows(const bf16* x, int64_t ldx, const bf16* b, int64_t K, float* c) {
  __m512 acc[R][2][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h][0] = acc[r][h][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    for (int h = 0; h < 2; ++h) {
      const bf16* bh = b + (k * 2 + h * 32) * 16;  // [k step][half][16 pairs][16 columns][2]
      for (int p = 0; p < 16; ++p) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(bh + p * 32);
        for (int r = 0; r < R; ++r) {
          const __m512bh xp = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + k + 2 * p));
          acc[r][h][p & 1] = _mm512_dpbf16_ps(acc[r][h][p & 1], xp, w);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_store_ps(c + r * kBlockCols + h * 16, _mm512_add_ps(acc[r][h][0], acc[r][h][1]));
}

void packed_matmul(const bf16* x, int64_t M, int64_t ldx, const bf16* w, int64_t K, const servelm::Epilogue& ep,
                   bf16* out) {
  const int64_t blocks = (ep.N + kBlockCols - 1) / kBlockCols, ldo = ep.silu_mul ? ep.N / 2 : ep.N;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    alignas(64) float c[4 * kBlockCols];
    for (int64_t nb = begin; nb < end; ++nb) {
      const bf16* b = w + nb * kBlockCols * K;
      for (int64_t r = 0; r < M; r += 4) {  // beyond 4 rows the block is read again, from cache
        const int64_t rows = std::min<int64_t>(4, M - r);
        const bf16* xr = x + r * ldx;
        if (rows == 4) block_rows<4>(xr, ldx, b, K, c);
        else if (rows == 3) block_rows<3>(xr, ldx, b, K, c);
        else if (rows == 2) block_rows<2>(xr, ldx, b, K, c);
        else block_rows<1>(xr, ldx, b, K, c);
        servelm::store_rows(servelm::Pending{c, rows, nb * kBlockCols, out + r * ldo}, ep);
      }
    }
  });
}
#endif

torch::Tensor packed_linear(torch::Tensor x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_gemv: bf16 [M, K] input and packed weight");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + 31) / 32;
  TORCH_CHECK(K % 32 == 0 && N > 0 && packed.is_contiguous() && packed.numel() == blocks * 32 * K,
              "bf16_gemv: a weight packed for ", N, " x ", K, " (K a multiple of 32)");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N),
              "bf16_gemv: bias must be bf16 [N]");
  TORCH_CHECK(!silu_mul || (N % 32 == 0 && !bias), "bf16_gemv_silu_mul: gate and up widths must be multiples of 16, no bias");
  auto out = torch::empty({M, silu_mul ? N / 2 : N}, x.options());
#ifdef SERVELM_AVX512_BF16
  if (M == 0) return out;
  if (x.stride(1) != 1) x = x.contiguous();
  const servelm::Epilogue ep{bias ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr, N, silu_mul};
  packed_matmul(reinterpret_cast<const bf16*>(x.data_ptr()), M, x.stride(0),
                reinterpret_cast<const bf16*>(packed.data_ptr()), K, ep, reinterpret_cast<bf16*>(out.data_ptr()));
#else
  TORCH_CHECK(false, "bf16_gemv needs AVX512-BF16");
#endif
  return out;
}

}  // namespace

// Whether bf16_gemv takes an input of K features here (K % 32 == 0, AVX512-BF16 compiled in).
bool bf16_gemv_supported(int64_t K) {
#ifdef SERVELM_AVX512_BF16
  return K > 0 && K % 32 == 0;
#else
  (void)K;
  return false;
#endif
}

// x: [M, K] bf16 (a few rows), packed: the weight in `pack_weight_for_tiles` order, bias: [N] bf16 or none.
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  return packed_linear(std::move(x), packed, N, bias, false);
}

// silu(gate) * up for a [gate; up] weight packed with `pack_weight_for_tiles(w, gate_up=True)`.
torch::Tensor bf16_gemv_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed_linear(std::move(x), packed, N, c10::nullopt, true);
}
