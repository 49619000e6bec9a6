// The Python module of ferry's CPU kernels (ferry/kernels/cpu.py builds it from every file here).
//
// No file here includes <torch/extension.h>: it pulls in the whole C++ frontend (torch/all.h: nn,
// optim, data) and took ~24 s of a ~25-30 s compile per file on a 2-core EPYC, for kernels that use
// ATen's tensors and parallel_for only. ATen (~7 s) and, where a binding is made, torch's pybind11
// casters (<torch/csrc/utils/pybind.h>) are what the sources need.
#include <ATen/core/Tensor.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>

// paged_decode_attention_cpu.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  c10::optional<at::Tensor> tree, c10::optional<at::Tensor> skip);
std::string paged_decode_attention_isa();
// paged_prefill_attention_cpu.cpp
void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                             at::Tensor spans, double scale, int64_t window, at::Tensor out);
// quantize_per_token_cpu.cpp
std::tuple<at::Tensor, at::Tensor> quantize_per_token_u8(at::Tensor x);
// gguf_quant_cpu.cpp
at::Tensor gguf_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias);
at::Tensor gguf_dequantize(at::Tensor w, int64_t qtype, int64_t K);
at::Tensor gguf_get_rows(at::Tensor w, at::Tensor ids, int64_t qtype, int64_t K);
at::Tensor gguf_interleave(at::Tensor w, int64_t qtype, int64_t K);
// fused_ops_cpu.cpp
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
void rotary_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
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
