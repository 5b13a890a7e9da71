// The Python module of servelm's CPU kernels (one extension built from every file in this folder).
#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window);
torch::Tensor argmax_rows(torch::Tensor logits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("argmax_rows", &argmax_rows, "first argmax of each row of float32 logits");
}
