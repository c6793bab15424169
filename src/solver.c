/* bk_solve: validation, damping and factorization, dispatch to the CPU
 * solvers (solver_ref.c), statistics. docs/solver.md describes every rule. */
#include "bakron/solver.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "quant.h"
#include "solver_check.h"
#include "solver_impl.h"
#include "util.h"

static const char *const alg_names[BK_ALG_COUNT] = {
    [BK_ALG_BAKRON] = "bakron", [BK_ALG_RECURSIVE] = "recursive", [BK_ALG_ANTIDIAG] = "antidiag",
    [BK_ALG_NAIVE] = "naive",   [BK_ALG_GPTQ] = "gptq",           [BK_ALG_RTN] = "rtn",
};

const char *bk_algorithm_name(bk_algorithm a)
{
    if ((int)a < 0 || a >= BK_ALG_COUNT)
        return "?";
    return alg_names[a];
}

bk_status bk_algorithm_from_name(const char *name, bk_algorithm *out)
{
    for (int a = 0; a < BK_ALG_COUNT; a++)
        if (name && !strcmp(name, alg_names[a])) {
            *out = (bk_algorithm)a;
            return BK_OK;
        }
    return bk_error(BK_ERR_INVALID_ARG,
                    "unknown algorithm '%s' (expected bakron, recursive, antidiag, naive, gptq "
                    "or rtn)",
                    name ? name : "(null)");
}

void bk_solve_opts_default(bk_solve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->algorithm = BK_ALG_BAKRON;
    o->precision = BK_PREC_FP32;
    o->quant.kind = BK_Q_LEVELS;
    o->quant.levels = 3;
    o->quant.bits = 4;
    o->quant.group = 0;
    o->quant.asym = 0;
    o->quant.mse = 1;
    o->quant.refit_groups = 0;
    o->damp = 0.5;
    o->max_damp_retries = 5;
    o->gptq_block = 128;
    o->compute_stats = 1;
}

void bk_solve_result_free(bk_solve_result *r)
{
    if (!r)
        return;
    free(r->codes);
    free(r->scales);
    free(r->zeros);
    free(r->weight);
    memset(r, 0, sizeof *r);
}

/* ------------------------------------------------------------ input access */

static inline double in_at(const void *p, bk_dtype dt, size_t idx)
{
    return dt == BK_DT_F64 ? ((const double *)p)[idx] : (double)((const float *)p)[idx];
}

bk_status bk_solve_check_finite(const void *p, bk_dtype dt, int64_t rows, int64_t cols,
                              const char *label)
{
    const size_t total = (size_t)rows * (size_t)cols;
    for (size_t t = 0; t < total; t++) {
        double v = in_at(p, dt, t);
        if (!isfinite(v))
            return bk_error(BK_ERR_NONFINITE, "%s: non-finite value (%g) at [%lld, %lld]", label,
                            v, (long long)(t / (size_t)cols), (long long)(t % (size_t)cols));
    }
    return BK_OK;
}

/* ------------------------------------------------------------------ factors */

/* One side of the Kronecker product: the damped factor and its inverse's
 * normalized Cholesky factor in the working precision. */
typedef struct side {
    int64_t n;
    int identity;  /* B absent: everything is the identity */
    void *L;       /* REAL [n, n], unit lower triangular */
    double *rdiag; /* [n] RevCholesky(X~)_jj = 1 / diag of the unnormalized L */
    double *til;   /* [n, n] the damped factor X~ (full), for the statistics */
    double damp;   /* relative damping used */
    int retries;   /* escalations */
} side;

static void side_free(side *s)
{
    free(s->L);
    free(s->rdiag);
    free(s->til);
    memset(s, 0, sizeof *s);
}

static int factor_inverse(void *X, int64_t n, double *diag, bk_precision prec)
{
    return prec == BK_PREC_FP64 ? bk_factor_inverse_d(X, n, diag)
                                : bk_factor_inverse_f(X, n, diag);
}

/* One damping attempt (bk_solve_damp_factor): s->L = Xd + add I in the
 * working precision, factored. */
typedef struct damp_try {
    side *s;
    const double *Xd;
    bk_precision prec;
} damp_try;

static bk_status cpu_damp_try(void *user, double add, int *step)
{
    const damp_try *d = user;
    side *s = d->s;
    const int64_t n = s->n;
    const size_t nn = (size_t)n * (size_t)n;
    if (d->prec == BK_PREC_FP64) {
        double *L = s->L;
        memcpy(L, d->Xd, nn * sizeof(double));
        for (int64_t j = 0; j < n; j++)
            L[j * n + j] += add;
    } else {
        float *L = s->L;
        for (size_t t = 0; t < nn; t++)
            L[t] = (float)d->Xd[t];
        for (int64_t j = 0; j < n; j++)
            L[j * n + j] = (float)(d->Xd[j * n + j] + add);
    }
    *step = factor_inverse(s->L, n, s->rdiag, d->prec);
    return BK_OK;
}

/* From a symmetric PSD matrix X: mirror its lower triangle (after a loose
 * symmetry check), fix zero diagonals (input side: dead columns, also zeroed
 * in Wd), damp and factor with escalation. */
static bk_status side_from_matrix(side *s, const void *X, bk_dtype dt, int64_t n,
                                  const char *label, int input_side, double *Wd, int64_t m,
                                  const bk_solve_opts *o, int64_t *dead, int keep_til)
{
    bk_status st = BK_OK;
    const size_t nn = (size_t)n * (size_t)n;
    const size_t rsz = o->precision == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    memset(s, 0, sizeof *s);
    s->n = n;
    double *Xd = bk_alloc(nn, sizeof(double));
    s->rdiag = bk_alloc((size_t)n, sizeof(double));
    s->L = bk_alloc(nn, rsz);
    if (!Xd || !s->rdiag || !s->L) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                      (long long)n, (long long)n);
        goto fail;
    }
    double mean = 0.0, add = 0.0;
    st = bk_solve_mirror_matrix(X, dt, n, label, input_side, Wd, m, dead, Xd, &mean);
    if (st != BK_OK)
        goto fail;
    damp_try dtry = {s, Xd, o->precision};
    st = bk_solve_damp_factor(o, mean, label, cpu_damp_try, &dtry, s->rdiag, n, &s->damp, &add,
                              &s->retries);
    if (st != BK_OK)
        goto fail;
    if (keep_til) {
        for (int64_t j = 0; j < n; j++)
            Xd[j * n + j] += add;
        s->til = Xd;
        Xd = NULL;
    }
    free(Xd);
    return BK_OK;
fail:
    free(Xd);
    side_free(s);
    return st;
}

/* From a precomputed factor L (lower triangular, positive diagonal,
 * L L^T = X~^-1): normalize; X~ = L^-T L^-1 for the statistics. */
static bk_status side_from_factor(side *s, const void *LX, bk_dtype dt, int64_t n,
                                  const char *label, bk_precision prec, int keep_til)
{
    bk_status st = BK_OK;
    const size_t nn = (size_t)n * (size_t)n;
    memset(s, 0, sizeof *s);
    s->n = n;
    st = bk_solve_check_factor(LX, dt, n, label);
    if (st != BK_OK)
        return st;
    s->rdiag = bk_alloc((size_t)n, sizeof(double));
    s->L = bk_alloc(nn, prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float));
    if (keep_til)
        s->til = bk_alloc(nn, sizeof(double));
    if (!s->rdiag || !s->L || (keep_til && !s->til)) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                      (long long)n, (long long)n);
        goto fail;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) {
            double v = j <= i ? in_at(LX, dt, (size_t)(i * n + j)) /
                                    in_at(LX, dt, (size_t)(j * n + j))
                              : 0.0;
            if (j == i)
                v = 1.0;
            if (prec == BK_PREC_FP64)
                ((double *)s->L)[i * n + j] = v;
            else
                ((float *)s->L)[i * n + j] = (float)v;
        }
    for (int64_t j = 0; j < n; j++)
        s->rdiag[j] = 1.0 / in_at(LX, dt, (size_t)(j * n + j));
    if (keep_til) {
        double *T = s->til;
        for (size_t t = 0; t < nn; t++)
            T[t] = in_at(LX, dt, t);
        /* Row-major lower = column-major upper U = L^T: trtri gives U^-1 = L^-T
         * (row-major view L^-1); lauum gives U^-1 U^-T = (L L^T)^-1 = X~. */
        if (LAPACKE_dtrtri(LAPACK_COL_MAJOR, 'U', 'N', (lapack_int)n, T, (lapack_int)n) != 0 ||
            LAPACKE_dlauum(LAPACK_COL_MAJOR, 'U', (lapack_int)n, T, (lapack_int)n) != 0) {
            st = bk_error(BK_ERR_NOT_PD, "%s: the precomputed factor cannot be inverted", label);
            goto fail;
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = i + 1; j < n; j++)
                T[i * n + j] = T[j * n + i];
    }
    return BK_OK;
fail:
    side_free(s);
    return st;
}

/* --------------------------------------------------------------- statistics */

/* tr(E^T B E A) and tr(E A E^T) in double (B NULL = identity; A, B
 * symmetric): sum of (B E) o (E A) and of E o (E A). */
static bk_status losses(int64_t m, int64_t n, const double *E, const double *A, const double *B,
                        double *two, double *one)
{
    const size_t mn = (size_t)m * (size_t)n;
    double *F = bk_alloc(mn, sizeof(double));
    double *G = B ? bk_alloc(mn, sizeof(double)) : NULL;
    if (!F || (B && !G)) {
        free(F);
        free(G);
        return bk_error(BK_ERR_NOMEM, "loss: out of memory");
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)n, 1.0, E,
                (int)n, A, (int)n, 0.0, F, (int)n);
    double s1 = 0.0, s2 = 0.0;
    for (size_t t = 0; t < mn; t++)
        s1 += E[t] * F[t];
    if (B) {
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)m, 1.0, B,
                    (int)m, E, (int)n, 0.0, G, (int)n);
        for (size_t t = 0; t < mn; t++)
            s2 += G[t] * F[t];
    } else {
        s2 = s1;
    }
    free(F);
    free(G);
    *one = s1;
    *two = s2;
    return BK_OK;
}

/* The arguments of a proxy loss. */
static bk_status proxy_args(int64_t m, int64_t n, const float *E, const float *A, const double *out)
{
    if (!E || !A || !out)
        return bk_error(BK_ERR_INVALID_ARG, "proxy loss: E, A and out must not be NULL");
    if (m <= 0 || n <= 0 || m > INT_MAX || n > INT_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "proxy loss: bad shape [%lld, %lld]", (long long)m,
                        (long long)n);
    return BK_OK;
}

bk_status bk_proxy_loss(int64_t m, int64_t n, const float *E, const float *A, const float *B,
                        double *out)
{
    bk_status st0 = proxy_args(m, n, E, A, out);
    if (st0 != BK_OK)
        return st0;
    const size_t mn = (size_t)m * (size_t)n;
    double *Ed = bk_alloc(mn, sizeof(double));
    double *Ad = bk_alloc((size_t)n * (size_t)n, sizeof(double));
    double *Bd = B ? bk_alloc((size_t)m * (size_t)m, sizeof(double)) : NULL;
    bk_status st = BK_OK;
    if (!Ed || !Ad || (B && !Bd)) {
        st = bk_error(BK_ERR_NOMEM, "proxy loss: out of memory");
        goto done;
    }
    for (size_t t = 0; t < mn; t++)
        Ed[t] = E[t];
    for (size_t t = 0; t < (size_t)n * (size_t)n; t++)
        Ad[t] = A[t];
    if (B)
        for (size_t t = 0; t < (size_t)m * (size_t)m; t++)
            Bd[t] = B[t];
    double one;
    st = losses(m, n, Ed, Ad, Bd, out, &one);
done:
    free(Ed);
    free(Ad);
    free(Bd);
    return st;
}

/* ------------------------------------------------------------------- solve */

bk_status bk_solve_check_opts(const bk_solve_opts *o)
{
    if ((int)o->algorithm < 0 || o->algorithm >= BK_ALG_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "solve: unknown algorithm %d", (int)o->algorithm);
    if (o->precision != BK_PREC_FP32 && o->precision != BK_PREC_FP64)
        return bk_error(BK_ERR_INVALID_ARG, "solve: unknown precision %d", (int)o->precision);
    if (!isfinite(o->damp) || o->damp < 0)
        return bk_error(BK_ERR_INVALID_ARG, "solve: damping must be a finite number >= 0 (got %g)",
                        o->damp);
    if (o->separate_damp_b && (!isfinite(o->damp_b) || o->damp_b < 0))
        return bk_error(BK_ERR_INVALID_ARG,
                        "solve: damping of B must be a finite number >= 0 (got %g)", o->damp_b);
    if (o->max_damp_retries < 0 || o->max_damp_retries > 30)
        return bk_error(BK_ERR_INVALID_ARG, "solve: max_damp_retries must be in [0, 30] (got %d)",
                        o->max_damp_retries);
    if (o->gptq_block < 1)
        return bk_error(BK_ERR_INVALID_ARG, "solve: gptq_block must be >= 1 (got %d)",
                        o->gptq_block);
    if (o->quant.refit_groups && o->algorithm != BK_ALG_GPTQ)
        return bk_error(BK_ERR_INVALID_ARG,
                        "solve: refit_groups works only with the gptq algorithm (got %s); the "
                        "two-sided solvers use static groups",
                        bk_algorithm_name(o->algorithm));
    return BK_OK;
}

bk_status bk_solve_check_problem(const bk_solve_problem *p, const bk_solve_opts *o, const char *lw,
                                 const char *la, const char *lb)
{
    if (p->m <= 0 || p->n <= 0)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: empty weight matrix [%lld, %lld] (both dimensions must be >= 1)", lw,
                        (long long)p->m, (long long)p->n);
    if (p->m > INT_MAX || p->n > INT_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "%s: [%lld, %lld] is too large (each dimension must "
                        "be < 2^31)", lw, (long long)p->m, (long long)p->n);
    uint64_t cells;
    if (bk_mul_u64((uint64_t)p->m, (uint64_t)p->n, &cells) ||
        bk_mul_u64(cells, sizeof(double), &cells) || cells > (uint64_t)SIZE_MAX / 4)
        return bk_error(BK_ERR_INVALID_ARG, "%s: [%lld, %lld] is too large", lw, (long long)p->m,
                        (long long)p->n);
    if (p->dtype != BK_DT_F32 && p->dtype != BK_DT_F64)
        return bk_error(BK_ERR_DTYPE, "%s: dtype %s is not supported by the solver (F32 or F64)",
                        lw, bk_dtype_name(p->dtype));
    if (!p->W)
        return bk_error(BK_ERR_INVALID_ARG, "%s: no weight matrix given", lw);
    if (!p->A && !p->LA && o->algorithm != BK_ALG_RTN)
        return bk_error(BK_ERR_INVALID_ARG, "%s: give the input-side factor A or its Cholesky "
                        "factor LA", la);
    if (p->A && p->LA)
        return bk_error(BK_ERR_INVALID_ARG, "%s: give either A or LA, not both", la);
    if (p->B && p->LB)
        return bk_error(BK_ERR_INVALID_ARG, "%s: give either B or LB, not both", lb);
    return BK_OK;
}

static int family_two_sided(bk_algorithm a)
{
    return a == BK_ALG_BAKRON || a == BK_ALG_RECURSIVE || a == BK_ALG_ANTIDIAG ||
           a == BK_ALG_NAIVE;
}

bk_status bk_solve(const bk_solve_problem *p, const bk_solve_opts *o, bk_solve_result *r)
{
    const char *lw = NULL, *la = NULL, *lb = NULL;
    bk_status st = bk_solve_begin(p, o, r, &lw, &la, &lb);
    if (st != BK_OK)
        return st;
    const int64_t m = p->m, n = p->n;
    const size_t mn = (size_t)m * (size_t)n;
    const bk_dtype dt = p->dtype;
    const bk_precision prec = o->precision;
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);

    if ((st = bk_solve_check_finite(p->W, dt, m, n, lw)) != BK_OK)
        return st;
    if ((p->A || p->LA) &&
        (st = bk_solve_check_finite(p->A ? p->A : p->LA, dt, n, n, la)) != BK_OK)
        return st;
    if ((p->B || p->LB) &&
        (st = bk_solve_check_finite(p->B ? p->B : p->LB, dt, m, m, lb)) != BK_OK)
        return st;

    bk_alphabet alpha;
    side sa, sb;
    memset(&sa, 0, sizeof sa);
    memset(&sb, 0, sizeof sb);
    double *Wd = NULL;
    void *Wr = NULL;
    int64_t dead = 0;
    if ((st = bk_alphabet_init(&alpha, &o->quant, m, n)) != BK_OK)
        return bk_error_prefix(st, lw);

    const double t0 = bk_now();
    Wd = bk_alloc(mn, sizeof(double));
    r->codes = bk_alloc(mn, sizeof(int16_t));
    r->weight = bk_alloc(mn, sizeof(float));
    Wr = bk_alloc(mn, rsz);
    if (!Wd || !r->codes || !r->weight || !Wr) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] solve", lw,
                      (long long)m, (long long)n);
        goto fail;
    }
    for (size_t t = 0; t < mn; t++)
        Wd[t] = in_at(p->W, dt, t);

    const int stats = o->compute_stats != 0 && (p->A || p->LA);
    bk_solve_opts ob = *o; /* the output side may have its own damping */
    if (o->separate_damp_b)
        ob.damp = o->damp_b;
    if (p->A)
        st = side_from_matrix(&sa, p->A, dt, n, la, 1, Wd, m, o, &dead, stats);
    else if (p->LA)
        st = side_from_factor(&sa, p->LA, dt, n, la, prec, stats);
    else
        sa.identity = 1; /* rtn without a Hessian */
    if (st != BK_OK)
        goto fail;
    if (p->B)
        st = side_from_matrix(&sb, p->B, dt, m, lb, 0, NULL, 0, &ob, NULL, stats);
    else if (p->LB)
        st = side_from_factor(&sb, p->LB, dt, m, lb, prec, stats);
    else
        sb.identity = 1;
    if (st != BK_OK)
        goto fail;

    if ((st = bk_alphabet_fit(&alpha, Wd, n)) != BK_OK) {
        bk_error_prefix(st, lw);
        goto fail;
    }
    const double t1 = bk_now();

    if (prec == BK_PREC_FP64)
        memcpy(Wr, Wd, mn * sizeof(double));
    else
        for (size_t t = 0; t < mn; t++)
            ((float *)Wr)[t] = (float)Wd[t];
    bk_core core;
    memset(&core, 0, sizeof core);
    core.alg = o->algorithm;
    core.m = m;
    core.n = n;
    core.W = Wr;
    core.LA = sa.L;
    core.LB = (o->algorithm == BK_ALG_GPTQ || sb.identity) ? NULL : sb.L;
    core.alpha = &alpha;
    core.gptq_block = o->gptq_block;
    core.label = lw;
    core.codes = r->codes;
    core.weight = r->weight;
    st = prec == BK_PREC_FP64 ? bk_core_solve_d(&core) : bk_core_solve_f(&core);
    if (st != BK_OK)
        goto fail;
    const double t2 = bk_now();
    if (core.counts.nonfinite > 0) {
        st = bk_error(BK_ERR_NONFINITE,
                      "%s: %lld values became non-finite during the %s solve (inputs too large "
                      "for %s?)",
                      lw, (long long)core.counts.nonfinite, bk_algorithm_name(o->algorithm),
                      prec == BK_PREC_FP64 ? "fp64" : "fp32");
        goto fail;
    }
    if (core.counts.overflow > 0) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "%s: integer alphabet: %lld codes exceed the int16 range of the result "
                      "(|code| <= %d)",
                      lw, (long long)core.counts.overflow, BK_Q_INT16_MAX);
        goto fail;
    }

    if (stats) {
        double *E = Wd; /* E = weight - W, in place */
        for (size_t t = 0; t < mn; t++)
            E[t] = (double)r->weight[t] - Wd[t];
        st = losses(m, n, E, sa.til, sb.identity ? NULL : sb.til, &r->loss_two_sided,
                    &r->loss_one_sided);
        if (st != BK_OK)
            goto fail;
        if (o->algorithm != BK_ALG_RTN) {
            /* bound of the problem the algorithm solved: B~ for the two-sided
             * family, the identity for gptq (compare with loss_one_sided) */
            const int use_b = family_two_sided(o->algorithm) && !sb.identity;
            r->bound = bk_solve_bound(&alpha, sa.rdiag, use_b ? sb.rdiag : NULL, m, n);
        }
    }
    const double t3 = bk_now();

    bk_solve_result_alphabet(r, &alpha, m, n, &o->quant);
    r->damp_a = p->A ? sa.damp : 0.0;
    r->damp_b = p->B ? sb.damp : 0.0;
    r->damp_retries = sa.retries + sb.retries;
    r->dead_columns = dead;
    r->clamped = core.counts.clamped;
    r->time_factor_s = t1 - t0;
    r->time_solve_s = t2 - t1;
    r->time_stats_s = stats ? t3 - t2 : 0.0;
    bk_alphabet_free(&alpha);
    side_free(&sa);
    side_free(&sb);
    free(Wd);
    free(Wr);
    return BK_OK;

fail:
    bk_alphabet_free(&alpha);
    side_free(&sa);
    side_free(&sb);
    free(Wd);
    free(Wr);
    bk_solve_result_free(r);
    r->loss_two_sided = r->loss_one_sided = r->bound = NAN;
    return st;
}

bk_status bk_proxy_loss_fast(int64_t m, int64_t n, const float *E, const float *A, double *out)
{
    bk_status st0 = proxy_args(m, n, E, A, out);
    if (st0 != BK_OK)
        return st0;
    const size_t mn = (size_t)m * (size_t)n;
    float *F = bk_alloc(mn, sizeof(float));
    if (!F)
        return bk_error(BK_ERR_NOMEM, "proxy loss: out of memory");
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)n, 1.0f, E,
                (int)n, A, (int)n, 0.0f, F, (int)n);
    double s = 0.0;
    for (size_t t = 0; t < mn; t++)
        s += (double)E[t] * (double)F[t];
    free(F);
    *out = s;
    return BK_OK;
}
