/* Internal interface of the CPU solvers (solver.c <-> solver_ref.c).
 *
 * The numeric code is written once in solver_tmpl.h and instantiated for
 * float (suffix _f) and double (suffix _d) by solver_ref.c.
 */
#ifndef BK_SOLVER_IMPL_H
#define BK_SOLVER_IMPL_H

#include <stdint.h>

#include "bakron/solver.h"
#include "quant.h"

/* One solve of the core algorithm. All matrices row-major, of the working
 * precision REAL (float or double). */
typedef struct bk_core {
    bk_algorithm alg;
    int64_t m, n;
    void *W;          /* REAL [m, n]: the weights to round; destroyed (used as workspace) */
    const void *LA;   /* REAL [n, n]: Cholesky(A~^-1), unit diagonal, zeros above it */
    const void *LB;   /* REAL [m, m] likewise for B~, or NULL for the identity */
    bk_alphabet *alpha; /* fitted; GPTQ with refit_groups refits groups as it goes */
    int gptq_block;   /* GPTQ lazy batch width */
    const char *label; /* names W in errors */
    int16_t *codes;   /* out [m, n] */
    float *weight;    /* out [m, n]: dequantized values */
    bk_q_counts counts; /* out */
} bk_core;

bk_status bk_core_solve_f(bk_core *c);
bk_status bk_core_solve_d(bk_core *c);

/* In place: X (REAL [n, n], symmetric positive definite, only the lower
 * triangle is read) becomes L = Cholesky(X^-1) with columns divided by their
 * diagonal (unit diagonal, zeros above). diag[j] receives the diagonal of the
 * unnormalized L (so RevCholesky(X)_jj = 1 / diag[j]). Returns 0 on success,
 * or which LAPACK step failed: 1 = Cholesky of X, 2 = inverse, 3 = Cholesky
 * of the inverse (X is then garbage). */
int bk_factor_inverse_f(float *X, int64_t n, double *diag);
int bk_factor_inverse_d(double *X, int64_t n, double *diag);

/* Tunables of the bakron recursion (solver_tmpl.h). Exposed for the
 * benchmark; the defaults are what bk_solve uses. */
typedef struct bk_bakron_tuning {
    int leaf_width; /* bands of at most this many anti-diagonals are solved directly */
    int min_block;  /* row block of the band updates: clamp(width / div, min, max) */
    int max_block;
    int block_div;
    int chunk;      /* column chunk of the two band GEMMs (0: none) */
} bk_bakron_tuning;
extern bk_bakron_tuning bk_bakron_tune;

#endif /* BK_SOLVER_IMPL_H */
