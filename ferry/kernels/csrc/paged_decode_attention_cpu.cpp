// Paged decode attention on the CPU: one query token per sequence, K/V read
// straight from the block-paged cache (no gathered copy).
//
// q:            [B, H, D]           float32
// k/v_cache:    [NB, BS, KVH, W]    float32 or bfloat16 (W = D), or int8 / float8_e4m3fn: D values
//                                   and their fp32 scale per row (W = D + 4), each block laid out by
//                                   head, K's and V's values as their kernels read them (kv_layout.h)
// block_tables: [B, MAXB]           int64
// seq_lens:     [B]                 int64 (tokens attended to, including the new one)
// tree:         [B, 2] int64 or None: (start, bits) per sequence (tree verification): of the
//               positions in [start, seq_len) only those whose bit p - start is set are attended
//               (a draft's ancestors and itself, not its cousins), read as if they were the
//               consecutive positions start, start + 1, ...: the row computes exactly what a
//               plain decode row over that sequence computes, bit for bit (a virtual block of
//               those rows is gathered per task; the int8 dots that follow would turn a rounding
//               difference into a different token)
// skip:         [B] int64 or None: rows of each sequence's first block that it does not attend to
//               (a sliding window: the caller passes each table from the block holding the window's
//               first key, the lengths counted from that block, and the keys before it there); not
//               with a tree
// out:          [B, H, D]           float32
//
// Work is split over (sequence, 64-token partition, kv head); the G = H / KVH query
// heads that share a kv head are processed together, so every K/V row is loaded once
// from memory. A task takes its partition whole: the scores of its rows for the G heads,
// one softmax, then the values; a sequence's partitions are merged by their softmax
// maxima (flash-decoding). With AVX-512 each row is loaded and widened once per pass of up
// to three heads (heads_scores / heads_values), not once per head; threads take chunks of
// partitions (or, in a large batch, whole sequences, merged while their partitions are still in
// cache) as they go, so one that waits on memory longer takes fewer: partitions from a run of their
// own, front first, then the others' from the back (ChunkRun); sequences from a shared counter. The
// next partition's lines are prefetched a share per block (PrefetchQueue): the core's miss buffers
// bound how many are in flight. A bf16 cache halves the bytes read, an int8 one about
// quarters them; with AVX2 both are read in place and widened in registers (load8 /
// load16: bf16 is the high half of an fp32). An int8 cache's K rows are widened to int16
// and dotted with q rounded to int16 (per head, 2^-15 of its largest value: far below
// K's own int8 step) by vpmaddwd / vpdpwssd, and the row scales multiply the 8 sums of 8
// keys at once; V rows are taken without their scale, which multiplies the softmax
// weight instead (one product per key, not D); with AVX-512 the softmax's exponentials are inline
// polynomials (exp_nonpositive). With AVX-512 (head_dim a multiple of 64), or AVX2 alone (a
// multiple of 16), those weights are rounded to int16 per partition and the values summed in
// int32, two keys per vpdpwssd / vpmaddwd (heads_values_int8); 16-token blocks are read in the
// cache's own layout, 16 keys a vector (heads_scores_lanes / heads_values_lanes), other block
// sizes as gathered rows, to the same bits. fp8 rows (and every row without AVX2)
// are dequantized into an L1-resident fp32 scratch first (fp8 through a 256-entry table).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fp8_table.h"
#include "kv_layout.h"
#include "simd_exp.h"

// Built with -ffast-math (so expf vectorizes): no infinities, a large finite floor instead.
constexpr float kNegBig = -1e30f;
// Tokens per partition of a long sequence (see paged_decode_attention_impl).
constexpr int64_t kPartitionTokens = 64;
// Claims of work per thread (see the task loop): enough to even out, few enough to stay cheap.
constexpr int64_t kChunksPerThread = 16;

// A worker's run of chunks [front, back), packed in one word: the owner takes from the front, others
// from the back, each with one compare-and-swap (a cache line of its own: the owner's claims stay in
// its L1 until someone steals).
struct alignas(64) ChunkRun {
  std::atomic<uint64_t> range{0};
  void set(int64_t front, int64_t back) { range.store(uint64_t(front) | uint64_t(back) << 32, std::memory_order_relaxed); }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }
  int64_t take(bool front) {  // the chunk taken, or -1 when the run is empty
    uint64_t r = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = r & 0xffffffffu, b = r >> 32;
      if (f >= b) return -1;
      const uint64_t next = front ? (f + 1) | b << 32 : f | (b - 1) << 32;
      if (range.compare_exchange_weak(r, next, std::memory_order_relaxed)) return int64_t(front ? f : b - 1);
    }
  }
};

// Cache lines to prefetch, issued a few at a time between pieces of arithmetic. A burst of a
// partition's few hundred lines at once stalled the loads behind it until the core's miss buffers
// drained, so memory waits added to the arithmetic instead of overlapping it. Some AVX-512 kernels
// take `per_tick` lines at each step of their inner loops (tick; which ones and how many steps:
// tick_steps in paged_decode_attention_impl), the other paths a share per block (issue). Per block, a
// task's share still went out as a burst of ~130 lines (an fp32 cache); in ticks of ~7 lines the
// kernels ran 3-6% (fp32) and 6-16% (bf16) faster at batch 1-64 (`cpu_attention_sweep.py --against`,
// the 2-vCPU Xeon, BENCHMARKS.md, session 33). The hint is T2
// (locality 1): on the Zen 5 VM it took a bf16 cache's batch-64 kernel 7-13% below T1's time (T0
// and NTA were 1.5-1.8x slower, int8 and fp32 within noise of T1; `cpu_attention_sweep.py
// --against`, BENCHMARKS.md's fifteenth part); Intel cores since Nehalem treat T1 and T2 alike.
struct PrefetchQueue {
  std::vector<std::pair<const char*, int64_t>> runs;  // first byte, length
  size_t run = 0;
  int64_t off = 0, lines = 0, share = 0, per_tick = 0;
  void clear() { runs.clear(), run = 0, off = 0, lines = 0; }
  void add(const char* p, int64_t bytes) { runs.emplace_back(p, bytes), lines += (bytes + 63) / 64; }
  // Always inlined: issue is called inside the kernels' inner loops, where a call (through the PLT,
  // the function having default visibility) made GCC spill and reload every accumulator around it
  // and clear the upper halves of the vector registers (vzeroupper): 12 zmm stores and loads per
  // key pair of the int8 values loop.
  __attribute__((always_inline)) void issue(int64_t n) {
    while (n > 0 && run < runs.size()) {
      const char* base = runs[run].first;
      const int64_t len = runs[run].second;
      for (; off < len && n > 0; off += 64, --n) __builtin_prefetch(base + off, 0, 1);
      if (off >= len) ++run, off = 0;
    }
  }
  __attribute__((always_inline)) void tick() { issue(per_tick); }
};

// The fp32 scales that follow n quantized rows of D values, `stride` bytes apart (a float store per
// row: a memcpy into the destination let the compiler assume it could alias anything, and reload).
inline void read_row_scales(const int8_t* rows, int64_t stride, int64_t n, int64_t D, float* __restrict out) {
  for (int64_t t = 0; t < n; ++t) {
    float s;
    std::memcpy(&s, rows + t * stride + D, sizeof(float));
    out[t] = s;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FERRY_ATTN_AVX2 1
// AVX-512 (with VNNI for the int8 cache's K dots): PV and the int8 K dots 16 floats / 32 int16
// wide, the same per-lane operation order as their AVX2 loops (the int32 dots exact). The build
// as a whole still rounds apart from the AVX2 one: the compiler vectorizes expf 16 wide there.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define FERRY_ATTN_AVX512 1
#endif

// Cache values as fp32 vectors, widened in registers: fp32 as is, bf16 (the high half of an fp32)
// shifted into place, int8 converted (unscaled: the row's scale is applied per key, not per value).
// The vector loops read the cache in its stored type, with no pass through a widened scratch copy.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#ifdef FERRY_ATTN_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// x as computed: an empty asm the value passes through, so that -ffast-math cannot reassociate the
// products on either side of it. Two loops that must round alike (an int8 cache's scores from rows and
// from its own layout) otherwise came out an ulp apart where the compiler regrouped one of them.
inline __m256 as_computed(__m256 x) {
  asm("" : "+x"(x));
  return x;
}

// The eight sums of a[0..7] (each 8 lanes), in one vector: a transposing hadd tree.
inline __m256 sum8x8(const __m256* a) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// sum8x8 for int32 lanes (exact).
inline __m256i sum8x8_epi32(const __m256i* a) {
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

#ifdef FERRY_ATTN_AVX512
// The eight sums of acc[0..7] (16 lanes each, halves folded first), in one vector.
inline __m256 sum8x16(const __m512* acc) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
  return sum8x8(h);
}

// The eight sums of acc[0..7] (int32, exact) by a transposing tree in 512-bit registers: pairs of
// accumulators interleaved and added by dwords, then qwords (lane_sums4_epi32: per 128-bit lane,
// the lane's sums of four accumulators), then 128-bit lanes (sum8_of_lane_sums): 24 instructions,
// where folding each to 256 bits first and a hadd tree (three uops a hadd) took about 37.
inline __m512i lane_sums4_epi32(const __m512i* a) {
  const __m512i s0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i s1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s0, s1), _mm512_unpackhi_epi64(s0, s1));
}

// The sums of a0..a3 and a4..a7 from their lane_sums4_epi32 (t0, t1), in order in 256 bits.
inline __m256i sum8_of_lane_sums(__m512i t0, __m512i t1) {
  // [a0..3 over lanes 0+1, a0..3 over lanes 2+3, a4..7 over 0+1, a4..7 over 2+3]
  const __m512i u = _mm512_add_epi32(_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xdd));
  const __m512i r = _mm512_add_epi32(_mm512_shuffle_i32x4(u, u, 0x08), _mm512_shuffle_i32x4(u, u, 0x0d));
  return _mm512_castsi512_si256(r);
}
#endif

// out[t] = scale * dot(q, k_t) for n keys of D (a multiple of 8) values, rows `ks` elements apart.
// Eight keys at a time: eight independent FMA chains over D, then one transposing reduction
// (hadd tree) that leaves the eight sums in one vector, instead of a horizontal sum per key.
template <typename T>
inline void block_scores(const float* q, const T* kb, int64_t ks, int64_t n, int64_t D, float scale, float* out) {
  int64_t t = 0;
#ifdef FERRY_ATTN_AVX512
  if (D % 16 == 0) {
    for (; t + 8 <= n; t += 8) {
      __m512 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      const T* k0 = kb + t * ks;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(qv, load16(k0 + i * ks + d), a[i]);
      }
      _mm256_storeu_ps(out + t, _mm256_mul_ps(sum8x16(a), _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; t + 8 <= n; t += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    const T* k0 = kb + t * ks;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(k0 + i * ks + d), a[i]);
    }
    _mm256_storeu_ps(out + t, _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale)));
  }
  for (; t < n; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kb + t * ks + d), a);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    out[t] = _mm_cvtss_f32(s4) * scale;
  }
}

// acc[0, 8 NV) += sum over n keys of p[t] * v_t[0, 8 NV): the accumulators stay in registers.
template <int NV, typename T>
inline void block_values_chunk(const float* p, const T* vb, int64_t vs, int64_t n, float* acc) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    const T* v = vb + t * vs;
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(pt, load8(v + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

#ifdef FERRY_ATTN_AVX512
template <int NV, typename T>
inline void block_values_chunk512(const float* p, const T* vb, int64_t vs, int64_t n, float* acc) {
  __m512 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    const T* v = vb + t * vs;
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(pt, load16(v + 16 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

// acc[0, D) += sum over n keys of p[t] * v_t, D a multiple of 8, rows `vs` elements apart.
template <typename T>
inline void block_values(const float* p, const T* vb, int64_t vs, int64_t n, int64_t D, float* acc) {
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

// out[t] = scale * qscale * kscale[t] * dot(q16, k16_t) over n int16 rows of D (a multiple of 16):
// block_scores with integer products (vpmaddwd: 16 int16 x int16 -> 8 int32 pair sums), exact in
// int32 (|q16| < 2^15, |k| <= 127: a lane sums D / 16 pairs of at most 2^23.1 each). The AVX-512
// build takes heads_scores_int8 (vpdpwssd) instead wherever D is a multiple of 32. The last n % 8
// keys are a group of 8 too, whose rows and scales past n are read and their scores dropped (the
// caller leaves 8 rows of room after kb and kscale): every score is the same two float products
// of the exact sum, as heads_scores_lanes computes it (a scalar tail was reassociated under
// -ffast-math, a rounding apart).
inline void block_scores_int16(const int16_t* q, const int16_t* kb, const float* kscale, int64_t n, int64_t D,
                               float scale, float* out) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t t = 0; t < n; t += 8) {
    __m256i a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
    const int16_t* k0 = kb + t * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
      for (int i = 0; i < 8; ++i)
        a[i] = _mm256_add_epi32(
            a[i], _mm256_madd_epi16(qv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + i * D + d))));
    }
    const __m256 f = _mm256_mul_ps(as_computed(_mm256_mul_ps(_mm256_cvtepi32_ps(sum8x8_epi32(a)), sv)), _mm256_loadu_ps(kscale + t));
    if (n - t >= 8) {
      _mm256_storeu_ps(out + t, f);
    } else {
      float tail[8];
      _mm256_storeu_ps(tail, f);
      std::memcpy(out + t, tail, (n - t) * sizeof(float));
    }
  }
}

// The G query heads of a kv head read the same K/V rows. The loops below take GH (<= 3) of them per
// pass over a block, so each row is loaded and widened once for GH heads, not once per head: the
// widening (2 instructions per 16 bf16 or int8 values) cost as much as the FMAs it fed. 8 keys x 3
// heads of accumulators, the q vectors and a key fill AVX-512's 32 registers; more heads would spill.
// (AVX2's int8 lanes loops below take as many, in 16 registers: 16 keys or values x 3 heads.)
constexpr int kMaxHeadsPerPass = 3;

// Heads g0 .. g0 + gh of a kv head's G, in passes of at most kMaxHeadsPerPass (4 as 2 + 2, so no pass
// is a lone head): calls f(first head, the pass's head count as a std::integral_constant).
// Always inlined: the task loop grew past GCC's inlining budget with the int8 lanes path, and a call
// per block left the bf16 kernel 7-10% slower with its blocks in cache.
template <typename F>
__attribute__((always_inline)) inline void for_head_passes(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t left = G - g0;
    const int64_t gh = left == 4 ? 2 : std::min<int64_t>(left, kMaxHeadsPerPass);
    if (gh == 3) f(g0, std::integral_constant<int, 3>{});
    else if (gh == 2) f(g0, std::integral_constant<int, 2>{});
    else f(g0, std::integral_constant<int, 1>{});
    g0 += gh;
  }
}

#ifdef FERRY_ATTN_AVX512

// out[g * os + t] = scale * dot(q_g, k_t) for GH heads (q_g at q + g * D) and n keys of D (a multiple
// of 16) fp32 / bf16 values, rows `ks` elements apart: block_scores for GH heads in one pass.
template <int GH, typename T>
inline void heads_scores(const float* q, const T* kb, int64_t ks, int64_t n, int64_t D, float scale, float* out,
                         int64_t os, PrefetchQueue* ahead = nullptr) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    if (ahead) ahead->tick();
    __m512 a[GH][8];
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 8; ++i) a[g][i] = _mm512_setzero_ps();
    const T* k0 = kb + t * ks;
    for (int64_t d = 0; d < D; d += 16) {
      __m512 qv[GH];
      for (int g = 0; g < GH; ++g) qv[g] = _mm512_loadu_ps(q + g * D + d);
      for (int i = 0; i < 8; ++i) {
        const __m512 kv = load16(k0 + i * ks + d);
        for (int g = 0; g < GH; ++g) a[g][i] = _mm512_fmadd_ps(qv[g], kv, a[g][i]);
      }
    }
    for (int g = 0; g < GH; ++g) _mm256_storeu_ps(out + g * os + t, _mm256_mul_ps(sum8x16(a[g]), _mm256_set1_ps(scale)));
  }
  if (t < n)
    for (int g = 0; g < GH; ++g) block_scores(q + g * D, kb + t * ks, ks, n - t, D, scale, out + g * os + t);
}

// The int8 cache's scores for GH heads: out[g * os + t] = qscale[g] * kscale_t * dot(q16_g, k_t) over
// n int8 rows of D (a multiple of 32) values, `ks` bytes apart, each followed by its fp32 scale (read
// into kscale[t]). Each key is widened to int16 once, in a register, for vpdpwssd against every head's
// q; the int32 sums are exact, so this is block_scores_int16 to the last bit.
template <int GH>
inline void heads_scores_int8(const int16_t* q, const int8_t* kb, int64_t ks, int64_t n, int64_t D,
                              const float* qscale, float* kscale, float* out, int64_t os) {
  read_row_scales(kb, ks, n, D, kscale);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    // Four keys at a time (GH x 4 accumulators, the q vectors and a key stay in registers; eight
    // keys' accumulators spilled), each four reduced at once to per-lane sums.
    __m512i half[2][GH];
    for (int hk = 0; hk < 2; ++hk) {
      __m512i w[GH][4];
      for (int g = 0; g < GH; ++g)
        for (int i = 0; i < 4; ++i) w[g][i] = _mm512_setzero_si512();
      const int8_t* k0 = kb + (t + 4 * hk) * ks;
      for (int64_t d = 0; d < D; d += 32) {
        __m512i qv[GH];
        for (int g = 0; g < GH; ++g) qv[g] = _mm512_loadu_si512(q + g * D + d);
        for (int i = 0; i < 4; ++i) {
          const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + i * ks + d)));
          for (int g = 0; g < GH; ++g) w[g][i] = _mm512_dpwssd_epi32(w[g][i], qv[g], kv);
        }
      }
      for (int g = 0; g < GH; ++g) half[hk][g] = lane_sums4_epi32(w[g]);
    }
    for (int g = 0; g < GH; ++g)
      _mm256_storeu_ps(out + g * os + t,
                       _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum8_of_lane_sums(half[0][g], half[1][g])),
                                                   _mm256_set1_ps(qscale[g])),
                                     _mm256_loadu_ps(kscale + t)));
  }
  for (; t < n; ++t)
    for (int g = 0; g < GH; ++g) {
      int32_t acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += static_cast<int32_t>(q[g * D + d]) * kb[t * ks + d];
      out[g * os + t] = static_cast<float>(acc) * qscale[g] * kscale[t];
    }
}

// acc_g[c, c + 16 NV) += sum over n keys of p[g * ps + t] * v_t[c, c + 16 NV) for GH heads (acc_g
// at acc + g * D): each key's values are loaded and widened once for the GH heads.
template <int GH, int NV, typename T>
inline void heads_values_chunk(const float* p, int64_t ps, const T* vb, int64_t vs, int64_t n, int64_t D,
                               float* acc, PrefetchQueue* ahead) {
  __m512 a[GH][NV];
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    if (ahead) ahead->tick();
    const T* v = vb + t * vs;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
    for (int g = 0; g < GH; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * ps + t]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(pt, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// block_values for GH heads in one pass, D a multiple of 16 (ahead: ticks once per key per chunk).
template <int GH, typename T>
inline void heads_values(const float* p, int64_t ps, const T* vb, int64_t vs, int64_t n, int64_t D, float* acc,
                         PrefetchQueue* ahead = nullptr) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) heads_values_chunk<GH, 4>(p, ps, vb + d, vs, n, D, acc + d, ahead);
  if (d + 32 <= D) heads_values_chunk<GH, 2>(p, ps, vb + d, vs, n, D, acc + d, ahead), d += 32;
  if (d + 16 <= D) heads_values_chunk<GH, 1>(p, ps, vb + d, vs, n, D, acc + d, ahead);
}

// The int8 cache's values for GH heads in integers: acc_g += sum over n keys of u[g * us + t] * v_t, with
// u the softmax weights times V's row scales rounded to int16 (see softmax_partition) and acc_g (at acc +
// g * D) int32 in the lane order values_from_int32 undoes. Two keys' rows are interleaved byte by byte and widened to int16
// pairs, so one vpdpwssd adds both keys' products for 16 values: per key and head a quarter of the
// instructions of widening to fp32 and an FMA per 16 values. D a multiple of 64; the sums stay exact
// in int32 over up to 256 keys (|u| <= 2^15 - 1, |v| <= 127).
template <int GH>
inline void heads_values_int8(const int16_t* u, int64_t us, const int8_t* vb, int64_t vs, int64_t n, int64_t D,
                              int32_t* acc) {
  for (int64_t c = 0; c < D; c += 64) {
    __m512i a[GH][4];
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_loadu_si512(acc + g * D + c + 16 * i);
    for (int64_t t = 0; t < n; t += 2) {
      const bool pair = t + 1 < n;  // a lone last key is paired with zeros, not the next row
      const __m512i r0 = _mm512_loadu_si512(vb + t * vs + c);
      const __m512i r1 = pair ? _mm512_loadu_si512(vb + (t + 1) * vs + c) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi8(r0, r1), hi = _mm512_unpackhi_epi8(r0, r1);
      const __m512i v[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                            _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
      for (int g = 0; g < GH; ++g) {
        int32_t w2;  // u_t in the low half, u_t+1 in the high half, as the interleaved rows
        if (pair) std::memcpy(&w2, u + g * us + t, sizeof(w2));
        else w2 = static_cast<uint16_t>(u[g * us + t]);
        const __m512i w = _mm512_set1_epi32(w2);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_dpwssd_epi32(a[g][i], v[i], w);
      }
    }
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(acc + g * D + c + 16 * i, a[g][i]);
  }
}

// exp_nonpositive (simd_exp.h): the softmax exponentials, inline.

// The lanes of the 16 values at t of n.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// One head's softmax over a partition's n scores s, unnormalized (the merge rescales partitions):
// its max into mx, the sum of e_t = exp(s_t - mx) into sum, e_t over s. With `scale` (an int8 cache's
// V row scales, for heads_values_int8) the weights w_t = e_t scale_t are also rounded to int16 into
// u, in steps of max_t(w_t) / 32767 (returned): a weight moves by at most half a step, 2^-16 of the
// partition's largest, ~250x below the int8 values' own rounding. One pass for the max, one for the
// exponentials, their sum and the weights' max, one to round: the exponentials stay in L1.
inline float softmax_partition(float* s, int64_t n, const float* scale, int16_t* u, float& mx, float& sum) {
  __m512 vmax = _mm512_set1_ps(kNegBig);
  // A partition's tail lanes load as kNegBig, not 0: a max of 0 over scores all below -87 would flush
  // every exponential to exp_nonpositive's floor and flatten the weights.
  for (int64_t t = 0; t < n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(n - t), s + t));
  mx = _mm512_reduce_max_ps(vmax);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps(), wmax = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = tail_mask(n - t);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
    vsum = _mm512_add_ps(vsum, e);
    _mm512_mask_storeu_ps(s + t, k, e);
    if (scale) wmax = _mm512_max_ps(wmax, _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, scale + t)));
  }
  sum = _mm512_reduce_add_ps(vsum);
  if (!scale) return 0.f;
  const float w = _mm512_reduce_max_ps(wmax);
  const __m512 inv = _mm512_set1_ps(w > 0.f ? 32767.f / w : 0.f);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = tail_mask(n - t);
    const __m512 q = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_maskz_loadu_ps(k, scale + t)), inv);
    _mm256_mask_storeu_epi16(u + t, k, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(q)));  // round to nearest
  }
  return w / 32767.f;
}

// out[0, D) = step * acc, acc in heads_values_int8's lane order: unpacklo_epi8 takes values 0..7 of
// each 16 (per 128-bit lane), unpackhi 8..15, and each widening two 128-bit lanes, so the eight lanes
// of each half of accumulator i hold a run of eight values, at 8 (i / 2) + 32 (i % 2) + 16 half.
inline void values_from_int32(const int32_t* acc, int64_t D, float step, float* out) {
  const __m512 s = _mm512_set1_ps(step);
  for (int64_t c = 0; c < D; c += 64)
    for (int i = 0; i < 4; ++i) {
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + c + 16 * i)), s);
      float* o = out + c + 8 * (i >> 1) + 32 * (i & 1);
      _mm256_storeu_ps(o, _mm512_castps512_ps256(f));
      _mm256_storeu_ps(o + 16, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    }
}

// An int8 cache's scores for GH heads from a block's K laid out for them (kv_layout.h: [D/2][BS][2],
// then BS scales; BS a multiple of 16): out[g * os + t - s] = qscale[g] * kscale_t * dot(q16_g, k_t) for
// the keys t in [s, s + n). Sixteen keys at a time, one per 32-bit lane: each pair of K's values for the
// 16 keys is one 32-byte load, widened to int16 and multiplied by every head's q pair (vpdpwssd), and
// the lanes' sums are the 16 keys' dots, with no reduction across lanes; the scales are 16 floats in a
// row. The int32 sums are exact, so this is heads_scores_int8 (rows) to the last bit.
template <int GH>
inline void heads_scores_lanes(const int16_t* q, const int8_t* kh, int64_t BS, int64_t s, int64_t n, int64_t D,
                               const float* qscale, float* out, int64_t os, PrefetchQueue* ahead = nullptr) {
  const float* ksc = reinterpret_cast<const float*>(kh + D * BS);
  const int32_t* q32 = reinterpret_cast<const int32_t*>(q);
  const int64_t D2 = D / 2;
  for (int64_t k0 = 0; k0 < BS; k0 += 16) {
    const int64_t lo = std::max(s, k0), hi = std::min(s + n, k0 + 16);
    if (lo >= hi) continue;
    __m512i a[GH][4];
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_si512();
    for (int64_t p = 0; p < D2; p += 4) {
      if (ahead) ahead->tick();
      for (int i = 0; i < 4; ++i) {
        const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kh + ((p + i) * BS + k0) * 2)));
        for (int g = 0; g < GH; ++g) a[g][i] = _mm512_dpwssd_epi32(a[g][i], kv, _mm512_set1_epi32(q32[g * D2 + p + i]));
      }
    }
    const __m512 ks = _mm512_loadu_ps(ksc + k0);
    const __mmask16 m = static_cast<__mmask16>(((1u << (hi - k0)) - 1) & ~((1u << (lo - k0)) - 1));
    for (int g = 0; g < GH; ++g) {
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a[g][0], a[g][1]), _mm512_add_epi32(a[g][2], a[g][3]));
      __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(qscale[g])), ks);
      if (lo > k0) f = _mm512_maskz_compress_ps(m, f);
      _mm512_mask_storeu_ps(out + g * os + (lo - s), tail_mask(hi - lo), f);
    }
  }
}

// heads_values_int8 for a block's V laid out for it (kv_layout.h: [BS/2][D][2]): acc_g (int32, in
// order) += the sum over key pairs j in [j0, j1) of u_g[2j], u_g[2j + 1] times the pair's values, u_g
// (BS int16 at u + g * us, indexed by position in the block) zero for keys the block does not attend
// to. Each pair's values are already side by side: four 32-byte loads per 64 values, no interleaving.
template <int GH>
inline void heads_values_lanes(const int16_t* u, int64_t us, const int8_t* vh, int64_t j0, int64_t j1, int64_t D,
                               int32_t* acc, PrefetchQueue* ahead = nullptr) {
  for (int64_t c = 0; c < D; c += 64) {
    __m512i a[GH][4];
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_loadu_si512(acc + g * D + c + 16 * i);
    for (int64_t j = j0; j < j1; ++j) {
      if (ahead) ahead->tick();
      const int8_t* r = vh + (j * D + c) * 2;
      __m512i v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32 * i)));
      for (int g = 0; g < GH; ++g) {
        int32_t w2;
        std::memcpy(&w2, u + g * us + 2 * j, sizeof(w2));
        const __m512i w = _mm512_set1_epi32(w2);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_dpwssd_epi32(a[g][i], v[i], w);
      }
    }
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(acc + g * D + c + 16 * i, a[g][i]);
  }
}

// out[0, D) = step * acc (acc in order, from heads_values_lanes).
inline void values_from_int32_natural(const int32_t* acc, int64_t D, float step, float* out) {
  const __m512 sc = _mm512_set1_ps(step);
  for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + c)), sc));
}

#else
// AVX2 without AVX-512: the int8 cache's integer paths of the AVX-512 build, 8 lanes wide, vpmaddwd and
// an add where that has vpdpwssd. The same arithmetic (exact integer sums, the same exponential
// polynomial, the same float products), so the scores and rounded weights should match the AVX-512
// build's, though -ffast-math does not promise it and no AVX-512 host has compared them; the sums of
// exponentials add in another order. Within one build, a block's lanes and its gathered rows give the
// same bits (tested).

// The lanes of the 8 values at t of n, as a maskload's mask.
inline __m256i tail_mask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// softmax_partition (see the AVX-512 build's) in 8 lanes: the scores' max, the exponentials over s and
// their sum, and with `scale` the weights e_t scale_t rounded to int16 into u, in steps of their max /
// 32767 (returned).
inline float softmax_partition(float* s, int64_t n, const float* scale, int16_t* u, float& mx, float& sum) {
  const __m256 neg = _mm256_set1_ps(kNegBig);
  __m256 vmax = neg;
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i k = tail_mask8(n - t);
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(neg, _mm256_maskload_ps(s + t, k), _mm256_castsi256_ps(k)));
  }
  mx = reduce_max8(vmax);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps(), wmax = _mm256_setzero_ps();
  int64_t t = 0;
  if (scale) {  // two vectors a step: two exponential chains in flight
    __m256 vsum1 = _mm256_setzero_ps(), wmax1 = _mm256_setzero_ps();
    for (; t + 16 <= n; t += 16) {
      const __m256 e0 = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
      const __m256 e1 = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t + 8), m));
      vsum = _mm256_add_ps(vsum, e0), vsum1 = _mm256_add_ps(vsum1, e1);
      _mm256_storeu_ps(s + t, e0), _mm256_storeu_ps(s + t + 8, e1);
      wmax = _mm256_max_ps(wmax, _mm256_mul_ps(e0, _mm256_loadu_ps(scale + t)));
      wmax1 = _mm256_max_ps(wmax1, _mm256_mul_ps(e1, _mm256_loadu_ps(scale + t + 8)));
    }
    vsum = _mm256_add_ps(vsum, vsum1), wmax = _mm256_max_ps(wmax, wmax1);
  }
  for (; t < n; t += 8) {
    const __m256i k = tail_mask8(n - t);
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(s + t, k), m)), _mm256_castsi256_ps(k));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_maskstore_ps(s + t, k, e);
    if (scale) wmax = _mm256_max_ps(wmax, _mm256_mul_ps(e, _mm256_maskload_ps(scale + t, k)));
  }
  sum = reduce_add8(vsum);
  if (!scale) return 0.f;
  const float w = reduce_max8(wmax);
  const __m256 inv = _mm256_set1_ps(w > 0.f ? 32767.f / w : 0.f);
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i k = tail_mask8(n - t);
    const __m256 q = _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(s + t, k), _mm256_maskload_ps(scale + t, k)), inv);
    const __m256i r = _mm256_cvtps_epi32(q);  // round to nearest; |q| <= 32767
    const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    if (n - t >= 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + t), r16);
    } else {
      int16_t tail[8];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tail), r16);
      std::memcpy(u + t, tail, (n - t) * sizeof(int16_t));
    }
  }
  return w / 32767.f;
}

// heads_scores_lanes (see the AVX-512 build's) with 8 keys a vector: for a block's K laid out by head
// ([D/2][BS][2], then BS scales; BS a multiple of 16), out[g * os + t - s] = qscale[g] * kscale_t *
// dot(q16_g, k_t) for the keys t in [s, s + n). Each pair of K's values for 16 keys is one 32-byte
// read, widened in two halves and multiplied by every head's q pair; no reduction across lanes.
template <int GH>
inline void heads_scores_lanes(const int16_t* q, const int8_t* kh, int64_t BS, int64_t s, int64_t n, int64_t D,
                               const float* qscale, float* out, int64_t os, PrefetchQueue* /*ticks: AVX-512's*/) {
  const float* ksc = reinterpret_cast<const float*>(kh + D * BS);
  const int32_t* q32 = reinterpret_cast<const int32_t*>(q);
  const int64_t D2 = D / 2;
  for (int64_t k0 = 0; k0 < BS; k0 += 16) {
    const int64_t lo = std::max(s, k0), hi = std::min(s + n, k0 + 16);
    if (lo >= hi) continue;
    __m256i a[GH][2];
    for (int g = 0; g < GH; ++g) a[g][0] = a[g][1] = _mm256_setzero_si256();
    for (int64_t p = 0; p < D2; ++p) {
      const int8_t* r = kh + (p * BS + k0) * 2;
      const __m256i k0v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
      const __m256i k1v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16)));
      for (int g = 0; g < GH; ++g) {
        const __m256i w = _mm256_set1_epi32(q32[g * D2 + p]);
        a[g][0] = _mm256_add_epi32(a[g][0], _mm256_madd_epi16(k0v, w));
        a[g][1] = _mm256_add_epi32(a[g][1], _mm256_madd_epi16(k1v, w));
      }
    }
    const bool whole = lo == k0 && hi == k0 + 16;  // stored in place, not through a copy (a call per head)
    for (int g = 0; g < GH; ++g) {
      float f[16];
      float* o = whole ? out + g * os + (lo - s) : f;
      for (int i = 0; i < 2; ++i)
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(as_computed(_mm256_mul_ps(_mm256_cvtepi32_ps(a[g][i]), _mm256_set1_ps(qscale[g]))),
                                                  _mm256_loadu_ps(ksc + k0 + 8 * i)));
      if (!whole) std::memcpy(out + g * os + (lo - s), f + (lo - k0), (hi - lo) * sizeof(float));
    }
  }
}

// heads_values_lanes (see the AVX-512 build's) 16 values at a time: acc_g (int32, in order) += the sum
// over key pairs j in [j0, j1) of u_g[2j], u_g[2j + 1] times the pair's values, read side by side from
// V's layout ([BS/2][D][2]); D a multiple of 16.
template <int GH>
inline void heads_values_lanes(const int16_t* u, int64_t us, const int8_t* vh, int64_t j0, int64_t j1, int64_t D,
                               int32_t* acc, PrefetchQueue* /*ticks: AVX-512's*/) {
  for (int64_t c = 0; c < D; c += 16) {
    __m256i a[GH][2];
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 2; ++i) a[g][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + g * D + c + 8 * i));
    for (int64_t j = j0; j < j1; ++j) {
      const int8_t* r = vh + (j * D + c) * 2;
      const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
      const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16)));
      for (int g = 0; g < GH; ++g) {
        int32_t w2;
        std::memcpy(&w2, u + g * us + 2 * j, sizeof(w2));
        const __m256i w = _mm256_set1_epi32(w2);
        a[g][0] = _mm256_add_epi32(a[g][0], _mm256_madd_epi16(v0, w));
        a[g][1] = _mm256_add_epi32(a[g][1], _mm256_madd_epi16(v1, w));
      }
    }
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 2; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + g * D + c + 8 * i), a[g][i]);
  }
}

// The rows' counterpart of heads_values_lanes, for gathered rows (other block sizes, a tree's virtual
// blocks): two keys' rows interleaved byte by byte, so each widened pair meets u_t, u_t+1 as in the
// layout; acc in order, D a multiple of 16, n keys' rows `vs` bytes apart.
template <int GH>
inline void heads_values_int8(const int16_t* u, int64_t us, const int8_t* vb, int64_t vs, int64_t n, int64_t D,
                              int32_t* acc) {
  for (int64_t c = 0; c < D; c += 16) {
    __m256i a[GH][2];
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 2; ++i) a[g][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + g * D + c + 8 * i));
    for (int64_t t = 0; t < n; t += 2) {
      const bool pair = t + 1 < n;  // a lone last key is paired with zeros, not the next row
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vb + t * vs + c));
      const __m128i r1 = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(vb + (t + 1) * vs + c)) : _mm_setzero_si128();
      const __m256i v0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1));
      const __m256i v1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1));
      for (int g = 0; g < GH; ++g) {
        int32_t w2;  // u_t in the low half, u_t+1 in the high half, as the interleaved rows
        if (pair) std::memcpy(&w2, u + g * us + t, sizeof(w2));
        else w2 = static_cast<uint16_t>(u[g * us + t]);
        const __m256i w = _mm256_set1_epi32(w2);
        a[g][0] = _mm256_add_epi32(a[g][0], _mm256_madd_epi16(v0, w));
        a[g][1] = _mm256_add_epi32(a[g][1], _mm256_madd_epi16(v1, w));
      }
    }
    for (int g = 0; g < GH; ++g)
      for (int i = 0; i < 2; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + g * D + c + 8 * i), a[g][i]);
  }
}

// out[0, D) = step * acc (acc in order).
inline void values_from_int32_natural(const int32_t* acc, int64_t D, float step, float* out) {
  const __m256 sc = _mm256_set1_ps(step);
  for (int64_t c = 0; c < D; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + c))), sc));
}
#endif
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

inline const float* rows_as_f32(const Fp8E4M3* src, int64_t n, int64_t D, int64_t stride, float* scratch,
                                int64_t& out_stride) {
  const float* table = fp8_e4m3_table();
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

// out[t] = scale * dot(q, k_t) for n rows of D floats, `ks` apart.
inline void row_scores(const float* q, const float* kb, int64_t ks, int64_t n, int64_t D, float scale, float* out) {
#ifdef FERRY_ATTN_AVX2
  if (D % 8 == 0) return block_scores(q, kb, ks, n, D, scale, out);
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
      s0 += q[d] * k0[d];
      s1 += q[d] * k1[d];
      s2 += q[d] * k2[d];
      s3 += q[d] * k3[d];
    }
    out[t] = s0 * scale, out[t + 1] = s1 * scale, out[t + 2] = s2 * scale, out[t + 3] = s3 * scale;
  }
  for (; t < n; ++t) {
    const float* kt = kb + t * ks;
    float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
    for (int64_t d = 0; d < D; ++d) s0 += q[d] * kt[d];
    out[t] = s0 * scale;
  }
}

// acc[0, D) += sum over n rows of p[t] * v_t, rows `vs` floats apart.
inline void row_values(const float* p, const float* vb, int64_t vs, int64_t n, int64_t D, float* acc) {
#ifdef FERRY_ATTN_AVX2
  if (D % 8 == 0) return block_values(p, vb, vs, n, D, acc);
#endif
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float* v0 = vb + t * vs;
    const float* v1 = v0 + vs;
    const float* v2 = v1 + vs;
    const float* v3 = v2 + vs;
    const float p0 = p[t], p1 = p[t + 1], p2 = p[t + 2], p3 = p[t + 3];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
  }
  for (; t < n; ++t) {
    const float* vt = vb + t * vs;
    const float pt = p[t];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += pt * vt[d];
  }
}

// A task's buffers for a quantized cache (kv_layout.h): each block's rows gathered (stride W), or with
// the int8 lanes path a tree block's head part rebuilt in the cache's layout from the positions its
// rows stand for; one packed row; with lanes, each block's first key and its weights by position.
// Empty for the float caches, whose kernels stay as they were: with these declared there (size 0)
// the bf16 task loop was 3 KB larger than before the layout (1.2 KB without) and ran up to 6%
// slower in the attention sweep.
template <bool Quantized, typename CacheT>
struct QuantizedBuffers {};
template <typename CacheT>
struct QuantizedBuffers<true, CacheT> {
  std::vector<CacheT> gathered_k, gathered_v;
  std::vector<uint8_t> row;
  std::vector<int64_t> s_of;
  std::vector<int16_t> upad;
  void size(bool lanes, bool tree, int64_t P, int64_t BS, int64_t W, int64_t G) {
    gathered_k.resize(!lanes || tree ? P * BS * W : 0), gathered_v.resize(gathered_k.size());
    row.resize(W), s_of.resize(lanes ? P : 0), upad.resize(lanes ? G * BS + 2 : 0);
  }
};

// A split sequence's output for kv head h's G query heads, from its nparts partitions' softmax maxima m
// and sums l (G each) and unnormalized values acc (G x D each), partition p's at index p * KVH + h:
// each rescaled to their common max (flash-decoding). Both ways of sharing out the work call this, in
// partition order, so a sequence's result does not depend on the batch around it.
inline void merge_partitions(const float* m, const float* l, const float* acc, int64_t nparts, int64_t KVH, int64_t h,
                             int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = kNegBig;
    for (int64_t p = 0; p < nparts; ++p) mx = std::max(mx, m[(p * KVH + h) * G + g]);
    float lsum = 0.f;
    float* og = out + g * D;
    std::fill(og, og + D, 0.f);
    for (int64_t p = 0; p < nparts; ++p) {
      const int64_t t = p * KVH + h;
      const float w = std::exp(m[t * G + g] - mx);
      lsum += l[t * G + g] * w;
      const float* a = acc + (t * G + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += a[d] * w;
    }
    const float inv = 1.f / lsum;
    for (int64_t d = 0; d < D; ++d) og[d] *= inv;
  }
}

// The partial results a split sequence's partitions leave for its merge (softmax max, sum of exps,
// weighted values) and each (sequence, kv head)'s partitions still to finish, grown as needed. Kept
// up to kKeptFloats of partials (a few long sequences need far more: 4 of 128k tokens with 8 kv heads
// of 4 x 128 took ~130 MB), released after a call that needed more.
struct SharedParts {
  static constexpr int64_t kKeptFloats = 1 << 18;  // 1 MB: SmolLM2 at batch 1 up to ~29k tokens
  std::vector<float> m, l, acc;
  std::vector<std::atomic<int32_t>> left;  // (atomics do not move: a larger one is built anew)
  void size(int64_t ml, int64_t a, int64_t counters) {
    if (int64_t(m.size()) < ml) m.resize(ml), l.resize(ml);
    if (int64_t(acc.size()) < a) acc.resize(a);
    if (int64_t(left.size()) < counters) left = std::vector<std::atomic<int32_t>>(counters);
  }
  void trim() {
    if (int64_t(acc.size()) > kKeptFloats) *this = SharedParts();
  }
};

template <typename CacheT>
void paged_decode_attention_impl(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                 at::Tensor seq_lens, double scale, const int64_t* tree, const int64_t* skip,
                                 at::Tensor out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t W = k_cache.size(3);  // row width: D, or D + 4 with a quantized row's scale
  const int64_t G = H / KVH;
  const int64_t MAXB = block_tables.size(1);
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const float* qp = q.data_ptr<float>();
  const CacheT* kp = reinterpret_cast<const CacheT*>(k_cache.data_ptr());
  const CacheT* vp = reinterpret_cast<const CacheT*>(v_cache.data_ptr());
  constexpr int64_t kElem = sizeof(CacheT);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* seq_lp = lens.data_ptr<int64_t>();
  // Tokens each row attends to: its length, or for a tree row the positions before its tree and the
  // drafts it descends from (tree_row: where its logical position l >= start is stored).
  std::vector<int64_t> logical(B);
  for (int64_t b = 0; b < B; ++b)
    logical[b] = tree != nullptr && tree[2 * b] < seq_lp[b]
                     ? tree[2 * b] + __builtin_popcountll(static_cast<uint64_t>(tree[2 * b + 1]))
                     : seq_lp[b];
  const int64_t* lp = logical.data();
  auto tree_row = [&](int64_t b, int64_t l) {  // the position holding logical position l >= start
    uint64_t bits = static_cast<uint64_t>(tree[2 * b + 1]);
    for (int64_t k = l - tree[2 * b]; k > 0; --k) bits &= bits - 1;  // drop the k lowest set bits
    return tree[2 * b] + __builtin_ctzll(bits);
  };
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
  int64_t most_tasks = 0;  // of one sequence
  for (int64_t b = 0; b < B; ++b) most_tasks = std::max(most_tasks, first[b + 1] - first[b]);

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

  // With AVX2, fp32 / bf16 / int8 rows are read in place and widened in registers (the vector loops'
  // load8 / load16); other caches (fp8, or D not a multiple of 8) are widened into a scratch first.
#ifdef FERRY_ATTN_AVX2
  constexpr bool kInPlace = std::is_same_v<CacheT, float> || std::is_same_v<CacheT, uint16_t> || kInt8Dots;
#else
  constexpr bool kInPlace = false;
#endif
  const bool in_place = kInPlace && D % 8 == 0 && (int8_dots || !kInt8Dots);
  // A quantized cache's blocks are laid out by head (kv_layout.h): the lanes path below reads them as
  // they are; every other path reads rows, gathered per block (stride W) into a task's scratch.
  constexpr bool kQuantized = std::is_same_v<CacheT, int8_t> || std::is_same_v<CacheT, Fp8E4M3>;
  const int64_t row_stride = kQuantized ? W : KVH * W;  // elements from one token's row of a head to the next's
  // With AVX-512, in-place rows are taken by up to three heads per pass (heads_scores / heads_values).
#ifdef FERRY_ATTN_AVX512
  const bool grouped = in_place && D % (int8_dots ? 32 : 16) == 0;
#endif

  // A task takes its whole partition at once (P blocks, up to PT rows): the scores of every row for
  // the G heads, one softmax over them, then the values. Per 16-token block, an online softmax's
  // max, exp, sum and accumulator rescale cost about what the block's dot products did.
  const int64_t PT = P * BS;
  // An int8 cache's values are summed in int16 x int8 products (heads_values_int8 / _lanes), exact in
  // int32 for partitions of up to 256 keys: with AVX-512 where head_dim is a multiple of 64, with
  // AVX2 alone (8 lanes, vpmaddwd) where it is a multiple of 16.
#ifdef FERRY_ATTN_AVX512
  const bool int_values = grouped && kInt8Dots && D % 64 == 0 && PT <= 256;
#elif defined(FERRY_ATTN_AVX2)
  const bool int_values = in_place && int8_dots && PT <= 256;
#else
  constexpr bool int_values = false;
#endif
  // The int8 cache's blocks read in their own layout, 16 keys per vector (heads_scores_lanes,
  // heads_values_lanes); with other block sizes, head sizes or ISAs its rows are gathered first.
  const bool lanes = int_values && BS % 16 == 0;
  // Threads take work as they go rather than in fixed halves: a task's time depends on where its
  // blocks are (cache or memory), and a static split left one thread waiting on the other at the
  // end. Where no one sequence is more than a 1 / kChunksPerThread share of a thread's work, a claim
  // is a whole sequence, whose partitions the thread merges as soon as it has them, while they are
  // in its L1/L2 (at batch 64 x 1k tokens the partial results are 2.4 MB a layer; written out and
  // merged in a second pass they cost ~15% of the kernel). Otherwise (few or very uneven sequences)
  // a claim is a chunk of whole partitions (all KVH heads, so the first head's task loads the blocks
  // the others read), and the thread that finishes a (sequence, kv head)'s last partition merges it
  // (no second fork: at batch 1 x 512 tokens a layer went 9.8 -> 9.5 us, caches hot). Results do not depend on which
  // thread takes a task.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks / KVH));
  const bool by_sequence = split && most_tasks * workers * kChunksPerThread <= tasks;
  const int64_t chunk = std::max<int64_t>(1, tasks / KVH / (workers * kChunksPerThread)) * KVH;
  // Where the next partition's prefetches go out in the kernels' ticks (PrefetchQueue): the AVX-512
  // float caches' grouped loops, and the int8 lanes where claims are whole sequences (a task's next
  // partition is then often the next sequence's first: ticked, batch 64 ran 1.05-1.06x; with chunks of
  // partitions, batch 1-4, 0.90-0.95x). tick_steps is a full block's ticks in one task (each pass of
  // heads: the scores' 8-key steps, or D/8 steps per 16 keys, then one per key, or key pair, per
  // chunk of values). Elsewhere 0: a share per block.
  int64_t tick_steps = 0;
#ifdef FERRY_ATTN_AVX512
  if (grouped && !kInt8Dots) {
    for_head_passes(G, [&](int64_t, auto) { tick_steps += BS / 8 + BS * (D / 64 + D % 64 / 32 + D % 32 / 16); });
  } else if (lanes && by_sequence) {
    for_head_passes(G, [&](int64_t, auto) { tick_steps += BS / 16 * (D / 8) + BS / 2 * (D / 64); });
  }
#endif
  // The split sequences' partial results, shared between the threads (SharedParts): the calling
  // thread's, kept from call to call. Allocated and zeroed per call they took ~1.5 us of a ~55 us
  // batch-1 layer; every slot is written by its task before a merge reads it.
  const bool shared_parts = split && !by_sequence;
  thread_local SharedParts shared;
  if (shared_parts) shared.size(tasks * G, tasks * G * D, B * KVH);
  float* const part_m = shared.m.data();
  float* const part_l = shared.l.data();
  float* const part_acc = shared.acc.data();
  std::atomic<int32_t>* const parts_left = shared.left.data();
  for (int64_t b = 0; b < (shared_parts ? B : 0); ++b)
    for (int64_t h = 0; h < KVH; ++h) parts_left[b * KVH + h].store(int32_t((first[b + 1] - first[b]) / KVH));
  std::atomic<int64_t> next_claim{0};  // by_sequence: the next sequence
  // Otherwise each worker owns a contiguous run of the chunks and takes its own from the front, so
  // the partition it prefetches (the one after its current one) is the one it computes next; one
  // out of work takes the others' from their backs. (From one shared counter two threads took
  // alternate partitions, each prefetching the one the other would take next into its own core's L2:
  // at batch 1, a 576-token layer's K/V from memory took 47 us with an fp32 cache and 28 with int8;
  // 37 and 24 this way.)
  const int64_t chunks = (tasks + chunk - 1) / chunk;
  std::unique_ptr<ChunkRun[]> runs(new ChunkRun[by_sequence ? 0 : workers]);
  for (int64_t w = 0; w < (by_sequence ? 0 : workers); ++w) runs[w].set(chunks * w / workers, chunks * (w + 1) / workers);
  at::parallel_for(0, workers, 1, [&](int64_t worker, int64_t) {
    std::vector<float> scores(G * PT);  // head g's row t at g * PT + t
    std::vector<float> kscratch(in_place ? 0 : PT * D), vscratch(in_place ? 0 : PT * D);  // rows widened first
    // The int8 AVX2 path: K rows in int16, the rows' scales, the softmax weights times V's scales.
    std::vector<int16_t> k16(int8_dots ? (PT + 8) * D : 0);  // (+ 8 rows, 8 scales: block_scores_int16)
    std::vector<float> kscale(PT + 8), vscale(PT), pv(int8_dots && !int_values ? G * PT : 0), qs(int8_dots ? G : 0);
    std::vector<float> acc(G * D);
    // The AVX-512 int8 values in integers (heads_values_int8): weights, sums, and each head's step.
    std::vector<int16_t> u16(int_values ? G * PT : 0);
    std::vector<int32_t> acc32(int_values ? G * D : 0);
    std::vector<float> ustep(G);
    std::vector<float> m(G), l(G);
    // Tree rows: a task's blocks that hold drafts, gathered into virtual blocks (one head's rows, at
    // the cache's own stride) so every kernel below reads them as it reads a plain block.
    std::vector<CacheT> virtual_k(tree != nullptr && !kQuantized ? P * BS * KVH * W : 0), virtual_v(virtual_k.size());
    // A quantized cache's buffers (QuantizedBuffers; none in the float caches' kernels).
    QuantizedBuffers<kQuantized, CacheT> quant;
    if constexpr (kQuantized) quant.size(lanes, tree != nullptr, P, BS, W, G);
    std::vector<const CacheT*> vrows_of(P);  // each block's V rows in place,
    std::vector<const float*> vb_of(P);  // or widened to fp32, with their stride
    std::vector<int64_t> vs_of(P), n_of(P);  // and each block's row count
    PrefetchQueue ahead;  // the next partition's lines
    PrefetchQueue* const ticks = tick_steps ? &ahead : nullptr;  // given to the kernels that tick
    std::vector<float> seq_m, seq_l, seq_acc;  // by_sequence: the claimed sequence's partial results
    // The next claim's tasks [t0, t1), or false when none are left.
    auto claim = [&](int64_t& t0, int64_t& t1) {
      if (by_sequence) {
        const int64_t b = next_claim.fetch_add(1);
        if (b >= B) return false;
        t0 = first[b], t1 = first[b + 1];
      } else {
        int64_t c = runs[worker].take_front();
        for (int64_t o = 1; c < 0 && o < workers; ++o) c = runs[(worker + o) % workers].take_back();
        if (c < 0) return false;
        t0 = c * chunk, t1 = std::min(t0 + chunk, tasks);
      }
      return true;
    };
    for (int64_t t0, t1; claim(t0, t1);)
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t part = (task - first[b]) / KVH, h = (task - first[b]) % KVH;
      const int64_t L = lp[b];
      const int64_t nparts = (first[b + 1] - first[b]) / KVH;
      const int64_t j0 = part * P, j1 = std::min((L + BS - 1) / BS, j0 + P);
      const float* qb = qp + (b * H + h * G) * D;
      const int16_t* q16 = int8_dots ? q16_all.data() + (b * H + h * G) * D : nullptr;
      const float* qscale = int8_dots ? qscale_all.data() + b * H + h * G : nullptr;
      for (int64_t g = 0; g < (int8_dots ? G : 0); ++g) qs[g] = fscale * qscale[g];
      if (h == 0) {
        // The next partition's blocks (this sequence's, or the first of the sequence this thread most
        // likely takes next), into L2 while this one is computed. Queued here and issued a share per
        // block of this partition's KVH tasks (below).
        ahead.clear();
        int64_t nb_ = b, nj0 = j1, nj1 = std::min((L + BS - 1) / BS, j1 + P);
        if (nj0 >= nj1) {
          const int64_t next = by_sequence ? next_claim.load(std::memory_order_relaxed) : b + 1;
          if (next < B) nb_ = next, nj0 = 0, nj1 = std::min((lp[next] + BS - 1) / BS, P);
        }
        for (int64_t j = nj0; j < nj1; ++j) {
          const int64_t nblk = btp[nb_ * MAXB + j];
          ahead.add(reinterpret_cast<const char*>(kp + nblk * BS * KVH * W), BS * KVH * W * kElem);
          ahead.add(reinterpret_cast<const char*>(vp + nblk * BS * KVH * W), BS * KVH * W * kElem);
        }
        // Spread over the partition's KVH tasks: in ticks where the kernels take them, else per block.
        const int64_t steps = KVH * (j1 - j0) * (tick_steps ? tick_steps : 1);
        (tick_steps ? ahead.per_tick : ahead.share) = (ahead.lines + steps - 1) / steps;
      }
      // Scores of each block's rows for all G heads; V rows located (or widened) for the last phase.
      int64_t rows = 0;
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t i = j - j0, blk = btp[b * MAXB + j];
        const int64_t s = skip != nullptr && j == 0 ? skip[b] : 0;  // window: the first block's keys before it
        const int64_t n = std::min(BS, L - j * BS) - s;
        n_of[i] = n;
        if (!ticks) ahead.issue(ahead.share);
        const bool tree_block = tree != nullptr && logical[b] != seq_lp[b] && (j + 1) * BS > tree[2 * b];
        const CacheT* krows = kp + ((blk * BS + s) * KVH + h) * W;
        const CacheT* vrows = vp + ((blk * BS + s) * KVH + h) * W;
        if constexpr (kQuantized) {
          const auto* kbytes = reinterpret_cast<const uint8_t*>(kp);
          const auto* vbytes = reinterpret_cast<const uint8_t*>(vp);
          auto* kg = reinterpret_cast<uint8_t*>(quant.gathered_k.data() + i * BS * W);
          auto* vg = reinterpret_cast<uint8_t*>(quant.gathered_v.data() + i * BS * W);
          uint8_t* row = quant.row.data();
          // Row t of the block: where logical position j * BS + s + t is stored (a tree's drafts elsewhere).
          auto source = [&](int64_t t, int64_t& sblk, int64_t& st) {
            const int64_t l = j * BS + s + t, pos = tree_block && l >= tree[2 * b] ? tree_row(b, l) : l;
            sblk = btp[b * MAXB + pos / BS], st = pos % BS;
          };
#ifdef FERRY_ATTN_AVX2
          if constexpr (kInt8Dots) {
            if (lanes) {
              const uint8_t* kh = kbytes + kv_head_offset(blk, h, BS, KVH, W);
              const uint8_t* vh = vbytes + kv_head_offset(blk, h, BS, KVH, W);
              if (tree_block) {  // (no window with a tree: s is 0)
                for (int64_t t = 0; t < n; ++t) {
                  int64_t sblk, st;
                  source(t, sblk, st);
                  kv_gather_row(kbytes + kv_head_offset(sblk, h, BS, KVH, W), KvLayout::Keys, st, BS, D, row);
                  kv_scatter_row(kg, KvLayout::Keys, t, BS, D, row);
                  kv_gather_row(vbytes + kv_head_offset(sblk, h, BS, KVH, W), KvLayout::Values, st, BS, D, row);
                  kv_scatter_row(vg, KvLayout::Values, t, BS, D, row);
                }
                kh = kg, vh = vg;
              }
              vrows_of[i] = reinterpret_cast<const CacheT*>(vh);
              quant.s_of[i] = s;
              for_head_passes(G, [&](int64_t g0, auto gh) {
                heads_scores_lanes<decltype(gh)::value>(q16 + g0 * D, reinterpret_cast<const int8_t*>(kh), BS, s, n, D,
                                                        qs.data() + g0, scores.data() + g0 * PT + rows, PT, ticks);
              });
              // V's scales, 8 at a time (a memcpy of n floats was a library call per block)
              const float* vsc = reinterpret_cast<const float*>(vh + kv_scale_offset(s, BS, D));
              int64_t t = 0;
              for (; t + 8 <= n; t += 8) _mm256_storeu_ps(vscale.data() + rows + t, _mm256_loadu_ps(vsc + t));
              for (; t < n; ++t) vscale[rows + t] = vsc[t];
              rows += n;
              continue;
            }
          }
#endif
          for (int64_t t = 0; t < n; ++t) {
            int64_t sblk, st;
            source(t, sblk, st);
            kv_gather_row(kbytes + kv_head_offset(sblk, h, BS, KVH, W), KvLayout::Keys, st, BS, D, kg + t * W);
            kv_gather_row(vbytes + kv_head_offset(sblk, h, BS, KVH, W), KvLayout::Values, st, BS, D, vg + t * W);
          }
          krows = reinterpret_cast<const CacheT*>(kg), vrows = reinterpret_cast<const CacheT*>(vg);
        } else if (tree_block) {
          CacheT* vk = virtual_k.data() + i * BS * KVH * W;
          CacheT* vv = virtual_v.data() + i * BS * KVH * W;
          for (int64_t t = 0; t < n; ++t) {
            const int64_t l = j * BS + t, pos = l < tree[2 * b] ? l : tree_row(b, l);
            const int64_t at = ((btp[b * MAXB + pos / BS] * BS + pos % BS) * KVH + h) * W;
            std::memcpy(vk + (t * KVH + h) * W, kp + at, W * kElem);
            std::memcpy(vv + (t * KVH + h) * W, vp + at, W * kElem);
          }
          krows = vk + h * W, vrows = vv + h * W;
        }
        vrows_of[i] = vrows;
#ifdef FERRY_ATTN_AVX2
        if constexpr (kInPlace) {
          if (in_place) {
#ifdef FERRY_ATTN_AVX512
            if (grouped) {
              if constexpr (kInt8Dots) {
                for_head_passes(G, [&](int64_t g0, auto gh) {
                  heads_scores_int8<decltype(gh)::value>(q16 + g0 * D, krows, row_stride, n, D, qs.data() + g0,
                                                         kscale.data() + rows, scores.data() + g0 * PT + rows, PT);
                });
                read_row_scales(vrows, row_stride, n, D, vscale.data() + rows);
              } else {
                for_head_passes(G, [&](int64_t g0, auto gh) {
                  heads_scores<decltype(gh)::value>(qb + g0 * D, krows, row_stride, n, D, fscale,
                                                    scores.data() + g0 * PT + rows, PT, ticks);
                });
              }
              rows += n;
              continue;
            }
#endif
            if constexpr (kInt8Dots) {
              widen_rows_int16(krows, n, D, row_stride, k16.data() + rows * D, kscale.data() + rows);
              read_row_scales(vrows, row_stride, n, D, vscale.data() + rows);
              for (int64_t g = 0; g < G; ++g)
                block_scores_int16(q16 + g * D, k16.data() + rows * D, kscale.data() + rows, n, D,
                                   qs[g], scores.data() + g * PT + rows);
            } else {
              for (int64_t g = 0; g < G; ++g)
                block_scores(qb + g * D, krows, row_stride, n, D, fscale, scores.data() + g * PT + rows);
            }
            rows += n;
            continue;
          }
        }
#endif
        int64_t ks = 0;
        const float* kb = rows_as_f32(krows, n, D, row_stride, kscratch.data() + rows * D, ks);
        vb_of[i] = rows_as_f32(vrows, n, D, row_stride, vscratch.data() + rows * D, vs_of[i]);
        for (int64_t g = 0; g < G; ++g) row_scores(qb + g * D, kb, ks, n, D, fscale, scores.data() + g * PT + rows);
        rows += n;
      }
      // One softmax over the partition per head: its max and sum are kept for the merge.
#ifdef FERRY_ATTN_AVX512
      for (int64_t g = 0; g < G; ++g)
        ustep[g] = softmax_partition(scores.data() + g * PT, rows, int_values ? vscale.data() : nullptr,
                                     int_values ? u16.data() + g * PT : nullptr, m[g], l[g]);
#else
#ifdef FERRY_ATTN_AVX2
      for (int64_t g = 0; g < (int_values ? G : 0); ++g)  // (AVX2's float caches keep the loop below)
        ustep[g] = softmax_partition(scores.data() + g * PT, rows, vscale.data(), u16.data() + g * PT, m[g], l[g]);
#endif
      for (int64_t g = 0; g < (int_values ? 0 : G); ++g) {
        float* sg = scores.data() + g * PT;
        float mx = kNegBig;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < rows; ++t) mx = sg[t] > mx ? sg[t] : mx;  // (std::max was left a call)
#pragma omp simd
        for (int64_t t = 0; t < rows; ++t) sg[t] = std::exp(sg[t] - mx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < rows; ++t) sum += sg[t];
        m[g] = mx, l[g] = sum;
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
#ifdef FERRY_ATTN_AVX2
      if constexpr (kInt8Dots) {
        if (int_values) {
          std::fill(acc32.begin(), acc32.end(), 0);
          for (int64_t i = 0, r = 0; i < j1 - j0; r += n_of[i++]) {
            if (lanes) {  // the block's weights by position in it, zero where it has no key
              const int64_t s0 = quant.s_of[i], n = n_of[i];
              // A whole block's weights are read where the softmax left them; a partial one's are
              // copied out with zeros around (two small library calls per head, ~8% of the AVX2 kernel
              // when every block took them).
              const bool whole = s0 == 0 && n == BS;
              const int16_t* ub = whole ? u16.data() + r : quant.upad.data();
              const int64_t us = whole ? PT : BS;
              for (int64_t g = 0; g < (whole ? 0 : G); ++g) {
                int16_t* pad = quant.upad.data() + g * BS;
                std::memset(pad, 0, BS * sizeof(int16_t));
                std::memcpy(pad + s0, u16.data() + g * PT + r, n * sizeof(int16_t));
              }
              for_head_passes(G, [&](int64_t g0, auto gh) {
                heads_values_lanes<decltype(gh)::value>(ub + g0 * us, us, reinterpret_cast<const int8_t*>(vrows_of[i]),
                                                        s0 / 2, (s0 + n + 1) / 2, D, acc32.data() + g0 * D, ticks);
              });
              continue;
            }
            for_head_passes(G, [&](int64_t g0, auto gh) {
              heads_values_int8<decltype(gh)::value>(u16.data() + g0 * PT + r, PT, vrows_of[i], row_stride, n_of[i], D,
                                                     acc32.data() + g0 * D);
            });
          }
          for (int64_t g = 0; g < G; ++g) {
#ifdef FERRY_ATTN_AVX512
            if (!lanes) {  // (heads_values_int8's own lane order; AVX2's sums the rows in order)
              values_from_int32(acc32.data() + g * D, D, ustep[g], acc.data() + g * D);
              continue;
            }
#endif
            values_from_int32_natural(acc32.data() + g * D, D, ustep[g], acc.data() + g * D);
          }
        }
      }
#endif
      rows = 0;
#ifdef FERRY_ATTN_AVX512
      if constexpr (kInPlace) {
        if (grouped && !int_values) {
          for (int64_t i = 0; i < j1 - j0; ++i) {
          const int64_t n = n_of[i];
          const float* p = scores.data() + rows;
          if constexpr (kInt8Dots) {  // V's row scales ride on the weights, as below
            for (int64_t g = 0; g < G; ++g)
              for (int64_t t = 0; t < n; ++t) pv[g * PT + t] = scores[g * PT + rows + t] * vscale[rows + t];
            p = pv.data();
          }
          for_head_passes(G, [&](int64_t g0, auto gh) {
            heads_values<decltype(gh)::value>(p + g0 * PT, PT, vrows_of[i], row_stride, n, D, acc.data() + g0 * D, ticks);
          });
          rows += n;
          }
        }
      }
      for (int64_t i = 0; i < (grouped ? 0 : j1 - j0); ++i) {
#else
      for (int64_t i = 0; i < (int_values ? 0 : j1 - j0); ++i) {
#endif
        const int64_t n = n_of[i];
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = scores.data() + g * PT + rows;
#ifdef FERRY_ATTN_AVX2
          if constexpr (kInPlace) {
            if (in_place) {
              if (kInt8Dots) {  // V's row scales ride on the weights: sum_t (p_t s_t) v_t
                for (int64_t t = 0; t < n; ++t) pv[t] = pg[t] * vscale[rows + t];
                pg = pv.data();
              }
              block_values(pg, vrows_of[i], row_stride, n, D, acc.data() + g * D);
              continue;
            }
          }
#endif
          row_values(pg, vb_of[i], vs_of[i], n, D, acc.data() + g * D);
        }
        rows += n;
      }
      float* ob = op + (b * H + h * G) * D;
      if (nparts > 1) {
        // The partial results go to the claimed sequence's own buffers (by_sequence) or the shared
        // ones, indexed from the sequence's first task either way, as merge_partitions reads them.
        if (by_sequence && task == first[b])
          seq_m.resize(nparts * KVH * G), seq_l.resize(nparts * KVH * G), seq_acc.resize(nparts * KVH * G * D);
        const int64_t base = by_sequence ? 0 : first[b], local = task - first[b];
        float* pm = (by_sequence ? seq_m.data() : part_m) + base * G;
        float* pl = (by_sequence ? seq_l.data() : part_l) + base * G;
        float* pa = (by_sequence ? seq_acc.data() : part_acc) + base * G * D;
        std::copy(m.begin(), m.end(), pm + local * G);
        std::copy(l.begin(), l.end(), pl + local * G);
        std::copy(acc.begin(), acc.end(), pa + local * G * D);
        if (by_sequence) {
          if (task + 1 == first[b + 1])  // the sequence's last task: merge every kv head's partitions
            for (int64_t hh = 0; hh < KVH; ++hh) merge_partitions(pm, pl, pa, nparts, KVH, hh, G, D, op + (b * H + hh * G) * D);
        } else if (parts_left[b * KVH + h].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          // The last of (b, h)'s partitions to finish merges them; acq_rel makes the others' writes visible.
          merge_partitions(pm, pl, pa, nparts, KVH, h, G, D, ob);
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
  shared.trim();
}

// paged_decode_attention into `out` (float32, contiguous, q's shape): the C++ decode step passes one
// buffer for all its layers (at::empty_like took ~2-3 us of a batch-1 layer's ~55).
void paged_decode_attention_out(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                at::Tensor seq_lens, double scale, c10::optional<at::Tensor> tree,
                                c10::optional<at::Tensor> skip, at::Tensor out) {
  TORCH_CHECK(q.dtype() == at::kFloat, "q must be float32");
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be a contiguous float32 tensor shaped like q");
  at::Tensor skip_rows;
  const int64_t* sp = nullptr;
  if (skip.has_value() && skip->defined()) {
    TORCH_CHECK(!(tree.has_value() && tree->defined()), "skip (a sliding window) does not combine with a tree");
    skip_rows = skip->contiguous();
    TORCH_CHECK(skip_rows.dtype() == at::kLong && skip_rows.dim() == 1 && skip_rows.size(0) == q.size(0),
                "skip must be int64 [B]");
    sp = skip_rows.data_ptr<int64_t>();
    auto lens = seq_lens.contiguous();
    const int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
      TORCH_CHECK(sp[b] >= 0 && sp[b] < std::min<int64_t>(k_cache.size(1), lp[b]),
                  "skip must leave each sequence's first block a key");
  }
  at::Tensor tree_rows;
  const int64_t* tp = nullptr;
  if (tree.has_value() && tree->defined()) {
    tree_rows = tree->contiguous();
    TORCH_CHECK(tree_rows.dtype() == at::kLong && tree_rows.dim() == 2 && tree_rows.size(0) == q.size(0) &&
                    tree_rows.size(1) == 2,
                "tree must be int64 [B, 2]");
    tp = tree_rows.data_ptr<int64_t>();
    auto lens = seq_lens.contiguous();
    const int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b) {
      TORCH_CHECK(lp[b] - tp[2 * b] <= 64, "a tree row spans at most 64 positions");
      const uint64_t bits = static_cast<uint64_t>(tp[2 * b + 1]);
      const int64_t span = lp[b] - tp[2 * b];
      TORCH_CHECK(span <= 0 || ((bits >> (span - 1)) & 1), "a tree row attends to itself (its last position)");
      TORCH_CHECK(span <= 0 || span == 64 || (bits >> span) == 0, "a tree row's bits lie within its span");
    }
  }
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "k and v caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const auto dt = k_cache.scalar_type();
  const bool quantized = dt == at::ScalarType::Char || dt == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(k_cache.size(3) == q.size(2) + (quantized ? 4 : 0), "cache rows must be head_dim wide (+4: a scale)");
  TORCH_CHECK(!quantized || k_cache.size(1) % 2 == 0, "a quantized cache's block size must be even (kv_layout.h)");
  if (dt == at::ScalarType::Float)
    return paged_decode_attention_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, tp, sp, out);
  if (dt == at::ScalarType::BFloat16)
    return paged_decode_attention_impl<uint16_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, tp, sp, out);
  if (dt == at::ScalarType::Char)
    return paged_decode_attention_impl<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, tp, sp, out);
  TORCH_CHECK(dt == at::ScalarType::Float8_e4m3fn, "the cache must be float32, bfloat16, int8 or float8_e4m3fn");
  return paged_decode_attention_impl<Fp8E4M3>(q, k_cache, v_cache, block_tables, seq_lens, scale, tp, sp, out);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  c10::optional<at::Tensor> tree, c10::optional<at::Tensor> skip) {
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  paged_decode_attention_out(q, k_cache, v_cache, block_tables, seq_lens, scale, tree, skip, out);
  return out;
}

// The vector path this build takes, for tests whose bounds depend on it: "avx512" (grouped heads; an
// int8 cache's values summed with int16 weights), "avx2" or "portable".
std::string paged_decode_attention_isa() {
#if defined(FERRY_ATTN_AVX512)
  return "avx512";
#elif defined(FERRY_ATTN_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
