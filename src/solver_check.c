/* Host logic of the factor preparation shared by the CPU and CUDA solvers
 * (src/solver_check.h). */
#include "solver_check.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "bakron/status.h"

static inline double in_at(const void *p, bk_dtype dt, size_t idx)
{
    return dt == BK_DT_F64 ? ((const double *)p)[idx] : (double)((const float *)p)[idx];
}

bk_status bk_solve_error_not_symmetric(const char *label, int64_t i, int64_t j, double lo,
                                       double up, double maxabs)
{
    return bk_error(BK_ERR_INVALID_ARG,
                    "%s: not symmetric: [%lld, %lld] = %.9g but [%lld, %lld] = %.9g "
                    "(tolerance %g relative to max |entry| %g)",
                    label, (long long)i, (long long)j, lo, (long long)j, (long long)i, up,
                    BK_SYM_TOL, maxabs);
}

bk_status bk_solve_fix_diagonal(double *diag, int64_t stride, int64_t n, const char *label,
                                int input_side, double *Wd, int64_t m, int64_t *dead,
                                int64_t *zeros, double *mean)
{
    double sum = 0.0;
    int64_t z = 0;
    for (int64_t j = 0; j < n; j++) {
        double *d = diag + j * stride;
        if (*d < 0)
            return bk_error(BK_ERR_NOT_PD,
                            "%s: diagonal entry [%lld, %lld] = %g is negative: not positive "
                            "semi-definite",
                            label, (long long)j, (long long)j, *d);
        if (*d == 0) {
            *d = 1.0;
            z++;
            if (input_side) {
                (*dead)++;
                if (Wd)
                    for (int64_t i = 0; i < m; i++)
                        Wd[i * n + j] = 0.0;
            }
        }
        sum += *d;
    }
    if (zeros)
        *zeros = z;
    *mean = sum / (double)n;
    return BK_OK;
}

bk_status bk_solve_mirror_matrix(const void *X, bk_dtype dt, int64_t n, const char *label,
                                 int input_side, double *Wd, int64_t m, int64_t *dead,
                                 double *Xd, double *mean)
{
    const size_t nn = (size_t)n * (size_t)n;
    double maxabs = 0.0;
    for (size_t t = 0; t < nn; t++)
        maxabs = fmax(maxabs, fabs(in_at(X, dt, t)));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j <= i; j++) {
            const double lo = in_at(X, dt, (size_t)(i * n + j));
            const double up = in_at(X, dt, (size_t)(j * n + i));
            if (fabs(lo - up) > BK_SYM_TOL * maxabs)
                return bk_solve_error_not_symmetric(label, i, j, lo, up, maxabs);
            Xd[i * n + j] = lo;
            Xd[j * n + i] = lo;
        }
    return bk_solve_fix_diagonal(Xd, n + 1, n, label, input_side, Wd, m, dead, NULL, mean);
}

bk_status bk_solve_check_factor(const void *LX, bk_dtype dt, int64_t n, const char *label)
{
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = i + 1; j < n; j++) {
            double v = in_at(LX, dt, (size_t)(i * n + j));
            if (v != 0.0)
                return bk_error(BK_ERR_INVALID_ARG,
                                "%s: a precomputed factor must be lower triangular: [%lld, %lld] "
                                "= %g is above the diagonal",
                                label, (long long)i, (long long)j, v);
        }
        double d = in_at(LX, dt, (size_t)(i * n + i));
        if (!(d > 0))
            return bk_error(BK_ERR_INVALID_ARG,
                            "%s: a precomputed Cholesky factor needs a positive diagonal: "
                            "[%lld, %lld] = %g",
                            label, (long long)i, (long long)i, d);
    }
    return BK_OK;
}

static const char *const factor_step[] = {
    "", "the Cholesky factorization of the damped matrix", "the inverse of its Cholesky factor",
    "the Cholesky factor of its inverse (a diagonal entry is not positive)"};

bk_status bk_solve_damp_escalate(const bk_solve_opts *o, double mean, const char *label,
                                 bk_damp_try_fn try_damp, void *user, double *damp, double *add,
                                 int *retries)
{
    double delta = o->damp, a = 0.0;
    int attempt;
    for (attempt = 0;; attempt++) {
        int step = 0;
        a = delta * mean;
        bk_status st = try_damp(user, a, &step);
        if (st != BK_OK)
            return st;
        if (step == 0)
            break;
        if (step < 0 || step > 3)
            return bk_error(BK_ERR_INTERNAL, "%s: factorization step %d", label, step);
        if (attempt >= o->max_damp_retries)
            return bk_error(BK_ERR_NOT_PD,
                            "%s: not positive definite even with relative damping %g (%d "
                            "escalation%s): %s failed",
                            label, delta, attempt, attempt == 1 ? "" : "s", factor_step[step]);
        delta = delta == 0.0 ? 1e-2 : delta * 10.0;
    }
    *damp = delta;
    *add = a;
    *retries = attempt;
    return BK_OK;
}

bk_status bk_solve_damp_factor(const bk_solve_opts *o, double mean, const char *label,
                               bk_damp_try_fn try_damp, void *user, double *rdiag, int64_t n,
                               double *damp, double *add, int *retries)
{
    bk_status st = bk_solve_damp_escalate(o, mean, label, try_damp, user, damp, add, retries);
    if (st != BK_OK)
        return st;
    for (int64_t j = 0; j < n; j++)
        rdiag[j] = 1.0 / rdiag[j];
    return BK_OK;
}

bk_status bk_solve_begin(const bk_solve_problem *p, const bk_solve_opts *o, bk_solve_result *r,
                         const char **lw, const char **la, const char **lb)
{
    if (!p || !o || !r)
        return bk_error(BK_ERR_INVALID_ARG, "solve: problem, options and result must not be NULL");
    memset(r, 0, sizeof *r);
    r->loss_two_sided = r->loss_one_sided = r->bound = NAN;
    *lw = p->label_w ? p->label_w : "W";
    *la = p->label_a ? p->label_a : (p->LA ? "LA" : "A");
    *lb = p->label_b ? p->label_b : (p->LB ? "LB" : "B");
    bk_status st = bk_solve_check_opts(o);
    if (st == BK_OK)
        st = bk_solve_check_problem(p, o, *lw, *la, *lb);
    return st;
}

double bk_solve_bound(const bk_alphabet *alpha, const double *ra, const double *rb, int64_t m,
                      int64_t n)
{
    double bound = 0.0;
    for (int64_t i = 0; i < m; i++) {
        const double rbi = rb ? rb[i] : 1.0;
        double row = 0.0;
        for (int64_t j = 0; j < n; j++) {
            const double s = bk_q_scale_at(alpha, i, j);
            row += s * s * ra[j] * ra[j];
        }
        bound += rbi * rbi * row;
    }
    return 0.25 * bound;
}

void bk_solve_result_alphabet(bk_solve_result *r, bk_alphabet *alpha, int64_t m, int64_t n,
                              const bk_quant_spec *q)
{
    r->m = m;
    r->n = n;
    r->groups = alpha->groups;
    r->scales = alpha->scale;
    alpha->scale = NULL;
    if (q->kind == BK_Q_UNIFORM && q->asym) {
        r->zeros = alpha->zero;
        alpha->zero = NULL;
    }
}
