// A whole decode step of a Llama-family model with GGUF weights, in one C++ call
// (ferry/models/cpu_decode_step.py builds it once per model).
//
// At batch 1 a step of SmolLM2-135M reads ~97 MB of weights (~5 ms at this class of
// machine's bandwidth), yet the layer-by-layer Python path took ~23 ms: 30 layers x a
// dozen ops, each a Python call, a pybind crossing, an allocation and a thread fork.
// Here the loop over layers runs in C++ over buffers allocated once per step, and every
// op is the same code the Python path calls (fused_ops_cpu.cpp, gguf_quant_cpu.cpp,
// paged_decode_attention_cpu.cpp), so both paths compute bit-identical results.
//
// Only steps made of decode rows take this path (every row one token, attending to the
// paged cache through the C++ decode attention); prompt rows go through the model's
// Python forward, whose GEMM path suits them.
//
// Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE: softmax routing) run here too: the
// router, the top k and the weighting in the ATen ops layers/moe.py uses (so the same experts are
// chosen and their outputs summed in the same order), the experts' GEMMs on their GGUF blocks, one
// expert at a time over the rows routed to it.
#include <ATen/ATen.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // DecodeStep's binding (bind_decode_step)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "kv_layout.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define FERRY_STEP_AVX512 1
#endif

namespace ferry_cpu {
// fused_ops_cpu.cpp
void add_rms_norm_rows(const float* x, float* residual, const float* w, float* out, int64_t M, int64_t K, float eps);
void rms_norm_rows(const float* x, const float* w, float* out, int64_t M, int64_t K, float eps);
void silu_and_mul_rows(const float* gate_up, float* out, int64_t M, int64_t I);
void rotary_rows(const int64_t* pos, int64_t T, float* q, int64_t q_tok, int64_t q_head, int64_t H, float* k,
                 int64_t k_tok, int64_t k_head, int64_t KVH, int64_t D, const float* cos, const float* sin);
// gguf_quant_cpu.cpp
void quantize_q8_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* dy, float* sy);
int64_t gguf_row_bytes(int64_t qtype, int64_t K);
// gguf_prompt_cpu.cpp
void gguf_matmul_rows(const int8_t* qx, const float* dy, const float* sy, int64_t M, int64_t K, const uint8_t* w,
                      int64_t N, int64_t qtype, int64_t n0, int64_t n1, float* y, int64_t ldy, const uint8_t* then,
                      int64_t then_bytes);
}  // namespace ferry_cpu

// paged_decode_attention_cpu.cpp
void paged_decode_attention_out(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                at::Tensor seq_lens, double scale, c10::optional<at::Tensor> tree,
                                c10::optional<at::Tensor> skip, at::Tensor out);

namespace {

using Parts = std::vector<std::tuple<at::Tensor, int64_t>>;  // (uint8 [rows, row_bytes], ggml type id)

struct QuantLinear {
  Parts parts;  // stacked by output rows (e.g. q, k, v), each in its own type
  std::vector<int64_t> rows;
  c10::optional<at::Tensor> bias;
  int64_t in = 0, out = 0;
};

QuantLinear make_linear(Parts parts, c10::optional<at::Tensor> bias, int64_t in, int64_t out, const char* name) {
  QuantLinear L{std::move(parts), {}, std::move(bias), in, 0};
  TORCH_CHECK(in % 32 == 0, name, ": input size ", in, " is not a multiple of 32");
  for (auto& [data, qtype] : L.parts) {
    TORCH_CHECK(data.dtype() == at::kByte && data.dim() == 2 && data.is_contiguous(), name,
                ": weight parts must be contiguous uint8 [rows, row_bytes]");
    TORCH_CHECK(data.size(1) == ferry_cpu::gguf_row_bytes(qtype, in), name, ": rows of ", data.size(1),
                " bytes do not hold ", in, " values of type ", qtype);
    L.rows.push_back(data.size(0));
    L.out += data.size(0);
  }
  TORCH_CHECK(L.out == out, name, ": parts make ", L.out, " output rows, expected ", out);
  if (L.bias) {
    TORCH_CHECK(L.bias->dtype() == at::kFloat && L.bias->is_contiguous() && L.bias->numel() == out, name,
                ": bias must be contiguous float32 [", out, "]");
  }
  return L;
}

// Activations quantized once per matmul input (llama.cpp's Q8_1: int8 per 32 values, scale and sum).
struct Q8Activations {
  std::vector<int8_t> q;
  std::vector<float> dy, sy;
  void quantize(const float* x, int64_t M, int64_t K) {
    q.resize(M * K);
    dy.resize(M * (K / 32));
    sy.resize(M * (K / 32));
    ferry_cpu::quantize_q8_rows(x, M, K, q.data(), dy.data(), sy.data());
  }
};

// The bytes of L's rows [r0, r1) that lie in the part holding row r0 (a thread's run of weight bytes
// until a part ends), or none where r0 >= r1.
std::pair<const uint8_t*, int64_t> part_rows(const QuantLinear& L, int64_t r0, int64_t r1) {
  int64_t offset = 0;
  for (size_t p = 0; p < L.parts.size() && r0 < r1; ++p) {
    if (r0 < offset + L.rows[p]) {
      const auto& data = std::get<0>(L.parts[p]);
      return {data.data_ptr<uint8_t>() + (r0 - offset) * data.size(1), (std::min(r1, offset + L.rows[p]) - r0) * data.size(1)};
    }
    offset += L.rows[p];
  }
  return {nullptr, 0};
}

// The weight bytes thread `tid` of `threads` reads first when run_linear runs `L`, as
// at::parallel_for(0, groups of 8, 2) hands them out: where the linear before it keeps prefetching
// once its own rows are read, so that the next run of weight bytes does not start cold (WeightStream,
// gguf_kernels.h). Prefetch only: a wrong guess costs time, not results.
std::pair<const uint8_t*, int64_t> first_rows(const QuantLinear& L, int64_t tid, int64_t threads) {
  const int64_t groups = (L.out + 7) / 8;
  if (groups == 0 || threads < 1) return {nullptr, 0};
  const int64_t used = std::min<int64_t>(threads, (groups + 1) / 2);
  const int64_t chunk = (groups + used - 1) / used;
  return part_rows(L, tid * chunk * 8, std::min(L.out, (tid + 1) * chunk * 8));
}

// y [M, L.out] = x [M, L.in] @ W.T (+ bias): one fork over all output rows of all parts, split at
// multiples of 8 rows (gguf_matmul_rows' interleaved groups). `next`: the linear the step runs after
// this one (each thread's first bytes of it prefetched at the end of its rows of this one), or none.
void run_linear(const QuantLinear& L, const float* x, int64_t M, float* y, Q8Activations& act,
                const QuantLinear* next = nullptr) {
  act.quantize(x, M, L.in);
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, (L.out + 7) / 8, 2, [&](int64_t t0, int64_t t1) {
    const auto [then, then_bytes] = next ? first_rows(*next, at::get_thread_num(), threads)
                                         : std::pair<const uint8_t*, int64_t>{nullptr, 0};
    const int64_t n0 = t0 * 8, n1 = std::min(L.out, t1 * 8);
    int64_t offset = 0;
    for (size_t p = 0; p < L.parts.size(); ++p) {
      const int64_t lo = std::max(n0, offset), hi = std::min(n1, offset + L.rows[p]);
      if (lo < hi) {
        const auto& [data, qtype] = L.parts[p];
        // What this thread reads after these rows: its rows of the next part, or of the next linear.
        const auto [after, after_bytes] = hi < n1 ? part_rows(L, hi, n1) : std::pair{then, then_bytes};
        ferry_cpu::gguf_matmul_rows(act.q.data(), act.dy.data(), act.sy.data(), M, L.in, data.data_ptr<uint8_t>(),
                                    L.rows[p], qtype, lo - offset, hi - offset, y + offset, L.out, after, after_bytes);
      }
      offset += L.rows[p];
    }
  });
  if (L.bias) {
    const float* b = L.bias->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      float* row = y + m * L.out;
#pragma omp simd
      for (int64_t n = 0; n < L.out; ++n) row[n] += b[n];
    }
  }
}

// A sparse MLP: softmax routing to top_k of the experts, and an optional shared expert (Qwen2-MoE's,
// scaled by a sigmoid gate when shared_gate is set).
struct MoE {
  at::Tensor router;  // float32 [E, hidden]
  int64_t top_k = 0, inter = 0;
  bool renormalize = false;
  double scale = 1.0;
  std::vector<QuantLinear> gate_up, down;  // per expert: [gate; up] [2 inter, hidden], down [hidden, inter]
  c10::optional<QuantLinear> shared_gate_up, shared_down;
  c10::optional<at::Tensor> shared_gate;  // float32 [1, hidden]
};

struct Layer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  QuantLinear qkv, o, gate_up, down;  // gate_up and down: a dense layer's MLP
  std::shared_ptr<MoE> moe;           // set: a sparse layer's MLP instead
};

// A step's new K/V rows go into the cache here, one (token, head) row at a time: at batch 64 the
// scalar loops (an fp32 division per int8 value, and a std::max call: GCC does not inline across
// the no-fast-math region below) took ~8 ms of a ~60 ms SmolLM2 step, while the other thread
// waited. With AVX-512 the int8 and bf16 rows are written 16 values at a time, byte for byte as
// torch writes them (tests/models/test_cpu_decode_step.py compares the caches).
#ifdef FERRY_STEP_AVX512
inline __mmask16 lanes_left(int64_t n) { return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1); }

// bf16 by round-to-nearest-even on the bits (c10::BFloat16's own formula), NaN as 0x7fc0.
inline void store_bf16_row(c10::BFloat16* dst, const float* src, int64_t n) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), nan = _mm512_set1_epi32(0x7fc0);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes_left(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(k, src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
    _mm512_mask_cvtepi32_storeu_epi16(dst + i, k, r);
  }
}

// An int8 row as ferry/kv_quant.py's quantize_rows writes it (see store_quantized_row): the division
// and the addition take explicit rounding modes, so -ffast-math cannot turn x / scale into
// x * (1 / scale) or fold the half-away-from-zero rounding; every step is the IEEE operation torch does.
inline void store_int8_row(uint8_t* dst, const float* x, int64_t D) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes_left(D - i), x + i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float scale = _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(amax > 1e-30f ? amax : 1e-30f), _mm_set_ss(127.f), kNearest));
  const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u)), half = _mm512_castps_si512(_mm512_set1_ps(0.5f));
  for (int64_t i = 0; i < D; i += 16) {
    const __mmask16 k = lanes_left(D - i);
    const __m512 y = _mm512_div_round_ps(_mm512_maskz_loadu_ps(k, x + i), vs, kNearest);
    const __m512 h = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(y), sign), half));
    const __m512 r = _mm512_roundscale_ps(_mm512_add_round_ps(y, h, kNearest), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    _mm512_mask_cvtsepi32_storeu_epi8(dst + i, k, _mm512_cvttps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r))));
  }
  std::memcpy(dst + D, &scale, sizeof(float));
}
#endif

template <typename CacheT>
inline void store_row(CacheT* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<CacheT, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
#ifdef FERRY_STEP_AVX512
    store_bf16_row(dst, src, n);
#else
    for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);  // round to nearest even, as torch's .to()
#endif
  }
}

// One (token, head) row of an int8 / fp8 cache, as ferry/kv_quant.py's quantize_rows writes it:
// scale = max(absmax, 1e-30) / qmax, values x / scale (int8: rounded half away from zero and
// clamped to +-127; fp8 e4m3fn: clamped to +-448, rounded to nearest even), then the fp32 scale.
// Compiled without -ffast-math: x / scale must round as torch's division does (no reciprocal),
// so both paths write bit-identical caches. (Comparisons, not std::max / std::min: those are
// calls here, as GCC does not inline fast-math code into this region.)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
template <typename Q>
void store_quantized_row(uint8_t* dst, const float* x, int64_t D) {
#ifdef FERRY_STEP_AVX512
  if constexpr (std::is_same_v<Q, int8_t>) return store_int8_row(dst, x, D);
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
  constexpr float qmax = std::is_same_v<Q, int8_t> ? 127.f : 448.f;
  const float scale = (amax > 1e-30f ? amax : 1e-30f) / qmax;
  for (int64_t i = 0; i < D; ++i) {
    const float y = x[i] / scale;
    if constexpr (std::is_same_v<Q, int8_t>) {
      const float t = std::trunc(y + std::copysign(0.5f, y));
      const float r = t > 127.f ? 127.f : (t < -127.f ? -127.f : t);
      dst[i] = static_cast<uint8_t>(static_cast<int8_t>(r));
    } else {
      const float c = y > 448.f ? 448.f : (y < -448.f ? -448.f : y);
      const c10::Float8_e4m3fn f(c);
      std::memcpy(dst + i, &f, 1);
    }
  }
  std::memcpy(dst + D, &scale, sizeof(float));
}
#pragma GCC pop_options

// One token's K or V (KVH heads of D values) into cache slot `slot` ([NB, BS, KVH, W] viewed as slots):
// fp32 copied, bf16 rounded to nearest even, int8 / fp8 rows quantized with their scale and placed as
// `layout` lays out a quantized cache's blocks (kv_layout.h).
inline void store_token_rows(const at::Tensor& cache, int64_t slot, const float* src, int64_t KVH, int64_t D,
                             KvLayout layout) {
  const auto dt = cache.scalar_type();
  if (dt == at::ScalarType::Float) {
    store_row(cache.data_ptr<float>() + slot * KVH * D, src, KVH * D);
  } else if (dt == at::ScalarType::BFloat16) {
    store_row(cache.data_ptr<c10::BFloat16>() + slot * KVH * D, src, KVH * D);
  } else {
    const int64_t W = D + 4, BS = cache.size(1);
    auto* base = static_cast<uint8_t*>(cache.data_ptr());
    uint8_t row[4096 + 4];  // D <= 4096 (checked by the callers)
    for (int64_t h = 0; h < KVH; ++h) {
      uint8_t* dst = layout == KvLayout::Rows ? base + (slot * KVH + h) * W : row;
      if (dt == at::ScalarType::Char) store_quantized_row<int8_t>(dst, src + h * D, D);
      else store_quantized_row<c10::Float8_e4m3fn>(dst, src + h * D, D);
      if (layout != KvLayout::Rows)
        kv_scatter_row(base + kv_head_offset(slot / BS, h, BS, KVH, W), layout, slot % BS, BS, D, row);
    }
  }
}

// x [T, KVH, D] float32 (rows of K or V for the step's tokens) into the cache rows of `slots` ([T]
// int64; a negative slot writes nothing), as ferry/kv_quant.py's store_rows writes them, byte for
// byte: fp32 copied, bf16 rounded to nearest even, int8 / fp8 rows quantized with their scale. One
// pass per row, in parallel, where the torch path took ~ten elementwise ops and an index_copy_ per
// layer (~8% of a 300-token prefill with an int8 cache).
void store_kv_rows(at::Tensor cache, at::Tensor slots, at::Tensor x, int64_t layout) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 3, "x must be float32 [T, KVH, D]");
  TORCH_CHECK(layout >= 0 && layout <= 2, "layout: 0 rows, 1 keys, 2 values (kv_layout.h)");
  TORCH_CHECK(x.size(2) <= 4096, "head_dim above 4096");
  if (x.stride(2) != 1 || x.stride(1) != x.size(2)) x = x.contiguous();  // (a qkv split's rows already are)
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(2) == x.size(1), "cache: contiguous [NB, BS, KVH, W]");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.dim() == 1 && slots.size(0) == x.size(0), "slots must be int64 [T]");
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2), W = cache.size(3);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const auto dt = cache.scalar_type();
  const bool quantized = dt == at::ScalarType::Char || dt == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(W == D + (quantized ? 4 : 0), "cache rows must be head_dim wide (+4: a scale)");
  TORCH_CHECK(quantized || dt == at::ScalarType::Float || dt == at::ScalarType::BFloat16,
              "the cache must be float32, bfloat16, int8 or float8_e4m3fn");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (sp[t] >= 0) store_token_rows(cache, sp[t], xp + t * xs, KVH, D, static_cast<KvLayout>(layout));
  });
}

}  // namespace

class DecodeStep {
 public:
  DecodeStep(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
             double eps, double scale, at::Tensor cos, at::Tensor sin, at::Tensor final_norm)
      : hidden_(hidden), inter_(intermediate), H_(num_heads), KVH_(num_kv_heads), D_(head_dim), eps_(float(eps)),
        scale_(scale), cos_(cos), sin_(sin), final_norm_(final_norm) {
    TORCH_CHECK(cos.dtype() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 && cos.size(1) == D_ / 2,
                "cos must be contiguous float32 [max_position, head_dim / 2]");
    TORCH_CHECK(sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.dtype() == at::kFloat, "sin like cos");
    TORCH_CHECK(head_dim <= 4096, "head_dim above 4096");
    check_norm(final_norm, hidden_, "final norm");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, Parts qkv, c10::optional<at::Tensor> qkv_bias,
                 c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, Parts o,
                 c10::optional<at::Tensor> o_bias, Parts gate_up, Parts down) {
    Layer layer = attention_layer(input_norm, post_norm, std::move(qkv), std::move(qkv_bias), q_norm, k_norm,
                                  std::move(o), std::move(o_bias));
    layer.gate_up = make_linear(std::move(gate_up), {}, hidden_, 2 * inter_, "gate_up_proj");
    layer.down = make_linear(std::move(down), {}, inter_, hidden_, "down_proj");
    layers_.push_back(std::move(layer));
  }

  // A layer whose MLP is a mixture of experts: `router` float32 [E, hidden]; per expert its [gate; up]
  // and down parts; the shared expert's (empty lists: none) and its sigmoid gate [1, hidden] (or none).
  void add_moe_layer(at::Tensor input_norm, at::Tensor post_norm, Parts qkv,
                     c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, Parts o, c10::optional<at::Tensor> o_bias,
                     at::Tensor router, int64_t top_k, bool renormalize, double scale, int64_t moe_inter,
                     std::vector<Parts> expert_gate_up, std::vector<Parts> expert_down, Parts shared_gate_up,
                     Parts shared_down, c10::optional<at::Tensor> shared_gate) {
    Layer layer = attention_layer(input_norm, post_norm, std::move(qkv), std::move(qkv_bias), q_norm, k_norm,
                                  std::move(o), std::move(o_bias));
    const int64_t E = int64_t(expert_gate_up.size());
    TORCH_CHECK(E > 0 && int64_t(expert_down.size()) == E, "one [gate; up] and one down projection per expert");
    TORCH_CHECK(router.dtype() == at::kFloat && router.is_contiguous() && router.dim() == 2 &&
                    router.size(0) == E && router.size(1) == hidden_,
                "router must be contiguous float32 [", E, ", ", hidden_, "]");
    TORCH_CHECK(1 <= top_k && top_k <= E, "top_k must be in [1, ", E, "], got ", top_k);
    auto moe = std::make_shared<MoE>();
    moe->router = router;
    moe->top_k = top_k, moe->inter = moe_inter, moe->renormalize = renormalize, moe->scale = scale;
    for (int64_t e = 0; e < E; ++e) {
      moe->gate_up.push_back(make_linear(std::move(expert_gate_up[e]), {}, hidden_, 2 * moe_inter, "expert gate_up"));
      moe->down.push_back(make_linear(std::move(expert_down[e]), {}, moe_inter, hidden_, "expert down"));
    }
    TORCH_CHECK(shared_gate_up.empty() == shared_down.empty(), "the shared expert's projections come together");
    if (!shared_gate_up.empty()) {
      int64_t rows = 0;
      for (auto& part : shared_gate_up) rows += std::get<0>(part).size(0);
      moe->shared_gate_up = make_linear(std::move(shared_gate_up), {}, hidden_, rows, "shared expert gate_up");
      moe->shared_down = make_linear(std::move(shared_down), {}, rows / 2, hidden_, "shared expert down");
    }
    if (shared_gate) {
      TORCH_CHECK(moe->shared_gate_up.has_value(), "a shared-expert gate without a shared expert");
      TORCH_CHECK(shared_gate->dtype() == at::kFloat && shared_gate->is_contiguous() &&
                      shared_gate->numel() == hidden_,
                  "shared-expert gate must be contiguous float32 [1, ", hidden_, "]");
      moe->shared_gate = shared_gate->view({1, hidden_});
    }
    layer.moe = std::move(moe);
    layers_.push_back(std::move(layer));
  }

  // x: [B, hidden] the tokens' embeddings (or the residual stream entering the first of these
  // layers: early exit's verification runs a model's last layers from where its draft left
  // off); one query token per sequence. Returns the final norm's output [B, hidden] (the LM
  // head's input), having written each layer's K/V; `pre_norm_out`, when given, receives the
  // residual stream before that norm (where the next layer, had there been one, would start).
  // Sliding windows: layer_view[l] >= 0 names the (tables, lens, skip) a windowed layer attends
  // through (the torch backend's WindowView: tables from the window's first block, the keys before
  // the window skipped in it); -1, or no layer_view at all, the whole context.
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, c10::optional<at::Tensor> tree,
                     std::vector<int64_t> layer_view, std::vector<at::Tensor> view_tables,
                     std::vector<at::Tensor> view_lens, std::vector<at::Tensor> view_skips,
                     c10::optional<at::Tensor> pre_norm_out) {
    const int64_t B = x.size(0), L = int64_t(layers_.size());
    const int64_t V = int64_t(view_tables.size());
    TORCH_CHECK(layer_view.empty() || int64_t(layer_view.size()) == L, "layer_view: one entry per layer, or none");
    TORCH_CHECK(int64_t(view_lens.size()) == V && int64_t(view_skips.size()) == V, "one lens and skip per view");
    for (int64_t v : layer_view) {
      TORCH_CHECK(-1 <= v && v < V, "layer_view names view ", v, " of ", V);
      TORCH_CHECK(v < 0 || !(tree.has_value() && tree->defined()), "a sliding window does not combine with a tree");
    }
    TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_, "x must be float32 [B, ",
                hidden_, "]");
    if (pre_norm_out.has_value()) {
      TORCH_CHECK(pre_norm_out->dtype() == at::kFloat && pre_norm_out->is_contiguous() &&
                      pre_norm_out->dim() == 2 && pre_norm_out->size(0) == B && pre_norm_out->size(1) == hidden_,
                  "pre_norm_out must be a contiguous float32 [B, ", hidden_, "]");
    }
    TORCH_CHECK(int64_t(k_caches.size()) == L && int64_t(v_caches.size()) == L, "one K and one V cache per layer");
    TORCH_CHECK(positions.dtype() == at::kLong && positions.numel() == B, "positions: int64 [B]");
    TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.numel() == B, "slot_mapping: int64 [B]");
    auto pos = positions.contiguous();
    auto slots = slot_mapping.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t row = KVH_ * D_;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pp[b] >= 0 && pp[b] < cos_.size(0), "position ", pp[b], " out of range");
    }
    for (int64_t l = 0; l < L; ++l) {
      const auto &kc = k_caches[l], &vc = v_caches[l];
      const bool quantized = kc.dtype() == at::kChar || kc.dtype() == at::ScalarType::Float8_e4m3fn;
      const int64_t width = D_ + (quantized ? 4 : 0);  // a quantized row carries its fp32 scale
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.sizes() == vc.sizes() &&
                      kc.size(2) == KVH_ && kc.size(3) == width && kc.dtype() == vc.dtype(),
                  "layer ", l, ": caches must be contiguous [blocks, block_size, ", KVH_, ", ", width, "] pairs");
      TORCH_CHECK(quantized || kc.dtype() == at::kFloat || kc.dtype() == at::kBFloat16,
                  "cache must be float32, bfloat16, int8 or float8_e4m3fn");
      const int64_t capacity = kc.size(0) * kc.size(1);
      for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] < capacity, "slot ", sp[b], " out of range");
    }
    auto opts = x.options();
    auto residual = x.clone();
    auto h = at::empty({B, hidden_}, opts);
    auto qkv = at::empty({B, (H_ + 2 * KVH_) * D_}, opts);
    auto q = at::empty({B, H_, D_}, opts);
    auto attn = at::empty({B, H_, D_}, opts);  // every layer's attention output, in turn
    auto o = at::empty({B, hidden_}, opts);
    auto gate_up = at::empty({B, 2 * inter_}, opts);
    auto act = at::empty({B, inter_}, opts);
    auto mlp = at::empty({B, hidden_}, opts);
    float *rp = residual.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
    float *qp = q.data_ptr<float>(), *op = o.data_ptr<float>(), *gp = gate_up.data_ptr<float>();
    float *ap = act.data_ptr<float>(), *mp = mlp.data_ptr<float>();
    const int64_t stride = (H_ + 2 * KVH_) * D_, q_size = H_ * D_;
    Q8Activations qa;
    for (int64_t l = 0; l < L; ++l) {
      const Layer& layer = layers_[l];
      if (l == 0) {
        ferry_cpu::rms_norm_rows(rp, layer.input_norm.data_ptr<float>(), hp, B, hidden_, eps_);
      } else {
        ferry_cpu::add_rms_norm_rows(mp, rp, layer.input_norm.data_ptr<float>(), hp, B, hidden_, eps_);
      }
      run_linear(layer.qkv, hp, B, qkvp, qa, &layer.o);
      if (layer.q_norm) {
        for (int64_t b = 0; b < B; ++b) {
          float* t = qkvp + b * stride;
          ferry_cpu::rms_norm_rows(t, layer.q_norm->data_ptr<float>(), t, H_, D_, eps_);
          ferry_cpu::rms_norm_rows(t + q_size, layer.k_norm->data_ptr<float>(), t + q_size, KVH_, D_, eps_);
        }
      }
      ferry_cpu::rotary_rows(pp, B, qkvp, stride, D_, H_, qkvp + q_size, stride, D_, KVH_, D_, cos_.data_ptr<float>(),
                             sin_.data_ptr<float>());
      const auto &kc = k_caches[l], &vc = v_caches[l];
      for (int64_t b = 0; b < B; ++b) {
        const float* t = qkvp + b * stride;
        std::memcpy(qp + b * q_size, t, q_size * sizeof(float));
        if (sp[b] < 0) continue;  // a padding row: its K/V go nowhere
        store_token_rows(kc, sp[b], t + q_size, KVH_, D_, KvLayout::Keys);
        store_token_rows(vc, sp[b], t + q_size + row, KVH_, D_, KvLayout::Values);
      }
      const int64_t view = layer_view.empty() ? -1 : layer_view[l];
      if (view < 0) paged_decode_attention_out(q, kc, vc, block_tables, seq_lens, scale_, tree, c10::nullopt, attn);
      else paged_decode_attention_out(q, kc, vc, view_tables[view], view_lens[view], scale_, c10::nullopt,
                                      view_skips[view], attn);
      run_linear(layer.o, attn.data_ptr<float>(), B, op, qa, layer.moe ? nullptr : &layer.gate_up);
      ferry_cpu::add_rms_norm_rows(op, rp, layer.post_norm.data_ptr<float>(), hp, B, hidden_, eps_);
      if (layer.moe) {
        mlp.copy_(sparse_mlp(*layer.moe, h, qa));
        continue;
      }
      run_linear(layer.gate_up, hp, B, gp, qa, &layer.down);
      ferry_cpu::silu_and_mul_rows(gp, ap, B, inter_);
      run_linear(layer.down, ap, B, mp, qa, l + 1 < L ? &layers_[l + 1].qkv : nullptr);
    }
    auto out = at::empty({B, hidden_}, opts);
    ferry_cpu::add_rms_norm_rows(mp, rp, final_norm_.data_ptr<float>(), out.data_ptr<float>(), B, hidden_, eps_);
    if (pre_norm_out.has_value()) pre_norm_out->copy_(residual);  // the add above left the stream in it
    return out;
  }

 private:
  Layer attention_layer(at::Tensor input_norm, at::Tensor post_norm, Parts qkv,
                        c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm,
                        c10::optional<at::Tensor> k_norm, Parts o, c10::optional<at::Tensor> o_bias) {
    check_norm(input_norm, hidden_, "input norm");
    check_norm(post_norm, hidden_, "post-attention norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    if (q_norm) check_norm(*q_norm, D_, "q norm"), check_norm(*k_norm, D_, "k norm");
    const int64_t qkv_out = (H_ + 2 * KVH_) * D_;
    Layer layer;
    layer.input_norm = input_norm, layer.post_norm = post_norm, layer.q_norm = q_norm, layer.k_norm = k_norm;
    layer.qkv = make_linear(std::move(qkv), std::move(qkv_bias), hidden_, qkv_out, "qkv_proj");
    layer.o = make_linear(std::move(o), std::move(o_bias), H_ * D_, hidden_, "o_proj");
    return layer;
  }

  // layers/moe.py's SparseMoeBlock on x [B, hidden]: select_experts (softmax, top k, renormalised,
  // scaled), grouped_experts (each expert over its rows in token order, outputs times their weights,
  // index_add'ed per token in expert order) and the shared expert, with the same ATen ops where it
  // uses them, so both paths produce the same bits.
  at::Tensor sparse_mlp(const MoE& m, const at::Tensor& x, Q8Activations& qa) {
    const int64_t B = x.size(0), k = m.top_k, E = int64_t(m.gate_up.size());
    auto scores = at::softmax(at::linear(x, m.router), -1);
    auto ids = std::get<1>(at::topk(scores, k, -1));
    auto weights = scores.gather(1, ids);
    if (m.renormalize) weights = weights / (weights.sum(-1, true) + 1e-20);
    if (m.scale != 1.0) weights = weights * m.scale;
    const int64_t* idp = ids.data_ptr<int64_t>();
    // (token, choice) pairs grouped by expert, tokens ascending within each (a stable sort)
    std::vector<int64_t> counts(E + 1, 0), order(B * k);
    for (int64_t i = 0; i < B * k; ++i) ++counts[idp[i] + 1];
    for (int64_t e = 0; e < E; ++e) counts[e + 1] += counts[e];
    {
      std::vector<int64_t> next(counts.begin(), counts.end() - 1);
      for (int64_t i = 0; i < B * k; ++i) order[next[idp[i]]++] = i;
    }
    auto opts = x.options();
    auto rows = at::empty({B * k, hidden_}, opts), out = at::empty({B * k, hidden_}, opts);
    auto gate_up = at::empty({B, 2 * m.inter}, opts), act = at::empty({B, m.inter}, opts);
    const float* xp = x.data_ptr<float>();
    float *rp = rows.data_ptr<float>(), *outp = out.data_ptr<float>();
    for (int64_t i = 0; i < B * k; ++i) std::memcpy(rp + i * hidden_, xp + (order[i] / k) * hidden_, hidden_ * 4);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t start = counts[e], n = counts[e + 1] - start;
      if (n == 0) continue;
      run_linear(m.gate_up[e], rp + start * hidden_, n, gate_up.data_ptr<float>(), qa);
      ferry_cpu::silu_and_mul_rows(gate_up.data_ptr<float>(), act.data_ptr<float>(), n, m.inter);
      run_linear(m.down[e], act.data_ptr<float>(), n, outp + start * hidden_, qa);
    }
    auto order_t = at::from_blob(order.data(), {B * k}, at::kLong);
    out.mul_(weights.reshape(-1).index_select(0, order_t).unsqueeze(1));
    auto sum = at::zeros_like(x).index_add_(0, at::floor_divide(order_t, k), out);
    if (!m.shared_gate_up) return sum;
    const int64_t si = m.shared_gate_up->out / 2;
    auto sgu = at::empty({B, 2 * si}, opts), sact = at::empty({B, si}, opts), shared = at::empty({B, hidden_}, opts);
    run_linear(*m.shared_gate_up, xp, B, sgu.data_ptr<float>(), qa);
    ferry_cpu::silu_and_mul_rows(sgu.data_ptr<float>(), sact.data_ptr<float>(), B, si);
    run_linear(*m.shared_down, sact.data_ptr<float>(), B, shared.data_ptr<float>(), qa);
    if (m.shared_gate) return sum + at::sigmoid(at::linear(x, *m.shared_gate)) * shared;
    return sum + shared;
  }

  static void check_norm(const at::Tensor& w, int64_t n, const char* name) {
    TORCH_CHECK(w.dtype() == at::kFloat && w.is_contiguous() && w.numel() == n, name,
                " weight must be contiguous float32 [", n, "]");
  }

  int64_t hidden_, inter_, H_, KVH_, D_;
  float eps_;
  double scale_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
};

void bind_decode_step(pybind11::module& m) {
  m.def("store_kv_rows", &store_kv_rows,
        "x [T, KVH, D] into the cache rows of slots, as kv_quant.store_rows writes them (CPU); layout 0 rows, 1 keys, "
        "2 values (a quantized cache's blocks)",
        pybind11::arg("cache"), pybind11::arg("slots"), pybind11::arg("x"), pybind11::arg("layout"));
  pybind11::class_<DecodeStep>(m, "DecodeStep", "a Llama-family decode step with GGUF weights, in one call (CPU)")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("add_moe_layer", &DecodeStep::add_moe_layer)
      .def("forward", &DecodeStep::forward, pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
           pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("tree") = pybind11::none(),
           pybind11::arg("layer_view") = std::vector<int64_t>{},
           pybind11::arg("view_tables") = std::vector<at::Tensor>{},
           pybind11::arg("view_lens") = std::vector<at::Tensor>{},
           pybind11::arg("view_skips") = std::vector<at::Tensor>{},
           pybind11::arg("pre_norm_out") = pybind11::none());
}
