/* CUDA backend — bk_backend_solve for the GPU: the same contract and rules
 * as bk_solve (src/solver.c, docs/solver.md), step for step:
 *   validation (same checks, messages and statuses),
 *   the alphabet (src/quant.c: fitted on the host, the CPU code itself),
 *   damping + Cholesky of the inverse on the device (factor.cu), with the
 *   CPU's escalation, dead columns and precomputed-factor rules,
 *   the core algorithm on the device (timed with CUDA events: time_solve_s),
 *   the statistics in double on the device (stats.cu) and the bound.
 *
 * Validation is solver.c's own (src/solver_check.h).
 */
#include <cmath>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_internal.cuh"

extern "C" {
#include "quant.h"
#include "util.h"
}
#include "solver_check.h"

namespace {

#define BK_SYM_TOL 1e-3 /* as solver.c */

inline double in_at(const void *p, bk_dtype dt, size_t idx)
{
    return dt == BK_DT_F64 ? static_cast<const double *>(p)[idx]
                           : (double)static_cast<const float *>(p)[idx];
}

/* side_from_matrix's host part: symmetry check, mirrored lower triangle,
 * negative diagonal -> NOT_PD, zero diagonal -> 1 (input side: a dead
 * column, zeroed in Wd), mean diagonal. */
bk_status prepare_matrix(const void *X, bk_dtype dt, int64_t n, const char *label, int input_side,
                         double *Wd, int64_t m, int64_t *dead, double **out, double *mean_out)
{
    const size_t nn = (size_t)n * (size_t)n;
    double *Xd = static_cast<double *>(bk_alloc(nn, sizeof(double)));
    if (!Xd)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                        (long long)n, (long long)n);
    double maxabs = 0.0;
    for (size_t t = 0; t < nn; t++)
        maxabs = fmax(maxabs, fabs(in_at(X, dt, t)));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j <= i; j++) {
            const double lo = in_at(X, dt, (size_t)(i * n + j));
            const double up = in_at(X, dt, (size_t)(j * n + i));
            if (fabs(lo - up) > BK_SYM_TOL * maxabs) {
                free(Xd);
                return bk_error(BK_ERR_INVALID_ARG,
                                "%s: not symmetric: [%lld, %lld] = %.9g but [%lld, %lld] = %.9g "
                                "(tolerance %g relative to max |entry| %g)",
                                label, (long long)i, (long long)j, lo, (long long)j, (long long)i,
                                up, BK_SYM_TOL, maxabs);
            }
            Xd[i * n + j] = lo;
            Xd[j * n + i] = lo;
        }
    double mean = 0.0;
    for (int64_t j = 0; j < n; j++) {
        double d = Xd[j * n + j];
        if (d < 0) {
            free(Xd);
            return bk_error(BK_ERR_NOT_PD,
                            "%s: diagonal entry [%lld, %lld] = %g is negative: not positive "
                            "semi-definite",
                            label, (long long)j, (long long)j, d);
        }
        if (d == 0) {
            Xd[j * n + j] = 1.0;
            if (input_side) {
                (*dead)++;
                for (int64_t i = 0; i < m; i++)
                    Wd[i * n + j] = 0.0;
            }
        }
        mean += Xd[j * n + j];
    }
    *mean_out = mean / (double)n;
    *out = Xd;
    return BK_OK;
}

/* side_from_factor's checks; the factor as host double. */
bk_status prepare_factor(const void *LX, bk_dtype dt, int64_t n, const char *label, double **out)
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
    const size_t nn = (size_t)n * (size_t)n;
    double *L = static_cast<double *>(bk_alloc(nn, sizeof(double)));
    if (!L)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                        (long long)n, (long long)n);
    for (size_t t = 0; t < nn; t++)
        L[t] = in_at(LX, dt, t);
    *out = L;
    return BK_OK;
}

int family_two_sided(bk_algorithm a)
{
    return a == BK_ALG_BAKRON || a == BK_ALG_RECURSIVE || a == BK_ALG_ANTIDIAG ||
           a == BK_ALG_NAIVE;
}

/* Upload a host double [rows, cols] into a device buffer of the solve type
 * with row stride ld (the buffer is already zeroed). */
bk_status upload_as(bk_cuda_ctx *c, void *dst, int64_t ld, const double *src, int64_t rows,
                    int64_t cols, bk_precision prec)
{
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *tmp = bk_alloc((size_t)rows * (size_t)cols, rsz);
    if (!tmp)
        return bk_error(BK_ERR_NOMEM, "out of host memory staging a [%lld, %lld] upload",
                        (long long)rows, (long long)cols);
    const size_t count = (size_t)rows * (size_t)cols;
    if (prec == BK_PREC_FP64)
        memcpy(tmp, src, count * sizeof(double));
    else
        for (size_t t = 0; t < count; t++)
            static_cast<float *>(tmp)[t] = (float)src[t];
    bk_status st = bk_cuda_status(cudaMemcpy2DAsync(dst, (size_t)ld * rsz, tmp, (size_t)cols * rsz,
                                                    (size_t)cols * rsz, (size_t)rows,
                                                    cudaMemcpyHostToDevice, c->stream),
                                  "upload", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "upload", __FILE__, __LINE__);
    free(tmp);
    return st;
}

/* scale/zero arrays (F32 on the host) into the solve type on the device */
bk_status upload_f32_as(bk_cuda_ctx *c, void *dst, const float *src, size_t count,
                        bk_precision prec)
{
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *tmp = bk_alloc(count, rsz);
    if (!tmp)
        return bk_error(BK_ERR_NOMEM, "out of host memory staging the scales");
    for (size_t t = 0; t < count; t++) {
        if (prec == BK_PREC_FP64)
            static_cast<double *>(tmp)[t] = (double)src[t];
        else
            static_cast<float *>(tmp)[t] = src[t];
    }
    bk_status st = bk_cuda_status(cudaMemcpyAsync(dst, tmp, count * rsz, cudaMemcpyHostToDevice,
                                                  c->stream),
                                  "upload scales", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "upload scales", __FILE__,
                            __LINE__);
    free(tmp);
    return st;
}

/* GPTQ's refit at a group start: download the group's columns, refit with
 * the CPU code, upload the group's new scales and zeros. */
typedef struct refit_ctx {
    bk_cuda_ctx *c;
    bk_alphabet *al;
    bk_precision prec;
    void *dscale, *dzero;
    const char *label;
} refit_ctx;

bk_status refit_group(void *vctx, int64_t g, const void *dW, int64_t ldw)
{
    refit_ctx *x = static_cast<refit_ctx *>(vctx);
    bk_alphabet *al = x->al;
    const int64_t m = al->m, j0 = g * al->group;
    const int64_t len = al->n - j0 < al->group ? al->n - j0 : al->group;
    const size_t rsz = x->prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *raw = bk_alloc((size_t)m * (size_t)len, rsz);
    double *G = static_cast<double *>(bk_alloc((size_t)m * (size_t)len, sizeof(double)));
    void *col = bk_alloc((size_t)m, rsz);
    bk_status st = BK_OK;
    if (!raw || !G || !col) {
        st = bk_error(BK_ERR_NOMEM, "%s: gptq: out of memory refitting a group", x->label);
        goto done;
    }
    BK_CUDA_GOTO(cudaMemcpy2DAsync(raw, (size_t)len * rsz, dW, (size_t)ldw * rsz,
                                   (size_t)len * rsz, (size_t)m, cudaMemcpyDeviceToHost,
                                   x->c->stream),
                 st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(x->c->stream), st, done);
    for (size_t t = 0; t < (size_t)m * (size_t)len; t++)
        G[t] = x->prec == BK_PREC_FP64 ? static_cast<double *>(raw)[t]
                                       : (double)static_cast<float *>(raw)[t];
    st = bk_alphabet_fit_group(al, g, G, len);
    if (st != BK_OK) {
        bk_error_prefix(st, x->label);
        goto done;
    }
    for (int pass = 0; pass < 2; pass++) {
        const float *srcv = pass == 0 ? al->scale : al->zero;
        void *dst = pass == 0 ? x->dscale : x->dzero;
        if (!srcv || !dst)
            continue;
        for (int64_t i = 0; i < m; i++) {
            const float v = srcv[i * al->groups + g];
            if (x->prec == BK_PREC_FP64)
                static_cast<double *>(col)[i] = (double)v;
            else
                static_cast<float *>(col)[i] = v;
        }
        BK_CUDA_GOTO(cudaMemcpy2DAsync(static_cast<char *>(dst) + (size_t)g * rsz,
                                       (size_t)al->groups * rsz, col, rsz, rsz, (size_t)m,
                                       cudaMemcpyHostToDevice, x->c->stream),
                     st, done);
        BK_CUDA_GOTO(cudaStreamSynchronize(x->c->stream), st, done);
    }
done:
    free(raw);
    free(G);
    free(col);
    return st;
}

} // namespace

bk_status bk_cuda_solve(bk_cuda_ctx *c, const bk_solve_problem *p, const bk_solve_opts *o,
                        bk_solve_result *r)
{
    if (!p || !o || !r)
        return bk_error(BK_ERR_INVALID_ARG, "solve: problem, options and result must not be NULL");
    memset(r, 0, sizeof *r);
    r->loss_two_sided = r->loss_one_sided = r->bound = NAN;
    const char *lw = p->label_w ? p->label_w : "W";
    const char *la = p->label_a ? p->label_a : (p->LA ? "LA" : "A");
    const char *lb = p->label_b ? p->label_b : (p->LB ? "LB" : "B");
    bk_status st = bk_solve_check_opts(o);
    if (st == BK_OK)
        st = bk_solve_check_problem(p, o, lw, la, lb);
    if (st != BK_OK)
        return st;
    if (!p->A && !p->LA) /* rtn without a Hessian: nothing for the GPU to do */
        return bk_solve(p, o, r);
    const int64_t m = p->m, n = p->n;
    const size_t mn = (size_t)m * (size_t)n;
    const bk_dtype dt = p->dtype;
    const bk_precision prec = o->precision;
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    const int64_t mpad = bk_round_up(m, BK_CUDA_PAD), npad = bk_round_up(n, BK_CUDA_PAD);

    if ((st = bk_solve_check_finite(p->W, dt, m, n, lw)) != BK_OK)
        return st;
    if ((st = bk_solve_check_finite(p->A ? p->A : p->LA, dt, n, n, la)) != BK_OK)
        return st;
    if ((p->B || p->LB) &&
        (st = bk_solve_check_finite(p->B ? p->B : p->LB, dt, m, m, lb)) != BK_OK)
        return st;

    bk_alphabet alpha;
    bk_dside sa, sb;
    memset(&sa, 0, sizeof sa);
    memset(&sb, 0, sizeof sb);
    double *Wd = NULL, *Xh = NULL;
    void *dW = NULL, *dscale = NULL, *dzero = NULL;
    int16_t *dcodes = NULL;
    float *dweight = NULL;
    unsigned long long *dcounts = NULL, counts[3] = {0, 0, 0};
    double *dWq = NULL, *dW0 = NULL;
    double mean = 0.0, t0, t1, t2, t3;
    int64_t dead = 0;
    float ms = 0.0f;
    const int stats = o->compute_stats != 0;
    bk_core_args a;
    refit_ctx rc;
    if ((st = bk_alphabet_init(&alpha, &o->quant, m, n)) != BK_OK)
        return bk_error_prefix(st, lw);

    t0 = bk_now();
    Wd = static_cast<double *>(bk_alloc(mn, sizeof(double)));
    r->codes = static_cast<int16_t *>(bk_alloc(mn, sizeof(int16_t)));
    r->weight = static_cast<float *>(bk_alloc(mn, sizeof(float)));
    if (!Wd || !r->codes || !r->weight) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] solve", lw,
                      (long long)m, (long long)n);
        goto fail;
    }
    for (size_t t = 0; t < mn; t++)
        Wd[t] = in_at(p->W, dt, t);

    if (p->A) {
        st = prepare_matrix(p->A, dt, n, la, 1, Wd, m, &dead, &Xh, &mean);
        if (st == BK_OK)
            st = bk_dside_from_matrix(c, &sa, Xh, n, npad, mean, la, o, c->factor_fp64, stats);
    } else {
        st = prepare_factor(p->LA, dt, n, la, &Xh);
        if (st == BK_OK)
            st = bk_dside_from_factor(c, &sa, Xh, n, npad, la, prec, stats);
    }
    free(Xh);
    Xh = NULL;
    if (st != BK_OK)
        goto fail;
    if (p->B) {
        st = prepare_matrix(p->B, dt, m, lb, 0, NULL, 0, NULL, &Xh, &mean);
        bk_solve_opts ob = *o; /* the output side may have its own damping */
        if (o->separate_damp_b)
            ob.damp = o->damp_b;
        if (st == BK_OK)
            st = bk_dside_from_matrix(c, &sb, Xh, m, mpad, mean, lb, &ob, c->factor_fp64, stats);
    } else if (p->LB) {
        st = prepare_factor(p->LB, dt, m, lb, &Xh);
        if (st == BK_OK)
            st = bk_dside_from_factor(c, &sb, Xh, m, mpad, lb, prec, stats);
    } else {
        sb.identity = 1;
    }
    free(Xh);
    Xh = NULL;
    if (st != BK_OK)
        goto fail;

    if ((st = bk_alphabet_fit(&alpha, Wd, n)) != BK_OK) {
        bk_error_prefix(st, lw);
        goto fail;
    }
    t1 = bk_now();

    /* device problem */
    st = bk_dev_alloc(c, &dW, rsz * (size_t)mpad * (size_t)npad, "the weight matrix");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dcodes, sizeof(int16_t) * mn, "the codes");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dweight, sizeof(float) * mn, "the dequantized weights");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dcounts, sizeof counts, "the counters");
    if (st == BK_OK)
        st = bk_dev_alloc(c, &dscale, rsz * (size_t)m * (size_t)alpha.groups, "the scales");
    if (st == BK_OK && alpha.zero)
        st = bk_dev_alloc(c, &dzero, rsz * (size_t)m * (size_t)alpha.groups, "the zero points");
    if (st == BK_OK)
        st = upload_as(c, dW, npad, Wd, m, n, prec);
    if (st == BK_OK)
        st = upload_f32_as(c, dscale, alpha.scale, (size_t)m * (size_t)alpha.groups, prec);
    if (st == BK_OK && alpha.zero)
        st = upload_f32_as(c, dzero, alpha.zero, (size_t)m * (size_t)alpha.groups, prec);
    if (st != BK_OK)
        goto fail;

    memset(&a, 0, sizeof a);
    a.m = m;
    a.n = n;
    a.mpad = mpad;
    a.npad = npad;
    a.W = dW;
    a.ldw = npad;
    a.LA = sa.dL;
    a.ldla = npad;
    a.LB = (o->algorithm == BK_ALG_GPTQ || sb.identity) ? NULL : sb.dL;
    a.ldlb = mpad;
    a.q.kind = o->quant.kind;
    a.q.qmin = alpha.qmin;
    a.q.qmax = alpha.qmax;
    a.q.group = alpha.group;
    a.q.groups = alpha.groups;
    a.q.scale = dscale;
    a.q.zero = dzero;
    a.codes = dcodes;
    a.weight = dweight;
    a.counts = dcounts;
    a.gptq_block = o->gptq_block;
    if (o->algorithm == BK_ALG_GPTQ && o->quant.refit_groups) {
        rc.c = c;
        rc.al = &alpha;
        rc.prec = prec;
        rc.dscale = dscale;
        rc.dzero = dzero;
        rc.label = lw;
        a.refit = refit_group;
        a.refit_ctx = &rc;
    }
    st = bk_cuda_core(c, o->algorithm, prec, &a, &ms);
    if (st != BK_OK) {
        bk_error_prefix(st, lw);
        goto fail;
    }
    BK_CUDA_GOTO(cudaMemcpyAsync(r->codes, dcodes, sizeof(int16_t) * mn, cudaMemcpyDeviceToHost,
                                 c->stream),
                 st, fail);
    /* the kernels store the value each code stands for as the CPU rule
     * computes it (a -0 included), so it is copied, not recomputed */
    BK_CUDA_GOTO(cudaMemcpyAsync(r->weight, dweight, sizeof(float) * mn, cudaMemcpyDeviceToHost,
                                 c->stream),
                 st, fail);
    BK_CUDA_GOTO(cudaMemcpyAsync(counts, dcounts, sizeof counts, cudaMemcpyDeviceToHost,
                                 c->stream),
                 st, fail);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    /* the device problem and factors are no longer needed: free them before
     * the statistics (the damped matrices stay) */
    bk_dev_free(c, dW);
    dW = NULL;
    bk_dev_free(c, sa.dL);
    sa.dL = NULL;
    bk_dev_free(c, sb.dL);
    sb.dL = NULL;
    t2 = bk_now();
    if (counts[2] > 0) {
        st = bk_error(BK_ERR_NONFINITE,
                      "%s: %lld values became non-finite during the %s solve (inputs too large "
                      "for %s?)",
                      lw, (long long)counts[2], bk_algorithm_name(o->algorithm),
                      prec == BK_PREC_FP64 ? "fp64" : "fp32");
        goto fail;
    }
    if (counts[1] > 0) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "%s: integer alphabet: %lld codes exceed the int16 range of the result "
                      "(|code| <= %d)",
                      lw, (long long)counts[1], BK_Q_INT16_MAX);
        goto fail;
    }

    if (stats) {
        double *Wq = Wd; /* reuse: staged as double, then Wd again */
        st = bk_dev_alloc(c, (void **)&dWq, sizeof(double) * mn, "loss: weight");
        if (st == BK_OK)
            st = bk_dev_alloc(c, (void **)&dW0, sizeof(double) * mn, "loss: W");
        if (st != BK_OK)
            goto fail;
        BK_CUDA_GOTO(cudaMemcpyAsync(dW0, Wd, sizeof(double) * mn, cudaMemcpyHostToDevice,
                                     c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
        for (size_t t = 0; t < mn; t++)
            Wq[t] = (double)r->weight[t];
        BK_CUDA_GOTO(cudaMemcpyAsync(dWq, Wq, sizeof(double) * mn, cudaMemcpyHostToDevice,
                                     c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
        st = bk_cuda_losses(c, m, n, dWq, dW0, sa.dtil, sb.identity ? NULL : sb.dtil,
                            &r->loss_one_sided, &r->loss_two_sided);
        if (st != BK_OK)
            goto fail;
        if (o->algorithm != BK_ALG_RTN) {
            const int use_b = family_two_sided(o->algorithm) && !sb.identity;
            double bound = 0.0;
            for (int64_t i = 0; i < m; i++) {
                const double rbi = use_b ? sb.rdiag[i] : 1.0;
                double row = 0.0;
                for (int64_t j = 0; j < n; j++) {
                    const double s = bk_q_scale_at(&alpha, i, j);
                    row += s * s * sa.rdiag[j] * sa.rdiag[j];
                }
                bound += rbi * rbi * row;
            }
            r->bound = 0.25 * bound;
        }
    }
    t3 = bk_now();

    r->m = m;
    r->n = n;
    r->groups = alpha.groups;
    r->scales = alpha.scale;
    alpha.scale = NULL;
    if (o->quant.kind == BK_Q_UNIFORM && o->quant.asym) {
        r->zeros = alpha.zero;
        alpha.zero = NULL;
    }
    r->damp_a = p->A ? sa.damp : 0.0;
    r->damp_b = p->B ? sb.damp : 0.0;
    r->damp_retries = sa.retries + sb.retries;
    r->dead_columns = dead;
    r->clamped = (int64_t)counts[0];
    r->time_factor_s = t1 - t0;
    r->time_solve_s = (double)ms / 1000.0;
    r->time_stats_s = stats ? t3 - t2 : 0.0;
    bk_alphabet_free(&alpha);
    bk_dside_free(c, &sa);
    bk_dside_free(c, &sb);
    bk_dev_free(c, dWq);
    bk_dev_free(c, dW0);
    bk_dev_free(c, dscale);
    bk_dev_free(c, dzero);
    bk_dev_free(c, dcodes);
    bk_dev_free(c, dweight);
    bk_dev_free(c, dcounts);
    free(Wd);
    return BK_OK;

fail:
    cudaStreamSynchronize(c->stream);
    cudaGetLastError();
    bk_alphabet_free(&alpha);
    bk_dside_free(c, &sa);
    bk_dside_free(c, &sb);
    bk_dev_free(c, dW);
    bk_dev_free(c, dWq);
    bk_dev_free(c, dW0);
    bk_dev_free(c, dscale);
    bk_dev_free(c, dzero);
    bk_dev_free(c, dcodes);
    bk_dev_free(c, dweight);
    bk_dev_free(c, dcounts);
    free(Wd);
    free(Xh);
    bk_solve_result_free(r);
    r->loss_two_sided = r->loss_one_sided = r->bound = NAN;
    return st;
}
