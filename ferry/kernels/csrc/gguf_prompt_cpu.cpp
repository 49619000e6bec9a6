// GGUF int8 dots for a prompt's many rows: the interleaved groups (Q4_0X8, Q4_1X8, Q8_0X8) tiled.
//
// gguf_dot_rows (gguf_quant_cpu.cpp) takes a weight group by group, all M activation rows against
// each group, and writes each row's 8 outputs of the group. With a prompt's M in the hundreds its
// [M, N] output is written 8 columns at a time for all M rows, rows N x 4 bytes apart, and every
// row's store missed the cache (300 rows: about a tenth of a 300-token prefill stalled on those
// stores). Here a thread's groups go in chunks of about kChunkBytes of weights, each chunk swept
// once per block of kRowBlock activation rows: a block's rows of a chunk's columns stay in L2, and
// so do the chunk's weights between blocks (still read from memory once).
//
// Its own translation unit so that the group kernels, which gguf_kernels.h gives internal linkage,
// are inlined here and in the decode loop independently (see gguf_kernels.h).
#include "gguf_kernels.h"

namespace {

constexpr int64_t kChunkBytes = 256 * 1024;  // a quarter of a Zen 5 or recent Xeon core's L2

template <int T>
void dot_groups_tiled(const int8_t* qx, const float* dy, const float* sy, int64_t M, int64_t K, const uint8_t* w,
                      int64_t n0, int64_t n1, float* y, int64_t ldy, int64_t row_bytes) {
  const int64_t nb = K / 32;
  const int64_t chunk_groups = std::max<int64_t>(1, kChunkBytes / (kGroup * row_bytes));
  const uint8_t* end = w + (n1 + kGroup - 1) / kGroup * kGroup * row_bytes;
  const int8_t* yr[kGroupRows];
  const float *dr[kGroupRows], *sr[kGroupRows];
  for (int64_t c0 = n0; c0 < n1; c0 = (c0 / kGroup + chunk_groups) * kGroup) {
    const int64_t c1 = std::min(n1, (c0 / kGroup + chunk_groups) * kGroup);
    for (int64_t mb = 0; mb < M; mb += kPromptRowBlock) {
      const int64_t me = std::min(M, mb + kPromptRowBlock);
      for (int64_t n = c0; n < c1;) {
        const int64_t g0 = n / kGroup * kGroup;
        const uint8_t* group = w + g0 * row_bytes;
        if (mb == 0) prefetch_ahead(group, kGroup * row_bytes, end);  // the first block reads the chunk from memory
        for (int64_t m = mb; m < me; m += kGroupRows) {
          const int R = int(std::min<int64_t>(kGroupRows, me - m));
          for (int r = 0; r < R; ++r) yr[r] = qx + (m + r) * K, dr[r] = dy + (m + r) * nb, sr[r] = sy + (m + r) * nb;
          float out[kGroupRows * kGroup];
          dot_group<T>(R, group, nb, yr, dr, sr, out);
          if (g0 >= n && g0 + kGroup <= c1) {  // a whole group: each row's 8 outputs in one store
            for (int r = 0; r < R; ++r) std::memcpy(y + (m + r) * ldy + g0, out + r * kGroup, kGroup * sizeof(float));
          } else {
            for (int64_t i = std::max(n, g0); i < std::min(c1, g0 + kGroup); ++i)
              for (int r = 0; r < R; ++r) y[(m + r) * ldy + i] = out[r * kGroup + (i - g0)];
          }
        }
        n = g0 + kGroup;
      }
    }
  }
}

}  // namespace

namespace ferry_cpu {

// gguf_quant_cpu.cpp
void gguf_dot_rows(const int8_t* qx, const float* dy, const float* sy, int64_t M, int64_t K, const uint8_t* w,
                   int64_t N, int64_t qtype, int64_t n0, int64_t n1, float* y, int64_t ldy, const uint8_t* then,
                   int64_t then_bytes);

// Output rows [n0, n1) of y = x @ dequant(w).T for M activation rows quantized by quantize_q8_rows,
// as gguf_dot_rows computes them (the same per-row bits: a row is always computed with its whole
// group, by the same kernel): a prompt's rows of whole interleaved groups through the tiles, every
// other row through gguf_dot_rows. The branch lives here, not in gguf_dot_rows: a call added to
// that loop cost batch-1 decode ~25% (weights streamed from memory, both builds in one process),
// through register allocation and layout alone, since decode rows never took the branch.
// [then, then + then_bytes): where the calling thread reads next (its rows of the step's next weight),
// prefetched as these rows end (WeightStream); none: nullptr.
void gguf_matmul_rows(const int8_t* qx, const float* dy, const float* sy, int64_t M, int64_t K, const uint8_t* w,
                      int64_t N, int64_t qtype, int64_t n0, int64_t n1, float* y, int64_t ldy, const uint8_t* then,
                      int64_t then_bytes) {
  const int64_t grouped = is_x8(qtype) ? N / kGroup * kGroup : 0;
  if (M > kPromptRowBlock && n0 < grouped) {
    const Layout L = layout_of(qtype);
    const int64_t row_bytes = K / L.block * L.bytes, end = std::min(n1, grouped);
    if (qtype == Q4_1X8) dot_groups_tiled<Q4_1>(qx, dy, sy, M, K, w, n0, end, y, ldy, row_bytes);
    else if (qtype == Q8_0X8) dot_groups_tiled<Q8_0>(qx, dy, sy, M, K, w, n0, end, y, ldy, row_bytes);
    else dot_groups_tiled<Q4_0>(qx, dy, sy, M, K, w, n0, end, y, ldy, row_bytes);
    n0 = end;
  }
  if (n0 < n1) gguf_dot_rows(qx, dy, sy, M, K, w, N, qtype, n0, n1, y, ldy, then, then_bytes);
}

}  // namespace ferry_cpu
