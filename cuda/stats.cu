/* CUDA backend — the statistics in double (cuBLAS), as src/solver.c's
 * losses(): E = Wq - W0, F = E A~, loss_one = sum E o F, and with B
 * G = B~ E, loss_two = sum G o F (= tr(E^T B~ E A~)).
 *
 * The GPTQ proxy loss tr(E A_plain E^T) of the same E comes from the same F
 * when A~ - A_plain is diagonal (A~ is A mirrored and damped; A_plain is the
 * same F32 matrix for every kind but the Shampoo ones):
 * E A_plain = F - E diag(d), d_j = A~_jj - A_plain_jj, so
 * loss_plain = sum_ij E_ij (F_ij - d_j E_ij), one pass over E and F instead of
 * a second m n^2 GEMM in double. */
#include <cmath>
#include <cstring>

#include "cuda_internal.cuh"

namespace {

__global__ void k_sub(double *a, const double *b, int64_t count)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < count)
        a[idx] -= b[idx];
}

/* d[j] = At[j, j] - (double)Ap[j, j]; *off = 1 when any off-diagonal entry
 * of At [n, n] differs from (double)Ap (both row-major, ld n). */
__global__ void k_diag_delta(const double *At, const float *Ap, int64_t n, double *d,
                             unsigned *off)
{
    const int64_t nn = n * n;
    unsigned bad = 0;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nn;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = t / n, j = t - i * n;
        const double a = At[t], p = (double)Ap[t];
        if (i == j)
            d[j] = a - p;
        else if (a != p)
            bad = 1;
    }
    if (bad)
        *off = 1u;
}

#define LOSS_THREADS 256
#define LOSS_BLOCKS 1024

/* part[block] = the block's share of sum_t E_t (F_t - d_{t mod n} E_t), a
 * fixed grid and a fixed order (deterministic). */
__global__ void k_loss_plain(const double *E, const double *F, const double *d, int64_t n,
                             int64_t count, double *part)
{
    __shared__ double sh[LOSS_THREADS];
    double s = 0.0;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < count;
         t += (int64_t)gridDim.x * blockDim.x) {
        const double e = E[t];
        s += e * (F[t] - d[t % n] * e);
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = LOSS_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        part[blockIdx.x] = sh[0];
}

__global__ void k_sum_parts(const double *part, int count, double *out)
{
    __shared__ double sh[LOSS_THREADS];
    double s = 0.0;
    for (int t = (int)threadIdx.x; t < count; t += LOSS_THREADS)
        s += part[t];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = LOSS_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        *out = sh[0];
}

/* The proxy loss from E and F = E A~ when A~ - Ap is diagonal; *loss = NAN
 * (and BK_OK) when it is not. */
bk_status loss_plain_from(bk_cuda_ctx *c, int64_t m, int64_t n, const double *E, const double *F,
                          const double *At, const float *Ap, double *loss)
{
    *loss = NAN;
    double *d = NULL, *part = NULL;
    unsigned off = 0, *doff = NULL;
    bk_status st = bk_dev_alloc(c, (void **)&d, sizeof(double) * (size_t)n, "loss: diagonal");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&part, sizeof(double) * (LOSS_BLOCKS + 1), "loss: sums");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&doff, sizeof(unsigned), "loss: flag");
    if (st != BK_OK)
        goto done;
    {
        const int64_t nn = n * n;
        int64_t blocks = (nn + 255) / 256;
        if (blocks > 65536)
            blocks = 65536;
        k_diag_delta<<<(unsigned)blocks, 256, 0, c->stream>>>(At, Ap, n, d, doff);
        BK_CUDA_GOTO(cudaGetLastError(), st, done);
        BK_CUDA_GOTO(cudaMemcpyAsync(&off, doff, sizeof off, cudaMemcpyDeviceToHost, c->stream),
                     st, done);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
    }
    if (off)
        goto done; /* not diagonal: the caller runs the GEMM */
    k_loss_plain<<<LOSS_BLOCKS, LOSS_THREADS, 0, c->stream>>>(E, F, d, n, m * n, part);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    k_sum_parts<<<1, LOSS_THREADS, 0, c->stream>>>(part, LOSS_BLOCKS, part + LOSS_BLOCKS);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    BK_CUDA_GOTO(cudaMemcpyAsync(loss, part + LOSS_BLOCKS, sizeof(double),
                                 cudaMemcpyDeviceToHost, c->stream),
                 st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
done:
    if (st != BK_OK)
        *loss = NAN;
    bk_dev_free(c, doff);
    bk_dev_free(c, part);
    bk_dev_free(c, d);
    return st;
}

} // namespace

bk_status bk_cuda_losses(bk_cuda_ctx *c, int64_t m, int64_t n, const double *dWq,
                         const double *dW0, const double *dAd, const double *dBd,
                         double *loss_one, double *loss_two, const float *dAp,
                         double *loss_plain)
{
    const int64_t mn = m * n;
    double *E = NULL, *F = NULL, *G = NULL;
    if (loss_plain)
        *loss_plain = NAN;
    bk_status st = bk_dev_alloc(c, (void **)&E, sizeof(double) * (size_t)mn, "loss: E");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&F, sizeof(double) * (size_t)mn, "loss: E A");
    if (st == BK_OK && dBd)
        st = bk_dev_alloc(c, (void **)&G, sizeof(double) * (size_t)mn, "loss: B E");
    if (st != BK_OK)
        goto done;
    BK_CUDA_GOTO(cudaMemcpyAsync(E, dWq, sizeof(double) * (size_t)mn, cudaMemcpyDeviceToDevice,
                                 c->stream),
                 st, done);
    k_sub<<<(unsigned)((mn + 255) / 256), 256, 0, c->stream>>>(E, dW0, mn);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    st = bk_rm_gemm(c->cublas, 0, 0, m, n, n, 1.0, E, n, dAd, n, 0.0, F, n);
    if (st != BK_OK)
        goto done;
    BK_CUBLAS_GOTO(cublasDdot_64(c->cublas, mn, E, 1, F, 1, loss_one), st, done);
    if (dBd) {
        st = bk_rm_gemm(c->cublas, 0, 0, m, n, m, 1.0, dBd, m, E, n, 0.0, G, n);
        if (st != BK_OK)
            goto done;
        BK_CUBLAS_GOTO(cublasDdot_64(c->cublas, mn, G, 1, F, 1, loss_two), st, done);
    } else {
        *loss_two = *loss_one;
    }
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
    if (dAp && loss_plain)
        st = loss_plain_from(c, m, n, E, F, dAd, dAp, loss_plain);
done:
    bk_dev_free(c, G);
    bk_dev_free(c, F);
    bk_dev_free(c, E);
    return st;
}

/* ------------------------------------- the same statistics on their own stream */

namespace {

/* The stats stream (lowest priority: the main stream's next work goes first),
 * its cuBLAS handle (the main handle's math mode) and its ordering event. */
bk_status stats_stream_ready(bk_cuda_ctx *c)
{
    bk_status st = BK_OK;
    if (!c->stats_stream) {
        int lo = 0, hi = 0;
        BK_CUDA_GOTO(cudaDeviceGetStreamPriorityRange(&lo, &hi), st, done);
        BK_CUDA_GOTO(cudaStreamCreateWithPriority(&c->stats_stream, cudaStreamNonBlocking, lo),
                     st, done);
    }
    if (!c->stats_ready)
        BK_CUDA_GOTO(cudaEventCreateWithFlags(&c->stats_ready, cudaEventDisableTiming), st, done);
    if (!c->stats_blas) {
        cublasHandle_t h = NULL;
        BK_CUBLAS_GOTO(cublasCreate(&h), st, done);
        c->stats_blas = h;
        BK_CUBLAS_GOTO(cublasSetStream(h, c->stats_stream), st, done);
        BK_CUBLAS_GOTO(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), st, done);
    }
done:
    return st;
}

void stats_release(bk_cuda_ctx *c, bk_stats_job *j)
{
    bk_dev_free(c, j->res);
    bk_dev_free(c, j->doff);
    bk_dev_free(c, j->part);
    bk_dev_free(c, j->d);
    bk_dev_free(c, j->G);
    bk_dev_free(c, j->F);
    bk_dev_free(c, j->E);
    memset(j, 0, sizeof *j);
}

} // namespace

void bk_cuda_stats_drop(bk_cuda_ctx *c, bk_stats_job *j)
{
    if (c->stats_stream)
        cudaStreamSynchronize(c->stats_stream);
    cudaGetLastError();
    stats_release(c, j);
}

bk_status bk_cuda_stats_launch(bk_cuda_ctx *c, bk_stats_job *j, int64_t m, int64_t n,
                               const double *dWq, const double *dW0, const double *dAd,
                               const double *dBd, const float *dAp)
{
    const int64_t mn = m * n;
    cudaStream_t s = NULL;
    memset(j, 0, sizeof *j);
    j->two = dBd != NULL;
    j->plain = dAp != NULL;
    /* everything allocated (and zeroed on c->stream) before the stats stream
     * is ordered after c->stream: no allocation or free while it runs */
    bk_status st = stats_stream_ready(c);
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&j->E, sizeof(double) * (size_t)mn, "loss: E");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&j->F, sizeof(double) * (size_t)mn, "loss: E A");
    if (st == BK_OK && dBd)
        st = bk_dev_alloc(c, (void **)&j->G, sizeof(double) * (size_t)mn, "loss: B E");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&j->res, sizeof(double) * 3, "loss: results");
    if (st == BK_OK && dAp)
        st = bk_dev_alloc(c, (void **)&j->d, sizeof(double) * (size_t)n, "loss: diagonal");
    if (st == BK_OK && dAp)
        st = bk_dev_alloc(c, (void **)&j->part, sizeof(double) * (LOSS_BLOCKS + 1),
                          "loss: sums");
    if (st == BK_OK && dAp)
        st = bk_dev_alloc(c, (void **)&j->doff, sizeof(unsigned), "loss: flag");
    if (st != BK_OK)
        goto fail;
    s = c->stats_stream;
    BK_CUDA_GOTO(cudaEventRecord(c->stats_ready, c->stream), st, fail);
    BK_CUDA_GOTO(cudaStreamWaitEvent(s, c->stats_ready, 0), st, fail);
    j->active = 1;
    /* bk_cuda_losses' sequence on s */
    BK_CUDA_GOTO(cudaMemcpyAsync(j->E, dWq, sizeof(double) * (size_t)mn,
                                 cudaMemcpyDeviceToDevice, s),
                 st, fail);
    k_sub<<<(unsigned)((mn + 255) / 256), 256, 0, s>>>(j->E, dW0, mn);
    BK_CUDA_GOTO(cudaGetLastError(), st, fail);
    st = bk_rm_gemm(c->stats_blas, 0, 0, m, n, n, 1.0, j->E, n, dAd, n, 0.0, j->F, n);
    if (st != BK_OK)
        goto fail;
    /* the dot products into device memory (no host wait); the GEMMs' alpha
     * and beta are host scalars, so the mode goes back after each */
    BK_CUBLAS_GOTO(cublasSetPointerMode(c->stats_blas, CUBLAS_POINTER_MODE_DEVICE), st, fail);
    st = bk_cublas_status(cublasDdot_64(c->stats_blas, mn, j->E, 1, j->F, 1, j->res),
                          "cublasDdot_64 (loss one-sided)", __FILE__, __LINE__);
    cublasSetPointerMode(c->stats_blas, CUBLAS_POINTER_MODE_HOST);
    if (st != BK_OK)
        goto fail;
    if (dBd) {
        st = bk_rm_gemm(c->stats_blas, 0, 0, m, n, m, 1.0, dBd, m, j->E, n, 0.0, j->G, n);
        if (st != BK_OK)
            goto fail;
        BK_CUBLAS_GOTO(cublasSetPointerMode(c->stats_blas, CUBLAS_POINTER_MODE_DEVICE), st,
                       fail);
        st = bk_cublas_status(cublasDdot_64(c->stats_blas, mn, j->G, 1, j->F, 1, j->res + 1),
                              "cublasDdot_64 (loss two-sided)", __FILE__, __LINE__);
        cublasSetPointerMode(c->stats_blas, CUBLAS_POINTER_MODE_HOST);
        if (st != BK_OK)
            goto fail;
    }
    if (dAp) {
        /* loss_plain_from's kernels; the sum is formed whether or not A~ - Ap
         * is diagonal and used only when it is (the flag, read at the
         * collection) */
        const int64_t nn = n * n;
        int64_t blocks = (nn + 255) / 256;
        if (blocks > 65536)
            blocks = 65536;
        k_diag_delta<<<(unsigned)blocks, 256, 0, s>>>(dAd, dAp, n, j->d, j->doff);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        k_loss_plain<<<LOSS_BLOCKS, LOSS_THREADS, 0, s>>>(j->E, j->F, j->d, n, mn, j->part);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        k_sum_parts<<<1, LOSS_THREADS, 0, s>>>(j->part, LOSS_BLOCKS, j->res + 2);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
    }
    return BK_OK;
fail:
    bk_cuda_stats_drop(c, j);
    return st;
}

bk_status bk_cuda_stats_collect(bk_cuda_ctx *c, bk_stats_job *j, double *loss_one,
                                double *loss_two, double *loss_plain)
{
    double res[3] = {0.0, 0.0, 0.0};
    unsigned off = 0;
    bk_status st = BK_OK;
    if (loss_plain)
        *loss_plain = NAN;
    if (!j->active)
        return bk_error(BK_ERR_INTERNAL, "the statistics collected without a launch");
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stats_stream), st, done);
    BK_CUDA_GOTO(cudaMemcpyAsync(res, j->res, sizeof res, cudaMemcpyDeviceToHost,
                                 c->stats_stream),
                 st, done);
    if (j->plain)
        BK_CUDA_GOTO(cudaMemcpyAsync(&off, j->doff, sizeof off, cudaMemcpyDeviceToHost,
                                     c->stats_stream),
                     st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stats_stream), st, done);
    *loss_one = res[0];
    *loss_two = j->two ? res[1] : res[0];
    if (loss_plain && j->plain && !off)
        *loss_plain = res[2];
done:
    if (st != BK_OK)
        bk_cuda_stats_drop(c, j);
    else
        stats_release(c, j);
    return st;
}
