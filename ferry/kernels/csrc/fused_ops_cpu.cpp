// The decoder's small fp32 ops as one C++ call each (ferry/layers/fused.py, rotary.py).
//
// At batch 1 a layer's norms, activation and rotary touch a few KB, yet torch runs
// each as 4-8 dispatched ops (rms_norm alone: pow, mean, add, rsqrt, mul, mul).
// One call each took a SmolLM2-135M decode step from ~28.2 to ~27 ms on an AVX2
// EPYC (end to end, no profiler). One pass per op over rows split between threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

void check_rows(const torch::Tensor& t, int64_t K, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.dim() >= 1 && t.size(-1) == K,
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

// residual += x (in place); returns rms_norm(residual) * weight.
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  const int64_t K = weight.size(0);
  check_rows(x, K, "x");
  check_rows(residual, K, "residual");
  check_rows(weight, K, "weight");
  TORCH_CHECK(x.numel() == residual.numel(), "x and residual differ in size");
  auto out = torch::empty_like(residual);
  const int64_t M = residual.numel() / K;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, M, grain_for(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* r = rp + m * K;
      const float* xr = xp + m * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) r[k] += xr[k];
      norm_row(r, wp, op + m * K, K, float(eps));
    }
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const int64_t K = weight.size(0);
  check_rows(x, K, "x");
  check_rows(weight, K, "weight");
  auto out = torch::empty_like(x);
  const int64_t M = x.numel() / K;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, grain_for(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(xp + m * K, wp, op + m * K, K, float(eps));
  });
  return out;
}

// [M, 2I] (gate | up) -> silu(gate) * up [M, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "gate_up must be contiguous float32 with an even last dimension");
  const int64_t I = gate_up.size(-1) / 2, M = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, grain_for(2 * I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gp + m * 2 * I;
      float* o = op + m * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    }
  });
  return out;
}

// NeoX (rotate-half) rotary embedding of q [T, H, D] and k [T, KVH, D] in place, where the
// heads of a token are rows `head_stride` floats apart (q/k may be views into the fused qkv).
void rotary_(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32, "q and k must be float32");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.dim() == 1, "positions must be 1-D int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == torch::kFloat32, "cos/sin: contiguous fp32");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2, max_pos = cos.size(0);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.size(1) == half, "unexpected q/k/cos layout");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " out of range");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  auto rotate = [&](torch::Tensor x, int64_t t) {
    const int64_t H = x.size(1);
    float* base = x.data_ptr<float>() + t * x.stride(0);
    const float* c = cp + pp[t] * half;
    const float* s = sp + pp[t] * half;
    for (int64_t h = 0; h < H; ++h) {
      float* v = base + h * x.stride(1);
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  };
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rotate(q, t), rotate(k, t);
  });
}
