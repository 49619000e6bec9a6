// The 256 values of an fp8 e4m3fn byte as floats, shared by the CPU attention kernels that read an
// fp8 KV cache (a byte's value by table lookup, then times its row's scale).
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <vector>

// c10's conversion, the one torch (and so ferry/kv_quant.py's reference) uses; e4m3fn has no
// infinities, and 0x7f / 0xff are NaN, which a quantized row never stores.
inline const float* fp8_e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}
