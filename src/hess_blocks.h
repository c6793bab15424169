/* Host logic shared by the CPU and CUDA Hessian accumulators (src/hessian.c,
 * cuda/hessian.cu): the assembly of a block-diagonal output factor from its
 * per-head blocks. */
#ifndef BK_HESS_BLOCKS_H
#define BK_HESS_BLOCKS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dst [m, m], m = heads * h: zero except the diagonal h x h block of every
 * head j, which is mul * sym(S) / div with S = blk + (j / rep) * blk_stride
 * (h x h doubles) and sym(S) = (S + S^T) / 2 (the sandwiches leave ~1 ulp of
 * asymmetry). rep > 1: the heads of a group share their group's block. mul
 * and div are both given so that callers scaling by a product and by a
 * quotient round as they always have (x * 1 and x / 1 are exact). */
void bk_hess_head_blocks(float *dst, const double *blk, int64_t blk_stride, int64_t heads,
                         int64_t rep, int64_t h, double mul, double div);

#ifdef __cplusplus
}
#endif
#endif
