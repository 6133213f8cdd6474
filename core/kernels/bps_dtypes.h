/* dtype codes, run-time CPU dispatch and the scalar fp16/bf16 conversions of the summation kernels.
 *
 * Everything is `static inline` (or static) so the one Cython translation unit that includes this
 * header can call it nogil. The wheel is built for baseline x86-64, so the wide paths are separate
 * functions compiled with __attribute__((target(...))) and picked at run time (bps_cpu_init()).
 *
 * dtype codes must match core/dtypes.py.
 */
#ifndef BPS_DTYPES_H_
#define BPS_DTYPES_H_

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

#endif /* BPS_DTYPES_H_ */
