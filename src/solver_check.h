/* Validation shared by every solver backend (src/solver.c, cuda/solve.cu):
 * the same checks, statuses and messages on the CPU and the GPU. */
#ifndef BK_SOLVER_CHECK_H
#define BK_SOLVER_CHECK_H

#include <stdint.h>

#include "bakron/solver.h"

#ifdef __cplusplus
extern "C" {
#endif

bk_status bk_solve_check_opts(const bk_solve_opts *o);
/* Shapes, dtype, which inputs are given. A (or LA) may be absent only for
 * the rtn algorithm (no Hessian: no statistics). */
bk_status bk_solve_check_problem(const bk_solve_problem *p, const bk_solve_opts *o, const char *lw,
                                 const char *la, const char *lb);
/* NaN / Inf anywhere in a rows x cols array of dtype dt. */
bk_status bk_solve_check_finite(const void *p, bk_dtype dt, int64_t rows, int64_t cols,
                                const char *label);

#ifdef __cplusplus
}
#endif
#endif
