// Every decoder layer of a decode step (each token a decode) in one call: the same kernels (AMX tiles or
// AVX512 for the linears, as the Python loop's Linear picks), in the same order, on the same data as the
// Python layer loop in model/decoder.py, without its ~20 Python-level
// operations per layer (about 0.85 ms of a SmolLM2 batch-1 step of 10 ms at one thread). Results are
// identical to the Python loop's.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels.h"
#include "vec.h"

using servelm::bf16;

namespace {

constexpr int64_t kPerLayer = 10;  // weights per layer (see servelm_decode_layers)

// The step's intermediate activations: one 64-byte aligned allocation per thread, grown when a larger step
// comes, carved into arrays that each start on their own cache line.
class Arena {
 public:
  ~Arena() { std::free(base_); }
  bf16* carve(const int64_t* counts, int n, bf16** out) {
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += (counts[i] * int64_t(sizeof(bf16)) + 63) / 64 * 64;
    if (total > bytes_) {
      std::free(base_);
      base_ = static_cast<char*>(std::aligned_alloc(64, total));
      bytes_ = base_ != nullptr ? total : 0;
      servelm::check(base_ != nullptr, "decode_layers: out of memory for ", total, " bytes");
    }
    char* p = base_;
    for (int i = 0; i < n; ++i) {
      out[i] = reinterpret_cast<bf16*>(p);
      p += (counts[i] * int64_t(sizeof(bf16)) + 63) / 64 * 64;
    }
    return out[0];
  }

 private:
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace

// h: [T, hidden] bf16 residual stream (updated in place); out [T, hidden] receives the final norm's output.
// Per layer, kPerLayer weight pointers: input norm, packed qkv, qkv bias, packed o_proj, o_proj bias, post
// norm, packed gate_up, packed down, q norm, k norm (biases and q/k norms null when absent). caches: k, v per
// layer, each [num_blocks, bs, Hkv, D]. sizes = {qkv, o_proj, gate_up, down} out features; heads =
// {num_heads, num_kv_heads, head_dim}; cos/sin [max_pos, D] rotary tables read at positions. formats: null
// (every linear bf16, packed for the tile kernels), or per layer 4 ints for qkv, o_proj, gate_up, down: -1
// for such a bf16 weight, else the GGUF block format of a weight packed for quant_linear.
SERVELM_API int servelm_decode_layers(bf16* out, bf16* h, int64_t T, int64_t hidden, const int64_t* positions,
                                      const bf16* cos, const bf16* sin, int64_t max_pos, const bf16* const* weights,
                                      void* const* caches, int64_t num_blocks, int64_t bs, const int64_t* slots,
                                      const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens,
                                      const bf16* final_norm, const int64_t* windows, int64_t L, const int64_t* sizes,
                                      const int64_t* heads, double eps_d, double scale, const int32_t* formats) {
  return servelm::guarded([&] {
    using servelm::Rows;
    const int64_t H = heads[0], Hkv = heads[1], D = heads[2];
    const int64_t q_size = H * D, kv_size = Hkv * D, qkv_size = sizes[0];
    const float eps = float(eps_d);
    servelm::check(qkv_size == q_size + 2 * kv_size && sizes[1] == hidden && sizes[3] == hidden,
                   "decode_layers: layer sizes do not fit the heads and hidden size");
    thread_local Arena arena;
    const int64_t counts[6] = {T * hidden, T * qkv_size, T * q_size, T * q_size, T * hidden, T * sizes[2] / 2};
    bf16* buf[6];
    arena.carve(counts, 6, buf);
    bf16 *x = buf[0], *qkv = buf[1], *q = buf[2], *o = buf[3], *attn = buf[4], *act = buf[5];
    bf16* delta = nullptr;  // the last sublayer's output, not yet added to h; reuses attn's room
    // the linear kernel the Python loop's Linear takes for these weights: AMX tiles where the CPU has them
    const bool tiles = servelm::amx_available();
    int64_t layer = 0;
    auto linear = [&](bf16* o, const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const bf16* bias,
                      bool silu_mul, int which) {
      const int fmt = formats != nullptr ? formats[4 * layer + which] : -1;
      if (fmt >= 0) servelm::quant_linear(o, x, M, K, K, fmt, reinterpret_cast<const uint8_t*>(w), N, bias, silu_mul,
                                          servelm::kQuantIntRows);
      else if (tiles) servelm::amx_linear(o, x, M, K, K, w, N, bias, silu_mul);
      else servelm::avx512_linear(o, x, M, K, K, w, N, bias, silu_mul);
    };
    const Rows hidden_rows{T, 1, hidden, 0};
    const Rows q_rows{T, H, qkv_size, D}, k_rows{T, Hkv, qkv_size, D};
    for (int64_t i = 0; i < L; ++i) {
      const bf16* const* w = weights + kPerLayer * i;
      layer = i;
      if (delta != nullptr) servelm::add_rms_norm(x, delta, h, w[0], T, hidden, eps);
      else servelm::rms_norm(x, hidden_rows, h, hidden_rows, w[0], hidden, eps);
      linear(qkv, x, T, hidden, w[1], qkv_size, w[2], false, 0);
      if (w[8] != nullptr) {  // Qwen3's per-head norms of queries and keys, in place
        servelm::rms_norm(qkv, q_rows, qkv, q_rows, w[8], D, eps);
        servelm::rms_norm(qkv + q_size, k_rows, qkv + q_size, k_rows, w[9], D, eps);
      }
      servelm::rotary(qkv, T, H + Hkv, D, qkv_size, D, positions, cos, sin, max_pos);  // queries and keys
      for (int64_t t = 0; t < T; ++t) std::memcpy(q + t * q_size, qkv + t * qkv_size, q_size * sizeof(bf16));
      void* kc = caches[2 * i];
      void* vc = caches[2 * i + 1];
      servelm::write_kv(kc, vc, num_blocks * bs, kv_size * int64_t(sizeof(bf16)), qkv + q_size,
                        qkv_size * int64_t(sizeof(bf16)), qkv + q_size + kv_size, qkv_size * int64_t(sizeof(bf16)),
                        slots, T);
      servelm::paged_decode_attention(servelm::kBFloat16, o, q, T, H, servelm::Cache{kc, vc, num_blocks, bs, Hkv, D},
                                      block_tables, max_blocks, seq_lens, scale, windows[i]);
      linear(attn, o, T, q_size, w[3], hidden, w[4], false, 1);
      servelm::add_rms_norm(x, attn, h, w[5], T, hidden, eps);
      linear(act, x, T, hidden, w[6], sizes[2], nullptr, true, 2);
      linear(attn, act, T, sizes[2] / 2, w[7], hidden, nullptr, false, 3);
      delta = attn;
    }
    servelm::add_rms_norm(out, delta, h, final_norm, T, hidden, eps);
  });
}

// Whether this build has the AVX512-BF16 kernels (the fused elementwise ones, decode_layers, the linear).
SERVELM_API int servelm_avx512_bf16_compiled() {
#ifdef SERVELM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

std::string& servelm::last_error() {
  thread_local std::string message;
  return message;
}

SERVELM_API const char* servelm_last_error() { return servelm::last_error().c_str(); }
