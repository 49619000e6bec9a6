// The Python module of ferry's CPU kernels (ferry/kernels/cpu.py builds it from every file here).
#include <torch/extension.h>

#include <tuple>

// paged_decode_attention_cpu.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     c10::optional<torch::Tensor> tree, c10::optional<torch::Tensor> skip);
std::string paged_decode_attention_isa();
// paged_prefill_attention_cpu.cpp
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                             torch::Tensor spans, double scale, int64_t window, torch::Tensor out);
// quantize_per_token_cpu.cpp
std::tuple<torch::Tensor, torch::Tensor> quantize_per_token_u8(torch::Tensor x);
// gguf_quant_cpu.cpp
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias);
torch::Tensor gguf_dequantize(torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor gguf_get_rows(torch::Tensor w, torch::Tensor ids, int64_t qtype, int64_t K);
torch::Tensor gguf_interleave(torch::Tensor w, int64_t qtype, int64_t K);
// fused_ops_cpu.cpp
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
// decode_step_cpu.cpp
void bind_decode_step(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU; fp32 q, fp32, bf16, int8 or fp8 cache)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("tree") = pybind11::none(),
        pybind11::arg("skip") = pybind11::none());
  m.def("paged_decode_attention_isa", &paged_decode_attention_isa, "the build's paged_decode_attention path: avx512, avx2 or portable");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over the paged cache, into out (CPU; fp32 q, fp32, bf16, int8 or fp8 cache)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("tables"),
        pybind11::arg("spans"), pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("out"));
  m.def("quantize_per_token_u8", &quantize_per_token_u8, "per-row int8 quantization as uint8 + 128 (CPU)");
  m.def("gguf_linear", &gguf_linear, "x @ dequant(w).T for a GGUF block-quantized weight, via int8 dots (CPU)");
  m.def("gguf_dequantize", &gguf_dequantize, "fp32 copy of a GGUF block-quantized weight (CPU)");
  m.def("gguf_get_rows", &gguf_get_rows, "fp32 rows of a GGUF block-quantized weight (CPU)");
  m.def("gguf_interleave", &gguf_interleave, "a Q4_0/Q4_1/Q8_0 weight interleaved by 8 rows (type id + 256) for the CPU");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; rms_norm(residual) * weight (CPU, fp32)");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight (CPU, fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [.., 2I] (CPU, fp32)");
  m.def("rotary_", &rotary_, "NeoX rotary embedding of q and k in place (CPU, fp32)");
  bind_decode_step(m);
}
