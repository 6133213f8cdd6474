/* Elementwise summation kernels for byteps.core._reduce.
 *
 * Everything is `static inline` (or static) so the one Cython translation unit that includes this
 * header can call it nogil. The wheel is built for baseline x86-64, so the wide paths are separate
 * functions compiled with __attribute__((target(...))) and picked at run time (bps_cpu_init()).
 *
 * dtype codes must match core/dtypes.py.
 */
#ifndef BPS_REDUCE_H_
#define BPS_REDUCE_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) || defined(__clang__)
#define BPS_X86 1
#include <immintrin.h>
#endif
#endif

#define BPS_FLOAT32 0
#define BPS_FLOAT64 1
#define BPS_FLOAT16 2
#define BPS_BFLOAT16 3
#define BPS_INT32 4
#define BPS_INT64 5
#define BPS_UINT8 6
#define BPS_INT8 7
#define BPS_NUM_DTYPES 8

/* Below this many bytes a single thread is faster: waking sleeping helpers costs ~10-20 us,
 * and one core already sums a cache-resident buffer in well under that.
 * Measured with bench/bench_sum.py (see docs/benchmarks.md). */
#define BPS_PAR_MIN_BYTES_DEFAULT (512 * 1024)

/* sum_many works on blocks of this many elements so the partial sum stays in L1/L2. */
#define BPS_BLOCK_ELEMS 2048

static size_t bps_par_min_bytes = BPS_PAR_MIN_BYTES_DEFAULT;

static inline int bps_itemsize(int dtype) {
  static const int sizes[BPS_NUM_DTYPES] = {4, 8, 2, 2, 4, 8, 1, 1};
  return (dtype >= 0 && dtype < BPS_NUM_DTYPES) ? sizes[dtype] : -1;
}

static inline const char *bps_dtype_name(int dtype) {
  static const char *names[BPS_NUM_DTYPES] = {"float32", "float64", "float16", "bfloat16",
                                               "int32",   "int64",   "uint8",   "int8"};
  return (dtype >= 0 && dtype < BPS_NUM_DTYPES) ? names[dtype] : "unknown";
}

/* ------------------------------------------------------------------------------------------ */
/* Run-time CPU dispatch                                                                        */

static int bps_use_avx2 = 0;      /* fp32/fp64/int loops and bf16 (integer) conversions */
static int bps_use_f16c = 0;      /* fp16 conversions; only used together with AVX2 */
static int bps_use_avx512 = 0;    /* avx512f+bw: wider bf16/fp16 paths */
static int bps_has_avx512bf16 = 0; /* detected only: VCVTNEPS2BF16 flushes subnormals, so unused */

static inline void bps_cpu_init(void) {
#ifdef BPS_X86
  __builtin_cpu_init();
  bps_use_avx2 = __builtin_cpu_supports("avx2") != 0;
  bps_use_f16c = bps_use_avx2 && __builtin_cpu_supports("f16c") != 0;
  bps_use_avx512 =
      bps_use_f16c && __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0;
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
  bps_has_avx512bf16 = __builtin_cpu_supports("avx512bf16") != 0;
#endif
#endif
}

/* For tests: level 0 = portable scalar code, 1 = up to AVX2/F16C, 2 = everything available. */
static inline void bps_set_simd_level(int level) {
  bps_cpu_init();
  if (level < 2) bps_use_avx512 = 0;
  if (level < 1) bps_use_avx2 = bps_use_f16c = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar half-precision conversions (portable fallback; the SIMD paths give the same bits)     */

static inline uint32_t bps_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bps_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bps_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bps_u2f(sign | 0x7f800000u | (man << 13)); /* Inf / NaN */
  if (exp == 0) {                                                      /* zero / subnormal */
    float v = (float)man * 5.9604644775390625e-8f;                     /* man * 2^-24, exact */
    return bps_u2f(bps_f2u(v) | sign);
  }
  return bps_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round to nearest even, like VCVTPS2PH with _MM_FROUND_TO_NEAREST_INT (F. Giesen's method). */
static inline uint16_t bps_f32_to_f16(float f) {
  uint32_t u = bps_f2u(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= 0x47800000u) { /* >= 65536: Inf, or NaN (kept quiet, top payload bits kept) */
    o = (u > 0x7f800000u) ? (uint16_t)(0x7e00u | ((u >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (u < 0x38800000u) { /* result is subnormal or zero: let the FPU round (RNE) */
    float v = bps_u2f(u) + 0.5f;
    o = (uint16_t)(bps_f2u(v) - 0x3f000000u);
  } else {
    uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd; /* rebias exponent (15-127)<<23 and round */
    o = (uint16_t)(u >> 13);
  }
  return (uint16_t)(o | (sign >> 16));
}

static inline float bps_bf16_to_f32(uint16_t h) { return bps_u2f((uint32_t)h << 16); }

/* Round to nearest even; a NaN must not be rounded (the carry could make it Inf), only quieted. */
static inline uint16_t bps_f32_to_bf16(float f) {
  uint32_t u = bps_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------------------------------ */
/* Native-type loops: portable, AVX2 and AVX-512 copies of the same source; -O3 vectorises.
 * Integers use unsigned types: wrap-around is defined for them and gives two's complement. */

typedef void (*bps_add_fn)(void *dst, const void *src, size_t n);
typedef void (*bps_scale_fn)(void *buf, double factor, size_t n);

#ifdef BPS_X86
#define BPS_AVX2 __attribute__((target("avx2,f16c,fma")))
#define BPS_AVX512 __attribute__((target("avx2,f16c,fma,avx512f,avx512bw")))
#endif

/* Scalar head until dst is 64-byte aligned: vector stores that straddle cache lines are slow,
 * and numpy's large buffers start 16 bytes into a page. */
#define BPS_ADD_BODY(T)                                                     \
  {                                                                         \
    T *d = (T *)dst;                                                        \
    const T *s = (const T *)src;                                            \
    size_t i = 0, head = ((64 - ((uintptr_t)d & 63)) & 63) / sizeof(T);     \
    if ((uintptr_t)d % sizeof(T)) head = 0;                                 \
    if (head > n) head = n;                                                 \
    for (; i < head; i++) d[i] = (T)(d[i] + s[i]);                          \
    d += i;                                                                 \
    s += i;                                                                 \
    n -= i;                                                                 \
    for (i = 0; i < n; i++) d[i] = (T)(d[i] + s[i]);                        \
  }

#define BPS_DEF_ADD(NAME, T)                                               \
  static void bps_add_##NAME(void *dst, const void *src, size_t n) BPS_ADD_BODY(T)

#ifdef BPS_X86
#define BPS_DEF_ADD_AVX2(NAME, T) \
  BPS_AVX2 static void bps_add_##NAME##_avx2(void *dst, const void *src, size_t n) BPS_ADD_BODY(T)
#define BPS_DEF_ADD_AVX512(NAME, T)                                                     \
  __attribute__((target("avx2,avx512f,avx512bw,prefer-vector-width=512"))) static void      \
      bps_add_##NAME##_avx512(void *dst, const void *src, size_t n) BPS_ADD_BODY(T)
#else
#define BPS_DEF_ADD_AVX2(NAME, T)
#define BPS_DEF_ADD_AVX512(NAME, T)
#endif

BPS_DEF_ADD(f32, float)
BPS_DEF_ADD(f64, double)
BPS_DEF_ADD(u32, uint32_t)
BPS_DEF_ADD(u64, uint64_t)
BPS_DEF_ADD(u8, uint8_t)
BPS_DEF_ADD_AVX2(f32, float)
BPS_DEF_ADD_AVX2(f64, double)
BPS_DEF_ADD_AVX2(u32, uint32_t)
BPS_DEF_ADD_AVX2(u64, uint64_t)
BPS_DEF_ADD_AVX2(u8, uint8_t)
BPS_DEF_ADD_AVX512(f32, float)
BPS_DEF_ADD_AVX512(f64, double)
BPS_DEF_ADD_AVX512(u32, uint32_t)
BPS_DEF_ADD_AVX512(u64, uint64_t)
BPS_DEF_ADD_AVX512(u8, uint8_t)

static void bps_scale_f32(void *buf, double factor, size_t n) {
  float *p = (float *)buf, f = (float)factor;
  for (size_t i = 0; i < n; i++) p[i] *= f;
}
static void bps_scale_f64(void *buf, double factor, size_t n) {
  double *p = (double *)buf;
  for (size_t i = 0; i < n; i++) p[i] *= factor;
}

/* x + y, returning x's NaN (quieted) when x is NaN, as x86 and numpy do; C leaves it open. */
static inline float bps_addf(float x, float y) {
  return (x != x) ? bps_u2f(bps_f2u(x) | 0x400000u) : x + y;
}

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16, portable scalar                                                                 */

#define BPS_DEF_HALF_SCALAR(H)                                                           \
  static void bps_add_##H(void *dst, const void *src, size_t n) {                        \
    uint16_t *d = (uint16_t *)dst;                                                       \
    const uint16_t *s = (const uint16_t *)src;                                           \
    for (size_t i = 0; i < n; i++)                                                       \
      d[i] = bps_f32_to_##H(bps_addf(bps_##H##_to_f32(d[i]), bps_##H##_to_f32(s[i])));   \
  }                                                                                      \
  static void bps_scale_##H(void *buf, double factor, size_t n) {                        \
    uint16_t *d = (uint16_t *)buf;                                                       \
    float f = (float)factor;                                                             \
    for (size_t i = 0; i < n; i++) d[i] = bps_f32_to_##H(bps_##H##_to_f32(d[i]) * f);   \
  }                                                                                      \
  static void bps_load_##H(float *acc, const void *src, size_t n) {                      \
    const uint16_t *s = (const uint16_t *)src;                                           \
    for (size_t i = 0; i < n; i++) acc[i] = bps_##H##_to_f32(s[i]);                      \
  }                                                                                      \
  static void bps_accum_##H(float *acc, const void *src, size_t n) {                     \
    const uint16_t *s = (const uint16_t *)src;                                           \
    for (size_t i = 0; i < n; i++) acc[i] = bps_addf(acc[i], bps_##H##_to_f32(s[i]));     \
  }                                                                                      \
  static void bps_store_##H(void *dst, const float *acc, size_t n) {                     \
    uint16_t *d = (uint16_t *)dst;                                                       \
    for (size_t i = 0; i < n; i++) d[i] = bps_f32_to_##H(acc[i]);                        \
  }

BPS_DEF_HALF_SCALAR(f16)
BPS_DEF_HALF_SCALAR(bf16)

typedef void (*bps_load_fn)(float *acc, const void *src, size_t n);
typedef void (*bps_store_fn)(void *dst, const float *acc, size_t n);

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

/* ------------------------------------------------------------------------------------------ */
/* Kernel selection                                                                             */

static inline bps_add_fn bps_pick_add(int dtype) {
#ifdef BPS_X86
  if (bps_use_avx512) {
    if (dtype == BPS_FLOAT16) return bps_add_f16_avx512;
    if (dtype == BPS_BFLOAT16) return bps_add_bf16_avx512;
    switch (dtype) {
      case BPS_FLOAT32: return bps_add_f32_avx512;
      case BPS_FLOAT64: return bps_add_f64_avx512;
      case BPS_INT32: return bps_add_u32_avx512;
      case BPS_INT64: return bps_add_u64_avx512;
      case BPS_UINT8: case BPS_INT8: return bps_add_u8_avx512;
      default: break;
    }
  }
  if (bps_use_avx2) {
    switch (dtype) {
      case BPS_FLOAT32: return bps_add_f32_avx2;
      case BPS_FLOAT64: return bps_add_f64_avx2;
      case BPS_FLOAT16: return bps_use_f16c ? bps_add_f16_avx2 : bps_add_f16;
      case BPS_BFLOAT16: return bps_add_bf16_avx2;
      case BPS_INT32: return bps_add_u32_avx2;
      case BPS_INT64: return bps_add_u64_avx2;
      case BPS_UINT8: case BPS_INT8: return bps_add_u8_avx2;
      default: return NULL;
    }
  }
#endif
  switch (dtype) {
    case BPS_FLOAT32: return bps_add_f32;
    case BPS_FLOAT64: return bps_add_f64;
    case BPS_FLOAT16: return bps_add_f16;
    case BPS_BFLOAT16: return bps_add_bf16;
    case BPS_INT32: return bps_add_u32;
    case BPS_INT64: return bps_add_u64;
    case BPS_UINT8: case BPS_INT8: return bps_add_u8;
    default: return NULL;
  }
}

static inline bps_scale_fn bps_pick_scale(int dtype) {
  switch (dtype) {
    case BPS_FLOAT32: return bps_scale_f32;
    case BPS_FLOAT64: return bps_scale_f64;
#ifdef BPS_X86
    case BPS_FLOAT16: return bps_use_f16c ? bps_scale_f16_avx2 : bps_scale_f16;
    case BPS_BFLOAT16: return bps_use_avx2 ? bps_scale_bf16_avx2 : bps_scale_bf16;
#else
    case BPS_FLOAT16: return bps_scale_f16;
    case BPS_BFLOAT16: return bps_scale_bf16;
#endif
    default: return NULL;
  }
}

/* Half types in sum_many: widen to an fp32 block, accumulate, round once. */
static inline void bps_pick_half(int dtype, bps_load_fn *load, bps_load_fn *accum, bps_store_fn *store) {
#ifdef BPS_X86
  if (bps_use_avx512) {
    if (dtype == BPS_FLOAT16) {
      *load = bps_load_f16_avx512; *accum = bps_accum_f16_avx512; *store = bps_store_f16_avx512;
    } else {
      *load = bps_load_bf16_avx512; *accum = bps_accum_bf16_avx512; *store = bps_store_bf16_avx512;
    }
    return;
  }
  if (dtype == BPS_FLOAT16 && bps_use_f16c) {
    *load = bps_load_f16_avx2; *accum = bps_accum_f16_avx2; *store = bps_store_f16_avx2;
    return;
  }
  if (dtype == BPS_BFLOAT16 && bps_use_avx2) {
    *load = bps_load_bf16_avx2; *accum = bps_accum_bf16_avx2; *store = bps_store_bf16_avx2;
    return;
  }
#endif
  if (dtype == BPS_FLOAT16) {
    *load = bps_load_f16; *accum = bps_accum_f16; *store = bps_store_f16;
  } else {
    *load = bps_load_bf16; *accum = bps_accum_bf16; *store = bps_store_bf16;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Thread pool: helpers that sleep (never spin) between calls.
 *
 * The kernels used OpenMP before. libgomp's idle threads spin for up to GOMP_SPINCOUNT iterations
 * (about a millisecond) after every parallel region and read their wait policy from the
 * environment once, when the library loads: on a small host that spin took the core the engine's
 * network thread needed (a 64 MB push_pull went from about 20 ms with one thread to 45-71 ms with
 * two on a 2-core host). These helpers block on a condition variable instead, so an idle helper
 * costs nothing, and a call that finds the pool busy (another thread of the process is summing)
 * runs on its own thread rather than queueing: then the cores are busy anyway.
 *
 * One pool per shared object that includes this header (each is `static`); helpers are started
 * on first use, named "byteps-sum", and are not inherited by a fork()ed child (the child starts
 * its own when it needs them).                                                                  */

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#define BPS_MAX_THREADS 64

typedef void (*bps_job_fn)(void *arg, int t, int nt);

typedef struct {
  pthread_mutex_t busy;   /* held by the one caller whose job the helpers run */
  pthread_mutex_t mu;     /* guards the fields below */
  pthread_cond_t wake;    /* helpers wait here for a new generation */
  pthread_cond_t done;    /* the caller waits here for remaining == 0 */
  int started;            /* helper threads running (thread t = 1 .. started) */
  unsigned long gen;      /* bumped for every job */
  bps_job_fn fn;
  void *arg;
  int nt;                 /* threads of the current job, caller included */
  int remaining;          /* helpers still to finish the current job */
  int atfork;             /* pthread_atfork registered */
} bps_pool_t;

static bps_pool_t bps_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                              PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0};

typedef struct {
  int t;
  unsigned long gen0;
} bps_helper_arg;

static void bps_pool_after_fork_child(void) {
  /* only the forking thread exists in the child: no helper, nothing held */
  pthread_mutex_init(&bps_pool.busy, NULL);
  pthread_mutex_init(&bps_pool.mu, NULL);
  pthread_cond_init(&bps_pool.wake, NULL);
  pthread_cond_init(&bps_pool.done, NULL);
  bps_pool.started = 0;
  bps_pool.remaining = 0;
}

static void *bps_pool_main(void *p) {
  bps_helper_arg a = *(bps_helper_arg *)p;
  free(p);
#if defined(__linux__) && defined(_GNU_SOURCE)
  pthread_setname_np(pthread_self(), "byteps-sum");
#endif
  unsigned long seen = a.gen0;
  pthread_mutex_lock(&bps_pool.mu);
  for (;;) {
    while (bps_pool.gen == seen) pthread_cond_wait(&bps_pool.wake, &bps_pool.mu);
    seen = bps_pool.gen;
    if (a.t >= bps_pool.nt) continue;  /* a job for fewer threads than are started */
    bps_job_fn fn = bps_pool.fn;
    void *arg = bps_pool.arg;
    int nt = bps_pool.nt;
    pthread_mutex_unlock(&bps_pool.mu);
    fn(arg, a.t, nt);
    pthread_mutex_lock(&bps_pool.mu);
    if (--bps_pool.remaining == 0) pthread_cond_signal(&bps_pool.done);
  }
  return NULL;
}

/* Start helpers until `want` run (or creation fails); returns how many run. Caller holds busy. */
static int bps_pool_grow(int want) {
  if (!bps_pool.atfork) {
    pthread_atfork(NULL, NULL, bps_pool_after_fork_child);
    bps_pool.atfork = 1;
  }
  while (bps_pool.started < want) {
    bps_helper_arg *a = (bps_helper_arg *)malloc(sizeof(bps_helper_arg));
    if (a == NULL) break;
    a->t = bps_pool.started + 1;
    a->gen0 = bps_pool.gen; /* stable: only a caller holding busy bumps it */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024); /* the kernels use a few KB (BPS_BLOCK_ELEMS floats) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* helpers inherit a full mask: signals go to other threads */
    pthread_t th;
    int rc = pthread_create(&th, &attr, bps_pool_main, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      free(a);
      break;
    }
    bps_pool.started++;
  }
  return bps_pool.started;
}

/* Run fn(arg, t, nt) for t = 0 .. nt-1, t = 0 on the calling thread; returns when all are done.
 * If another thread is using the pool, runs fn(arg, 0, 1) (the whole range) on this thread. */
static void bps_parallel(bps_job_fn fn, void *arg, int nt) {
  if (nt > BPS_MAX_THREADS) nt = BPS_MAX_THREADS;
  if (nt <= 1 || pthread_mutex_trylock(&bps_pool.busy) != 0) {
    fn(arg, 0, 1);
    return;
  }
  int have = bps_pool_grow(nt - 1) + 1;
  if (nt > have) nt = have;
  if (nt <= 1) {
    pthread_mutex_unlock(&bps_pool.busy);
    fn(arg, 0, 1);
    return;
  }
  pthread_mutex_lock(&bps_pool.mu);
  bps_pool.fn = fn;
  bps_pool.arg = arg;
  bps_pool.nt = nt;
  bps_pool.remaining = nt - 1;
  bps_pool.gen++;
  pthread_cond_broadcast(&bps_pool.wake);
  pthread_mutex_unlock(&bps_pool.mu);
  fn(arg, 0, nt);
  pthread_mutex_lock(&bps_pool.mu);
  while (bps_pool.remaining > 0) pthread_cond_wait(&bps_pool.done, &bps_pool.mu);
  pthread_mutex_unlock(&bps_pool.mu);
  pthread_mutex_unlock(&bps_pool.busy);
}

/* ------------------------------------------------------------------------------------------ */
/* Drivers: split [0, n) into one contiguous chunk per thread, each a whole number of
 * 64-element groups so no two threads write the same cache line.                               */

static inline int bps_threads_for(size_t nbytes, int nthreads) {
  return (nthreads > 1 && nbytes >= bps_par_min_bytes) ? nthreads : 1;
}

static inline void bps_chunk(size_t n, int nt, int t, size_t *b, size_t *e) {
  size_t per = ((n + (size_t)nt - 1) / (size_t)nt + 63) & ~(size_t)63;
  size_t lo = per * (size_t)t;
  *b = lo < n ? lo : n;
  *e = (lo + per) < n ? (lo + per) : n;
}

typedef struct {
  void *dst;
  const void *src;
  const void *const *srcs;
  int nsrc;
  size_t n;       /* elements (bytes for copy) */
  size_t isz;
  int dtype;
  double factor;
  bps_add_fn add;
  bps_scale_fn scale;
} bps_job;

static void bps_job_add(void *p, int t, int nt) {
  bps_job *j = (bps_job *)p;
  size_t b, e;
  bps_chunk(j->n, nt, t, &b, &e);
  if (e > b) j->add((char *)j->dst + b * j->isz, (const char *)j->src + b * j->isz, e - b);
}

/* dst[i] += src[i] for n elements. Returns -1 for an unknown dtype. */
static inline int bps_sum_into(void *dst, const void *src, size_t n, int dtype, int nthreads) {
  bps_add_fn f = bps_pick_add(dtype);
  if (f == NULL) return -1;
  size_t isz = (size_t)bps_itemsize(dtype);
  int nt = bps_threads_for(n * isz, nthreads);
  if (nt == 1) {
    f(dst, src, n);
    return 0;
  }
  bps_job j = {dst, src, NULL, 0, n, isz, dtype, 0.0, f, NULL};
  bps_parallel(bps_job_add, &j, nt);
  return 0;
}

/* One thread's share of sum_many: elements [b, e). */
static inline void bps_sum_many_range(void *dst, const void *const *srcs, int nsrc, size_t b, size_t e,
                                      int dtype) {
  size_t isz = (size_t)bps_itemsize(dtype);
  char *d = (char *)dst;
  if ((dtype == BPS_FLOAT16 || dtype == BPS_BFLOAT16) && nsrc > 1) {
    bps_load_fn load, accum;
    bps_store_fn store;
    float acc[BPS_BLOCK_ELEMS];
    bps_pick_half(dtype, &load, &accum, &store);
    for (size_t lo = b; lo < e; lo += BPS_BLOCK_ELEMS) {
      size_t m = (e - lo) < BPS_BLOCK_ELEMS ? (e - lo) : BPS_BLOCK_ELEMS;
      load(acc, (const char *)srcs[0] + lo * isz, m);
      for (int k = 1; k < nsrc; k++) accum(acc, (const char *)srcs[k] + lo * isz, m);
      store(d + lo * isz, acc, m);
    }
    return;
  }
  bps_add_fn add = bps_pick_add(dtype);
  /* Block so dst stays cache-resident while each source is added: one pass over memory. */
  size_t blk = (size_t)(BPS_BLOCK_ELEMS * 4) / isz;
  for (size_t lo = b; lo < e; lo += blk) {
    size_t m = (e - lo) < blk ? (e - lo) : blk;
    const char *s0 = (const char *)srcs[0] + lo * isz;
    if (s0 != d + lo * isz) memcpy(d + lo * isz, s0, m * isz);
    for (int k = 1; k < nsrc; k++) add(d + lo * isz, (const char *)srcs[k] + lo * isz, m);
  }
}

static void bps_job_sum_many(void *p, int t, int nt) {
  bps_job *j = (bps_job *)p;
  size_t b, e;
  bps_chunk(j->n, nt, t, &b, &e);
  if (e > b) bps_sum_many_range(j->dst, j->srcs, j->nsrc, b, e, j->dtype);
}

/* dst = srcs[0] + ... + srcs[nsrc-1] (dst may be srcs[0]). Returns -1 for an unknown dtype. */
static inline int bps_sum_many(void *dst, const void *const *srcs, int nsrc, size_t n, int dtype,
                               int nthreads) {
  if (bps_pick_add(dtype) == NULL) return -1;
  if (nsrc < 1 || n == 0) return 0;
  int nt = bps_threads_for(n * (size_t)bps_itemsize(dtype) * (size_t)nsrc, nthreads);
  if (nt == 1) {
    bps_sum_many_range(dst, srcs, nsrc, 0, n, dtype);
    return 0;
  }
  bps_job j = {dst, NULL, srcs, nsrc, n, (size_t)bps_itemsize(dtype), dtype, 0.0, NULL, NULL};
  bps_parallel(bps_job_sum_many, &j, nt);
  return 0;
}

static void bps_job_scale(void *p, int t, int nt) {
  bps_job *j = (bps_job *)p;
  size_t b, e;
  bps_chunk(j->n, nt, t, &b, &e);
  if (e > b) j->scale((char *)j->dst + b * j->isz, j->factor, e - b);
}

/* buf[i] *= factor for float dtypes (fp16/bf16 in fp32, rounded once). -1 for other dtypes. */
static inline int bps_scale(void *buf, double factor, size_t n, int dtype, int nthreads) {
  bps_scale_fn f = bps_pick_scale(dtype);
  if (f == NULL) return -1;
  size_t isz = (size_t)bps_itemsize(dtype);
  int nt = bps_threads_for(n * isz, nthreads);
  if (nt == 1) {
    f(buf, factor, n);
    return 0;
  }
  bps_job j = {buf, NULL, NULL, 0, n, isz, dtype, factor, NULL, f};
  bps_parallel(bps_job_scale, &j, nt);
  return 0;
}

static void bps_job_copy(void *p, int t, int nt) {
  bps_job *j = (bps_job *)p;
  size_t b, e;
  bps_chunk(j->n, nt, t, &b, &e);
  if (e > b) memcpy((char *)j->dst + b, (const char *)j->src + b, e - b);
}

static inline void bps_copy(void *dst, const void *src, size_t nbytes, int nthreads) {
  int nt = bps_threads_for(nbytes, nthreads);
  if (nt == 1) {
    memcpy(dst, src, nbytes);
    return;
  }
  bps_job j = {dst, src, NULL, 0, nbytes, 1, 0, 0.0, NULL, NULL};
  bps_parallel(bps_job_copy, &j, nt);
}

/* A copy whose destination this core does not read again soon: a result into the caller's tensor, or a
 * partition staged in shared memory, which a server or the machine's owner reads next on another core,
 * after other partitions have gone through the cache. From 1 MB on, non-temporal stores write it without
 * first reading every destination line into the cache, as a plain copy does (docs/benchmarks.md,
 * "Result copies"). */
#define BPS_STREAM_MIN_BYTES (1u << 20)

static inline void bps_copy_stream(void *dst, const void *src, size_t nbytes) {
#if defined(BPS_X86) && defined(__SSE2__)
  if (nbytes >= BPS_STREAM_MIN_BYTES) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* the stores need a 16-byte aligned destination */
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= nbytes; i += 64) {
      __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
      __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
      __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
      __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
      _mm_stream_si128((__m128i *)(d + i), a);
      _mm_stream_si128((__m128i *)(d + i + 16), b);
      _mm_stream_si128((__m128i *)(d + i + 32), c);
      _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    _mm_sfence(); /* the stores are visible before whoever is told the copy is done reads them */
    memcpy(d + i, s + i, nbytes - i);
    return;
  }
#endif
  memcpy(dst, src, nbytes);
}

/* dst[i] = src[i] / divisor for float dtypes (dst may be src): an average, folded into the copy of the
 * sum into the caller's tensor so that it costs no pass of its own. A true division, as torch's div_
 * does it (fp16/bf16 widened to fp32 and rounded once), so the result is bit-identical to dividing
 * afterwards. -1 for other dtypes (integers are floor-divided by the caller). */
static inline int bps_divide_copy(void *dst, const void *src, size_t n, int dtype, uint32_t divisor) {
  switch (dtype) {
    case BPS_FLOAT32: {
      float d = (float)divisor, *o = (float *)dst;
      const float *s = (const float *)src;
      for (size_t i = 0; i < n; i++) o[i] = s[i] / d;
      return 0;
    }
    case BPS_FLOAT64: {
      double d = (double)divisor, *o = (double *)dst;
      const double *s = (const double *)src;
      for (size_t i = 0; i < n; i++) o[i] = s[i] / d;
      return 0;
    }
    case BPS_FLOAT16:
    case BPS_BFLOAT16: {
      float d = (float)divisor;
      uint16_t *o = (uint16_t *)dst;
      const uint16_t *s = (const uint16_t *)src;
      if (dtype == BPS_FLOAT16)
        for (size_t i = 0; i < n; i++) o[i] = bps_f32_to_f16(bps_f16_to_f32(s[i]) / d);
      else
        for (size_t i = 0; i < n; i++) o[i] = bps_f32_to_bf16(bps_bf16_to_f32(s[i]) / d);
      return 0;
    }
    default: return -1;
  }
}

static inline int bps_divides(int dtype) { return dtype >= BPS_FLOAT32 && dtype <= BPS_BFLOAT16; }

/* bps_copy_stream on one thread, or bps_copy's threads when it uses several. */
static inline void bps_copy_streamed(void *dst, const void *src, size_t nbytes, int nthreads) {
  if (bps_threads_for(nbytes, nthreads) > 1)
    bps_copy(dst, src, nbytes, nthreads);
  else
    bps_copy_stream(dst, src, nbytes);
}

#endif /* BPS_REDUCE_H_ */
