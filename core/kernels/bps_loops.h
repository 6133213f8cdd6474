/* The portable and AVX2/AVX-512 loops of dst += src and buf *= factor for each native type, and the
 * portable fp16/bf16 ones (widened to fp32, rounded once). */
#ifndef BPS_LOOPS_H_
#define BPS_LOOPS_H_

#include "core/kernels/bps_dtypes.h"


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

#endif /* BPS_LOOPS_H_ */
