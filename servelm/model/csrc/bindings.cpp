// The Python module of servelm's CPU kernels (one extension built from every file in this folder).
#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window);
bool prefill_attention_supported(torch::Tensor q);
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, int64_t ctx_len, double scale, int64_t window);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
torch::Tensor argmax_rows(torch::Tensor logits);
bool amx_linear_supported(int64_t K);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
torch::Tensor amx_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t N);
bool avx512_linear_supported(int64_t K);
std::string bf16_dot();
void set_bf16_dot(const std::string& mode);
torch::Tensor avx512_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
torch::Tensor avx512_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t N);
bool fused_elementwise_supported(torch::Tensor t);
void rms_norm_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps);
void add_rms_norm_bf16(torch::Tensor out, torch::Tensor delta, torch::Tensor residual, torch::Tensor w, double eps);
void rotary_bf16_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul_bf16(torch::Tensor x);
torch::Tensor decode_layers(torch::Tensor h, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> weights, std::vector<torch::Tensor> caches,
                            torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens,
                            torch::Tensor final_norm, std::vector<int64_t> windows, std::vector<int64_t> sizes,
                            std::vector<int64_t> heads, double eps, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether paged_prefill_attention takes q (AVX512-BF16, bf16, head_dim % 32 == 0, at most 256)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of one sequence's query chunk over its paged cache (AMX tiles or AVX512-BF16)");
  m.def("write_kv", &write_kv, "copy each token's keys and values into its cache slot");
  m.def("amx_linear_supported", &amx_linear_supported, "whether amx_linear takes inputs of K features");
  m.def("amx_linear", &amx_linear, "x @ w.T (+ bias) on AMX tiles, w packed by pack_weight_for_tiles");
  m.def("amx_linear_silu_mul", &amx_linear_silu_mul,
        "silu(gate) * up from x @ w.T, w a [gate; up] weight packed by pack_weight_for_tiles(w, gate_up=True)");
  m.def("avx512_linear_supported", &avx512_linear_supported, "whether avx512_linear takes inputs of K features");
  m.def("bf16_dot", &bf16_dot,
        "how avx512_linear and paged_prefill_attention multiply bf16 pairs: 'bf16' (dot-product instruction) or 'fma'");
  m.def("set_bf16_dot", &set_bf16_dot, "choose 'bf16' or 'fma' (default: 'fma' on Intel CPUs)");
  m.def("avx512_linear", &avx512_linear, "x @ w.T (+ bias) for bf16 rows, w packed by pack_weight_for_tiles (AVX512-BF16)");
  m.def("avx512_linear_silu_mul", &avx512_linear_silu_mul,
        "silu(gate) * up from x @ w.T (AVX512-BF16), w packed by pack_weight_for_tiles(w, gate_up=True)");
  m.def("fused_elementwise_supported", &fused_elementwise_supported, "whether the fused bf16 kernels take t");
  m.def("rms_norm_bf16", &rms_norm_bf16, "out = RMSNorm(x) * w, row by row");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "residual += delta; out = RMSNorm(residual) * w");
  m.def("rotary_bf16_", &rotary_bf16_, "rotary embedding in place");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up");
  m.def("decode_layers", &decode_layers, "every decoder layer of a pure-decode step (AVX512-BF16 kernels)");
  m.def("argmax_rows", &argmax_rows, "first argmax of each row of float32 or bf16 logits");
}
