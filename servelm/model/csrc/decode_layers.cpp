// Every decoder layer of a decode step (each token a decode) in one call: the same kernels, in the same
// order, on the same tensors as the Python layer loop in model/decoder.py, without its ~20 Python-level
// operations per layer (about 0.85 ms of a SmolLM2 batch-1 step of 10 ms at one thread). Results are
// identical to the Python loop's.
#include <torch/extension.h>

#include <vector>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
torch::Tensor avx512_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
torch::Tensor avx512_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t N);
void rms_norm_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps);
void add_rms_norm_bf16(torch::Tensor out, torch::Tensor delta, torch::Tensor residual, torch::Tensor w, double eps);
void rotary_bf16_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);

namespace {

// An absent optional weight travels as an empty tensor (a Python list of tensors cannot hold None).
c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

}  // namespace

// h: [T, hidden] bf16 residual stream (updated in place). Per layer, kPerLayer weights: input norm,
// packed qkv, qkv bias, packed o_proj, o_proj bias, post norm, packed gate_up, packed down, q norm,
// k norm (biases and q/k norms empty when absent). caches: k, v per layer. Out features: sizes =
// {qkv, o_proj, gate_up, down}; heads = {num_heads, num_kv_heads, head_dim}. Returns the final norm's output.
torch::Tensor decode_layers(torch::Tensor h, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> weights, std::vector<torch::Tensor> caches,
                            torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens,
                            torch::Tensor final_norm, std::vector<int64_t> windows, std::vector<int64_t> sizes,
                            std::vector<int64_t> heads, double eps, double scale) {
  constexpr size_t kPerLayer = 10;
  const size_t L = windows.size();
  TORCH_CHECK(weights.size() == kPerLayer * L && caches.size() == 2 * L && sizes.size() == 4 && heads.size() == 3,
              "decode_layers: ", kPerLayer, " weights and 2 caches per layer");
  const int64_t T = h.size(0), H = heads[0], Hkv = heads[1], D = heads[2];
  const int64_t q_size = H * D, kv_size = Hkv * D;
  torch::Tensor delta;
  torch::Tensor x = torch::empty_like(h);
  for (size_t i = 0; i < L; ++i) {
    const torch::Tensor* w = &weights[kPerLayer * i];
    if (delta.defined()) {
      add_rms_norm_bf16(x, delta, h, w[0], eps);
    } else {
      rms_norm_bf16(x, h, w[0], eps);
    }
    torch::Tensor qkv = avx512_linear(x, w[1], sizes[0], present(w[2]));
    torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, H + Hkv, D});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
    if (w[8].numel()) {  // Qwen3's per-head norms of queries and keys, in place
      torch::Tensor q_part = qk.narrow(1, 0, H), k_part = qk.narrow(1, H, Hkv);
      rms_norm_bf16(q_part, q_part, w[8], eps);
      rms_norm_bf16(k_part, k_part, w[9], eps);
    }
    rotary_bf16_(qk, positions, cos, sin);
    torch::Tensor q = qk.narrow(1, 0, H).contiguous();
    write_kv(caches[2 * i], caches[2 * i + 1], qk.narrow(1, H, Hkv), v, slots);
    torch::Tensor o = torch::empty_like(q);
    paged_decode_attention(o, q, caches[2 * i], caches[2 * i + 1], block_tables, seq_lens, scale, windows[i]);
    torch::Tensor attn = avx512_linear(o.view({T, q_size}), w[3], sizes[1], present(w[4]));
    add_rms_norm_bf16(x, attn, h, w[5], eps);
    delta = avx512_linear(avx512_linear_silu_mul(x, w[6], sizes[2]), w[7], sizes[3], c10::nullopt);
  }
  torch::Tensor out = torch::empty_like(h);
  add_rms_norm_bf16(out, delta, h, final_norm, eps);
  return out;
}
