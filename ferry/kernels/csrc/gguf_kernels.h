// GGUF block-quantized weights: the formats and the int8 dot kernels, shared by the translation
// units that run them (gguf_quant_cpu.cpp: decode rows and the torch ops; gguf_prompt_cpu.cpp:
// prompt rows, tiled). Everything here has internal linkage, so each unit inlines its own copies:
// GCC stopped inlining the group kernels into the decode loop once a prompt loop in the same file
// called them too, and batch-1 decode ran ~12% slower (BENCHMARKS.md, issue 15's thirteenth part).
//
#pragma once

// GGUF block-quantized weights executed as stored (ferry/layers/gguf_linear.py).
//
// A weight is [N, row_bytes] uint8, the file's bytes per row (so a fused q/k/v
// weight is its parts' rows concatenated). K-quant rows are ggml's blocks as
// stored. Q4_0, Q4_1 and Q8_0 rows are the same bytes regrouped at load (see
// gguf_linear.py: to_kernel_layout): all the blocks' quants, then all their fp16
// scales d, then (Q4_1) all their mins m. Eight blocks' scales then convert in
// one instruction and the min term is a vector FMA, which halves the
// instructions per block of the decode loop (it is instruction-bound: ~11
// cycles per block with the scales inline, measured on an AVX2 EPYC).
//
// On the CPU, after loading, Q4_0/Q4_1/Q8_0 weights are interleaved by eight rows (type ids
// Q4_0X8 / Q4_1X8 / Q8_0X8 = 256 + the ggml id; gguf_interleave): per block, four (Q8_0: eight)
// 32-byte chunks, chunk c holding bytes 4c..4c+3 of each of the 8 rows' quants (row r at 4r), then
// the 8 rows' fp16 scales, then (Q4_1) their mins; rows past the last whole group stay as above.
// (The AVX-512 VNNI build places the quants as chunk pairs instead: group_quant_offset.)
// One 32-bit lane per row: maddubs against 4 broadcast activation bytes yields 8 rows' partial
// dots at once, they add up in int16 over the block's 32 values (8 x 2 x 15 x 127 < 2^15), and
// the float conversion and scale FMA run once per block for 8 rows instead of once per row. That
// took the SmolLM2 layer shapes from ~1.7 to ~0.6-0.75 ns per row-block on one Zen 5 core (AVX2),
// making the batch-1 matmuls bound by memory, not instructions. Same bytes, same results per row
// whatever range of rows a thread takes (a row is always computed with its whole group).
// Q8_0's quants are stored offset by 128 (q ^ 0x80, unsigned) for vpdpbusd's unsigned operand, so
// with VNNI its dot is Q4_0's with another offset: d dy sum(u y) - 128 d sy (the AVX2 kernel signs
// them back: maddubs would saturate on u8 up to 255). SmolLM2's tied 49152 x 576 head, a third of
// a 16-row decode step's matmul time as rows, runs 1.7x (16 rows) to 2x (64) faster so.
//
// Matmuls with few rows (decode) quantize the activations per 32-element block
// to int8 (scale dy, and sy = dy * sum(q): llama.cpp's Q8_1) and take integer
// dot products against the weight's nibbles: 32 u8 x s8 products per
// maddubs. For a block of 32:
//   Q4_0 (w = d (q - 8)):  d dy sum(q y) - 8 d sy
//   Q4_1 (w = d q + m):    d dy sum(q y) + m sy
//   Q8_0 (w = d q):        d dy sum(q y)          (signed x signed: sign trick)
// K-quants (Q4_K, Q5_K, Q6_K) are decoded from their super-blocks in registers, a
// 32-value sub-block per vector, and take the same integer dots (dot_row_kquant).
// Prompt rows of Q4_0/Q4_1/Q8_0 take these kernels too (they outrun an fp32 GEMM
// there); the K-quants' prompt rows are dequantized (gguf_dequantize) into a BLAS
// GEMM on the Python side (ferry/layers/gguf_linear.py says why).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FERRY_AVX2 1
#endif
// AVX-512 with VNNI (Ice Lake and later Xeons, Zen 4/5): vpdpbusd multiplies u8 x s8 and adds
// groups of four straight into int32 lanes, 64 bytes at a time, where AVX2 needs vpmaddubsw
// (int16 pairs), vpmaddwd (to int32) and an add for 32. The interleaved Q4 and Q8_0 group kernels,
// the plain Q8_0 row kernel and the K-quant row kernel take it; plain Q4 rows (past a weight's last
// group of 8) stay AVX2.
// FERRY_CPU_ISA=avx2 builds without it (ferry/kernels/cpu.py), which the tests compare against.
#if defined(FERRY_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FERRY_AVX512_VNNI 1
#endif

namespace {

// ggml's type ids (ggml.h: enum ggml_type).
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// ferry's own: Q4_0 / Q4_1 / Q8_0 interleaved by 8 rows (see the top of this file).
constexpr int64_t kInterleaved = 256;
constexpr int64_t Q4_0X8 = kInterleaved + Q4_0, Q4_1X8 = kInterleaved + Q4_1, Q8_0X8 = kInterleaved + Q8_0;
constexpr int64_t kGroup = 8;  // rows per interleaved group
// Bytes of an interleaved group per 32-value block (quants, scales and mins of its 8 rows).
template <int T>
constexpr int64_t kGroupBlockBytes = kGroup * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34);

inline bool is_x8(int64_t t) { return t == Q4_0X8 || t == Q4_1X8 || t == Q8_0X8; }
inline int64_t base_type(int64_t t) { return is_x8(t) ? t - kInterleaved : t; }

struct Layout {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

Layout layout_of(int64_t t) {
  switch (t) {
    case Q4_0: case Q4_0X8: return {32, 18};
    case Q4_1: case Q4_1X8: return {32, 20};
    case Q8_0: case Q8_0X8: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "unsupported GGUF quantization type id ", t);
}

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Bytes of one 32-block's quants (the regrouped rows of Q4_0, Q4_1, Q8_0).
inline int64_t quant_bytes(int64_t t) { return t == Q8_0 ? 32 : 16; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// Q4_K / Q5_K: the j-th (0..7) 6-bit scale and min of a super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One row of a K-quant weight as int8 values plus a scale per 16 and a min per 32:
// w[k] = scale16[k / 16] * q[k] - min32[k / 32].
void unpack_kquant_row(int64_t t, const uint8_t* row, int64_t K, int8_t* q, float* scale16, float* min32) {
  const int64_t nsb = K / 256;
  for (int64_t s = 0; s < nsb; ++s) {
    int8_t* qs_out = q + s * 256;
    float* sc16 = scale16 + s * 16;
    float* mn32 = min32 + s * 8;
    if (t == Q4_K || t == Q5_K) {
      const uint8_t* b = row + s * (t == Q4_K ? 144 : 176);
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = t == Q5_K ? b + 16 : nullptr;
      const uint8_t* qs = b + (t == Q5_K ? 48 : 16);
      for (int pair = 0; pair < 4; ++pair) {  // 64 values: 32 low nibbles, then 32 high
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * pair + half;
          uint8_t sc, mn;
          scale_min_k4(j, scales, sc, mn);
          sc16[2 * j] = sc16[2 * j + 1] = d * sc;
          mn32[j] = dmin * mn;
          for (int l = 0; l < 32; ++l) {
            int v = half ? (qs[pair * 32 + l] >> 4) : (qs[pair * 32 + l] & 0xF);
            if (qh) v += ((qh[l] >> j) & 1) << 4;
            qs_out[j * 32 + l] = int8_t(v);
          }
        }
      }
    } else {  // Q6_K: ql[128], qh[64], int8 scales[16], fp16 d; w = d * sc * (q - 32)
      const uint8_t* b = row + s * 210;
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int g = 0; g < 16; ++g) sc16[g] = d * sc[g];
      for (int g = 0; g < 8; ++g) mn32[g] = 0.f;
      for (int n = 0; n < 2; ++n) {  // two halves of 128 values
        const uint8_t* l8 = ql + n * 64;
        const uint8_t* h8 = qh + n * 32;
        int8_t* o = qs_out + n * 128;
        for (int l = 0; l < 32; ++l) {
          o[l] = int8_t(((l8[l] & 0xF) | (((h8[l] >> 0) & 3) << 4)) - 32);
          o[l + 32] = int8_t(((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4)) - 32);
          o[l + 64] = int8_t(((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
          o[l + 96] = int8_t(((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
  }
}

void dequantize_row(int64_t t, const uint8_t* row, int64_t K, float* out) {
  if (t == Q4_0 || t == Q4_1 || t == Q8_0) {
    const int64_t nb = K / 32, qb = quant_bytes(t);
    const uint8_t* ds = row + nb * qb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* q = row + b * qb;
      const float d = half_at(ds + 2 * b);
      float* o = out + b * 32;
      if (t == Q8_0) {
        const int8_t* qs = reinterpret_cast<const int8_t*>(q);
        for (int l = 0; l < 32; ++l) o[l] = d * qs[l];
      } else {
        const float m = t == Q4_1 ? half_at(ds + 2 * nb + 2 * b) : -8.f * d;
        for (int l = 0; l < 16; ++l) {
          o[l] = d * (q[l] & 0xF) + m;
          o[l + 16] = d * (q[l] >> 4) + m;
        }
      }
    }
    return;
  }
  std::vector<int8_t> q(K);
  std::vector<float> sc16(K / 16), mn32(K / 32);
  unpack_kquant_row(t, row, K, q.data(), sc16.data(), mn32.data());
  for (int64_t k = 0; k < K; ++k) out[k] = sc16[k / 16] * q[k] - mn32[k / 32];
}

// Where byte i (0 .. qb) of row r's quants of a block sits among the group's quants of that block.
// Chunk c = i / 4 is four bytes of a row. AVX2: chunk-major, 32 bytes a chunk (row r at 4r), so a
// 256-bit load is 8 rows' chunk c, one 32-bit lane a row. AVX-512 VNNI: chunk pairs, 64 bytes a
// pair, row r's chunks c and c + 1 side by side at 8r, so the activation bytes a 512-bit vector
// multiplies are one 8-byte broadcast (lanes 2r and 2r + 1: row r) rather than two dwords placed
// by a permute per row and block (dot_group_vnni says why that matters). Private to the build:
// weights are interleaved by the build that runs them (gguf_interleave) and never stored so.
inline int64_t group_quant_offset(int64_t i, int r) {
#ifdef FERRY_AVX512_VNNI
  return i / 8 * 64 + r * 8 + i % 8;
#else
  return i / 4 * 32 + r * 4 + i % 4;
#endif
}

// Eight plain rows of base type t (each: nb * qb quant bytes, nb fp16 scales, [nb fp16 mins]) -> one
// interleaved group: per block the 8 rows' quants (group_quant_offset), then the 8 rows' scales per
// block, then mins.
void interleave_group(const uint8_t* rows, int64_t nb, int64_t t, int64_t row_bytes, uint8_t* out) {
  const int64_t qb = quant_bytes(t), gb = kGroup * qb;  // a block's quant bytes: one row, the group
  const uint8_t flip = t == Q8_0 ? 0x80 : 0;
  uint8_t* scales = out + nb * gb;
  uint8_t* mns = scales + nb * 16;
  for (int r = 0; r < kGroup; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t i = 0; i < qb; ++i) out[b * gb + group_quant_offset(i, r)] = row[b * qb + i] ^ flip;
      std::memcpy(scales + b * 16 + r * 2, row + nb * qb + b * 2, 2);
      if (t == Q4_1) std::memcpy(mns + b * 16 + r * 2, row + nb * 18 + b * 2, 2);
    }
  }
}

// Row r of an interleaved group of base type t, gathered back into the plain row layout.
void gather_row(const uint8_t* group, int64_t nb, int64_t t, int r, uint8_t* row) {
  const int64_t qb = quant_bytes(t), gb = kGroup * qb;
  const uint8_t flip = t == Q8_0 ? 0x80 : 0;
  const uint8_t* scales = group + nb * gb;
  const uint8_t* mns = scales + nb * 16;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < qb; ++i) row[b * qb + i] = group[b * gb + group_quant_offset(i, r)] ^ flip;
    std::memcpy(row + nb * qb + b * 2, scales + b * 16 + r * 2, 2);
    if (t == Q4_1) std::memcpy(row + nb * 18 + b * 2, mns + b * 16 + r * 2, 2);
  }
}

// Row n of an [N, row_bytes] weight of type t in the plain layout of base_type(t): in place, or
// gathered into `scratch` (row_bytes) when it sits in an interleaved group.
const uint8_t* plain_row(const uint8_t* w, int64_t N, int64_t t, int64_t row_bytes, int64_t K, int64_t n,
                         uint8_t* scratch) {
  if (!is_x8(t) || n >= N / kGroup * kGroup) return w + n * row_bytes;
  gather_row(w + n / kGroup * kGroup * row_bytes, K / 32, base_type(t), int(n % kGroup), scratch);
  return scratch;
}

// A thread's weight bytes prefetched a few cache lines per block of arithmetic, kStreamAhead bytes
// ahead of the block being read, and on into the start of its rows of the weight the step reads
// next. A decode step streams ~120 short runs of weight bytes per thread (SmolLM2: 100-550 KB each),
// a group of 8 rows (2-8 KB) at a time; prefetching each group's lines in one burst as it began
// (prefetch_ahead) left the batch-1 matmuls at ~10 GB/s on a host whose plain sum over the same
// tensors reads 21-24 GB/s: the burst overflows the core's miss buffers, then nothing is in flight
// while the group is computed, and every run starts cold. Spread over the blocks, kept ahead across
// groups and across calls, the same matmuls read at ~19-24 GB/s (BENCHMARKS.md, issue 15,
// 2026-11-27). 4 and 8 KB ahead measured alike; 1-2 KB were too short to cover the latency.
// Into L2 (T2), not L1 (T0): on the 2-vCPU Xeon a decode step of SmolLM2 took 9-11% less time
// (fp32 and int8 caches, the two hints alternated in one process), and 90 layers' weights streamed
// from memory at 19 GB/s against 17 (BENCHMARKS.md, session 33); T1 measured as T2 (Intel treats them
// alike), and on Zen 5 the attention's prefetches too ran best as T2 (PrefetchQueue).
constexpr int64_t kStreamAhead = 6144;
constexpr int kStreamLocality = 1;  // __builtin_prefetch's locality 1: PREFETCHT2
struct WeightStream {
  const uint8_t* run = nullptr;   // the run being prefetched
  int64_t pos = 0, len = 0;       // the next byte of it to prefetch (kStreamAhead ahead of the reads), its size
  const uint8_t* then = nullptr;  // the run after it (its first kStreamAhead bytes), or none
  int64_t then_bytes = 0;
  WeightStream() = default;
  // The thread reads [from, from + bytes), then [next, next + next_bytes).
  WeightStream(const uint8_t* from, int64_t bytes, const uint8_t* next, int64_t next_bytes)
      : run(from), len(bytes), then(next), then_bytes(next_bytes) {
    for (int64_t i = 0; i < kStreamAhead / 64; ++i) ahead<64>();
  }
  // The kernel moves on by BYTES (a group's block): the lines BYTES further on are prefetched (offsets
  // clamped to the run: no address past it is formed). Called once per block from the kernels' inner
  // loops, on a local copy, and kept out of line: inlined, it took registers the 8-row kernels hold
  // their sums in, and weights already in cache ran 25-50% slower (out of line: within 4% of the
  // burst prefetch before it, hot weights, 1-4 rows).
  template <int64_t BYTES>
  __attribute__((noinline)) void ahead() {
    if (pos >= len) {
      if (!then || then_bytes <= 0) return;
      run = then, pos = 0, len = std::min(then_bytes, kStreamAhead), then = nullptr;
    }
#pragma GCC unroll 8
    for (int64_t o = 0; o < BYTES; o += 64) __builtin_prefetch(run + std::min(pos + o, len - 1), 0, kStreamLocality);
    pos = std::min(pos + BYTES, len);
  }
};

// Activations [M, K] -> int8 [M, K], dy [M, K/32], sy [M, K/32] (sy = dy * sum of the block's q).
void quantize_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* dy, float* sy) {
  const int64_t nb = K / 32;
#ifdef FERRY_AVX512_VNNI
  // A block's 32 values in two registers (the loops after #else, as the compiler vectorized them, took
  // ~1.7 cycles a value: ~3 ms of a batch-64 SmolLM2 step). The same operations, so the same bytes:
  // cvtps rounds to nearest even, as nearbyint does in the default rounding mode.
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * 32;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    dy[i] = d;
    sy[i] = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
#else
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(xb[l]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* qb = q + m * K + b * 32;
      int sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int l = 0; l < 32; ++l) {
        const int v = int(std::nearbyint(xb[l] * inv));
        qb[l] = int8_t(v);
        sum += v;
      }
      dy[m * nb + b] = d;
      sy[m * nb + b] = d * float(sum);
    }
  }
#endif
}

#ifdef FERRY_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 unsigned nibbles of a Q4 block, in element order: low nibbles are 0..15, high 16..31.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// sum over 32 of u[i] * s[i] (u unsigned bytes <= 127 * 2 per pair stays in int16), as 8 floats.
inline __m256 dot_u8s8(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// R activation rows (R <= 4) against one regrouped weight row of a 32-block type: out[r] = dot.
template <int T, int R>
void dot_row_q32(const uint8_t* w, int64_t nb, const int8_t* const* y, const float* const* dy,
                 const float* const* sy, float* out) {
  constexpr int64_t QB = T == Q8_0 ? 32 : 16;
  const uint8_t* ds = w + nb * QB;  // fp16 scales, then (Q4_1) fp16 mins
  const uint8_t* ms = ds + 2 * nb;
  float tail[R];
  for (int r = 0; r < R; ++r) tail[r] = 0.f;
  int64_t b = 0;
#ifdef FERRY_AVX2
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), accm[r] = _mm256_setzero_ps();
#ifdef FERRY_AVX512_VNNI
  if constexpr (T == Q8_0) {
    // Two blocks per 64-byte vector: lanes 0-7 hold block j's four-product sums, lanes 8-15 block
    // j + 1's. vpdpbusd wants u8 x s8: |w| against y with w's sign (a masked negation; y is never
    // -128, quantize_q8 rounds into +-127).
    __m512 acc16[R];
    for (int r = 0; r < R; ++r) acc16[r] = _mm512_setzero_ps();
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (; b + 8 <= nb; b += 8) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + 2 * b)));
      __m512 sc[R];
      for (int r = 0; r < R; ++r)
        sc[r] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(dy[r] + b)));
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        const __m512i qw = _mm512_loadu_si512(w + (b + j) * 32);
        const __m512i aw = _mm512_abs_epi8(qw);
        const __mmask64 neg = _mm512_movepi8_mask(qw);
        const __m512i lanes = _mm512_add_epi32(pair, _mm512_set1_epi32(j));
        for (int r = 0; r < R; ++r) {
          const __m512i yv = _mm512_loadu_si512(y[r] + (b + j) * 32);
          const __m512i ys = _mm512_mask_sub_epi8(yv, neg, _mm512_setzero_si512(), yv);
          const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, ys);
          acc16[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, sc[r]), _mm512_cvtepi32_ps(dots), acc16[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_add_ps(_mm512_castps512_ps256(acc16[r]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc16[r]), 1)));
  }
#endif
  for (; b + 8 <= nb; b += 8) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + 2 * b)));
    __m256 sc[R];
    for (int r = 0; r < R; ++r) {
      sc[r] = _mm256_mul_ps(dw, _mm256_loadu_ps(dy[r] + b));
      if (T == Q4_1) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ms + 2 * b)));
        accm[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(sy[r] + b), accm[r]);
      } else if (T == Q4_0) {
        accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(-8.f)), _mm256_loadu_ps(sy[r] + b), accm[r]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i lane = _mm256_set1_epi32(j);
      const uint8_t* q = w + (b + j) * QB;
      if (T == Q8_0) {
        const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        for (int r = 0; r < R; ++r) {
          const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[r] + (b + j) * 32));
          acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc[r], lane), dot_u8s8(aw, _mm256_sign_epi8(yv, qw)), acc[r]);
        }
      } else {
        const __m256i qw = nibbles(q);
        for (int r = 0; r < R; ++r) {
          const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[r] + (b + j) * 32));
          acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc[r], lane), dot_u8s8(qw, yv), acc[r]);
        }
      }
    }
  }
  for (; b < nb; ++b) {  // the blocks after the last whole group of 8: scales one at a time
    const float d = half_at(ds + 2 * b);
    const float m = T == Q4_1 ? half_at(ms + 2 * b) : (T == Q4_0 ? -8.f * d : 0.f);
    const uint8_t* q = w + b * QB;
    __m256i qw, aw;
    if (T == Q8_0) {
      qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      aw = _mm256_sign_epi8(qw, qw);
    } else {
      qw = aw = nibbles(q);
    }
    for (int r = 0; r < R; ++r) {
      __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[r] + b * 32));
      if (T == Q8_0) yv = _mm256_sign_epi8(yv, qw);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy[r][b]), dot_u8s8(aw, yv), acc[r]);
      tail[r] = std::fma(m, sy[r][b], tail[r]);  // explicit: no row count may contract it otherwise
    }
  }
  for (int r = 0; r < R; ++r) tail[r] += hsum(acc[r]) + hsum(accm[r]);
#else
  int8_t q[32];
  for (; b < nb; ++b) {
    const uint8_t* qs = w + b * QB;
    const float d = half_at(ds + 2 * b);
    float m = 0.f;
    if (T == Q8_0) {
      std::memcpy(q, qs, 32);
    } else {
      m = T == Q4_1 ? half_at(ms + 2 * b) : -8.f * d;
      for (int l = 0; l < 16; ++l) q[l] = int8_t(qs[l] & 0xF), q[l + 16] = int8_t(qs[l] >> 4);
    }
    for (int r = 0; r < R; ++r) {
      int acc_i = 0;
      for (int l = 0; l < 32; ++l) acc_i += int(q[l]) * int(y[r][b * 32 + l]);
      tail[r] += std::fma(d * dy[r][b], float(acc_i), m * sy[r][b]);
    }
  }
#endif
  for (int r = 0; r < R; ++r) out[r] = tail[r];
}

#ifdef FERRY_AVX512_VNNI
// Round-to-nearest float ops the compiler may not reassociate (-ffast-math lets it regroup plain
// vector + and *): a row's result must be the same bits whichever R it is computed in, or a verify
// step's rows would differ from the same tokens decoded one at a time.
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// R activation rows (R <= 8) against one interleaved group of 8 weight rows (T = Q4_0, Q4_1 or Q8_0):
// out[r * 8 + i] = dot of activation row r with weight row i. A block's quants make four 64-byte
// vectors of chunk pairs (group_quant_offset): lanes 2i, 2i + 1 hold row i's chunks c, c + 1, so
// each vector multiplies one 8-byte group of the activations broadcast to every lane (a load, no
// shuffle). Q4: two loaded vectors, each as its low nibbles (activation bytes 8j..8j+7 for pair j)
// and high ones (16 + 8j..); Q8_0: four loaded vectors (bytes 8j..), offset by 128. Per row and
// block that leaves 4 broadcasts, 4 vpdpbusd and the scaling; the quants are unpacked and the
// scales converted once for all R rows. The lanes' int32 sums are scaled per block (row i's d in
// lanes 2i and 2i + 1), and the two lanes of a row added once at the end; the offsets (-8 d for
// Q4_0, -128 d for Q8_0) and Q4_1's mins come in against sy. Up to 8 rows a pass (the registers
// hold 8 accumulators, 8 min sums and a block's quants): a verify step's k + 1 rows of one
// request share the pass; each row's arithmetic is the same whatever R.
template <int T, int R>
void dot_group_vnni(const uint8_t* group, int64_t nb, const int8_t* const* y, const float* const* dy,
                    const float* const* sy, float* out, WeightStream* stream) {
  constexpr int64_t kBlock = kGroup * (T == Q8_0 ? 32 : 16);  // a block's quant bytes, 8 rows
  const uint8_t* scales = group + nb * kBlock;
  const uint8_t* mns = scales + nb * 16;
  const __m512i mask = _mm512_set1_epi8(0xF);
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  // The activation qword (8 bytes) each quant vector multiplies: Q4 low nibbles of pair j: j, high
  // nibbles: 2 + j (vectors in the order lo 0, hi 0, lo 1, hi 1); Q8_0: vector j, qword j.
  constexpr int kQword[4] = {0, T == Q8_0 ? 1 : 2, T == Q8_0 ? 2 : 1, 3};
  __m512 acc[R];
  __m256 accm[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
  WeightStream ws = stream ? *stream : WeightStream();
  for (int64_t b = 0; b < nb; ++b) {
    if (stream) ws.ahead<kGroupBlockBytes<T>>();
    const uint8_t* q = group + b * kBlock;
    __m512i v[4];
    if constexpr (T == Q8_0) {
      for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_si512(q + 64 * i);
    } else {
      for (int i = 0; i < 2; ++i) {
        const __m512i packed = _mm512_loadu_si512(q + 64 * i);
        v[2 * i] = _mm512_and_si512(packed, mask);
        v[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 16)));
    const __m256 mw = T == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mns + b * 16)))
                                : _mm256_mul_ps(dw, _mm256_set1_ps(T == Q8_0 ? -128.f : -8.f));  // exact
    const __m512 dw16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(dw));
    // Unrolled so the accumulators stay in registers (rolled, GCC kept them on the stack at R = 8).
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* yb = y[r] + b * 32;
      __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        int64_t yq;
        std::memcpy(&yq, yb + 8 * kQword[i], 8);
        s = _mm512_dpbusd_epi32(s, v[i], _mm512_set1_epi64(yq));
      }
      const __m512 scale = _mm512_mul_round_ps(dw16, _mm512_set1_ps(dy[r][b]), kRound);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sy[r][b]), accm[r]);
    }
  }
  if (stream) *stream = ws;
  const __m512i even = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int r = 0; r < R; ++r) {
    const __m512 rows = _mm512_add_round_ps(_mm512_permutexvar_ps(even, acc[r]), _mm512_permutexvar_ps(odd, acc[r]),
                                            kRound);
    const __m512 total = _mm512_add_round_ps(rows, _mm512_castps256_ps512(accm[r]), kRound);
    _mm256_storeu_ps(out + r * kGroup, _mm512_castps512_ps256(total));
  }
}
#elif defined(FERRY_AVX2)
// R activation rows (R <= 4) against one interleaved group of 8 weight rows (T = Q4_0 or Q4_1):
// out[r * 8 + i] = dot of activation row r with weight row i.
template <int T, int R>
void dot_group_q4(const uint8_t* group, int64_t nb, const int8_t* const* y, const float* const* dy,
                  const float* const* sy, float* out, WeightStream* stream) {
  const uint8_t* scales = group + nb * 128;
  const uint8_t* mns = scales + nb * 16;
  const __m256i mask = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  WeightStream ws = stream ? *stream : WeightStream();
  for (int64_t b = 0; b < nb; ++b) {
    if (stream) ws.ahead<kGroupBlockBytes<T>>();
    const uint8_t* q = group + b * 128;
    // The block's nibbles unpacked once for the R rows (8 registers), then each row's 8 products
    // summed in order (the empty asm: integer adds being associative, GCC regrouped them into a
    // tree whose partial sums, with the rows' interleaved, lived on the stack) and scaled before
    // the next row's begin. On two Zen 3 cores (scripts/gguf_cpu_sweep.py --against, same process):
    // 16 to 512 rows 1.12-1.18x faster, one row unchanged (BENCHMARKS.md, issue 15, session 31).
    __m256i lo[4], hi[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32));
      lo[c] = _mm256_and_si256(v, mask), hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 16)));
    for (int r = 0; r < R; ++r) {
      const int8_t* yb = y[r] + b * 32;
      __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        int32_t ylo, yhi;  // activations 4c..4c+3 (low nibbles) and 16+4c.. (high), in every lane
        std::memcpy(&ylo, yb + 4 * c, 4);
        std::memcpy(&yhi, yb + 16 + 4 * c, 4);
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(ylo)));
        asm("" : "+x"(s));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(yhi)));
        asm("" : "+x"(s));
      }
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(dw, _mm256_set1_ps(dy[r][b])), acc[r]);
    }
  }
  if (stream) *stream = ws;
  // The offset terms (m, or -8 d, against each block's sy) in a pass of their own, the same
  // operations as they were inside the loop above, where their R accumulators took registers the
  // dots need (AVX2 has 16).
  __m256 accm[R];
  for (int r = 0; r < R; ++r) accm[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 mw = T == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mns + b * 16)))
                                : _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 16))),
                                                _mm256_set1_ps(-8.f));
    for (int r = 0; r < R; ++r) accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sy[r][b]), accm[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kGroup, _mm256_add_ps(acc[r], accm[r]));
}

// R activation rows (R <= 4) against one interleaved Q8_0 group of 8 weight rows. maddubs would
// saturate on the offset quants (255 x 127 x 2 > 2^15), so the quants are signed again (^ 0x80) and
// take the sign trick of the plain Q8_0 rows: |w| against y with w's sign, no offset term.
template <int R>
void dot_group_q8(const uint8_t* group, int64_t nb, const int8_t* const* y, const float* const* dy,
                  const float* const*, float* out, WeightStream* stream) {
  const uint8_t* scales = group + nb * 256;
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  WeightStream ws = stream ? *stream : WeightStream();
  for (int64_t b = 0; b < nb; ++b) {
    if (stream) ws.ahead<kGroupBlockBytes<Q8_0>>();
    const uint8_t* q = group + b * 256;
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)), flip);
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        int32_t yc;  // activations 4c..4c+3, in every lane
        std::memcpy(&yc, y[r] + b * 32 + 4 * c, 4);
        const __m256i ys = _mm256_sign_epi8(_mm256_set1_epi32(yc), w);
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, ys), ones));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 16)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dw, _mm256_set1_ps(dy[r][b])), acc[r]);
  }
  if (stream) *stream = ws;
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kGroup, acc[r]);
}
#endif

template <int T>
void dot_q32(int R, const uint8_t* w, int64_t nb, const int8_t* const* y, const float* const* dy, const float* const* sy,
             float* out) {
  switch (R) {
    case 4: dot_row_q32<T, 4>(w, nb, y, dy, sy, out); break;
    case 3: dot_row_q32<T, 3>(w, nb, y, dy, sy, out); break;
    case 2: dot_row_q32<T, 2>(w, nb, y, dy, sy, out); break;
    default: dot_row_q32<T, 1>(w, nb, y, dy, sy, out);
  }
}

#ifndef FERRY_AVX2
// Portable: each row of the group gathered back and taken by the plain kernel.
template <int T, int R>
void dot_group_x8(const uint8_t* group, int64_t nb, const int8_t* const* y, const float* const* dy,
                  const float* const* sy, float* out, WeightStream* stream) {
  for (int64_t b = 0; stream && b < nb; ++b) stream->ahead<kGroupBlockBytes<T>>();
  std::vector<uint8_t> row(nb * layout_of(T).bytes);
  for (int i = 0; i < kGroup; ++i) {
    gather_row(group, nb, T, i, row.data());
    float o[4];
    dot_q32<T>(R, row.data(), nb, y, dy, sy, o);
    for (int r = 0; r < R; ++r) out[r * kGroup + i] = o[r];
  }
}
#else
template <int T, int R>
void dot_group_x8(const uint8_t* group, int64_t nb, const int8_t* const* y, const float* const* dy,
                  const float* const* sy, float* out, WeightStream* stream) {
#ifdef FERRY_AVX512_VNNI
  dot_group_vnni<T, R>(group, nb, y, dy, sy, out, stream);
#else
  if constexpr (T == Q8_0) dot_group_q8<R>(group, nb, y, dy, sy, out, stream);
  else dot_group_q4<T, R>(group, nb, y, dy, sy, out, stream);
#endif
}
#endif

// Activation rows a group kernel takes in one pass: with VNNI up to 8 (see dot_group_vnni), else 4.
#ifdef FERRY_AVX512_VNNI
constexpr int kGroupRows = 8;
#else
constexpr int kGroupRows = 4;
#endif

// Software prefetch of [at, at + bytes) shifted kPrefetchAhead bytes ahead, up to `end` (the end of
// the calling thread's rows), in one burst: a prompt tile's groups (compute-bound: each group is read
// for 32 rows) and plain rows. Decode rows of interleaved groups take WeightStream instead (above):
// the hardware prefetcher restarts on every one of a step's ~120 short weight streams and alone left
// the batch-1 matmuls at ~14 GB/s; this burst per group took them to ~10-20 GB/s, WeightStream to 19-24.
constexpr int64_t kPrefetchAhead = 2048;  // bytes; 1, 2 and 4 KB measured alike
inline void prefetch_ahead(const uint8_t* at, int64_t bytes, const uint8_t* end) {
#ifdef FERRY_AVX2
  for (const uint8_t* p = at + kPrefetchAhead; p < std::min(at + kPrefetchAhead + bytes, end); p += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#endif
}

// Matmuls with more activation rows than this (prompts) take the interleaved groups through
// gguf_prompt_cpu.cpp's tiles, kPromptRowBlock rows a block; decode rows stay one block.
constexpr int64_t kPromptRowBlock = 32;

// R (<= kGroupRows) activation rows against one interleaved group of 8 weight rows; `stream`, when
// given, advanced block by block over the group's bytes.
template <int T>
void dot_group(int R, const uint8_t* group, int64_t nb, const int8_t* const* y, const float* const* dy,
               const float* const* sy, float* out, WeightStream* stream = nullptr) {
  switch (R) {
#ifdef FERRY_AVX512_VNNI
    case 8: dot_group_x8<T, 8>(group, nb, y, dy, sy, out, stream); break;
    case 7: dot_group_x8<T, 7>(group, nb, y, dy, sy, out, stream); break;
    case 6: dot_group_x8<T, 6>(group, nb, y, dy, sy, out, stream); break;
    case 5: dot_group_x8<T, 5>(group, nb, y, dy, sy, out, stream); break;
#endif
    case 4: dot_group_x8<T, 4>(group, nb, y, dy, sy, out, stream); break;
    case 3: dot_group_x8<T, 3>(group, nb, y, dy, sy, out, stream); break;
    case 2: dot_group_x8<T, 2>(group, nb, y, dy, sy, out, stream); break;
    default: dot_group_x8<T, 1>(group, nb, y, dy, sy, out, stream);
  }
}

#ifndef FERRY_AVX2
// Portable: a K-quant row (already unpacked to int8 q, scale per 16, min per 32) against R
// activation rows, with explicit fma so that no row count rounds a row differently.
template <int R>
void dot_row_unpacked(const int8_t* q, const float* sc16, const float* mn32, int64_t K, const int8_t* const* y,
                      const float* const* dy, const float* const* sy, float* out) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int64_t g = 0; g < K / 16; ++g) {
    const int8_t* qg = q + g * 16;
    for (int r = 0; r < R; ++r) {
      const int8_t* yg = y[r] + g * 16;
      int s = 0;
#pragma omp simd reduction(+ : s)
      for (int l = 0; l < 16; ++l) s += int(qg[l]) * int(yg[l]);
      acc[r] = std::fma(sc16[g] * dy[r][g / 2], float(s), acc[r]);
    }
  }
  for (int64_t b = 0; b < K / 32; ++b)
    for (int r = 0; r < R; ++r) acc[r] = std::fma(-mn32[b], sy[r][b], acc[r]);
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}
#endif

#ifdef FERRY_AVX2
// A Q4_K / Q5_K super-block at b: its 8 sub-block scales d * sc_j, returned, and its min term
// (dmin * mn_j against the 8 activation blocks' sy) added to accm[r] for each of R rows. The
// twelve bytes of 6-bit scales and mins unpack as three 32-bit words (scale_min_k4's bit layout,
// four sub-blocks a word) instead of eight branchy calls: at batch 1 that per-super-block work,
// not the dots, bounded the K-quant rows.
template <int R>
inline __m256 kquant_scales_and_mins(const uint8_t* b, const float* const* sy, int64_t b0, __m256* accm) {
  uint32_t w[3];
  std::memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
  const uint32_t sc[2] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & top2) << 4)};
  const uint32_t mn[2] = {w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4)};
  auto widen = [](const uint32_t* v) {
    int64_t bytes;
    std::memcpy(&bytes, v, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes)));
  };
  const __m256 mn8 = _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), widen(mn));
  for (int r = 0; r < R; ++r) accm[r] = _mm256_fmadd_ps(mn8, _mm256_loadu_ps(sy[r] + b0), accm[r]);
  return _mm256_mul_ps(_mm256_set1_ps(half_at(b)), widen(sc));
}
#endif

#ifdef FERRY_AVX512_VNNI
// The same with AVX-512 VNNI: two sub-blocks per 64-byte vector (lanes 0-7 sub-block 2p, 8-15
// sub-block 2p + 1), vpdpbusd summing four u8 x s8 products into each int32 lane where AVX2 takes
// maddubs and madd. Q6_K's lanes hold 16-value groups 4p .. 4p + 3 (four lanes each), scaled in
// float by d * sc_g, and its -32 offset is a second vpdpbusd (32 against y) taken off in int32.
template <int T, int R>
void dot_row_kquant(const uint8_t* row, int64_t K, const int8_t* const* y, const float* const* dy,
                    const float* const* sy, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  const __m512i k32 = _mm512_set1_epi8(32), b4 = _mm512_set1_epi8(0x10);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i quarters = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R];
  __m256 accm[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 256; ++s) {
    const int64_t b0 = s * 8;
    __m512i u[4];   // sub-blocks 2p, 2p + 1
    __m512 lane_scale[4];  // Q6_K: d * sc of each lane's 16-value group
    __m256 sc8;     // Q4_K / Q5_K: d * sc_j per sub-block; Q6_K: unused
    auto pair = [](__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); };
    if constexpr (T == Q4_K || T == Q5_K) {
      const uint8_t* b = row + s * (T == Q4_K ? 144 : 176);
      sc8 = kquant_scales_and_mins<R>(b, sy, b0, accm);
      const uint8_t* qs = b + (T == Q5_K ? 48 : 16);
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 32));
        u[p] = pair(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
      }
      if constexpr (T == Q5_K) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
        for (int p = 0; p < 4; ++p) {
          const __m512i bits = pair(_mm256_set1_epi8(char(1 << (2 * p))), _mm256_set1_epi8(char(1 << (2 * p + 1))));
          u[p] = _mm512_mask_add_epi8(u[p], _mm512_test_epi8_mask(qh, bits), u[p], b4);
        }
      }
    } else {  // Q6_K
      const uint8_t* b = row + s * 210;
      const __m512 d16 = _mm512_set1_ps(half_at(b + 208));
      const __m512 sc16 = _mm512_mul_ps(d16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
      for (int p = 0; p < 4; ++p)
        lane_scale[p] = _mm512_permutexvar_ps(_mm512_add_epi32(quarters, _mm512_set1_epi32(4 * p)), sc16);
      for (int n = 0; n < 2; ++n) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n * 64));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n * 64 + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + n * 32));
        auto high = [&](int shift) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), m2), 4); };
        u[2 * n] = pair(_mm256_or_si256(_mm256_and_si256(l0, m4), high(0)),
                        _mm256_or_si256(_mm256_and_si256(l1, m4), high(2)));
        u[2 * n + 1] = pair(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dy8 = _mm256_loadu_ps(dy[r] + b0);
      const __m512 scale = _mm512_castps256_ps512(T == Q6_K ? dy8 : _mm256_mul_ps(sc8, dy8));
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i yv = _mm512_loadu_si512(y[r] + (b0 + 2 * p) * 32);
        __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p], yv);
        __m512 lanes = _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(2 * p)), scale);
        if constexpr (T == Q6_K) {
          dots = _mm512_sub_epi32(dots, _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32, yv));
          lanes = _mm512_mul_ps(lanes, lane_scale[p]);
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), lanes, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - hsum(accm[r]);
}
#elif defined(FERRY_AVX2)
// K-quant super-blocks straight from the file's bytes, R activation rows (R <= 4) at a time. Each
// 32-value sub-block j's quants are decoded to unsigned bytes in one vector (Q4_K: a nibble half;
// Q5_K: plus its bit of qh; Q6_K: 4 bits of ql and 2 of qh), dotted with the row's int8 block by
// maddubs, and scaled in float per sub-block: Q4_K/Q5_K by d * sc_j (the 6-bit scale) times the
// block's dy, their mins as one 8-lane FMA per super-block (dmin * mn_j against the 8 blocks' sy);
// Q6_K's per-16 int8 scales multiply the int16 pair sums in the madd (lanes 0-7 hold values 0-15),
// and its -32 offset is taken off in int16 (maddubs of 32 against y). Each row keeps its own
// accumulators and op order, so its result does not depend on R.
template <int T, int R>
void dot_row_kquant(const uint8_t* row, int64_t K, const int8_t* const* y, const float* const* dy,
                    const float* const* sy, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  const __m256i b4 = _mm256_set1_epi8(0x10), k32 = _mm256_set1_epi8(32);
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), accm[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 256; ++s) {
    const int64_t b0 = s * 8;  // the super-block's first activation block
    __m256 sc8;                // per sub-block float scale (Q6_K: d; its 16-value scales go in the madd)
    __m256i u[8];              // the 8 sub-blocks' quants as unsigned bytes
    __m256i sc16[8];           // Q6_K: int16 scales, lanes 0-7 the first 16 values, 8-15 the next
    if constexpr (T == Q4_K || T == Q5_K) {
      const uint8_t* b = row + s * (T == Q4_K ? 144 : 176);
      sc8 = kquant_scales_and_mins<R>(b, sy, b0, accm);
      const uint8_t* qs = b + (T == Q5_K ? 48 : 16);
      __m256i qh;
      if constexpr (T == Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 32));
        u[2 * p] = _mm256_and_si256(v, m4);
        u[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      }
      if constexpr (T == Q5_K) {
        for (int j = 0; j < 8; ++j) {
          const __m256i bit = _mm256_set1_epi8(char(1 << j));
          u[j] = _mm256_or_si256(u[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), b4));
        }
      }
    } else {  // Q6_K
      const uint8_t* b = row + s * 210;
      sc8 = _mm256_set1_ps(half_at(b + 208));
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      for (int j = 0; j < 8; ++j)
        sc16[j] = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * j]), _mm_set1_epi16(scales[2 * j + 1]));
      for (int n = 0; n < 2; ++n) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n * 64));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n * 64 + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + n * 32));
        auto high = [&](int shift) {  // bits shift..shift+1 of qh as bits 4-5
          return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), m2), 4);
        };
        u[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), high(0));
        u[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), high(2));
        u[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4));
        u[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(sc8, _mm256_loadu_ps(dy[r] + b0));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[r] + (b0 + j) * 32));
        __m256i dots;
        if constexpr (T == Q6_K) {
          const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(u[j], yv), _mm256_maddubs_epi16(k32, yv));
          dots = _mm256_madd_epi16(pairs, sc16[j]);
        } else {
          dots = _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], yv), ones);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(j)), _mm256_cvtepi32_ps(dots), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - hsum(accm[r]);
}
#endif

#ifdef FERRY_AVX2
template <int T>
void dot_kquant(int R, const uint8_t* row, int64_t K, const int8_t* const* y, const float* const* dy,
                const float* const* sy, float* out) {
  switch (R) {
    case 4: dot_row_kquant<T, 4>(row, K, y, dy, sy, out); break;
    case 3: dot_row_kquant<T, 3>(row, K, y, dy, sy, out); break;
    case 2: dot_row_kquant<T, 2>(row, K, y, dy, sy, out); break;
    default: dot_row_kquant<T, 1>(row, K, y, dy, sy, out);
  }
}
#endif

}  // namespace
