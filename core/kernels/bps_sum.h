/* Summation and scaling over a whole buffer: the kernel picked for the dtype and this CPU, on one
 * thread or split over the pool's. */
#ifndef BPS_SUM_H_
#define BPS_SUM_H_

#include "core/kernels/bps_half_simd.h"
#include "core/kernels/bps_pool.h"

/* Below this many bytes a single thread is faster: waking sleeping helpers costs ~10-20 us,
 * and one core already sums a cache-resident buffer in well under that.
 * Measured with bench/bench_sum.py (see docs/benchmarks.md). */
#define BPS_PAR_MIN_BYTES_DEFAULT (512 * 1024)

/* sum_many works on blocks of this many elements so the partial sum stays in L1/L2. */
#define BPS_BLOCK_ELEMS 2048

static size_t bps_par_min_bytes = BPS_PAR_MIN_BYTES_DEFAULT;

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

#endif /* BPS_SUM_H_ */
