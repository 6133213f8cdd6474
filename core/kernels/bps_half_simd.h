/* fp16 / bf16 sums and conversions on AVX2 (+F16C) and AVX-512: the same bits as the portable
 * loops of bps_loops.h, NaN payloads included. */
#ifndef BPS_HALF_SIMD_H_
#define BPS_HALF_SIMD_H_

#include "core/kernels/bps_loops.h"

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16, AVX2 (+F16C): 8 lanes of fp32 per vector. Tails go through an 8-element
 * scratch buffer so that every element takes the same code path (same bits, NaN payloads). */

#ifdef BPS_X86
/* Elements (uint16) before p reaches an `align`-byte boundary: a 64-byte vector store that
 * straddles two cache lines costs about twice as much (numpy buffers are often 16-aligned). */
static inline size_t bps_peel(const uint16_t *p, size_t align, size_t n) {
  size_t k = ((align - ((uintptr_t)p & (align - 1))) & (align - 1)) / 2;
  return k < n ? k : n;
}

/* a + b with `a` pinned as the first operand: when both are NaN, x86 returns the first one
 * (quieted). The compiler may otherwise commute the add; numpy returns dst's NaN. */
BPS_AVX2 static inline __m256 bps_add8(__m256 a, __m256 b) {
  __m256 r;
  __asm__("vaddps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}
BPS_AVX2 static inline __m256 bps_ld8_f16(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
BPS_AVX2 static inline void bps_st8_f16(uint16_t *p, __m256 v) {
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
BPS_AVX2 static inline __m256 bps_ld8_bf16(const uint16_t *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
/* fp32 -> bf16 bits in the low half of each 32-bit lane (round to nearest even, NaN quieted). */
BPS_AVX2 static inline __m256i bps_round8_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(r, q, nan), 16);
}
BPS_AVX2 static inline void bps_st8_bf16(uint16_t *p, __m256 v) {
  __m256i r = bps_round8_bf16(v);
  /* values are < 0x10000, so the unsigned saturating pack is exact */
  __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128((__m128i *)p, h);
}

#define BPS_DEF_HALF_ADD_AVX2(H)                                                         \
  BPS_AVX2 static void bps_add_##H##_avx2(void *dst, const void *src, size_t n) {        \
    uint16_t *d = (uint16_t *)dst;                                                       \
    const uint16_t *s = (const uint16_t *)src;                                           \
    size_t i = 0;                                                                        \
    for (; i + 16 <= n; i += 16) {                                                       \
      __m256 a = bps_add8(bps_ld8_##H(d + i), bps_ld8_##H(s + i));                  \
      __m256 b = bps_add8(bps_ld8_##H(d + i + 8), bps_ld8_##H(s + i + 8));          \
      bps_st8_##H(d + i, a);                                                             \
      bps_st8_##H(d + i + 8, b);                                                         \
    }                                                                                    \
    for (; i + 8 <= n; i += 8)                                                           \
      bps_st8_##H(d + i, bps_add8(bps_ld8_##H(d + i), bps_ld8_##H(s + i)));         \
    if (i < n) {                                                                         \
      uint16_t td[8] = {0}, ts[8] = {0};                                                 \
      memcpy(td, d + i, (n - i) * 2);                                                    \
      memcpy(ts, s + i, (n - i) * 2);                                                    \
      bps_st8_##H(td, bps_add8(bps_ld8_##H(td), bps_ld8_##H(ts)));                  \
      memcpy(d + i, td, (n - i) * 2);                                                    \
    }                                                                                    \
  }

#define BPS_DEF_HALF_AVX2(H)                                                             \
  BPS_AVX2 static void bps_scale_##H##_avx2(void *buf, double factor, size_t n) {        \
    uint16_t *d = (uint16_t *)buf;                                                       \
    __m256 f = _mm256_set1_ps((float)factor);                                            \
    size_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8) bps_st8_##H(d + i, _mm256_mul_ps(bps_ld8_##H(d + i), f)); \
    if (i < n) {                                                                         \
      uint16_t t[8] = {0};                                                               \
      memcpy(t, d + i, (n - i) * 2);                                                     \
      bps_st8_##H(t, _mm256_mul_ps(bps_ld8_##H(t), f));                                  \
      memcpy(d + i, t, (n - i) * 2);                                                     \
    }                                                                                    \
  }                                                                                      \
  BPS_AVX2 static void bps_load_##H##_avx2(float *acc, const void *src, size_t n) {      \
    const uint16_t *s = (const uint16_t *)src;                                           \
    size_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, bps_ld8_##H(s + i));            \
    if (i < n) {                                                                         \
      uint16_t t[8] = {0};                                                               \
      float f[8];                                                                        \
      memcpy(t, s + i, (n - i) * 2);                                                     \
      _mm256_storeu_ps(f, bps_ld8_##H(t));                                               \
      memcpy(acc + i, f, (n - i) * 4);                                                   \
    }                                                                                    \
  }                                                                                      \
  BPS_AVX2 static void bps_accum_##H##_avx2(float *acc, const void *src, size_t n) {     \
    const uint16_t *s = (const uint16_t *)src;                                           \
    size_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8)                                                           \
      _mm256_storeu_ps(acc + i, bps_add8(_mm256_loadu_ps(acc + i), bps_ld8_##H(s + i))); \
    if (i < n) {                                                                         \
      uint16_t t[8] = {0};                                                               \
      float f[8];                                                                        \
      memcpy(t, s + i, (n - i) * 2);                                                     \
      _mm256_storeu_ps(f, bps_ld8_##H(t));                                               \
      for (size_t j = 0; i + j < n; j++) acc[i + j] = bps_addf(acc[i + j], f[j]);        \
    }                                                                                    \
  }                                                                                      \
  BPS_AVX2 static void bps_store_##H##_avx2(void *dst, const float *acc, size_t n) {     \
    uint16_t *d = (uint16_t *)dst;                                                       \
    size_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8) bps_st8_##H(d + i, _mm256_loadu_ps(acc + i));             \
    if (i < n) {                                                                         \
      uint16_t t[8];                                                                     \
      float f[8] = {0};                                                                  \
      memcpy(f, acc + i, (n - i) * 4);                                                   \
      bps_st8_##H(t, _mm256_loadu_ps(f));                                                \
      memcpy(d + i, t, (n - i) * 2);                                                     \
    }                                                                                    \
  }

BPS_DEF_HALF_ADD_AVX2(f16)
BPS_DEF_HALF_AVX2(f16)
BPS_DEF_HALF_AVX2(bf16)

/* bf16 values widened to fp32 have 16 zero low bits, and x86 arithmetic on them returns either
 * a number or one of their NaNs (quieted) or the default NaN, all with zero low bits. Rounding
 * then never carries out of a NaN, so sums need no NaN test (scale keeps it: its factor is
 * arbitrary). */
BPS_AVX2 static inline __m256i bps_round8_bf16_sum(__m256i u) {
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_set1_epi32(0x7fff));
  return _mm256_srli_epi32(_mm256_add_epi32(u, odd), 16);
}

/* 16 bf16 at a time. unpack{lo,hi}(0, x) widens to fp32 in a lane-interleaved order that
 * packus_epi32 undoes, so no cross-lane shuffles are needed. */
BPS_AVX2 static void bps_add_bf16_avx2(void *dst, const void *src, size_t n) {
  uint16_t *d = (uint16_t *)dst;
  const uint16_t *s = (const uint16_t *)src;
  const __m256i z = _mm256_setzero_si256();
  size_t i = n >= 32 ? bps_peel(d, 32, n) : 0;
  if (i) bps_add_bf16_avx2(d, s, i); /* < 16 elements: no peel, scratch-buffer path */
  for (; i + 16 <= n; i += 16) {
    __m256i dv = _mm256_loadu_si256((const __m256i *)(d + i));
    __m256i sv = _mm256_loadu_si256((const __m256i *)(s + i));
    __m256 lo = bps_add8(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, dv)),
                         _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, sv)));
    __m256 hi = bps_add8(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, dv)),
                         _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, sv)));
    __m256i r = _mm256_packus_epi32(bps_round8_bf16_sum(_mm256_castps_si256(lo)),
                                    bps_round8_bf16_sum(_mm256_castps_si256(hi)));
    _mm256_storeu_si256((__m256i *)(d + i), r);
  }
  if (i < n) {
    uint16_t td[16] = {0}, ts[16] = {0};
    memcpy(td, d + i, (n - i) * 2);
    memcpy(ts, s + i, (n - i) * 2);
    bps_add_bf16_avx2(td, ts, 16);
    memcpy(d + i, td, (n - i) * 2);
  }
}

/* AVX-512: same algorithms, 32 halves per iteration; the last < 32 go to the AVX2 code. */
BPS_AVX512 static inline __m512 bps_add16(__m512 a, __m512 b) {
  __m512 r;
  __asm__("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}

BPS_AVX512 static void bps_add_f16_avx512(void *dst, const void *src, size_t n) {
  uint16_t *d = (uint16_t *)dst;
  const uint16_t *s = (const uint16_t *)src;
  size_t i = bps_peel(d, 64, n);
  if (i) bps_add_f16_avx2(d, s, i);
  for (; i + 32 <= n; i += 32) {
    __m512 a = bps_add16(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + i))),
                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
    __m512 b = bps_add16(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + i + 16))),
                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i + 16))));
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_si256((__m256i *)(d + i + 16), _mm512_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
  }
  if (i < n) bps_add_f16_avx2(d + i, s + i, n - i);
}

BPS_AVX512 static inline __m512i bps_round16_bf16_sum(__m512i u) {
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
  return _mm512_srli_epi32(_mm512_add_epi32(u, odd), 16);
}

BPS_AVX512 static void bps_add_bf16_avx512(void *dst, const void *src, size_t n) {
  uint16_t *d = (uint16_t *)dst;
  const uint16_t *s = (const uint16_t *)src;
  const __m512i z = _mm512_setzero_si512();
  size_t i = bps_peel(d, 64, n);
  if (i) bps_add_bf16_avx2(d, s, i);
  for (; i + 32 <= n; i += 32) {
    __m512i dv = _mm512_loadu_si512((const void *)(d + i));
    __m512i sv = _mm512_loadu_si512((const void *)(s + i));
    __m512 lo = bps_add16(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, dv)),
                          _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, sv)));
    __m512 hi = bps_add16(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, dv)),
                          _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, sv)));
    __m512i r = _mm512_packus_epi32(bps_round16_bf16_sum(_mm512_castps_si512(lo)),
                                    bps_round16_bf16_sum(_mm512_castps_si512(hi)));
    _mm512_storeu_si512((void *)(d + i), r);
  }
  if (i < n) bps_add_bf16_avx2(d + i, s + i, n - i);
}

/* sum_many's fp32 block helpers, 16 lanes; the last < 16 elements go to the AVX2 versions. */
BPS_AVX512 static inline __m512 bps_ld16_f16(const uint16_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
BPS_AVX512 static inline void bps_st16_f16(uint16_t *p, __m512 v) {
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
BPS_AVX512 static inline __m512 bps_ld16_bf16(const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
BPS_AVX512 static inline void bps_st16_bf16(uint16_t *p, __m512 v) { /* v: a sum of bf16 values */
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bps_round16_bf16_sum(_mm512_castps_si512(v))));
}

#define BPS_DEF_HALF_MANY_AVX512(H)                                                           \
  BPS_AVX512 static void bps_load_##H##_avx512(float *acc, const void *src, size_t n) {       \
    const uint16_t *s = (const uint16_t *)src;                                                \
    size_t i = 0;                                                                             \
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(acc + i, bps_ld16_##H(s + i));              \
    if (i < n) bps_load_##H##_avx2(acc + i, s + i, n - i);                                    \
  }                                                                                           \
  BPS_AVX512 static void bps_accum_##H##_avx512(float *acc, const void *src, size_t n) {      \
    const uint16_t *s = (const uint16_t *)src;                                                \
    size_t i = 0;                                                                             \
    for (; i + 16 <= n; i += 16)                                                              \
      _mm512_storeu_ps(acc + i, bps_add16(_mm512_loadu_ps(acc + i), bps_ld16_##H(s + i)));    \
    if (i < n) bps_accum_##H##_avx2(acc + i, s + i, n - i);                                   \
  }                                                                                           \
  BPS_AVX512 static void bps_store_##H##_avx512(void *dst, const float *acc, size_t n) {      \
    uint16_t *d = (uint16_t *)dst;                                                            \
    size_t i = 0;                                                                             \
    for (; i + 16 <= n; i += 16) bps_st16_##H(d + i, _mm512_loadu_ps(acc + i));               \
    if (i < n) bps_store_##H##_avx2(d + i, acc + i, n - i);                                   \
  }

BPS_DEF_HALF_MANY_AVX512(f16)
BPS_DEF_HALF_MANY_AVX512(bf16)
#endif /* BPS_X86 */

#endif /* BPS_HALF_SIMD_H_ */
