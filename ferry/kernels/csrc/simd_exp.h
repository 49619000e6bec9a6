// e^x for x <= 0 in 16 AVX-512 lanes, shared by the CPU attention kernels (a softmax's s - max).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// 2^n e^r with n = round(x log2 e) and |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), inline. -ffast-math turned std::exp into calls to libmvec's 16-wide
// expf, around which every live vector register was spilled.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // e^-87 ~ 1.6e-38, still normal; a row's sum is >= 1
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts: n ln2_hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 e = _mm512_set1_ps(1.f / 720);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(e, n);
}
#endif
