// The decoder's small fp32 ops as one C++ call each (ferry/layers/fused.py, rotary.py).
//
// At batch 1 a layer's norms, activation and rotary touch a few KB, yet torch runs
// each as 4-8 dispatched ops (rms_norm alone: pow, mean, add, rsqrt, mul, mul).
// One call each took a SmolLM2-135M decode step from ~28.2 to ~27 ms on an AVX2
// EPYC (end to end, no profiler). One pass per op over rows split between threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

void check_rows(const at::Tensor& t, int64_t K, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.dim() >= 1 && t.size(-1) == K,
              name, " must be a contiguous float32 tensor with last dimension ", K);
}

inline void norm_row(const float* r, const float* w, float* o, int64_t K, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < K; ++k) ss += r[k] * r[k];
  const float inv = 1.f / std::sqrt(ss / float(K) + eps);
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) o[k] = r[k] * inv * w[k];
}

// Rows per thread task: small batches (decode) stay on one thread, a fork costs more than the work.
int64_t grain_for(int64_t K) { return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(K, 1)); }

}  // namespace

// Raw-pointer forms, shared with the whole-step decode kernel (decode_stack_cpu.cpp).
namespace ferry_cpu {

void add_rms_norm_rows(const float* x, float* residual, const float* w, float* out, int64_t M, int64_t K, float eps) {
  at::parallel_for(0, M, grain_for(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* r = residual + m * K;
      const float* xr = x + m * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) r[k] += xr[k];
      norm_row(r, w, out + m * K, K, eps);
    }
  });
}

// out may alias x (each row is read whole before it is written).
void rms_norm_rows(const float* x, const float* w, float* out, int64_t M, int64_t K, float eps) {
  at::parallel_for(0, M, grain_for(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(x + m * K, w, out + m * K, K, eps);
  });
}

void silu_and_mul_rows(const float* gate_up, float* out, int64_t M, int64_t I) {
  at::parallel_for(0, M, grain_for(2 * I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gate_up + m * 2 * I;
      float* o = out + m * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    }
  });
}

// NeoX (rotate-half) rotary embedding in place of T tokens' q heads (H rows of D floats, tokens
// q_tok floats apart, heads q_head apart) and k heads (KVH rows; k_tok, k_head).
void rotary_rows(const int64_t* pos, int64_t T, float* q, int64_t q_tok, int64_t q_head, int64_t H, float* k,
                 int64_t k_tok, int64_t k_head, int64_t KVH, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  auto rotate = [&](float* base, int64_t heads, int64_t head_stride, int64_t t) {
    const float* c = cos + pos[t] * half;
    const float* s = sin + pos[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = base + h * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  };
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rotate(q + t * q_tok, H, q_head, t), rotate(k + t * k_tok, KVH, k_head, t);
  });
}

}  // namespace ferry_cpu

// residual += x (in place); returns rms_norm(residual) * weight.
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  const int64_t K = weight.size(0);
  check_rows(x, K, "x");
  check_rows(residual, K, "residual");
  check_rows(weight, K, "weight");
  TORCH_CHECK(x.numel() == residual.numel(), "x and residual differ in size");
  auto out = at::empty_like(residual);
  ferry_cpu::add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                               out.data_ptr<float>(), residual.numel() / K, K, float(eps));
  return out;
}

// x: contiguous rows, or [T, H, K] heads of a token contiguous and tokens any stride apart (the
// q or k heads viewed inside a fused qkv, Qwen3's q/k norms); the output is contiguous.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  const int64_t K = weight.size(0);
  check_rows(weight, K, "weight");
  if (!x.is_contiguous() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == K && x.size(2) == K &&
      x.dtype() == at::kFloat) {
    const int64_t T = x.size(0), H = x.size(1);
    auto out = at::empty({T, H, K}, x.options());
    for (int64_t t = 0; t < T; ++t)
      ferry_cpu::rms_norm_rows(x.data_ptr<float>() + t * x.stride(0), weight.data_ptr<float>(),
                               out.data_ptr<float>() + t * H * K, H, K, float(eps));
    return out;
  }
  check_rows(x, K, "x");
  auto out = at::empty_like(x);
  ferry_cpu::rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.numel() / K, K,
                           float(eps));
  return out;
}

// [M, 2I] (gate | up) -> silu(gate) * up [M, I].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == at::kFloat && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "gate_up must be contiguous float32 with an even last dimension");
  const int64_t I = gate_up.size(-1) / 2, M = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  ferry_cpu::silu_and_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, I);
  return out;
}

// NeoX (rotate-half) rotary embedding of q [T, H, D] and k [T, KVH, D] in place (q/k may be views
// into the fused qkv: any token and head strides, unit stride within a head).
void rotary_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dtype() == at::kFloat && k.dtype() == at::kFloat, "q and k must be float32");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.dim() == 1, "positions must be 1-D int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat, "cos/sin: contiguous fp32");
  const int64_t T = q.size(0), D = q.size(2), max_pos = cos.size(0);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.size(1) == D / 2, "unexpected q/k/cos layout");
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && positions.size(0) == T, "q, k and positions disagree in shape");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " out of range");
  ferry_cpu::rotary_rows(pp, T, q.data_ptr<float>(), q.stride(0), q.stride(1), q.size(1), k.data_ptr<float>(),
                         k.stride(0), k.stride(1), k.size(1), D, cos.data_ptr<float>(), sin.data_ptr<float>());
}
