// e^x for x <= 0 in 16 AVX-512 or 8 AVX2 lanes, shared by the CPU attention kernels (a softmax's s - max).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
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

#if defined(__AVX2__) && defined(__FMA__)
// The same operations in 8 lanes: 2^n (n >= -126, as x >= -87) is built in the
// exponent bits, and e^r times a power of two is exact as scalef's. Despite the name, x up to
// ~88 is fine (n <= 127): the prefill kernel's tiles pass s - max up to its rescale margin, 20.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 e = _mm256_set1_ps(1.f / 720);
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 120));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 24));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 6));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}
#endif
