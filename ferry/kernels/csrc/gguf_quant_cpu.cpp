// GGUF block-quantized weights executed as stored (ferry/layers/gguf_linear.py): the decode rows'
// loop (gguf_dot_rows, also called by the C++ decode step) and the torch ops. The formats and the
// kernels are in gguf_kernels.h.
#include "gguf_kernels.h"

namespace {

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "weight must be contiguous uint8 [N, row_bytes]");
  const Layout L = layout_of(qtype);
  TORCH_CHECK(K % L.block == 0, "K=", K, " is not a multiple of the block size ", L.block);
  TORCH_CHECK(w.size(1) == K / L.block * L.bytes, "weight rows are ", w.size(1), " bytes, expected ", K / L.block * L.bytes);
}

}  // namespace

namespace ferry_cpu {

// gguf_prompt_cpu.cpp
void gguf_matmul_rows(const int8_t* qx, const float* dy, const float* sy, int64_t M, int64_t K, const uint8_t* w,
                      int64_t N, int64_t qtype, int64_t n0, int64_t n1, float* y, int64_t ldy,
                      const uint8_t* then = nullptr, int64_t then_bytes = 0);

// quantize_q8 with the rows shared between the threads (each row's bytes are its own, so the same
// on any thread count). Run serially it was the part of a batch's or a prompt's matmuls the other
// thread waited on: 0.9-2.4% of a batch-64 decode step's samples, 1.5% of a prefill's (`perf`, all
// on the master thread); shared, 64 rows quantized 1.2-1.3x faster, 2,048 rows 1.4x. Up to
// kRowsPerThread rows (a decode step's) stay on the calling thread: no fork.
void quantize_q8_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* dy, float* sy) {
  constexpr int64_t kRowsPerThread = 16;
  const int64_t nb = K / 32;
  at::parallel_for(0, M, kRowsPerThread, [&](int64_t m0, int64_t m1) {
    quantize_q8(x + m0 * K, m1 - m0, K, q + m0 * K, dy + m0 * nb, sy + m0 * nb);
  });
}

int64_t gguf_row_bytes(int64_t qtype, int64_t K) {
  const Layout L = layout_of(qtype);
  return K / L.block * L.bytes;
}

// Output rows [n0, n1) of y = x @ dequant(w).T for M activation rows quantized by quantize_q8_rows:
// y[m * ldy + n]; w is [N, row_bytes]. One weight row is read once for all M rows. Called by one
// thread; a row of an interleaved group is always computed with its whole group, so its result does
// not depend on how rows are split between threads (callers split at multiples of 8 to waste none).
void gguf_dot_rows(const int8_t* qx, const float* dy, const float* sy, int64_t M, int64_t K, const uint8_t* w,
                   int64_t N, int64_t qtype, int64_t n0, int64_t n1, float* y, int64_t ldy, const uint8_t* then,
                   int64_t then_bytes) {
  const int64_t row_bytes = gguf_row_bytes(qtype, K), nb = K / 32;
  const int64_t t = base_type(qtype);
  const bool kquant = layout_of(t).block == 256;
  const int64_t grouped = is_x8(qtype) ? N / kGroup * kGroup : 0;  // rows in whole interleaved groups
#ifndef FERRY_AVX2
  std::vector<int8_t> q(kquant ? K : 0);
  std::vector<float> sc16(kquant ? K / 16 : 0), mn32(kquant ? K / 32 : 0);
#endif
  const uint8_t* end = w + std::min(N, (n1 + kGroup - 1) / kGroup * kGroup) * row_bytes;
  // Plain rows (K-quants; a weight's rows past its last group of 8): prefetch_ahead's loop
  // (gguf_kernels.h), written out: calling the helper here changed this function's register
  // allocation, and a change that small once cost its 1-row pass 25%.
  auto prefetch = [&](const uint8_t* at, int64_t bytes) {
#ifdef FERRY_AVX2
    for (const uint8_t* p = at + kPrefetchAhead; p < std::min(at + kPrefetchAhead + bytes, end); p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#endif
  };
  const int8_t* yr[kGroupRows];
  const float *dr[kGroupRows], *sr[kGroupRows];
  auto activations = [&](int64_t m, int R) {
    for (int r = 0; r < R; ++r) yr[r] = qx + (m + r) * K, dr[r] = dy + (m + r) * nb, sr[r] = sy + (m + r) * nb;
  };
  int64_t n = n0;
  // The groups' bytes are one run, prefetched as the first pass of activation rows reads them, and
  // on into `then`. (A thread without groups, e.g. a K-quant weight's, prefetches none of `then`: its
  // plain rows come first.)
  const int64_t g_begin = std::min(n0 / kGroup * kGroup, grouped), g_end = std::min(n1, grouped);
  const int64_t group_bytes = std::max<int64_t>(0, (g_end + kGroup - 1) / kGroup * kGroup - g_begin) * row_bytes;
  WeightStream stream(w + g_begin * row_bytes, group_bytes, group_bytes ? then : nullptr, then_bytes);
  while (n < n1 && n < grouped) {  // interleaved groups of 8 rows
    const int64_t g0 = n / kGroup * kGroup;
    const uint8_t* group = w + g0 * row_bytes;
    for (int64_t m = 0; m < M; m += kGroupRows) {
      const int R = int(std::min<int64_t>(kGroupRows, M - m));
      activations(m, R);
      float out[kGroupRows * kGroup];
      WeightStream* ws = m == 0 ? &stream : nullptr;
      if (qtype == Q4_1X8) dot_group<Q4_1>(R, group, nb, yr, dr, sr, out, ws);
      else if (qtype == Q8_0X8) dot_group<Q8_0>(R, group, nb, yr, dr, sr, out, ws);
      else dot_group<Q4_0>(R, group, nb, yr, dr, sr, out, ws);
      for (int64_t i = std::max(n, g0); i < std::min(n1, g0 + kGroup); ++i)
        for (int r = 0; r < R; ++r) y[(m + r) * ldy + i] = out[r * kGroup + (i - g0)];
    }
    n = g0 + kGroup;
  }
  for (; n < n1; ++n) {  // plain rows
    const uint8_t* row = w + n * row_bytes;
    prefetch(row, row_bytes);
#ifndef FERRY_AVX2
    if (kquant) unpack_kquant_row(t, row, K, q.data(), sc16.data(), mn32.data());
#endif
    for (int64_t m = 0; m < M; m += 4) {
      const int R = int(std::min<int64_t>(4, M - m));
      activations(m, R);
      float out[4];
      if (kquant) {
#ifdef FERRY_AVX2
        if (t == Q4_K) dot_kquant<Q4_K>(R, row, K, yr, dr, sr, out);
        else if (t == Q5_K) dot_kquant<Q5_K>(R, row, K, yr, dr, sr, out);
        else dot_kquant<Q6_K>(R, row, K, yr, dr, sr, out);
#else
        switch (R) {
          case 4: dot_row_unpacked<4>(q.data(), sc16.data(), mn32.data(), K, yr, dr, sr, out); break;
          case 3: dot_row_unpacked<3>(q.data(), sc16.data(), mn32.data(), K, yr, dr, sr, out); break;
          case 2: dot_row_unpacked<2>(q.data(), sc16.data(), mn32.data(), K, yr, dr, sr, out); break;
          default: dot_row_unpacked<1>(q.data(), sc16.data(), mn32.data(), K, yr, dr, sr, out);
        }
#endif
      } else {
        if (t == Q4_1) dot_q32<Q4_1>(R, row, nb, yr, dr, sr, out);
        else if (t == Q4_0) dot_q32<Q4_0>(R, row, nb, yr, dr, sr, out);
        else dot_q32<Q8_0>(R, row, nb, yr, dr, sr, out);
      }
      for (int r = 0; r < R; ++r) y[(m + r) * ldy + n] = out[r];
    }
  }
}

}  // namespace ferry_cpu

// y [M, N] = x [M, K] @ dequant(w [N, row_bytes]).T (+ bias), through int8 dot products.
at::Tensor gguf_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dy(M * (K / 32)), sy(M * (K / 32));
  ferry_cpu::quantize_q8_rows(xc.data_ptr<float>(), M, K, qx.data(), dy.data(), sy.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Each thread takes a run of output rows, whole groups of 8 (see gguf_dot_rows).
  at::parallel_for(0, (N + 7) / 8, 2, [&](int64_t t0, int64_t t1) {
    ferry_cpu::gguf_matmul_rows(qx.data(), dy.data(), sy.data(), M, K, wp, N, qtype, t0 * 8, std::min(N, t1 * 8), yp, N);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// fp32 [N, K] copy of a quantized weight (the prefill path's GEMM operand, and the test oracle's peer).
at::Tensor gguf_dequantize(at::Tensor w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  auto out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> scratch(row_bytes);
    for (int64_t n = n0; n < n1; ++n)
      dequantize_row(base_type(qtype), plain_row(wp, N, qtype, row_bytes, K, n, scratch.data()), K, op + n * K);
  });
  return out;
}

// fp32 rows `ids` of a quantized weight (an embedding lookup that reads only those rows).
at::Tensor gguf_get_rows(at::Tensor w, at::Tensor ids, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "ids must be 1-D int64");
  auto idc = ids.contiguous();
  const int64_t T = idc.size(0), N = w.size(0), row_bytes = w.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row id ", ip[i], " out of range [0, ", N, ")");
  auto out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> scratch(row_bytes);
    for (int64_t i = t0; i < t1; ++i)
      dequantize_row(base_type(qtype), plain_row(wp, N, qtype, row_bytes, K, ip[i], scratch.data()), K, op + i * K);
  });
  return out;
}

// A Q4_0 / Q4_1 / Q8_0 weight [N, row_bytes] in the plain layout -> the same bytes interleaved by 8
// rows (type id + 256); rows past the last whole group are copied as they are.
at::Tensor gguf_interleave(at::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "only Q4_0, Q4_1 and Q8_0 weights are interleaved, not type ", qtype);
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), row_bytes = w.size(1), groups = N / kGroup;
  auto out = at::empty_like(w);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      interleave_group(wp + g * kGroup * row_bytes, K / 32, qtype, row_bytes, op + g * kGroup * row_bytes);
  });
  std::memcpy(op + groups * kGroup * row_bytes, wp + groups * kGroup * row_bytes, (N - groups * kGroup) * row_bytes);
  return out;
}
