/* Copies: split over the pool's threads, streamed past the cache, or divided on the way (an average). */
#ifndef BPS_COPY_H_
#define BPS_COPY_H_

#include "core/kernels/bps_sum.h"


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

#endif /* BPS_COPY_H_ */
