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

/* Below this many bytes a single thread is faster: waking the OpenMP team costs ~10-20 us,
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
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; t++) {
    size_t b, e;
    bps_chunk(n, nt, t, &b, &e);
    if (e > b) f((char *)dst + b * isz, (const char *)src + b * isz, e - b);
  }
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
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; t++) {
    size_t b, e;
    bps_chunk(n, nt, t, &b, &e);
    if (e > b) bps_sum_many_range(dst, srcs, nsrc, b, e, dtype);
  }
  return 0;
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
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; t++) {
    size_t b, e;
    bps_chunk(n, nt, t, &b, &e);
    if (e > b) f((char *)buf + b * isz, factor, e - b);
  }
  return 0;
}

static inline void bps_copy(void *dst, const void *src, size_t nbytes, int nthreads) {
  int nt = bps_threads_for(nbytes, nthreads);
  if (nt == 1) {
    memcpy(dst, src, nbytes);
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; t++) {
    size_t b, e;
    bps_chunk(nbytes, nt, t, &b, &e);
    if (e > b) memcpy((char *)dst + b, (const char *)src + b, e - b);
  }
}

#endif /* BPS_REDUCE_H_ */
