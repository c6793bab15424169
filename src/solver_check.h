/* Host logic shared by every solver backend (src/solver.c, cuda/solve.cu,
 * cuda/factor.cu): the same checks, statuses, messages and damping rule on the
 * CPU and the GPU. Implemented in src/solver_check.c (the checks of the
 * inputs in src/solver.c). */
#ifndef BK_SOLVER_CHECK_H
#define BK_SOLVER_CHECK_H

#include <stdint.h>

#include "bakron/solver.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "quant.h" /* (a C header without its own extern "C") */

/* Relative tolerance of the symmetry check: |X_ij - X_ji| <= tol * max |X|. */
#define BK_SYM_TOL 1e-3

bk_status bk_solve_check_opts(const bk_solve_opts *o);
/* The start of every backend's solve: the NULL checks, r emptied (losses
 * NAN), the labels (defaults "W", "A"/"LA", "B"/"LB"), bk_solve_check_opts
 * and bk_solve_check_problem. */
bk_status bk_solve_begin(const bk_solve_problem *p, const bk_solve_opts *o, bk_solve_result *r,
                         const char **lw, const char **la, const char **lb);
/* Shapes, dtype, which inputs are given. A (or LA) may be absent only for
 * the rtn algorithm (no Hessian: no statistics). */
bk_status bk_solve_check_problem(const bk_solve_problem *p, const bk_solve_opts *o, const char *lw,
                                 const char *la, const char *lb);
/* NaN / Inf anywhere in a rows x cols array of dtype dt. */
bk_status bk_solve_check_finite(const void *p, bk_dtype dt, int64_t rows, int64_t cols,
                                const char *label);

/* The error of a failed symmetry check: lo = X[i, j] (i >= j), up = X[j, i]. */
bk_status bk_solve_error_not_symmetric(const char *label, int64_t i, int64_t j, double lo,
                                       double up, double maxabs);

/* The diagonal diag[j * stride] (j < n) of a symmetric factor: a negative
 * entry is BK_ERR_NOT_PD; a zero one becomes 1 (input side: a dead column,
 * counted in *dead and zeroed in Wd [m, n] when Wd is not NULL). *zeros (may
 * be NULL): how many were replaced; *mean: the mean diagonal afterwards. */
bk_status bk_solve_fix_diagonal(double *diag, int64_t stride, int64_t n, const char *label,
                                int input_side, double *Wd, int64_t m, int64_t *dead,
                                int64_t *zeros, double *mean);

/* A symmetric factor X [n, n] of dtype dt as the double matrix Xd [n, n]:
 * the symmetry check, the lower triangle mirrored, then
 * bk_solve_fix_diagonal. */
bk_status bk_solve_mirror_matrix(const void *X, bk_dtype dt, int64_t n, const char *label,
                                 int input_side, double *Wd, int64_t m, int64_t *dead,
                                 double *Xd, double *mean);

/* A precomputed Cholesky factor LX [n, n]: lower triangular with a positive
 * diagonal. */
bk_status bk_solve_check_factor(const void *LX, bk_dtype dt, int64_t n, const char *label);

/* One damping attempt of a backend: damp the factor with add on its diagonal
 * and factor it; *step = 0 on success, else the step that failed (1 the
 * Cholesky factorization, 2 the inverse of its factor, 3 a non-positive
 * diagonal of the factor of the inverse). A returned error ends the loop. */
typedef bk_status (*bk_damp_try_fn)(void *user, double add, int *step);

/* The damping escalation: relative damping o->damp, then 1e-2 when it was
 * 0, times 10 per retry, at most o->max_damp_retries retries; the absolute
 * damping is the relative one times mean (the mean diagonal). Returns the
 * relative damping used, the absolute one and the retries; BK_ERR_NOT_PD
 * naming label and the failed step when every attempt failed. */
bk_status bk_solve_damp_escalate(const bk_solve_opts *o, double mean, const char *label,
                                 bk_damp_try_fn try_damp, void *user, double *damp, double *add,
                                 int *retries);
/* bk_solve_damp_escalate, then each of the n diagonal entries that the
 * successful attempt left in rdiag replaced by its reciprocal (the factor's
 * reciprocal diagonal, as every backend keeps it). */
bk_status bk_solve_damp_factor(const bk_solve_opts *o, double mean, const char *label,
                               bk_damp_try_fn try_damp, void *user, double *rdiag, int64_t n,
                               double *damp, double *add, int *retries);

/* The bound of the rounding error (r->bound): 0.25 Σ_i rb_i² Σ_j s_ij² ra_j²
 * with s_ij the scale of entry (i, j) in alpha, ra [n] the input side's and
 * rb [m] the output side's diagonal (NULL: 1), summed row by row. */
double bk_solve_bound(const bk_alphabet *alpha, const double *ra, const double *rb, int64_t m,
                      int64_t n);
/* The result's shape (m x n) and its alphabet: alpha's scales, and its zeros
 * for an asymmetric uniform grid (q), move into r (NULL in alpha after). */
void bk_solve_result_alphabet(bk_solve_result *r, bk_alphabet *alpha, int64_t m, int64_t n,
                              const bk_quant_spec *q);

#ifdef __cplusplus
}
#endif
#endif
