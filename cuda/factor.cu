/* CUDA backend — damping and the normalized Cholesky factor of the inverse
 * (cuSOLVER), with the CPU's escalation rules (src/solver.c,
 * side_from_matrix / side_from_factor; docs/solver.md).
 *
 * Row-major lower = column-major upper. The Cholesky factor of X^-1 from
 * J X J = R R^T (J the reversal): L = J R^-T J, by potrf('U') and
 * trtri('U') on the reversed row-major buffer and an anti-transpose -- the
 * same steps as bk_factor_inverse on the CPU (docs/solver.md step 4).
 */
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cuda_internal.cuh"
#include "factor_kernels.cuh"
#include "solver_check.h"

namespace {

/* ------------------------------------------------------ cuSOLVER overloads */

cusolverStatus_t potrf_bs(cusolverDnHandle_t h, int n, float *A, int lda, int *lw)
{
    return cusolverDnSpotrf_bufferSize(h, CUBLAS_FILL_MODE_UPPER, n, A, lda, lw);
}
cusolverStatus_t potrf_bs(cusolverDnHandle_t h, int n, double *A, int lda, int *lw)
{
    return cusolverDnDpotrf_bufferSize(h, CUBLAS_FILL_MODE_UPPER, n, A, lda, lw);
}
cusolverStatus_t potrf(cusolverDnHandle_t h, int n, float *A, int lda, float *w, int lw, int *info)
{
    return cusolverDnSpotrf(h, CUBLAS_FILL_MODE_UPPER, n, A, lda, w, lw, info);
}
cusolverStatus_t potrf(cusolverDnHandle_t h, int n, double *A, int lda, double *w, int lw,
                       int *info)
{
    return cusolverDnDpotrf(h, CUBLAS_FILL_MODE_UPPER, n, A, lda, w, lw, info);
}
template <typename R> cudaDataType_t cuda_type();
template <> cudaDataType_t cuda_type<float>()
{
    return CUDA_R_32F;
}
template <> cudaDataType_t cuda_type<double>()
{
    return CUDA_R_64F;
}

cublasStatus_t trsm(cublasHandle_t h, cublasSideMode_t side, int64_t m, int64_t n,
                    const float *alpha, const float *A, int64_t lda, float *B, int64_t ldb)
{
    return cublasStrsm_64(h, side, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, m, n,
                          alpha, A, lda, B, ldb);
}
cublasStatus_t trsm(cublasHandle_t h, cublasSideMode_t side, int64_t m, int64_t n,
                    const double *alpha, const double *A, int64_t lda, double *B, int64_t ldb)
{
    return cublasDtrsm_64(h, side, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, m, n,
                          alpha, A, lda, B, ldb);
}

/* ----------------------------------------------------------------- kernels */

/* (k_fill_rev, k_antitranspose, k_get_diag, k_normalize: factor_kernels.cuh) */

template <typename S, typename D>
__global__ void k_convert(D *dst, const S *src, int64_t count)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < count)
        dst[idx] = (D)src[idx];
}

__global__ void k_add_diag(double *X, int64_t k, double add)
{
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k)
        X[j * k + j] += add;
}

inline unsigned blocks(int64_t n)
{
    return (unsigned)((n + 255) / 256);
}

/* Blocks of at most this order are inverted by cuSOLVER's trtri; larger ones
 * recursively (tri_inverse). */
const int64_t TRI_LEAF = 512;

/* The leaf workspace of tri_inverse (cuSOLVER trtri of order <= TRI_LEAF). */
struct tri_ws {
    void *dev, *host;
    size_t dbytes, hbytes;
    int *dinfo;
};

/* In place: the column-major upper triangular X [k, k] (stride ld) becomes
 * its inverse. With X = [[A, B], [0, C]], X^-1 = [[A^-1, -A^-1 B C^-1],
 * [0, C^-1]]: B <- -A^-1 B C^-1 by two cuBLAS triangular solves with the
 * original A and C, then A and C recursively; blocks of order <= TRI_LEAF
 * by cuSOLVER's trtri (its cost is dominated by the large triangular
 * solves, about k^3/3 flop in all, as trtri's; cuSOLVER's own trtri is
 * about twice as slow as potrf on the 14336^2 factors of an 8B model).
 * *info > 0: a zero diagonal entry in a leaf. */
template <typename R>
bk_status tri_inverse(bk_cuda_ctx *c, R *X, int64_t k, int64_t ld, const tri_ws *w, int *info)
{
    if (k <= TRI_LEAF) {
        BK_CUSOLVER_CHECK(cusolverDnXtrtri(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                           CUBLAS_DIAG_NON_UNIT, k, cuda_type<R>(), X, ld, w->dev,
                                           w->dbytes, w->host, w->hbytes, w->dinfo));
        BK_CUDA_CHECK(cudaMemcpyAsync(info, w->dinfo, sizeof *info, cudaMemcpyDeviceToHost,
                                      c->stream));
        BK_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        return BK_OK;
    }
    const int64_t n1 = (k / 2 + 63) / 64 * 64, n2 = k - n1;
    R *A = X, *B = X + n1 * ld, *C = X + n1 * ld + n1;
    const R minus_one = R(-1), one = R(1);
    BK_CUBLAS_CHECK(trsm(c->cublas, CUBLAS_SIDE_LEFT, n1, n2, &minus_one, A, ld, B, ld));
    BK_CUBLAS_CHECK(trsm(c->cublas, CUBLAS_SIDE_RIGHT, n1, n2, &one, C, ld, B, ld));
    bk_status st = tri_inverse<R>(c, A, n1, ld, w, info);
    if (st == BK_OK && *info == 0)
        st = tri_inverse<R>(c, C, n2, ld, w, info);
    return st;
}

/* bk_factor_inverse on the device, in place on the leading k x k block of X
 * (row stride ld), which holds J X J (k_fill_rev): *step = 0 on success,
 * else the failed step (1 Cholesky, 2 triangular inverse, 3 a non-positive
 * diagonal). diag (host, k) receives the unnormalized diagonal. */
template <typename R>
bk_status factor_inverse(bk_cuda_ctx *c, R *X, int64_t k, int64_t ld, double *diag, int *step)
{
    bk_status st = BK_OK;
    int lw = 0, info = 0;
    size_t twd = 0, twh = 0;
    R *work = NULL, *d = NULL, *dh = NULL;
    void *twork = NULL, *thost = NULL;
    int *dinfo = NULL;
    *step = 0;
    double tp = bk_now();
    /* orders whose k x ld buffer exceeds 2^31 elements (a 405B-width
     * down_proj: 53248) go through cuSOLVER's 64-bit potrf; the smaller ones
     * keep the 32-bit entry their results were validated with */
    const int big = k * ld > (int64_t)2147483647;
    cusolverDnParams_t prm = NULL;
    size_t pwd = 0, pwh = 0;
    void *phost = NULL;
    if (big) {
        BK_CUSOLVER_CHECK(cusolverDnCreateParams(&prm));
        bk_status pst = bk_cusolver_status(
            cusolverDnXpotrf_bufferSize(c->cusolver, prm, CUBLAS_FILL_MODE_UPPER, k, cuda_type<R>(),
                                        X, ld, cuda_type<R>(), &pwd, &pwh),
            "cusolverDnXpotrf_bufferSize", __FILE__, __LINE__);
        if (pst != BK_OK) {
            cusolverDnDestroyParams(prm);
            return pst;
        }
        lw = (int)((pwd + sizeof(R) - 1) / sizeof(R)); /* the device workspace, in elements */
    } else {
        BK_CUSOLVER_CHECK(potrf_bs(c->cusolver, (int)k, X, (int)ld, &lw));
    }
    BK_CUSOLVER_GOTO(cusolverDnXtrtri_bufferSize(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                                 CUBLAS_DIAG_NON_UNIT,
                                                 k < TRI_LEAF ? k : TRI_LEAF, cuda_type<R>(), X,
                                                 ld, &twd, &twh),
                     st, done);
    st = bk_dev_alloc(c, (void **)&work,
                      big ? (pwd > 0 ? pwd : 1) : sizeof(R) * (size_t)(lw > 0 ? lw : 1),
                      "factor: cuSOLVER workspace");
    if (st == BK_OK && pwh > 0 && !(phost = malloc(pwh)))
        st = bk_error(BK_ERR_NOMEM, "factor: out of host memory");
    if (st == BK_OK)
        st = bk_dev_alloc(c, &twork, twd > 0 ? twd : 1, "factor: trtri workspace");
    if (st == BK_OK && twh > 0 && !(thost = malloc(twh)))
        st = bk_error(BK_ERR_NOMEM, "factor: out of host memory");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dinfo, sizeof(int), "factor: info");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&d, sizeof(R) * (size_t)k, "factor: diagonal");
    if (st != BK_OK)
        goto done;
    bk_cuda_pmark(c->stream, &tp, "fac.alloc");
    for (int s = 1; s <= 2; s++) {
        if (s == 1) {
            if (big)
                BK_CUSOLVER_GOTO(cusolverDnXpotrf(c->cusolver, prm, CUBLAS_FILL_MODE_UPPER, k,
                                                  cuda_type<R>(), X, ld, cuda_type<R>(), work, pwd,
                                                  phost, pwh, dinfo),
                                 st, done);
            else
                BK_CUSOLVER_GOTO(potrf(c->cusolver, (int)k, X, (int)ld, work, lw, dinfo), st,
                                 done);
            BK_CUDA_GOTO(cudaMemcpyAsync(&info, dinfo, sizeof info, cudaMemcpyDeviceToHost,
                                         c->stream),
                         st, done);
            BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
        } else {
            const tri_ws w = {twork, thost, twd, twh, dinfo};
            if ((st = tri_inverse<R>(c, X, k, ld, &w, &info)) != BK_OK)
                goto done;
        }
        if (info < 0) {
            st = bk_error(BK_ERR_DEVICE, "cuSOLVER: argument %d of the factorization step %d "
                          "is invalid", -info, s);
            goto done;
        }
        if (info > 0) {
            *step = s;
            goto done;
        }
        bk_cuda_pmark(c->stream, &tp, s == 1 ? "fac.potrf" : "fac.trtri");
    }
    k_antitranspose<R><<<blocks(k * k), 256, 0, c->stream>>>(X, ld, k);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    k_get_diag<R><<<blocks(k), 256, 0, c->stream>>>(X, ld, k, d);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    dh = static_cast<R *>(malloc(sizeof(R) * (size_t)k));
    if (!dh) {
        st = bk_error(BK_ERR_NOMEM, "factor: out of host memory");
        goto done;
    }
    BK_CUDA_GOTO(cudaMemcpyAsync(dh, d, sizeof(R) * (size_t)k, cudaMemcpyDeviceToHost, c->stream),
                 st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
    for (int64_t j = 0; j < k; j++) {
        diag[j] = (double)dh[j];
        if (!(dh[j] > R(0))) {
            *step = 3;
            goto done;
        }
    }
    k_normalize<R><<<blocks(k * k), 256, 0, c->stream>>>(X, ld, k, d);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
    bk_cuda_pmark(c->stream, &tp, "fac.normalize");
done:
    free(dh);
    free(thost);
    free(phost);
    if (prm)
        cusolverDnDestroyParams(prm);
    bk_dev_free(c, d);
    bk_dev_free(c, dinfo);
    bk_dev_free(c, work);
    bk_dev_free(c, twork);
    return st;
}

/* One damping attempt (bk_solve_damp_escalate, src/solver_check.c): L =
 * dXd + add I in the working precision (padded), factored. */
template <typename R> struct damp_try {
    bk_cuda_ctx *c;
    bk_dside *s;
    R *L;
    const double *dXd;
    int64_t k, kpad;
};

template <typename R> bk_status cuda_damp_try(void *user, double add, int *step)
{
    damp_try<R> *d = static_cast<damp_try<R> *>(user);
    k_fill_rev<R><<<blocks(d->kpad * d->kpad), 256, 0, d->c->stream>>>(d->L, d->kpad, d->dXd,
                                                                      d->k, d->kpad, add);
    BK_CUDA_CHECK(cudaGetLastError());
    return factor_inverse<R>(d->c, d->L, d->k, d->kpad, d->s->rdiag, step);
}

/* Damp and factor from the device double matrix dXd [k, k] (symmetric, zero
 * diagonals already replaced); dXd is consumed: it becomes s->dtil (with the
 * damping added) when keep_til, else it is freed, also on failure. */
template <typename R>
bk_status from_matrix(bk_cuda_ctx *c, bk_dside *s, double *dXd, int64_t k, int64_t kpad,
                      double mean, const char *label, const bk_solve_opts *o, int keep_til,
                      R **out_L)
{
    bk_status st = BK_OK;
    R *L = NULL;
    st = bk_dev_alloc(c, (void **)&L, sizeof(R) * (size_t)kpad * (size_t)kpad,
                      "factor: Cholesky factor");
    if (st != BK_OK)
        goto fail;
    {
        double add = 0.0;
        damp_try<R> dt = {c, s, L, dXd, k, kpad};
        st = bk_solve_damp_escalate(o, mean, label, cuda_damp_try<R>, &dt, &s->damp, &add,
                                    &s->retries);
        if (st != BK_OK)
            goto fail;
        for (int64_t j = 0; j < k; j++)
            s->rdiag[j] = 1.0 / s->rdiag[j];
        if (keep_til) {
            k_add_diag<<<blocks(k), 256, 0, c->stream>>>(dXd, k, add);
            BK_CUDA_GOTO(cudaGetLastError(), st, fail);
            s->dtil = dXd;
            dXd = NULL;
        }
    }
    bk_dev_free(c, dXd);
    *out_L = L;
    return BK_OK;
fail:
    bk_dev_free(c, dXd);
    bk_dev_free(c, L);
    return st;
}

} // namespace

void bk_dside_free(bk_cuda_ctx *c, bk_dside *s)
{
    if (!s)
        return;
    bk_dev_free(c, s->dL);
    bk_dev_free(c, s->dtil);
    free(s->rdiag);
    memset(s, 0, sizeof *s);
}

bk_status bk_dside_from_dmatrix(bk_cuda_ctx *c, bk_dside *s, double *dXd, int64_t k,
                                int64_t kpad, double mean, const char *label,
                                const bk_solve_opts *o, int fp64_factor, int keep_til)
{
    memset(s, 0, sizeof *s);
    s->k = k;
    s->kpad = kpad;
    s->rdiag = static_cast<double *>(malloc(sizeof(double) * (size_t)k));
    if (!s->rdiag) {
        bk_dev_free(c, dXd);
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                        (long long)k, (long long)k);
    }
    bk_status st;
    if (o->precision == BK_PREC_FP64) {
        double *L = NULL;
        st = from_matrix<double>(c, s, dXd, k, kpad, mean, label, o, keep_til, &L);
        s->dL = L;
    } else if (!fp64_factor) {
        float *L = NULL;
        st = from_matrix<float>(c, s, dXd, k, kpad, mean, label, o, keep_til, &L);
        s->dL = L;
    } else {
        double *Ld = NULL;
        float *L = NULL;
        st = from_matrix<double>(c, s, dXd, k, kpad, mean, label, o, keep_til, &Ld);
        if (st == BK_OK)
            st = bk_dev_alloc(c, (void **)&L, sizeof(float) * (size_t)kpad * (size_t)kpad,
                              "factor: Cholesky factor (fp32)");
        if (st == BK_OK) {
            k_convert<double, float><<<blocks(kpad * kpad), 256, 0, c->stream>>>(L, Ld,
                                                                                 kpad * kpad);
            st = bk_cuda_status(cudaGetLastError(), "k_convert", __FILE__, __LINE__);
        }
        if (st == BK_OK)
            st = bk_cuda_status(cudaStreamSynchronize(c->stream), "factor", __FILE__, __LINE__);
        bk_dev_free(c, Ld);
        s->dL = L;
    }
    if (st != BK_OK)
        bk_dside_free(c, s);
    return st;
}

bk_status bk_dside_from_matrix(bk_cuda_ctx *c, bk_dside *s, const double *Xd, int64_t k,
                               int64_t kpad, double mean, const char *label,
                               const bk_solve_opts *o, int fp64_factor, int keep_til)
{
    memset(s, 0, sizeof *s);
    double *dXd = NULL;
    const size_t kk = (size_t)k * (size_t)k;
    bk_status st = bk_dev_alloc(c, (void **)&dXd, sizeof(double) * kk, "factor: damped matrix");
    if (st != BK_OK)
        return st;
    BK_CUDA_GOTO(cudaMemcpyAsync(dXd, Xd, sizeof(double) * kk, cudaMemcpyHostToDevice, c->stream),
                 st, fail);
    return bk_dside_from_dmatrix(c, s, dXd, k, kpad, mean, label, o, fp64_factor, keep_til);
fail:
    bk_dev_free(c, dXd);
    return st;
}

bk_status bk_dside_from_factor(bk_cuda_ctx *c, bk_dside *s, const double *Lh, int64_t k,
                               int64_t kpad, const char *label, bk_precision prec, int keep_til)
{
    memset(s, 0, sizeof *s);
    s->k = k;
    s->kpad = kpad;
    const size_t kk = (size_t)k * (size_t)k;
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *Ln = NULL;
    double *dT = NULL;
    int *dinfo = NULL;
    void *work = NULL;
    bk_status st = BK_OK;
    s->rdiag = static_cast<double *>(malloc(sizeof(double) * (size_t)k));
    Ln = calloc((size_t)kpad * (size_t)kpad, rsz);
    if (!s->rdiag || !Ln) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                      (long long)k, (long long)k);
        goto fail;
    }
    /* normalization on the host, as side_from_factor */
    for (int64_t i = 0; i < k; i++)
        for (int64_t j = 0; j <= i; j++) {
            double v = j == i ? 1.0 : Lh[i * k + j] / Lh[j * k + j];
            if (prec == BK_PREC_FP64)
                static_cast<double *>(Ln)[i * kpad + j] = v;
            else
                static_cast<float *>(Ln)[i * kpad + j] = (float)v;
        }
    for (int64_t j = 0; j < k; j++)
        s->rdiag[j] = 1.0 / Lh[j * k + j];
    st = bk_dev_alloc(c, &s->dL, rsz * (size_t)kpad * (size_t)kpad, "factor: Cholesky factor");
    if (st != BK_OK)
        goto fail;
    BK_CUDA_GOTO(cudaMemcpyAsync(s->dL, Ln, rsz * (size_t)kpad * (size_t)kpad,
                                 cudaMemcpyHostToDevice, c->stream),
                 st, fail);
    if (keep_til) {
        /* X~ = (L L^T)^-1 = L^-T L^-1: trtri on the column-major upper view
         * (= L^T) gives L^-T, i.e. the row-major L^-1; then one GEMM. */
        size_t wd = 0, wh = 0;
        int info = 0;
        void *hwork = NULL;
        st = bk_dev_alloc(c, (void **)&dT, sizeof(double) * kk, "factor: inverse factor");
        if (st == BK_OK)
            st = bk_dev_alloc(c, (void **)&s->dtil, sizeof(double) * kk, "factor: X~");
        if (st == BK_OK)
            st = bk_dev_alloc(c, (void **)&dinfo, sizeof(int), "factor: info");
        if (st != BK_OK)
            goto fail;
        BK_CUDA_GOTO(cudaMemcpyAsync(dT, Lh, sizeof(double) * kk, cudaMemcpyHostToDevice,
                                     c->stream),
                     st, fail);
        st = bk_cusolver_status(cusolverDnXtrtri_bufferSize(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                                            CUBLAS_DIAG_NON_UNIT, k, CUDA_R_64F,
                                                            dT, k, &wd, &wh),
                                "cusolverDnXtrtri_bufferSize", __FILE__, __LINE__);
        if (st == BK_OK)
            st = bk_dev_alloc(c, &work, wd > 0 ? wd : 1, "factor: trtri workspace");
        if (st == BK_OK && wh > 0) {
            hwork = malloc(wh);
            if (!hwork)
                st = bk_error(BK_ERR_NOMEM, "factor: out of host memory");
        }
        if (st == BK_OK)
            st = bk_cusolver_status(cusolverDnXtrtri(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                                     CUBLAS_DIAG_NON_UNIT, k, CUDA_R_64F, dT, k,
                                                     work, wd, hwork, wh, dinfo),
                                    "cusolverDnXtrtri", __FILE__, __LINE__);
        if (st == BK_OK)
            st = bk_cuda_status(cudaMemcpyAsync(&info, dinfo, sizeof info, cudaMemcpyDeviceToHost,
                                                c->stream),
                                "trtri info", __FILE__, __LINE__);
        if (st == BK_OK)
            st = bk_cuda_status(cudaStreamSynchronize(c->stream), "trtri", __FILE__, __LINE__);
        free(hwork);
        if (st != BK_OK)
            goto fail;
        if (info != 0) {
            st = bk_error(BK_ERR_NOT_PD, "%s: the precomputed factor cannot be inverted", label);
            goto fail;
        }
        /* dT (row-major) = L^-1, lower; X~ = (L^-1)^T L^-1 */
        st = bk_rm_gemm(c->cublas, 1, 0, k, k, k, 1.0, dT, k, dT, k, 0.0, s->dtil, k);
        if (st != BK_OK)
            goto fail;
    }
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    free(Ln);
    bk_dev_free(c, work);
    bk_dev_free(c, dinfo);
    bk_dev_free(c, dT);
    return BK_OK;
fail:
    free(Ln);
    bk_dev_free(c, work);
    bk_dev_free(c, dinfo);
    bk_dev_free(c, dT);
    bk_dside_free(c, s);
    return st;
}
