// Paged decode attention on the CPU: one query token per sequence, K/V read
// straight from the block-paged cache (no gathered copy), online over blocks.
//
// q:            [B, H, D]           float32
// k/v_cache:    [NB, BS, KVH, W]    float32 or bfloat16 (W = D), or int8 / float8_e4m3fn rows of
//                                   D values followed by their fp32 scale (W = D + 4; ferry/kv_quant.py)
// block_tables: [B, MAXB]           int64
// seq_lens:     [B]                 int64 (tokens attended to, including the new one)
// out:          [B, H, D]           float32
//
// Work is split over (sequence, 64-token partition, kv head); the G = H / KVH query
// heads that share a kv head are processed together, so every K/V row is loaded once.
// A sequence's partitions are merged by their softmax maxima (flash-decoding).
// A bf16 cache halves the bytes read (decode attention is bound by them); each
// block's rows of this head are widened to fp32 in an L1-resident scratch and
// the fp32 loops run on that. An int8 / fp8 cache (about a quarter of fp32's bytes) is
// dequantized the same way: value x the row's scale (fp8 through a 256-entry table). With AVX2 an
// int8 cache skips most of that: K rows are widened to int16 and dotted with q rounded to int16
// (per head, 2^-15 of its largest value: far below K's own int8 step) by vpmaddwd, 16 products
// per instruction, and the row scales multiply the 8 sums of 8 keys at once; V rows are widened
// without their scale, which multiplies the softmax weight instead (one product per key, not D).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// Built with -ffast-math (so expf vectorizes): no infinities, a large finite floor instead.
constexpr float kNegBig = -1e30f;
// Tokens per partition of a long sequence (see paged_decode_attention_impl).
constexpr int64_t kPartitionTokens = 64;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FERRY_ATTN_AVX2 1
// AVX-512 (with VNNI for the int8 cache's K dots): PV and the int8 K dots 16 floats / 32 int16
// wide, the same per-lane operation order as their AVX2 loops (the int32 dots exact). The build
// as a whole still rounds apart from the AVX2 one: the compiler vectorizes expf 16 wide there.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FERRY_ATTN_AVX512 1
#endif

// out[t] = scale * dot(q, k_t) for n keys of D (a multiple of 8) floats, rows `ks` floats apart.
// Eight keys at a time: eight independent FMA chains over D, then one transposing reduction
// (hadd tree) that leaves the eight sums in one vector, instead of a horizontal sum per key.
inline void block_scores(const float* q, const float* kb, int64_t ks, int64_t n, int64_t D, float scale, float* out) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    const float* k0 = kb + t * ks;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i * ks + d), a[i]);
    }
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                     _mm256_permute2f128_ps(h0123, h4567, 0x31));
    _mm256_storeu_ps(out + t, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
  }
  for (; t < n; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kb + t * ks + d), a);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    out[t] = _mm_cvtss_f32(s4) * scale;
  }
}

// acc[0, 8 NV) += sum over n keys of p[t] * v_t[0, 8 NV): the accumulators stay in registers.
template <int NV>
inline void block_values_chunk(const float* p, const float* vb, int64_t vs, int64_t n, float* acc) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    const float* v = vb + t * vs;
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

#ifdef FERRY_ATTN_AVX512
template <int NV>
inline void block_values_chunk512(const float* p, const float* vb, int64_t vs, int64_t n, float* acc) {
  __m512 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    const float* v = vb + t * vs;
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

inline void block_values(const float* p, const float* vb, int64_t vs, int64_t n, int64_t D, float* acc) {
  int64_t d = 0;
#ifdef FERRY_ATTN_AVX512
  for (; d + 64 <= D; d += 64) block_values_chunk512<4>(p, vb + d, vs, n, acc + d);
  if (d + 32 <= D) block_values_chunk512<2>(p, vb + d, vs, n, acc + d), d += 32;
  if (d + 16 <= D) block_values_chunk512<1>(p, vb + d, vs, n, acc + d), d += 16;
#endif
  for (; d + 64 <= D; d += 64) block_values_chunk<8>(p, vb + d, vs, n, acc + d);
  if (d + 32 <= D) block_values_chunk<4>(p, vb + d, vs, n, acc + d), d += 32;
  if (d + 16 <= D) block_values_chunk<2>(p, vb + d, vs, n, acc + d), d += 16;
  if (d + 8 <= D) block_values_chunk<1>(p, vb + d, vs, n, acc + d);
}

// q (D floats, D a multiple of 16) rounded to int16 with one scale: returns it (q ~ q16 * scale).
inline float quantize_q_int16(const float* q, int64_t D, int16_t* q16) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  const float scale = amax > 0.f ? amax / 32767.f : 1.f;
  const __m256 inv = _mm256_set1_ps(1.f / scale);
  for (int64_t d = 0; d < D; d += 16) {  // round to nearest even, as lrintf; |q * inv| <= 32767
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + d), inv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + d + 8), inv));
    // packs interleaves 128-bit lanes: [lo0 hi0 lo1 hi1]; permute back to [lo0 lo1 hi0 hi1].
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + d),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
  }
  return scale;
}

// n int8 rows of D values (D a multiple of 16), `stride` bytes apart, each followed by its fp32
// scale: the values widened to int16 into `dst` (D apart), the scales into `scales`.
inline void widen_rows_int16(const int8_t* src, int64_t n, int64_t D, int64_t stride, int16_t* dst, float* scales) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* row = src + t * stride;
    std::memcpy(&scales[t], row + D, sizeof(float));
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * D + d),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  }
}

// The same rows as unscaled fp32 (D a multiple of 8) into `dst`, their scales into `scales`.
inline void widen_rows_f32(const int8_t* src, int64_t n, int64_t D, int64_t stride, float* dst, float* scales) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* row = src + t * stride;
    std::memcpy(&scales[t], row + D, sizeof(float));
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(dst + t * D + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)))));
  }
}

// out[t] = scale * qscale * kscale[t] * dot(q16, k16_t) over n int16 rows of D (a multiple of 16):
// block_scores with integer products (vpmaddwd: 16 int16 x int16 -> 8 int32 pair sums), exact in
// int32 (|q16| < 2^15, |k| <= 127: a lane sums D / 16 pairs of at most 2^23.1 each).
inline void block_scores_int16(const int16_t* q, const int16_t* kb, const float* kscale, int64_t n, int64_t D,
                               float scale, float* out) {
  int64_t t = 0;
  const __m256 sv = _mm256_set1_ps(scale);
  for (; t + 8 <= n; t += 8) {
    __m256i a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
    const int16_t* k0 = kb + t * D;
    int64_t d = 0;
#ifdef FERRY_ATTN_AVX512
    if (D % 32 == 0) {  // vpdpwssd: 32 int16 products summed in pairs into 16 int32 lanes
      __m512i w[8];
      for (int i = 0; i < 8; ++i) w[i] = _mm512_setzero_si512();
      for (; d < D; d += 32) {
        const __m512i qv = _mm512_loadu_si512(q + d);
        for (int i = 0; i < 8; ++i) w[i] = _mm512_dpwssd_epi32(w[i], qv, _mm512_loadu_si512(k0 + i * D + d));
      }
      for (int i = 0; i < 8; ++i)
        a[i] = _mm256_add_epi32(_mm512_castsi512_si256(w[i]), _mm512_extracti64x4_epi64(w[i], 1));
    }
#endif
    for (; d < D; d += 16) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
      for (int i = 0; i < 8; ++i)
        a[i] = _mm256_add_epi32(
            a[i], _mm256_madd_epi16(qv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + i * D + d))));
    }
    const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                                         _mm256_permute2x128_si256(h0123, h4567, 0x31));
    _mm256_storeu_ps(out + t, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), sv), _mm256_loadu_ps(kscale + t)));
  }
  for (; t < n; ++t) {
    int32_t acc = 0;
    for (int64_t d = 0; d < D; ++d) acc += static_cast<int32_t>(q[d]) * kb[t * D + d];
    out[t] = static_cast<float>(acc) * scale * kscale[t];
  }
}
#endif

// n rows of D values, `stride` elements apart, as fp32. A float cache is used in
// place (returns src with its stride); bf16 is widened into `scratch` (stride D).
inline const float* rows_as_f32(const float* src, int64_t, int64_t, int64_t stride, float*, int64_t& out_stride) {
  out_stride = stride;
  return src;
}

inline const float* rows_as_f32(const uint16_t* src, int64_t n, int64_t D, int64_t stride, float* scratch,
                                int64_t& out_stride) {
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* row = src + t * stride;
    uint32_t* dst = reinterpret_cast<uint32_t*>(scratch + t * D);
    int64_t d = 0;
#ifdef FERRY_ATTN_AVX2
    for (; d + 8 <= D; d += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
#endif
    for (; d < D; ++d) dst[d] = static_cast<uint32_t>(row[d]) << 16;  // bf16 = high half of fp32
  }
  out_stride = D;
  return scratch;
}

// An fp8 e4m3fn byte (a distinct type, so the template picks its widening).
struct Fp8E4M3 {
  uint8_t bits;
};

inline void read_scale(const uint8_t* p, float& s) { std::memcpy(&s, p, sizeof(float)); }

inline const float* rows_as_f32(const int8_t* src, int64_t n, int64_t D, int64_t stride, float* scratch,
                                int64_t& out_stride) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* row = src + t * stride;
    float s;
    read_scale(reinterpret_cast<const uint8_t*>(row + D), s);
    float* dst = scratch + t * D;
    int64_t d = 0;
#ifdef FERRY_ATTN_AVX2
    // Eight values per step: sign-extend 8 bytes straight to int32 lanes, convert, scale (the
    // compiler's vectorization of the loop below went through int16 halves: ~2x the instructions).
    const __m256 sv = _mm256_set1_ps(s);
    for (; d + 8 <= D; d += 8) {
      const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(v), sv));
    }
#endif
    for (; d < D; ++d) dst[d] = static_cast<float>(row[d]) * s;
  }
  out_stride = D;
  return scratch;
}

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities (0x7f/0xff are NaN and never stored).
static float fp8_e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

static const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = fp8_e4m3_value(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

inline const float* rows_as_f32(const Fp8E4M3* src, int64_t n, int64_t D, int64_t stride, float* scratch,
                                int64_t& out_stride) {
  const float* table = fp8_table();
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(src + t * stride);
    float s;
    read_scale(row + D, s);
    float* dst = scratch + t * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = table[row[d]] * s;
  }
  out_stride = D;
  return scratch;
}

template <typename CacheT>
torch::Tensor paged_decode_attention_impl(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t W = k_cache.size(3);  // row width: D, or D + 4 with a quantized row's scale
  const int64_t G = H / KVH;
  const int64_t MAXB = block_tables.size(1);
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const CacheT* kp = reinterpret_cast<const CacheT*>(k_cache.data_ptr());
  const CacheT* vp = reinterpret_cast<const CacheT*>(v_cache.data_ptr());
  constexpr int64_t kElem = sizeof(CacheT);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // A sequence's blocks are split into partitions of kPartitionTokens (flash-decoding): at batch 1
  // B x KVH tasks alone (3 for SmolLM2) leave one of two threads idle half the time. Partitions
  // depend only on the sequence's own length, so its result is the same in any batch.
  const int64_t P = std::max<int64_t>(1, kPartitionTokens / BS);  // blocks per partition
  std::vector<int64_t> first(B + 1, 0);  // first task of each sequence; a task is (partition, kv head)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nblk = (lp[b] + BS - 1) / BS;
    first[b + 1] = first[b] + std::max<int64_t>(1, (nblk + P - 1) / P) * KVH;
  }
  const int64_t tasks = first[B];
  const bool split = tasks > B * KVH;
  // Unnormalized partial results of split tasks: running max, sum of exps, weighted values.
  std::vector<float> part_m(split ? tasks * G : 0), part_l(split ? tasks * G : 0), part_acc(split ? tasks * G * D : 0);

  // The int8 AVX2 path (see the top of the file): every query head's q in int16 with its scale,
  // once here rather than in each of a sequence's partition tasks.
#ifdef FERRY_ATTN_AVX2
  constexpr bool kInt8Dots = std::is_same_v<CacheT, int8_t>;
#else
  constexpr bool kInt8Dots = false;
#endif
  const bool int8_dots = kInt8Dots && D % 16 == 0;
  std::vector<int16_t> q16_all(int8_dots ? B * H * D : 0);
  std::vector<float> qscale_all(int8_dots ? B * H : 0);
#ifdef FERRY_ATTN_AVX2
  if (int8_dots)
    for (int64_t r = 0; r < B * H; ++r) qscale_all[r] = quantize_q_int16(qp + r * D, D, q16_all.data() + r * D);
#endif

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * BS);
    std::vector<float> kscratch(BS * D), vscratch(BS * D);
    // The int8 AVX2 path: K rows in int16, the rows' scales, the softmax weights times V's scales.
    std::vector<int16_t> k16(int8_dots ? BS * D : 0);
    std::vector<float> kscale(BS), vscale(BS), pv(int8_dots ? G * BS : 0);
    std::vector<float> acc(G * D);
    std::vector<float> m(G), l(G), corr(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t part = (task - first[b]) / KVH, h = (task - first[b]) % KVH;
      const int64_t L = lp[b];
      const int64_t nparts = (first[b + 1] - first[b]) / KVH;
      const int64_t j0 = part * P, j1 = std::min((L + BS - 1) / BS, j0 + P);
      const float* qb = qp + (b * H + h * G) * D;
      const int16_t* q16 = int8_dots ? q16_all.data() + (b * H + h * G) * D : nullptr;
      const float* qscale = int8_dots ? qscale_all.data() + b * H + h * G : nullptr;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNegBig);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t blk = btp[b * MAXB + j];
        const int64_t n = std::min(BS, L - j * BS);
        int64_t ks = 0, vs = 0;  // row strides of kb / vb in floats
        const float* kb = nullptr;
        const float* vb = nullptr;
#ifdef FERRY_ATTN_AVX2
        if constexpr (kInt8Dots) {
          if (int8_dots) {
            const int8_t* krows = reinterpret_cast<const int8_t*>(kp + (blk * BS * KVH + h) * W);
            const int8_t* vrows = reinterpret_cast<const int8_t*>(vp + (blk * BS * KVH + h) * W);
            widen_rows_int16(krows, n, D, KVH * W, k16.data(), kscale.data());
            widen_rows_f32(vrows, n, D, KVH * W, vscratch.data(), vscale.data());
            vb = vscratch.data(), vs = D;
          }
        }
#endif
        if (!int8_dots) {
          kb = rows_as_f32(kp + (blk * BS * KVH + h) * W, n, D, KVH * W, kscratch.data(), ks);
          vb = rows_as_f32(vp + (blk * BS * KVH + h) * W, n, D, KVH * W, vscratch.data(), vs);
        }
        if (h == 0 && j + 1 < j1) {
          // The next block lives elsewhere in the pool: start its loads now so they overlap this
          // block's arithmetic. The first kv head's task takes the whole block (every head's rows,
          // one contiguous run of 64-byte lines); the other heads' tasks, which follow it on this
          // thread, find their rows cached.
          const int64_t nblk = btp[b * MAXB + j + 1];
          const char* nk = reinterpret_cast<const char*>(kp + nblk * BS * KVH * W);
          const char* nv = reinterpret_cast<const char*>(vp + nblk * BS * KVH * W);
          for (int64_t off = 0; off < BS * KVH * W * kElem; off += 64) {
            __builtin_prefetch(nk + off);
            __builtin_prefetch(nv + off);
          }
        }
        // Scores of this block for all G heads, exponentiated in one vectorizable
        // loop, then an online-softmax update of the accumulators. With AVX2 and
        // D a multiple of 8, block_scores / block_values (2-3x the compiler's
        // vectorization of the loops below, which remain the portable path).
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
#ifdef FERRY_ATTN_AVX2
          if (int8_dots) {
            block_scores_int16(q16 + g * D, k16.data(), kscale.data(), n, D, fscale * qscale[g],
                               scores.data() + g * BS);
            continue;
          }
          if (D % 8 == 0) {
            block_scores(qg, kb, ks, n, D, fscale, scores.data() + g * BS);
            continue;
          }
#endif
          int64_t t = 0;
          for (; t + 4 <= n; t += 4) {
            const float* k0 = kb + t * ks;
            const float* k1 = k0 + ks;
            const float* k2 = k1 + ks;
            const float* k3 = k2 + ks;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < D; ++d) {
              s0 += qg[d] * k0[d];
              s1 += qg[d] * k1[d];
              s2 += qg[d] * k2[d];
              s3 += qg[d] * k3[d];
            }
            scores[g * BS + t] = s0 * fscale;
            scores[g * BS + t + 1] = s1 * fscale;
            scores[g * BS + t + 2] = s2 * fscale;
            scores[g * BS + t + 3] = s3 * fscale;
          }
          for (; t < n; ++t) {
            const float* kt = kb + t * ks;
            float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
            for (int64_t d = 0; d < D; ++d) s0 += qg[d] * kt[d];
            scores[g * BS + t] = s0 * fscale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * BS;
          float bmax = kNegBig;
          for (int64_t t = 0; t < n; ++t) bmax = std::max(bmax, sg[t]);
          const float new_m = std::max(m[g], bmax);
          corr[g] = std::exp(m[g] - new_m);
          m[g] = new_m;
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) sg[t] = std::exp(sg[t] - new_m);
          float lsum = 0.f;
          for (int64_t t = 0; t < n; ++t) lsum += sg[t];
          l[g] = l[g] * corr[g] + lsum;
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr[g];
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = scores.data() + g * BS;
          float* ag = acc.data() + g * D;
#ifdef FERRY_ATTN_AVX2
          if (int8_dots) {  // V's row scales ride on the weights: sum_t (p_t s_t) v_t
            float* pvg = pv.data() + g * BS;
            for (int64_t t = 0; t < n; ++t) pvg[t] = pg[t] * vscale[t];
            block_values(pvg, vb, vs, n, D, ag);
            continue;
          }
          if (D % 8 == 0) {
            block_values(pg, vb, vs, n, D, ag);
            continue;
          }
#endif
          int64_t t = 0;
          for (; t + 4 <= n; t += 4) {
            const float* v0 = vb + t * vs;
            const float* v1 = v0 + vs;
            const float* v2 = v1 + vs;
            const float* v3 = v2 + vs;
            const float p0 = pg[t], p1 = pg[t + 1], p2 = pg[t + 2], p3 = pg[t + 3];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
          }
          for (; t < n; ++t) {
            const float* vt = vb + t * vs;
            const float p = pg[t];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
          }
        }
      }
      if (nparts > 1) {
        std::copy(m.begin(), m.end(), part_m.begin() + task * G);
        std::copy(l.begin(), l.end(), part_l.begin() + task * G);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + task * G * D);
        continue;
      }
      float* ob = op + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
  if (split) {  // merge each split sequence's partitions, rescaled to their common max
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / KVH, h = bh % KVH;
        const int64_t nparts = (first[b + 1] - first[b]) / KVH;
        if (nparts == 1) continue;
        float* ob = op + (b * H + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          float mx = kNegBig;
          for (int64_t p = 0; p < nparts; ++p) mx = std::max(mx, part_m[(first[b] + p * KVH + h) * G + g]);
          float lsum = 0.f;
          float* og = ob + g * D;
          std::fill(og, og + D, 0.f);
          for (int64_t p = 0; p < nparts; ++p) {
            const int64_t t = first[b] + p * KVH + h;
            const float w = std::exp(part_m[t * G + g] - mx);
            lsum += part_l[t * G + g] * w;
            const float* a = part_acc.data() + (t * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) og[d] += a[d] * w;
          }
          const float inv = 1.f / lsum;
          for (int64_t d = 0; d < D; ++d) og[d] *= inv;
        }
      }
    });
  }
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q must be float32");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "k and v caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const auto dt = k_cache.scalar_type();
  const bool quantized = dt == at::ScalarType::Char || dt == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(k_cache.size(3) == q.size(2) + (quantized ? 4 : 0), "cache rows must be head_dim wide (+4: a scale)");
  if (dt == at::ScalarType::Float)
    return paged_decode_attention_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale);
  if (dt == at::ScalarType::BFloat16)
    return paged_decode_attention_impl<uint16_t>(q, k_cache, v_cache, block_tables, seq_lens, scale);
  if (dt == at::ScalarType::Char)
    return paged_decode_attention_impl<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale);
  TORCH_CHECK(dt == at::ScalarType::Float8_e4m3fn, "the cache must be float32, bfloat16, int8 or float8_e4m3fn");
  return paged_decode_attention_impl<Fp8E4M3>(q, k_cache, v_cache, block_tables, seq_lens, scale);
}
