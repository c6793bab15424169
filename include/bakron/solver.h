/* bakron — the adaptive-rounding solvers (GPTQ and the BaKron family) under a
 * Kronecker-factored Hessian H = A (x) B.
 *
 * Conventions (docs/solver.md has the derivations):
 *   W  [m, n] row-major, Hugging Face layout [out, in];
 *   A  [n, n] input-side factor (e.g. E[x x^T]), symmetric PSD;
 *   B  [m, m] output-side factor, symmetric PSD; NULL means the identity.
 *   Damping: A <- A + damp * mean(diag A) * I (same for B). If a Cholesky
 *   factorization fails, damp is multiplied by 10 and retried, at most
 *   max_damp_retries times; the damping used is reported.
 *   L_A = Cholesky(A^-1), L_B = Cholesky(B^-1), columns scaled to unit diagonal.
 *   Features are processed in their natural order.
 */
#ifndef BAKRON_SOLVER_H
#define BAKRON_SOLVER_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/safetensors.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bk_algorithm {
    BK_ALG_BAKRON = 0,   /* Alg. 6: anti-diagonals + divide and conquer */
    BK_ALG_RECURSIVE,    /* Alg. 5 */
    BK_ALG_ANTIDIAG,     /* Alg. 3 */
    BK_ALG_NAIVE,        /* Alg. 2 */
    BK_ALG_GPTQ,         /* Alg. 1 with lazy batches; B is ignored */
    BK_ALG_RTN,          /* plain rounding, no Hessian */
    BK_ALG_COUNT
} bk_algorithm;

const char *bk_algorithm_name(bk_algorithm a);
bk_status bk_algorithm_from_name(const char *name, bk_algorithm *out);

typedef enum bk_precision {
    BK_PREC_FP32 = 0,
    BK_PREC_FP64
} bk_precision;

typedef enum bk_qkind {
    BK_Q_LEVELS = 0,   /* symmetric {-levels..levels} * s_i, one scale per row */
    BK_Q_UNIFORM,      /* b-bit uniform, GPTQ conventions, per row or per group */
    BK_Q_INTEGER       /* unbounded integers, scale 1 (the paper's Z; for tests) */
} bk_qkind;

typedef struct bk_quant_spec {
    bk_qkind kind;
    int levels;        /* BK_Q_LEVELS: l >= 1 (l = 3: log2(7) = 2.81 bits) */
    int bits;          /* BK_Q_UNIFORM: 2, 3, 4 or 8 */
    int64_t group;     /* BK_Q_UNIFORM: input columns per group; 0 = one group per row */
    int asym;          /* BK_Q_UNIFORM: asymmetric (scale + zero) */
    int mse;           /* shrink scales by an MSE grid search (docs/solver.md) */
    int refit_groups;  /* GPTQ only: refit scale/zero at each group start from the
                          current (error-compensated) weights, as the GPTQ reference
                          does with static_groups=False */
} bk_quant_spec;

typedef struct bk_solve_opts {
    bk_algorithm algorithm;
    bk_precision precision;
    bk_quant_spec quant;
    double damp;            /* relative damping delta, default 0.5 */
    int separate_damp_b;    /* 0 (default): B is damped with `damp` like A; 1: with damp_b */
    double damp_b;          /* relative damping of the output-side factor B when separate */
    int max_damp_retries;   /* default 5 */
    int gptq_block;         /* GPTQ lazy batch size, default 128 */
    int compute_stats;      /* losses and bound (costs about one more solve); default 1 */
} bk_solve_opts;

/* Defaults: bakron, fp32, levels 3 with MSE search, damp 0.5, 5 retries,
 * block 128, stats on. */
void bk_solve_opts_default(bk_solve_opts *o);

/* A problem. W, A, B (and factors) are host arrays of `dtype` (F32 or F64).
 * Either A or LA must be given; B and LB are both optional (identity).
 * LA / LB are precomputed lower Cholesky factors of the (damped) inverse:
 * L L^T = A~^-1, NOT normalized; when given, no damping is applied on that
 * side. Labels name the inputs in error messages ("model.layers.0.mlp.up_proj"). */
typedef struct bk_solve_problem {
    int64_t m, n;
    bk_dtype dtype;          /* BK_DT_F32 or BK_DT_F64 */
    const void *W;           /* [m, n] */
    const void *A;           /* [n, n] or NULL when LA is given */
    const void *B;           /* [m, m] or NULL */
    const void *LA;          /* [n, n] or NULL */
    const void *LB;          /* [m, m] or NULL */
    const char *label_w, *label_a, *label_b;
} bk_solve_problem;

typedef struct bk_solve_result {
    int64_t m, n, groups;
    int16_t *codes;          /* [m, n]: -l..l (levels), 0..2^b-1 (uniform), any (integer) */
    float *scales;           /* [m, groups] */
    float *zeros;            /* [m, groups]; NULL unless uniform asymmetric */
    float *weight;           /* [m, n] dequantized: (codes - zero) * scale */
    double damp_a, damp_b;   /* relative damping actually used (0 for an identity B) */
    int damp_retries;        /* escalations that were needed */
    int64_t dead_columns;    /* zero-diagonal input columns (GPTQ handling) */
    int64_t clamped;         /* entries whose rounding hit the ends of the alphabet */
    /* statistics, computed with the damped factors A~, B~ the solver used,
     * E = weight - W (NaN when stats were off): */
    double loss_two_sided;   /* tr(E^T B~ E A~) */
    double loss_one_sided;   /* tr(E A~ E^T) */
    double bound;            /* Corollary 3.4 generalized to per-row scales:
                                1/4 sum_ij s_i^2 (R_B)_ii^2 (R_A)_jj^2, R = RevCholesky;
                                holds whenever no entry was clamped */
    double time_factor_s;    /* damping + Cholesky */
    double time_solve_s;     /* the core algorithm only */
    double time_stats_s;
} bk_solve_result;

void bk_solve_result_free(bk_solve_result *r);

/* Validate (shapes, finiteness) and solve on the CPU reference backend.
 * For other backends use bk_backend_solve (bakron/backend.h). */
bk_status bk_solve(const bk_solve_problem *p, const bk_solve_opts *o, bk_solve_result *r);

/* tr(E^T B E A) with E [m,n], A [n,n], B [m,m] (B NULL = identity), float64
 * accumulation. */
bk_status bk_proxy_loss(int64_t m, int64_t n, const float *E, const float *A, const float *B,
                        double *out);

/* The one-sided tr(E A E^T) with single-precision products (BLAS sgemm) and a
 * float64 reduction: about 1e-6 relative, and several times faster than
 * bk_proxy_loss on large modules (used for the per-module report). */
bk_status bk_proxy_loss_fast(int64_t m, int64_t n, const float *E, const float *A, double *out);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_SOLVER_H */
