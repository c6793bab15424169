/* Quantization alphabets: fitting scales and zero points (docs/solver.md). */
#include "quant.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <pthread.h>

#include "util.h"

bk_status bk_alphabet_init(bk_alphabet *a, const bk_quant_spec *spec, int64_t m, int64_t n)
{
    memset(a, 0, sizeof *a);
    if (m <= 0 || n <= 0)
        return bk_error(BK_ERR_INVALID_ARG, "alphabet: empty matrix [%lld, %lld]", (long long)m,
                        (long long)n);
    a->spec = *spec;
    a->m = m;
    a->n = n;
    a->group = n;
    a->groups = 1;
    switch (spec->kind) {
    case BK_Q_LEVELS:
        if (spec->levels < 1 || spec->levels > BK_Q_INT16_MAX)
            return bk_error(BK_ERR_INVALID_ARG,
                            "quantizer: levels must be in [1, %d] (got %d)", BK_Q_INT16_MAX,
                            spec->levels);
        a->qmin = -spec->levels;
        a->qmax = spec->levels;
        break;
    case BK_Q_UNIFORM:
        if (spec->bits != 2 && spec->bits != 3 && spec->bits != 4 && spec->bits != 8)
            return bk_error(BK_ERR_INVALID_ARG,
                            "quantizer: uniform bits must be 2, 3, 4 or 8 (got %d)", spec->bits);
        if (spec->group < 0)
            return bk_error(BK_ERR_INVALID_ARG,
                            "quantizer: group size must be >= 0 (0 = one group per row; got %lld)",
                            (long long)spec->group);
        a->qmin = 0;
        a->qmax = (1 << spec->bits) - 1;
        if (spec->group > 0 && spec->group < n) {
            a->group = spec->group;
            a->groups = (n + spec->group - 1) / spec->group;
        }
        break;
    case BK_Q_INTEGER:
        a->qmin = -BK_Q_INT16_MAX;
        a->qmax = BK_Q_INT16_MAX;
        break;
    default:
        return bk_error(BK_ERR_INVALID_ARG, "quantizer: unknown kind %d", (int)spec->kind);
    }
    if (spec->refit_groups && (spec->kind != BK_Q_UNIFORM || a->groups < 2))
        return bk_error(BK_ERR_INVALID_ARG,
                        "quantizer: refit_groups needs the uniform alphabet with a group size "
                        "smaller than the %lld input columns",
                        (long long)n);
    uint64_t cells;
    if (bk_mul_u64((uint64_t)m, (uint64_t)a->groups, &cells) || cells > SIZE_MAX / sizeof(float))
        return bk_error(BK_ERR_INVALID_ARG, "alphabet: [%lld, %lld] scales overflow",
                        (long long)m, (long long)a->groups);
    a->scale = bk_alloc((size_t)cells, sizeof(float));
    if (spec->kind == BK_Q_UNIFORM)
        a->zero = bk_alloc((size_t)cells, sizeof(float));
    if (!a->scale || (spec->kind == BK_Q_UNIFORM && !a->zero)) {
        bk_alphabet_free(a);
        return bk_error(BK_ERR_NOMEM, "alphabet: out of memory for %llu scales",
                        (unsigned long long)cells);
    }
    for (uint64_t c = 0; c < cells; c++)
        a->scale[c] = 1.0f;
    if (a->zero)
        memset(a->zero, 0, (size_t)cells * sizeof(float));
    return BK_OK;
}

void bk_alphabet_free(bk_alphabet *a)
{
    if (!a)
        return;
    free(a->scale);
    free(a->zero);
    a->scale = NULL;
    a->zero = NULL;
}

/* ------------------------------------------------------------------ levels */

/* The objectives stop early once the running sum exceeds `limit` (every term
 * is >= 0, so such a candidate cannot win the strict comparison); the sum
 * of a candidate that can win is always complete and in the same order. */
static double levels_obj(const double *x, int64_t len, int levels, double scale, double limit)
{
    double err = 0.0;
    for (int64_t j = 0; j < len; j++) {
        double c = rint(x[j] / scale);
        if (c < -levels)
            c = -levels;
        else if (c > levels)
            c = levels;
        const double e = c * scale - x[j];
        err += e * e;
        if (err > limit)
            break;
    }
    return err;
}

double bk_q_levels_objective(const double *x, int64_t len, int levels, double scale)
{
    return levels_obj(x, len, levels, scale, INFINITY);
}

bk_status bk_q_fit_levels(const double *x, int64_t len, int levels, int mse, float *scale)
{
    double amax = 0.0;
    for (int64_t j = 0; j < len; j++)
        amax = fmax(amax, fabs(x[j]));
    /* An all-zero row (or one so small that its scale underflows fp32) gets
     * the scale it would have with max |x| = 1, as GPTQ's xmin=-1, xmax=1. */
    if (amax == 0.0 || (float)(amax / levels) == 0.0f)
        amax = 1.0;
    if (!((float)(amax / levels) <= FLT_MAX))
        return bk_error(BK_ERR_INVALID_ARG,
                        "max |value| = %g gives a scale beyond the F32 range", amax);
    float best_s = (float)(amax / levels);
    if (mse) {
        double best = INFINITY;
        for (int i = 0; i < BK_Q_LEVELS_STEPS; i++) {
            double p = 1.0 - (double)i / BK_Q_LEVELS_GRID;
            float s = (float)(p * amax / levels);
            if (!(s > 0.0f))
                continue;
            double e = levels_obj(x, len, levels, (double)s, best);
            if (e < best) { /* strict: ties keep the larger scale (p closer to 1) */
                best = e;
                best_s = s;
            }
        }
    }
    *scale = best_s;
    return BK_OK;
}

/* ----------------------------------------------------------------- uniform */

static double uniform_obj(const double *x, int64_t len, int maxq, double scale, double zero,
                          double limit)
{
    double err = 0.0;
    for (int64_t j = 0; j < len; j++) {
        double q = rint(x[j] / scale) + zero;
        if (q < 0)
            q = 0;
        else if (q > maxq)
            q = maxq;
        err += pow(fabs(scale * (q - zero) - x[j]), BK_Q_UNIFORM_NORM);
        if (err > limit)
            break;
    }
    return err;
}

double bk_q_uniform_objective(const double *x, int64_t len, int maxq, double scale,
                              double zero)
{
    return uniform_obj(x, len, maxq, scale, zero, INFINITY);
}

bk_status bk_q_fit_uniform(const double *x, int64_t len, int bits, int asym, int mse,
                           float *scale, float *zero)
{
    const int maxq = (1 << bits) - 1;
    const int sym = !asym;
    double xmin = 0.0, xmax = 0.0; /* min(x, 0), max(x, 0) */
    for (int64_t j = 0; j < len; j++) {
        xmin = fmin(xmin, x[j]);
        xmax = fmax(xmax, x[j]);
    }
    if (sym) {
        xmax = fmax(fabs(xmin), xmax);
        /* The reference mirrors xmin only where it is negative: a row with
         * no negative value keeps xmin = 0 (docs/solver.md). */
        if (xmin < 0)
            xmin = -xmax;
    }
    if ((xmin == 0.0 && xmax == 0.0) || (float)((xmax - xmin) / maxq) == 0.0f) {
        xmin = -1.0;
        xmax = 1.0;
    }
    if (!((float)((xmax - xmin) / maxq) <= FLT_MAX))
        return bk_error(BK_ERR_INVALID_ARG, "value range [%g, %g] gives a scale beyond the F32 "
                        "range", xmin, xmax);
    float s = (float)((xmax - xmin) / maxq);
    double z = sym ? (maxq + 1) / 2.0 : rint(-xmin / (double)s);
    if (mse) {
        double best = INFINITY;
        for (int i = 0; i < BK_Q_UNIFORM_MAXSHRINK_STEPS; i++) {
            double p = 1.0 - (double)i / BK_Q_UNIFORM_GRID;
            double xmin1 = p * xmin, xmax1 = p * xmax;
            float s1 = (float)((xmax1 - xmin1) / maxq);
            if (!(s1 > 0.0f))
                continue;
            double z1 = sym ? z : rint(-xmin1 / (double)s1);
            double e = uniform_obj(x, len, maxq, (double)s1, z1, best);
            if (e < best) {
                best = e;
                s = s1;
                z = z1;
            }
        }
    }
    *scale = s;
    *zero = (float)z;
    return BK_OK;
}

/* --------------------------------------------------------------------- fit */

static bk_status fit_cell(bk_alphabet *a, int64_t i, int64_t g, const double *x, int64_t len)
{
    const int64_t c = i * a->groups + g;
    bk_status st = BK_OK;
    switch (a->spec.kind) {
    case BK_Q_LEVELS:
        st = bk_q_fit_levels(x, len, a->spec.levels, a->spec.mse, &a->scale[c]);
        break;
    case BK_Q_UNIFORM:
        st = bk_q_fit_uniform(x, len, a->spec.bits, a->spec.asym, a->spec.mse, &a->scale[c],
                              &a->zero[c]);
        break;
    case BK_Q_INTEGER:
        a->scale[c] = 1.0f;
        break;
    }
    if (st != BK_OK) {
        char ctx[96];
        snprintf(ctx, sizeof ctx, "row %lld, group %lld", (long long)i, (long long)g);
        return bk_error_prefix(st, ctx);
    }
    return BK_OK;
}

/* Rows are independent: split them over the BLAS thread count (the fit is
 * the only plain loop of a solve that costs O(mn * grid)). A worker only
 * records the first row that failed; its message is regenerated on the
 * calling thread (messages are thread-local). */
typedef struct fit_job {
    bk_alphabet *a;
    int64_t g, len, r0, r1, ldx;
    const double *X;
    int64_t bad_row; /* -1 when all rows fitted */
} fit_job;

static void *fit_rows(void *arg)
{
    fit_job *j = arg;
    j->bad_row = -1;
    for (int64_t i = j->r0; i < j->r1; i++)
        if (fit_cell(j->a, i, j->g, j->X + i * j->ldx, j->len) != BK_OK) {
            j->bad_row = i;
            break;
        }
    return NULL;
}

#define BK_FIT_MAX_THREADS 64

bk_status bk_alphabet_fit_group(bk_alphabet *a, int64_t g, const double *X, int64_t ldx)
{
    if (g < 0 || g >= a->groups)
        return bk_error(BK_ERR_INTERNAL, "alphabet: group %lld out of range", (long long)g);
    const int64_t j0 = g * a->group;
    const int64_t len = (a->n - j0 < a->group) ? a->n - j0 : a->group;
    int threads = openblas_get_num_threads();
    if (a->spec.kind == BK_Q_INTEGER || !a->spec.mse || a->m * len < 65536)
        threads = 1;
    if (threads > BK_FIT_MAX_THREADS)
        threads = BK_FIT_MAX_THREADS;
    if (threads > a->m)
        threads = (int)a->m;
    if (threads < 1)
        threads = 1;
    fit_job jobs[BK_FIT_MAX_THREADS];
    pthread_t tid[BK_FIT_MAX_THREADS];
    int started[BK_FIT_MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        fit_job *j = &jobs[t];
        j->a = a;
        j->g = g;
        j->len = len;
        j->ldx = ldx;
        j->X = X;
        j->r0 = a->m * t / threads;
        j->r1 = a->m * (t + 1) / threads;
        j->bad_row = -1;
        if (t > 0)
            started[t] = pthread_create(&tid[t], NULL, fit_rows, j) == 0;
    }
    fit_rows(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            fit_rows(&jobs[t]); /* could not start a thread: do it here */
    }
    for (int t = 0; t < threads; t++)
        if (jobs[t].bad_row >= 0) {
            const int64_t i = jobs[t].bad_row;
            bk_status st = fit_cell(a, i, g, X + i * ldx, len);
            return st != BK_OK ? st
                               : bk_error(BK_ERR_INTERNAL, "alphabet: row %lld fit is not "
                                          "deterministic", (long long)i);
        }
    return BK_OK;
}

bk_status bk_alphabet_fit(bk_alphabet *a, const double *W, int64_t ldw)
{
    for (int64_t g = 0; g < a->groups; g++) {
        bk_status st = bk_alphabet_fit_group(a, g, W + g * a->group, ldw);
        if (st != BK_OK)
            return st;
    }
    return BK_OK;
}
