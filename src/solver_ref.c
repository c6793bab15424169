/* The CPU reference solvers: solver_tmpl.h instantiated for float and double. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "solver_impl.h"
#include "util.h"

#define BK_CAT_(a, b) a##b
#define BK_CAT(a, b) BK_CAT_(a, b)

/* Defaults measured on the 2-core development machine (docs/BENCHMARKS.md). */
bk_bakron_tuning bk_bakron_tune = {
    .leaf_width = 8,
    .min_block = 16,
    .max_block = 256,
    .block_div = 8,
    .chunk = 128,
};

#define REAL float
#define SUF _f
#define Q_APPLY bk_q_apply_f
#define GEMM cblas_sgemm
#define GER cblas_sger
#define AXPY cblas_saxpy
#define TRMM cblas_strmm
#define POTRF LAPACKE_spotrf
#define TRTRI LAPACKE_strtri
#include "solver_tmpl.h" /* (undefines its parameters) */

#define REAL double
#define SUF _d
#define Q_APPLY bk_q_apply_d
#define GEMM cblas_dgemm
#define GER cblas_dger
#define AXPY cblas_daxpy
#define TRMM cblas_dtrmm
#define POTRF LAPACKE_dpotrf
#define TRTRI LAPACKE_dtrtri
#include "solver_tmpl.h" /* (undefines its parameters) */
