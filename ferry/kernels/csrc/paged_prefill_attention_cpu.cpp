// Paged prefill attention on the CPU: each query row of each prefill chunk attends causally (and
// within the layer's sliding window, if it has one) to its request's keys, read from the
// block-paged cache: the cached prefix and the chunk's own rows, which the caller stored first.
//
// q:         [T, H, D]         float32, the step's flat batch (only the chunks' rows are read)
// k/v_cache: [NB, BS, KVH, W]  float32 or bfloat16 (W = D), or int8 / float8_e4m3fn: D values and
//                              their fp32 scale per row (W = D + 4), each block laid out by head
//                              (kv_layout.h; ferry/kv_quant.py)
// tables:    [C, MAXB]         int64, each chunk's request blocks
// spans:     [C, 3]            int64, per chunk (first row in q, rows, context length); row i of a
//                              chunk sits at position context - rows + i and sees keys up to it
// window:    0, or the sliding window: the row at position p sees keys p - window + 1 .. p
// out:       [T, H, D]         float32: the chunks' rows are written, the others left as they are
//
// Why a kernel: the torch reference gathers and dequantizes every chunk's context per layer, then
// runs SDPA, whose CPU flash kernel computes the whole square and masks it (~70 GFLOP/s for a
// 300-token prompt on the 2-vCPU EPYC, a sixth of a prompt's time there). Here the keys of a
// chunk's context are dequantized once per kv head into an fp32 scratch that holds K transposed,
// [D][16] per 16 keys, so 16 keys sit in the lanes of one vector: a query's 16 scores are D FMAs
// of a broadcast query value with one loaded vector, no horizontal sums, and up to kMaxVectors
// query vectors (rows x the G heads that share the kv head) share each load. Tiles of keys past a
// row's position are never visited (causal), nor before its window. The softmax is online (flash
// attention): a running max and sum per query vector, its unnormalized output rescaled when the
// max grows, divided by the sum at the end. Values are read as [16][D] fp32 rows and summed with the
// 16 weights broadcast. The context is dequantized kRangeKeys keys at a time, so the scratch stays
// bounded whatever the context.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fp8_table.h"
#include "kv_layout.h"
#include "simd_exp.h"

namespace {

constexpr int64_t kLanes = 16;        // keys per tile
constexpr int64_t kRangeKeys = 1024;  // keys dequantized per pass (a multiple of kLanes)
constexpr int kMaxVectors = 12;       // query vectors that share one pass over a key tile
constexpr float kNegBig = -1e30f;     // built with -ffast-math: no infinities

enum class Kind { F32, BF16, I8, F8 };

// One cache row as D floats: the same values ferry/kv_quant.py's dequantize_rows gives (q * scale).
template <Kind K>
inline void row_to_f32(const uint8_t* row, int64_t D, float* out) {
  if constexpr (K == Kind::F32) {
    std::memcpy(out, row, D * sizeof(float));
  } else if constexpr (K == Kind::BF16) {
    for (int64_t d = 0; d < D; ++d) {
      uint16_t h;
      std::memcpy(&h, row + 2 * d, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(out + d, &bits, 4);
    }
  } else {
    float s;
    std::memcpy(&s, row + D, sizeof(float));
    if constexpr (K == Kind::I8) {
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(static_cast<int8_t>(row[d])) * s;
    } else {
      const float* table = fp8_e4m3_table();
      for (int64_t d = 0; d < D; ++d) out[d] = table[row[d]] * s;
    }
  }
}

struct Problem {
  const float* q;
  float* out;
  float* run_max;  // [T, H] running max of each query vector's scores
  float* run_sum;  // [T, H] running sum of its exponentials
  int64_t H, KVH, G, D;
  int64_t window;
};

// One chunk's share of a key range: its keys [r0, r0 + keys) in fp32, K transposed by 16-key tiles
// (kt: [tiles][D][16]) and V as rows (vf: [tiles * 16][D]) per kv head; positions past the context
// are zero (never weighted: every row's mask ends at its position).
struct RangeSlice {
  int64_t chunk, tiles;
  float* kt;  // kv head h at kt + h * tiles * D * 16
  float* vf;  // kv head h at vf + h * tiles * 16 * D
};

// A query vector: one head of one row, its (pre-scaled) q and its output row, its running max and sum
// across ranges, and the keys it sees, [lo, pos] (pos: its position).
struct QueryVec {
  const float* q;
  float* o;
  float* m;
  float* l;
  int64_t pos, lo;
};

// A pass's softmax state, local to it (so the compiler knows it aliases no output): per query vector
// the max its weights are taken against and the running sum of the weights, as 16 lane sums.
struct Softmax {
  float m[kMaxVectors];
  alignas(64) float l[kMaxVectors][kLanes];
};

// The max is raised only when a tile's scores exceed it by more than this (natural log units):
// weights up to e^20 stay far from fp32's range, and the exponentials need not wait for each
// tile's max (its horizontal reduction is off their path), nor the outputs be rescaled every tile.
constexpr float kRescaleMargin = 20.f;

// Scores, softmax and values of n query vectors against one 16-key tile at position kb, the plain
// loops (the compiler vectorizes the 16-lane ones): the path without AVX2, or with D % 8 != 0.
void tile_portable(const QueryVec* v, int n, const float* qt, const float* kt, const float* vf, int64_t kb,
                   int64_t D, Softmax& sm) {
  for (int j = 0; j < n; ++j) {
    float s[kLanes];
    for (int t = 0; t < kLanes; ++t) s[t] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float qd = qt[d * n + j];
      for (int t = 0; t < kLanes; ++t) s[t] += qd * kt[d * kLanes + t];
    }
    float bm = kNegBig;
    bool any = false;
    for (int t = 0; t < kLanes; ++t) {
      const int64_t key = kb + t;
      if (key < v[j].lo || key > v[j].pos) s[t] = kNegBig;
      else any = true, bm = std::max(bm, s[t]);
    }
    if (!any) continue;
    float* o = v[j].o;
    if (bm > sm.m[j] + kRescaleMargin) {
      const float alpha = std::exp(sm.m[j] - bm);
      for (int t = 0; t < kLanes; ++t) sm.l[j][t] *= alpha;
      for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
      sm.m[j] = bm;
    }
    float p[kLanes];
    for (int t = 0; t < kLanes; ++t) {
      const int64_t key = kb + t;
      p[t] = (key < v[j].lo || key > v[j].pos) ? 0.f : std::exp(s[t] - sm.m[j]);
      sm.l[j][t] += p[t];
    }
    for (int t = 0; t < kLanes; ++t) {
      if (p[t] == 0.f) continue;
      const float* vr = vf + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p[t] * vr[d];
    }
  }
}

// F<n>::run(args...) for a run-time count n of query vectors in 1..Max (F<1> below 1): the vector
// tiles are templates on their count, so that each keeps its accumulators in registers.
template <template <int> class F, int Max = kMaxVectors, typename... Args>
void with_count(int n, Args&&... args) {
  if constexpr (Max > 1)
    if (n < Max) return with_count<F, Max - 1>(n, args...);
  F<Max>::run(args...);
}

#if defined(__AVX512F__)
// The same for N query vectors with AVX-512 (D a multiple of 16): N score accumulators of 16 keys,
// each FMA taking its query value (qt: [D][N]) as an embedded broadcast; then per 16 output values
// N accumulators over the 16 keys, each value vector loaded once for all N queries.
// The scores of N query vectors against 16 keys, into s[N][16]. A function of its own: inlined into
// the softmax that follows, GCC kept half the accumulators on the stack (a store and a reload per FMA).
template <int N>
__attribute__((noinline)) void tile_scores(const float* qt, const float* kt, int64_t D, float (*s)[kLanes]) {
  __m512 acc[N];
#pragma GCC unroll 12
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * kLanes);
#pragma GCC unroll 12
    for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(qt[d * N + j]), k, acc[j]);
  }
#pragma GCC unroll 12
  for (int j = 0; j < N; ++j) _mm512_store_ps(s[j], acc[j]);
}

// o_j += the 16 weights p[j] times the 16 value rows, for N query vectors (noinline: see tile_scores).
template <int N>
__attribute__((noinline)) void tile_values(const QueryVec* v, const float (*p)[kLanes], const float* vf, int64_t D) {
  for (int64_t c = 0; c < D; c += 16) {
    __m512 o[N];
#pragma GCC unroll 12
    for (int j = 0; j < N; ++j) o[j] = _mm512_loadu_ps(v[j].o + c);
    for (int t = 0; t < kLanes; ++t) {
      const __m512 vt = _mm512_loadu_ps(vf + t * D + c);
#pragma GCC unroll 12
      for (int j = 0; j < N; ++j) o[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j][t]), vt, o[j]);
    }
#pragma GCC unroll 12
    for (int j = 0; j < N; ++j) _mm512_storeu_ps(v[j].o + c, o[j]);
  }
}

template <int N>
void tile_avx512(const QueryVec* v, const float* qt, const float* kt, const float* vf, int64_t kb, int64_t D,
                 Softmax& sm) {
  alignas(64) float p[N][kLanes];
  tile_scores<N>(qt, kt, D, p);  // the scores, then the weights in their place
  const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(kb)),
                                        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
#pragma GCC unroll 12
  for (int j = 0; j < N; ++j) {
    const __mmask16 valid = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(v[j].pos))) &
                            _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(v[j].lo)));
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegBig), valid, _mm512_load_ps(p[j]));
    __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(sm.m[j]))));
    const float bm = _mm512_reduce_max_ps(s);
    if (valid && bm > sm.m[j] + kRescaleMargin) {  // rare: the first tile a query sees, a jump in scores
      const __m512 alpha = _mm512_set1_ps(std::exp(sm.m[j] - bm));
      _mm512_store_ps(sm.l[j], _mm512_mul_ps(alpha, _mm512_load_ps(sm.l[j])));
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(v[j].o + c, _mm512_mul_ps(alpha, _mm512_loadu_ps(v[j].o + c)));
      sm.m[j] = bm;
      e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(bm))));
    }
    _mm512_store_ps(sm.l[j], _mm512_add_ps(e, _mm512_load_ps(sm.l[j])));
    _mm512_store_ps(p[j], e);
  }
  tile_values<N>(v, p, vf, D);
}

template <int N>
struct Tile512 {
  static void run(const QueryVec* v, const float* qt, const float* kt, const float* vf, int64_t kb, int64_t D,
                  Softmax& sm) {
    tile_avx512<N>(v, qt, kt, vf, kb, D, sm);
  }
};

void tile_dispatch(const QueryVec* v, int n, const float* qt, const float* kt, const float* vf, int64_t kb,
                   int64_t D, Softmax& sm) {
  with_count<Tile512>(n, v, qt, kt, vf, kb, D, sm);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same with AVX2 (D a multiple of 8), 16 keys as two 8-lane halves. 16 registers hold the
// scores of at most six query vectors (two accumulators each, two key loads, a broadcast), so a
// pass's n vectors take their scores six at a time over the same tile (its K is in L1 by then).
// Without it, the plain loops above ran each query vector alone with libm's expf per key: on an
// AVX2-only EPYC that was ~18% of a `ferry serve` run at concurrency 16 (BENCHMARKS.md, issue 15).
constexpr int kScoreVectors8 = 6;

template <int N>
__attribute__((noinline)) void tile_scores8(const float* qt, int n, const float* kt, int64_t D, float (*s)[kLanes]) {
  __m256 lo[N], hi[N];
#pragma GCC unroll 6
  for (int j = 0; j < N; ++j) lo[j] = _mm256_setzero_ps(), hi[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kLanes), k1 = _mm256_loadu_ps(kt + d * kLanes + 8);
#pragma GCC unroll 6
    for (int j = 0; j < N; ++j) {
      const __m256 qd = _mm256_broadcast_ss(qt + d * n + j);
      lo[j] = _mm256_fmadd_ps(qd, k0, lo[j]);
      hi[j] = _mm256_fmadd_ps(qd, k1, hi[j]);
    }
  }
#pragma GCC unroll 6
  for (int j = 0; j < N; ++j) _mm256_store_ps(s[j], lo[j]), _mm256_store_ps(s[j] + 8, hi[j]);
}

// o_j += the 16 weights p[j] times the 16 value rows, 8 output values at a time, for N <= 12 query
// vectors (N accumulators, the value vector and a broadcast).
template <int N>
__attribute__((noinline)) void tile_values8(const QueryVec* v, const float (*p)[kLanes], const float* vf, int64_t D) {
  for (int64_t c = 0; c < D; c += 8) {
    __m256 o[N];
#pragma GCC unroll 12
    for (int j = 0; j < N; ++j) o[j] = _mm256_loadu_ps(v[j].o + c);
    for (int t = 0; t < kLanes; ++t) {
      const __m256 vt = _mm256_loadu_ps(vf + t * D + c);
#pragma GCC unroll 12
      for (int j = 0; j < N; ++j) o[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[j][t]), vt, o[j]);
    }
#pragma GCC unroll 12
    for (int j = 0; j < N; ++j) _mm256_storeu_ps(v[j].o + c, o[j]);
  }
}

template <int N>
struct Scores8 {
  static void run(const float* qt, int n, const float* kt, int64_t D, float (*s)[kLanes]) { tile_scores8<N>(qt, n, kt, D, s); }
};

template <int N>
struct Values8 {
  static void run(const QueryVec* v, const float (*p)[kLanes], const float* vf, int64_t D) { tile_values8<N>(v, p, vf, D); }
};

inline float max_of16(__m256 a, __m256 b) {
  __m256 m = _mm256_max_ps(a, b);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// One tile for n query vectors: scores (six vectors at a time), the masked online softmax as in
// tile_avx512, then the values.
void tile_avx2(const QueryVec* v, int n, const float* qt, const float* kt, const float* vf, int64_t kb, int64_t D,
               Softmax& sm) {
  alignas(64) float p[kMaxVectors][kLanes];
  for (int j0 = 0; j0 < n; j0 += kScoreVectors8)
    with_count<Scores8, kScoreVectors8>(std::min(kScoreVectors8, n - j0), qt + j0, n, kt, D, p + j0);
  const __m256i keys0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(kb)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i keys1 = _mm256_add_epi32(keys0, _mm256_set1_epi32(8));
  const __m256 neg = _mm256_set1_ps(kNegBig);
  for (int j = 0; j < n; ++j) {
    // valid: lo <= key <= pos, as all-ones lanes
    const __m256i pos = _mm256_set1_epi32(static_cast<int32_t>(v[j].pos));
    const __m256i lom1 = _mm256_set1_epi32(static_cast<int32_t>(v[j].lo) - 1);
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(keys0, pos), _mm256_cmpgt_epi32(keys0, lom1)));
    const __m256 valid1 = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(keys1, pos), _mm256_cmpgt_epi32(keys1, lom1)));
    const bool any = _mm256_movemask_ps(_mm256_or_ps(valid0, valid1)) != 0;
    const __m256 s0 = _mm256_blendv_ps(neg, _mm256_load_ps(p[j]), valid0);
    const __m256 s1 = _mm256_blendv_ps(neg, _mm256_load_ps(p[j] + 8), valid1);
    float m = sm.m[j];
    const float bm = max_of16(s0, s1);
    if (any && bm > m + kRescaleMargin) {  // rare: the first tile a query sees, a jump in scores
      const float a = std::exp(m - bm);
      const __m256 alpha = _mm256_set1_ps(a);
      _mm256_store_ps(sm.l[j], _mm256_mul_ps(alpha, _mm256_load_ps(sm.l[j])));
      _mm256_store_ps(sm.l[j] + 8, _mm256_mul_ps(alpha, _mm256_load_ps(sm.l[j] + 8)));
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(v[j].o + c, _mm256_mul_ps(alpha, _mm256_loadu_ps(v[j].o + c)));
      sm.m[j] = m = bm;
    }
    const __m256 mv = _mm256_set1_ps(m);
    const __m256 e0 = _mm256_and_ps(valid0, exp_nonpositive(_mm256_sub_ps(s0, mv)));
    const __m256 e1 = _mm256_and_ps(valid1, exp_nonpositive(_mm256_sub_ps(s1, mv)));
    _mm256_store_ps(sm.l[j], _mm256_add_ps(e0, _mm256_load_ps(sm.l[j])));
    _mm256_store_ps(sm.l[j] + 8, _mm256_add_ps(e1, _mm256_load_ps(sm.l[j] + 8)));
    _mm256_store_ps(p[j], e0);
    _mm256_store_ps(p[j] + 8, e1);
  }
  with_count<Values8>(n, v, p, vf, D);
}
#endif

// n (<= kMaxVectors) query vectors over the key tiles of one range slice that any of them sees.
void attend_slice(const QueryVec* v, int n, const RangeSlice& slice, int64_t h, int64_t r0, int64_t D) {
  alignas(64) float qbuf[kMaxVectors * 256];
  std::vector<float> big;
  float* q = qbuf;
  if (D > 256) big.resize(kMaxVectors * D), q = big.data();
  Softmax sm;
  int64_t lo = v[0].lo, hi = v[0].pos;
  for (int j = 0; j < n; ++j) {  // q transposed, [D][n]: a pass's query values for one d side by side
    for (int64_t d = 0; d < D; ++d) q[d * n + j] = v[j].q[d];
    lo = std::min(lo, v[j].lo), hi = std::max(hi, v[j].pos);
    sm.m[j] = *v[j].m;
    sm.l[j][0] = *v[j].l;
    for (int t = 1; t < kLanes; ++t) sm.l[j][t] = 0.f;
  }
  const int64_t first = std::max<int64_t>(0, (lo - r0) / kLanes);
  const int64_t last = std::min<int64_t>(slice.tiles, (hi - r0) / kLanes + 1);  // exclusive
  const float* kt = slice.kt + h * slice.tiles * D * kLanes;
  const float* vf = slice.vf + h * slice.tiles * kLanes * D;
  for (int64_t t = first; t < last; ++t) {
    const int64_t kb = r0 + t * kLanes;
#if defined(__AVX512F__)
    if (D % 16 == 0) {
      tile_dispatch(v, n, q, kt + t * D * kLanes, vf + t * kLanes * D, kb, D, sm);
      continue;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
      tile_avx2(v, n, q, kt + t * D * kLanes, vf + t * kLanes * D, kb, D, sm);
      continue;
    }
#endif
    tile_portable(v, n, q, kt + t * D * kLanes, vf + t * kLanes * D, kb, D, sm);
  }
  for (int j = 0; j < n; ++j) {
    float l = 0.f;
    for (int t = 0; t < kLanes; ++t) l += sm.l[j][t];
    *v[j].m = sm.m[j];
    *v[j].l = l;
  }
}

template <Kind K>
void run(const Problem& pb, const uint8_t* kc, const uint8_t* vc, int64_t BS, int64_t row_bytes,
         const int64_t* tables, int64_t MAXB, const int64_t* spans, int64_t C) {
  const int64_t D = pb.D, KVH = pb.KVH, G = pb.G, H = pb.H;
  int64_t max_ctx = 0;
  for (int64_t c = 0; c < C; ++c) max_ctx = std::max(max_ctx, spans[3 * c + 2]);
  // Query vectors per task: whole rows of G heads, up to kMaxVectors (one row when G exceeds it).
  const int64_t rows_per_task = std::max<int64_t>(1, kMaxVectors / G);
  const int nthreads = at::get_num_threads();
  std::vector<float> scratch;
  for (int64_t r0 = 0; r0 < max_ctx; r0 += kRangeKeys) {
    const int64_t r1 = r0 + kRangeKeys;
    // The chunks with a row that sees a key of [r0, r1), and the tiles of the range each holds.
    std::vector<RangeSlice> slices;
    std::vector<std::pair<int64_t, int64_t>> rows;  // per slice, the rows [i0, i1) that see the range
    int64_t floats = 0;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t len = spans[3 * c + 1], ctx = spans[3 * c + 2], begin = ctx - len;
      if (len <= 0 || ctx <= r0) continue;
      // Row i (position begin + i) sees the range iff begin + i >= r0 and its first key is below r1.
      const int64_t i0 = std::max<int64_t>(0, r0 - begin);
      int64_t i1 = len;
      if (pb.window > 0) i1 = std::min(len, std::max<int64_t>(0, r1 - 1 + pb.window - begin));
      if (i0 >= i1) continue;
      const int64_t tiles = (std::min(r1, ctx) - r0 + kLanes - 1) / kLanes;
      slices.push_back({c, tiles, nullptr, nullptr});
      rows.emplace_back(i0, i1);
      floats += 2 * KVH * tiles * kLanes * D;
    }
    if (slices.empty()) continue;
    scratch.resize(floats);
    int64_t at = 0;
    std::vector<int64_t> tile_start(slices.size() + 1, 0);  // (slice, head, tile) tasks, flattened
    for (size_t s = 0; s < slices.size(); ++s) {
      slices[s].kt = scratch.data() + at;
      slices[s].vf = slices[s].kt + KVH * slices[s].tiles * kLanes * D;
      at += 2 * KVH * slices[s].tiles * kLanes * D;
      tile_start[s + 1] = tile_start[s] + KVH * slices[s].tiles;
    }
    // Dequantize the range: K transposed per tile, V as rows.
    at::parallel_for(0, tile_start.back(), 1, [&](int64_t a, int64_t b) {
      std::vector<float> row(D);
      std::vector<uint8_t> packed(D + 4);  // a quantized cache's row, gathered
      for (int64_t task = a; task < b; ++task) {
        const size_t s = std::upper_bound(tile_start.begin(), tile_start.end(), task) - tile_start.begin() - 1;
        const RangeSlice& sl = slices[s];
        const int64_t h = (task - tile_start[s]) / sl.tiles, t = (task - tile_start[s]) % sl.tiles;
        const int64_t ctx = spans[3 * sl.chunk + 2];
        const int64_t* table = tables + sl.chunk * MAXB;
        float* kt = sl.kt + (h * sl.tiles + t) * D * kLanes;
        float* vf = sl.vf + (h * sl.tiles + t) * kLanes * D;
        for (int64_t l = 0; l < kLanes; ++l) {
          const int64_t pos = r0 + t * kLanes + l;
          if (pos >= ctx) {
            for (int64_t d = 0; d < D; ++d) kt[d * kLanes + l] = 0.f;
            std::memset(vf + l * D, 0, D * sizeof(float));
            continue;
          }
          if constexpr (K == Kind::I8 || K == Kind::F8) {  // rows gathered from the blocks' layout
            const int64_t head = kv_head_offset(table[pos / BS], h, BS, KVH, row_bytes);
            kv_gather_row(kc + head, KvLayout::Keys, pos % BS, BS, D, packed.data());
            row_to_f32<K>(packed.data(), D, row.data());
            for (int64_t d = 0; d < D; ++d) kt[d * kLanes + l] = row[d];
            kv_gather_row(vc + head, KvLayout::Values, pos % BS, BS, D, packed.data());
            row_to_f32<K>(packed.data(), D, vf + l * D);
            continue;
          }
          const int64_t slot = table[pos / BS] * BS + pos % BS;
          const int64_t off = (slot * KVH + h) * row_bytes;
          row_to_f32<K>(kc + off, D, row.data());
          for (int64_t d = 0; d < D; ++d) kt[d * kLanes + l] = row[d];
          row_to_f32<K>(vc + off, D, vf + l * D);
        }
      }
    });
    // Attend: tasks of (slice, kv head, rows), the later rows (more keys) claimed first.
    struct Task {
      int64_t slice, h, i0, i1;
    };
    std::vector<Task> tasks;
    for (size_t s = 0; s < slices.size(); ++s)
      for (int64_t h = 0; h < KVH; ++h)
        for (int64_t i1 = rows[s].second; i1 > rows[s].first; i1 -= rows_per_task)
          tasks.push_back({static_cast<int64_t>(s), h, std::max(rows[s].first, i1 - rows_per_task), i1});
    std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) {
      return spans[3 * slices[x.slice].chunk + 2] - spans[3 * slices[x.slice].chunk + 1] + x.i1 >
             spans[3 * slices[y.slice].chunk + 2] - spans[3 * slices[y.slice].chunk + 1] + y.i1;
    });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      QueryVec vecs[kMaxVectors];
      for (int64_t k; (k = next.fetch_add(1)) < static_cast<int64_t>(tasks.size());) {
        const Task& task = tasks[k];
        const RangeSlice& sl = slices[task.slice];
        const int64_t row0 = spans[3 * sl.chunk], len = spans[3 * sl.chunk + 1], ctx = spans[3 * sl.chunk + 2];
        int n = 0;
        for (int64_t i = task.i0; i < task.i1; ++i) {
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = task.h * G + g, pos = ctx - len + i;
            const int64_t idx = (row0 + i) * H + head;
            vecs[n++] = {pb.q + idx * D, pb.out + idx * D, pb.run_max + idx, pb.run_sum + idx, pos,
                         pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0};
            if (n == kMaxVectors) attend_slice(vecs, n, sl, task.h, r0, D), n = 0;
          }
        }
        if (n) attend_slice(vecs, n, sl, task.h, r0, D);
      }
    });
  }
}

}  // namespace

void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                             at::Tensor spans, double scale, int64_t window, at::Tensor out) {
  TORCH_CHECK(q.dtype() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(out.dtype() == at::kFloat && out.sizes() == q.sizes() && out.is_contiguous(), "out must be like q");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() && k_cache.sizes() == v_cache.sizes(), "k and v caches must match");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: contiguous [NB, BS, KVH, W]");
  TORCH_CHECK(tables.dtype() == at::kLong && tables.dim() == 2, "tables must be int64 [C, MAXB]");
  TORCH_CHECK(spans.dtype() == at::kLong && spans.dim() == 2 && spans.size(1) == 3 && spans.size(0) == tables.size(0),
              "spans must be int64 [C, 3] (first row, rows, context length)");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of kv heads");
  const auto dt = k_cache.scalar_type();
  const bool quantized = dt == at::ScalarType::Char || dt == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(k_cache.size(3) == D + (quantized ? 4 : 0), "cache rows must be head_dim wide (+4: a scale)");
  TORCH_CHECK(!quantized || BS % 2 == 0, "a quantized cache's block size must be even (kv_layout.h)");
  auto tb = tables.contiguous();
  auto sp = spans.contiguous();
  const int64_t C = sp.size(0), MAXB = tb.size(1);
  const int64_t* spp = sp.data_ptr<int64_t>();
  const int64_t* tbp = tb.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) {
    const int64_t row0 = spp[3 * c], len = spp[3 * c + 1], ctx = spp[3 * c + 2];
    TORCH_CHECK(len >= 0 && row0 >= 0 && row0 + len <= T && ctx >= len, "chunk ", c, ": span outside q or context");
    TORCH_CHECK(ctx <= MAXB * BS, "chunk ", c, ": context longer than its table");
    for (int64_t b = 0; b < (ctx + BS - 1) / BS; ++b)
      TORCH_CHECK(tbp[c * MAXB + b] >= 0 && tbp[c * MAXB + b] < NB, "chunk ", c, ": block id out of range");
  }
  // Running max and sum per (row, head); the outputs accumulate unnormalized in out.
  auto run_max = at::full({T, H}, kNegBig, q.options());
  auto run_sum = at::zeros({T, H}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) std::memset(op + spp[3 * c] * H * D, 0, spp[3 * c + 1] * H * D * sizeof(float));
  // q pre-scaled (a copy: q is the caller's), so the scores need no multiply.
  auto qs = q.mul(static_cast<float>(scale));
  const Problem pb{qs.data_ptr<float>(), op, run_max.data_ptr<float>(), run_sum.data_ptr<float>(), H, KVH, H / KVH, D,
                   window};
  const auto* kc = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vc = static_cast<const uint8_t*>(v_cache.data_ptr());
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  switch (dt) {
    case at::ScalarType::Float: run<Kind::F32>(pb, kc, vc, BS, row_bytes, tbp, MAXB, spp, C); break;
    case at::ScalarType::BFloat16: run<Kind::BF16>(pb, kc, vc, BS, row_bytes, tbp, MAXB, spp, C); break;
    case at::ScalarType::Char: run<Kind::I8>(pb, kc, vc, BS, row_bytes, tbp, MAXB, spp, C); break;
    case at::ScalarType::Float8_e4m3fn: run<Kind::F8>(pb, kc, vc, BS, row_bytes, tbp, MAXB, spp, C); break;
    default: TORCH_CHECK(false, "the cache must be float32, bfloat16, int8 or float8_e4m3fn");
  }
  const float* ls = run_sum.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    const int64_t row0 = spp[3 * c], len = spp[3 * c + 1];
    at::parallel_for(row0 * H, (row0 + len) * H, 64, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const float inv = ls[i] > 0.f ? 1.f / ls[i] : 0.f;
        for (int64_t d = 0; d < D; ++d) op[i * D + d] *= inv;
      }
    });
  }
}
