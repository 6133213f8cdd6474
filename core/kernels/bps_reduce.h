/* Elementwise summation, scaling and copy kernels with run-time SIMD dispatch, for byteps.core._reduce
 * and the native cores: every piece, in order (each header also includes what it needs). */
#ifndef BPS_REDUCE_H_
#define BPS_REDUCE_H_

#include "core/kernels/bps_dtypes.h"    /* dtype codes, CPU dispatch, scalar fp16/bf16 conversions */
#include "core/kernels/bps_loops.h"     /* dst += src and buf *= factor per native type, portable fp16/bf16 */
#include "core/kernels/bps_half_simd.h" /* fp16/bf16 on AVX2 and AVX-512 */
#include "core/kernels/bps_pool.h"      /* the helpers that sleep between calls */
#include "core/kernels/bps_sum.h"       /* sum_into, sum_many, scale: kernel selection and threads */
#include "core/kernels/bps_copy.h"      /* copy, copy_stream, divide_copy */

#endif /* BPS_REDUCE_H_ */
