// The Python module of servelm's CPU kernels (one extension built from every file in this folder).
#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window);
torch::Tensor argmax_rows(torch::Tensor logits);
bool bf16_gemv_supported(int64_t K);
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("bf16_gemv_supported", &bf16_gemv_supported, "whether bf16_gemv takes inputs of K features");
  m.def("bf16_gemv", &bf16_gemv, "x @ w.T (+ bias) for one bf16 row");
  m.def("argmax_rows", &argmax_rows, "first argmax of each row of float32 logits");
}
