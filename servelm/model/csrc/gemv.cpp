// A bf16 matrix-vector product for single-row (batch-1 decode) linear layers: oneDNN's bf16 matmul
// tops out near 18 GB/s there even with the weight in cache, this kernel streams the weight at the
// memory bound. Wider batches are left to oneDNN, where the work is compute-bound.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace {
#ifdef SERVELM_AVX512_BF16
// y[n] = sum_k x[k] w[n, k] (+ b[n]), bf16 in and out, float32 sums; K a multiple of 32.
// Four weight rows at a time keep four independent dot-product chains in flight.
void gemv_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
               int64_t N, int64_t K) {
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 4, rows = std::min<int64_t>(4, N - n0);
      __m512 acc[4];
      for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
      const c10::BFloat16* wr[4];
      for (int r = 0; r < 4; ++r) wr[r] = w + (n0 + std::min<int64_t>(r, rows - 1)) * K;
      for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[4];
        for (int r = 0; r < 4; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        for (int r = 0; r < 4; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv[r]);
      }
      for (int r = 0; r < rows; ++r) {
        float s = _mm512_reduce_add_ps(acc[r]);
        if (bias) s += static_cast<float>(bias[n0 + r]);
        y[n0 + r] = static_cast<c10::BFloat16>(s);
      }
    }
  });
}
#endif

}  // namespace

// Whether bf16_gemv takes an input of K features here (K % 32 == 0, AVX512-BF16 compiled in).
bool bf16_gemv_supported(int64_t K) {
#ifdef SERVELM_AVX512_BF16
  return K % 32 == 0;
#else
  (void)K;
  return false;
#endif
}

// x: [1, K] bf16, w: [N, K] bf16 (row-major, as stored by a checkpoint), bias: [N] bf16 or empty.
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_gemv needs bf16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_gemv: shapes do not match");
  TORCH_CHECK(x.size(0) == 1 && bf16_gemv_supported(x.size(1)), "bf16_gemv: unsupported shape or CPU");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "bf16_gemv: weight must be contiguous");
  const int64_t N = w.size(0), K = x.size(1);
  auto y = torch::empty({1, N}, x.options());
#ifdef SERVELM_AVX512_BF16
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "bad bias");
    b = bias->data_ptr<c10::BFloat16>();
  }
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  gemv_rows(xp, wp, b, yp, N, K);
#endif
  return y;
}

