// Fused elementwise kernels for the bf16 decoder: RMSNorm (with the residual add), rotary embedding,
// SiLU-and-multiply. In PyTorch each is a chain of 3-6 ops, each a pass over memory and a dispatch;
// at batch 64 they cost more than their arithmetic, and in a 512-token prefill bf16 SiLU alone ran at
// ~1.5 GB/s. Each kernel rounds to bf16 wherever the transformers op chain does, so results are
// identical to it, not merely close.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

bool fast_bf16(const torch::Tensor& t) {
#ifdef SERVELM_AVX512_BF16
  return t.scalar_type() == at::kBFloat16 && t.device().is_cpu() && t.stride(-1) == 1;
#else
  (void)t;
  return false;
#endif
}

// Rows per parallel task: enough work that a task outweighs its scheduling.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

#ifdef SERVELM_AVX512_BF16
using servelm::bf16;
using servelm::lanes;
using servelm::load_bf16;
using servelm::round_bf16;
using servelm::store_bf16;

// out = w * bf16(x * rsqrt(mean(x^2) + eps)), as transformers' RMSNorm computes it in bf16.
inline void norm_row(const bf16* x, const bf16* w, bf16* out, int64_t D, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = load_bf16(x + d, lanes(D - d));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(D - d);
    const __m512 n = round_bf16(_mm512_mul_ps(load_bf16(x + d, m), iv));
    store_bf16(out + d, _mm512_mul_ps(load_bf16(w + d, m), n), m);
  }
}
#endif

// Views any [.., D] tensor with a unit last stride as rows: (outer, inner) index -> row pointer.
struct Rows {
  int64_t outer, inner, so, si;
  explicit Rows(const torch::Tensor& t)
      : outer(t.size(0)), inner(t.dim() == 3 ? t.size(1) : 1),
        so(t.stride(0)), si(t.dim() == 3 ? t.stride(1) : 0) {}
  int64_t offset(int64_t r) const { return (r / inner) * so + (r % inner) * si; }
  int64_t count() const { return outer * inner; }
};

}  // namespace

bool fused_elementwise_supported(torch::Tensor t) { return fast_bf16(t); }

// out[r] = RMSNorm(x[r]) * w for each row of x ([T, D] or [T, H, D], unit last stride); out may be x.
void rms_norm_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(fast_bf16(x) && fast_bf16(out) && w.is_contiguous() && w.scalar_type() == at::kBFloat16 &&
                  out.sizes() == x.sizes() && w.size(0) == x.size(-1),
              "rms_norm_bf16 needs bf16 rows with a unit last stride");
#ifdef SERVELM_AVX512_BF16
  const int64_t D = x.size(-1);
  const Rows rx(x), ro(out);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rx.count(), grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + rx.offset(r), wp, op + ro.offset(r), D, float(eps));
  });
#endif
}

// residual = bf16(residual + delta) in place, out = RMSNorm(residual) * w: the residual add of one
// sublayer fused with the norm that opens the next. All [T, D] contiguous.
void add_rms_norm_bf16(torch::Tensor out, torch::Tensor delta, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(fast_bf16(delta) && out.is_contiguous() && delta.is_contiguous() && residual.is_contiguous() &&
                  residual.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(0) == residual.size(-1) &&
                  delta.sizes() == residual.sizes() && out.sizes() == residual.sizes() && residual.dim() == 2,
              "add_rms_norm_bf16 needs contiguous bf16 [T, D] tensors");
#ifdef SERVELM_AVX512_BF16
  const int64_t D = residual.size(1);
  const bf16* dp = delta.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* rp = residual.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, residual.size(0), grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* res = rp + r * D;
      const bf16* del = dp + r * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = lanes(D - d);
        store_bf16(res + d, _mm512_add_ps(load_bf16(res + d, m), load_bf16(del + d, m)), m);
      }
      norm_row(res, wp, op + r * D, D, float(eps));
    }
  });
#endif
}

// In place on x ([T, H, D], unit last stride): x = bf16(x * cos) + bf16(rotate_half(x) * sin), rounded
// as transformers' bf16 ops round; cos/sin are [max_pos, D] tables read at positions[t].
void rotary_bf16_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(fast_bf16(x) && x.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous() && x.size(2) % 2 == 0,
              "rotary_bf16_ needs bf16 [T, H, D] with a unit last stride and int64 positions");
#ifdef SERVELM_AVX512_BF16
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(positions.numel() == T && cos.size(-1) == D && sin.sizes() == cos.sizes(), "rotary_bf16_: shapes differ");
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_bf16_: position ", pos[t], " beyond the table");
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  bf16* xp = x.data_ptr<bf16>();
  at::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cp + pos[t] * D;
      const bf16* s = sp + pos[t] * D;
      for (int64_t h = 0; h < H; ++h) {
        bf16* row = xp + t * st + h * sh;
        for (int64_t d = 0; d < half; d += 16) {
          const __mmask16 m = lanes(half - d);
          const __m512 lo = load_bf16(row + d, m), hi = load_bf16(row + half + d, m);
          // first half: lo * cos - hi * sin; second half: hi * cos + lo * sin (rotate_half negates hi)
          const __m512 a = round_bf16(_mm512_mul_ps(lo, load_bf16(c + d, m)));
          const __m512 b = round_bf16(_mm512_mul_ps(hi, load_bf16(s + d, m)));
          const __m512 e = round_bf16(_mm512_mul_ps(hi, load_bf16(c + half + d, m)));
          const __m512 f = round_bf16(_mm512_mul_ps(lo, load_bf16(s + half + d, m)));
          store_bf16(row + d, _mm512_sub_ps(a, b), m);
          store_bf16(row + half + d, _mm512_add_ps(e, f), m);
        }
      }
    }
  });
#endif
}

// [T, 2I] -> [T, I]: bf16(bf16(silu(gate)) * up), gate and up the two halves of each row.
torch::Tensor silu_mul_bf16(torch::Tensor x) {
  TORCH_CHECK(fast_bf16(x) && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_mul_bf16 needs contiguous bf16 [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
#ifdef SERVELM_AVX512_BF16
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const bf16* g = xp + t * 2 * I;
      const bf16* u = g + I;
      for (int64_t d = 0; d < I; d += 16) {
        const __mmask16 m = lanes(I - d);
        const __m512 gv = load_bf16(g + d, m);
        const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one, servelm::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store_bf16(op + t * I + d, _mm512_mul_ps(round_bf16(act), load_bf16(u + d, m)), m);
      }
    }
  });
#endif
  return out;
}
