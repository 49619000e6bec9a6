// Where a quantized KV cache keeps each value and scale: the block layout of ferry/kv_quant.py.
// A cache is [NB, BS, KVH, W] bytes (W = D + 4), but head h's part of block b is the BS * W bytes
// from (b * KVH + h) * BS * W: its values, then BS fp32 scales in token order. K's values are
// [D/2][BS][2] (token t's values 2p, 2p + 1 side by side, token after token), V's [BS/2][D][2]
// (tokens 2j, 2j + 1's value d side by side); MLA's latent cache stays rows ([BS][KVH][W]).
#pragma once

#include <cstdint>
#include <cstring>

enum class KvLayout : int64_t { Rows = 0, Keys = 1, Values = 2 };

// The first byte of head h's part of block `block`.
inline int64_t kv_head_offset(int64_t block, int64_t h, int64_t BS, int64_t KVH, int64_t W) {
  return (block * KVH + h) * BS * W;
}

// The byte of token t's scale within a head's part.
inline int64_t kv_scale_offset(int64_t t, int64_t BS, int64_t D) { return D * BS + 4 * t; }

// Token t's row of a head's part (Keys or Values) as quantize_rows packs it: D values, then the scale.
inline void kv_gather_row(const uint8_t* head, KvLayout layout, int64_t t, int64_t BS, int64_t D, uint8_t* row) {
  if (layout == KvLayout::Keys) {
    const uint8_t* p = head + t * 2;
    for (int64_t i = 0; i < D / 2; ++i) std::memcpy(row + 2 * i, p + i * BS * 2, 2);
  } else {
    const uint8_t* p = head + (t >> 1) * D * 2 + (t & 1);
    for (int64_t d = 0; d < D; ++d) row[d] = p[2 * d];
  }
  std::memcpy(row + D, head + kv_scale_offset(t, BS, D), 4);
}

// kv_gather_row's inverse: a packed row into token t of a head's part.
inline void kv_scatter_row(uint8_t* head, KvLayout layout, int64_t t, int64_t BS, int64_t D, const uint8_t* row) {
  if (layout == KvLayout::Keys) {
    uint8_t* p = head + t * 2;
    for (int64_t i = 0; i < D / 2; ++i) std::memcpy(p + i * BS * 2, row + 2 * i, 2);
  } else {
    uint8_t* p = head + (t >> 1) * D * 2 + (t & 1);
    for (int64_t d = 0; d < D; ++d) p[2 * d] = row[d];
  }
  std::memcpy(head + kv_scale_offset(t, BS, D), row + D, 4);
}
