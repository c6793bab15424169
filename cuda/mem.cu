/* CUDA backend — tracked device allocations (for bk_backend_peak_memory and
 * the optional limit (setting mem_limit) used to test the out-of-memory path) and
 * the row-major GEMM wrapper over cuBLAS. */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <pthread.h>
#include <unistd.h>

#include "cuda_internal.cuh"

/* Each allocation carries its size in a 256-byte header so that frees can
 * be accounted for without a table. */
#define BK_DEV_HDR 256

/* The memory counters of every context (bk_cuda_ctx.acct: a context's
 * allocations may count against another's, from another host thread). */
static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;

static bk_cuda_ctx *acct_of(bk_cuda_ctx *c)
{
    return c->acct ? c->acct : c;
}

bk_status bk_dev_alloc(bk_cuda_ctx *c, void **p, size_t bytes, const char *what)
{
    *p = NULL;
    if (bytes > SIZE_MAX - BK_DEV_HDR)
        return bk_error(BK_ERR_DEVICE_OOM, "CUDA: %s: size overflows (%zu bytes)", what, bytes);
    size_t total = bytes + BK_DEV_HDR;
    bk_cuda_ctx *a = acct_of(c);
    pthread_mutex_lock(&g_mem_mu);
    const size_t held = a->mem_current, limit = a->mem_limit;
    pthread_mutex_unlock(&g_mem_mu);
    if (limit && held + total > limit)
        return bk_error(BK_ERR_DEVICE_OOM,
                        "CUDA out of memory: %s needs %zu bytes, %zu of the %zu-byte limit "
                        "(setting mem_limit) in use",
                        what, bytes, held, limit);
    unsigned char *raw = NULL;
    cudaError_t e = cudaMalloc((void **)&raw, total);
    if (e != cudaSuccess) {
        cudaGetLastError();
        if (e == cudaErrorMemoryAllocation) {
            size_t fr = 0, tot = 0;
            cudaMemGetInfo(&fr, &tot);
            cudaGetLastError();
            return bk_error(BK_ERR_DEVICE_OOM,
                            "CUDA out of memory: %s needs %.1f MiB, %.1f MiB free of %.1f MiB",
                            what, bytes / 1048576.0, fr / 1048576.0, tot / 1048576.0);
        }
        return bk_error(BK_ERR_DEVICE, "CUDA error allocating %s (%zu bytes): %s", what, bytes,
                        cudaGetErrorString(e));
    }
    e = cudaMemsetAsync(raw + BK_DEV_HDR, 0, bytes, c->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(raw, &total, sizeof total, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaFree(raw);
        return bk_cuda_status(e, "initializing a device allocation", __FILE__, __LINE__);
    }
    pthread_mutex_lock(&g_mem_mu);
    a->mem_current += total;
    if (a->mem_current > a->mem_peak)
        a->mem_peak = a->mem_current;
    pthread_mutex_unlock(&g_mem_mu);
    *p = raw + BK_DEV_HDR;
    return BK_OK;
}

bk_status bk_dev_mem_free(const bk_cuda_ctx *c, size_t *free_bytes, size_t *total_bytes)
{
    size_t fr = 0, tot = 0;
    cudaError_t e = cudaMemGetInfo(&fr, &tot);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *free_bytes = *total_bytes = 0;
        return bk_cuda_status(e, "reading the device's free memory", __FILE__, __LINE__);
    }
    if (c && c->mem_limit) {
        pthread_mutex_lock(&g_mem_mu);
        const size_t cur = c->mem_current;
        pthread_mutex_unlock(&g_mem_mu);
        const size_t left = cur < c->mem_limit ? c->mem_limit - cur : 0;
        if (left < fr)
            fr = left;
    }
    *free_bytes = fr;
    *total_bytes = tot;
    return BK_OK;
}

void bk_dev_free(bk_cuda_ctx *c, void *p)
{
    if (!p)
        return;
    if (c->defer) { /* the owner frees it (bk_dev_defer_flush) */
        bk_dev_defer *d = c->defer;
        if (d->n == d->cap) {
            const int cap = d->cap ? 2 * d->cap : 16;
            void **q = static_cast<void **>(realloc(d->p, sizeof(void *) * (size_t)cap));
            if (q) {
                d->p = q;
                d->cap = cap;
            }
        }
        if (d->n < d->cap) {
            d->p[d->n++] = p;
            return;
        }
        /* (no room for the pointer: freed here, which waits for the device) */
    }
    bk_cuda_ctx *a = acct_of(c);
    unsigned char *raw = static_cast<unsigned char *>(p) - BK_DEV_HDR;
    size_t total = 0;
    if (cudaMemcpy(&total, raw, sizeof total, cudaMemcpyDeviceToHost) == cudaSuccess) {
        pthread_mutex_lock(&g_mem_mu);
        if (total <= a->mem_current)
            a->mem_current -= total;
        pthread_mutex_unlock(&g_mem_mu);
    } else {
        cudaGetLastError();
    }
    cudaFree(raw);
    cudaGetLastError();
}

void bk_dev_defer_flush(bk_cuda_ctx *c, bk_dev_defer *d)
{
    if (!d)
        return;
    for (int i = 0; i < d->n; i++)
        bk_dev_free(c, d->p[i]);
    free(d->p);
    memset(d, 0, sizeof *d);
}

void bk_dev_note_transient(bk_cuda_ctx *c, size_t bytes)
{
    bk_cuda_ctx *a = acct_of(c);
    pthread_mutex_lock(&g_mem_mu);
    if (a->mem_current + bytes > a->mem_peak)
        a->mem_peak = a->mem_current + bytes;
    pthread_mutex_unlock(&g_mem_mu);
}

/* ------------------------------------------------------- downloads */

struct copy_part {
    const char *src;
    char *dst;
    size_t bytes;
    pthread_t tid;
    int started;
};

static void *copy_part_main(void *arg)
{
    copy_part *p = static_cast<copy_part *>(arg);
    memcpy(p->dst, p->src, p->bytes);
    return NULL;
}

void bk_host_copy_parts(char *dst, const char *src, size_t bytes, int np)
{
    enum { MAXP = 64 };
    if (np > MAXP)
        np = MAXP;
    if (np < 1)
        np = 1;
    copy_part parts[MAXP];
    for (int p = 0; p < np; p++) {
        const size_t a = bytes * p / np, b = bytes * (p + 1) / np;
        parts[p].src = src + a;
        parts[p].dst = dst + a;
        parts[p].bytes = b - a;
        parts[p].started =
            p > 0 && pthread_create(&parts[p].tid, NULL, copy_part_main, &parts[p]) == 0;
    }
    for (int p = 0; p < np; p++)
        if (!parts[p].started)
            copy_part_main(&parts[p]);
    for (int p = 0; p < np; p++)
        if (parts[p].started)
            pthread_join(parts[p].tid, NULL);
}

namespace {

/* dst = src over host threads (parts of 4 MiB at least) */
void par_copy(char *dst, const char *src, size_t bytes, int threads)
{
    size_t np = bytes / ((size_t)4 << 20);
    if (np > (size_t)threads)
        np = (size_t)threads;
    bk_host_copy_parts(dst, src, bytes, np < 1 ? 1 : (int)np);
}

/* The two pinned slots and their events; 0 when they exist. On failure the
 * context stays on plain copies (dl_off). */
int dl_setup(bk_cuda_ctx *c)
{
    if (c->dl_pin[1])
        return 0;
    if (c->dl_off)
        return -1;
    for (int i = 0; i < 2; i++) {
        if (cudaHostAlloc(&c->dl_pin[i], BK_DL_CHUNK, cudaHostAllocDefault) != cudaSuccess ||
            cudaEventCreateWithFlags(&c->dl_ev[i], cudaEventDisableTiming) != cudaSuccess) {
            cudaGetLastError();
            bk_cuda_download_release(c);
            c->dl_off = 1;
            return -1;
        }
    }
    const long nc = sysconf(_SC_NPROCESSORS_ONLN);
    c->dl_threads = nc < 2 ? 1 : nc > 16 ? 8 : (int)(nc / 2);
    return 0;
}

} // namespace

void bk_cuda_download_release(bk_cuda_ctx *c)
{
    for (int i = 0; i < 2; i++) {
        if (c->dl_pin[i])
            cudaFreeHost(c->dl_pin[i]);
        if (c->dl_ev[i])
            cudaEventDestroy(c->dl_ev[i]);
        c->dl_pin[i] = NULL;
        c->dl_ev[i] = NULL;
    }
    cudaGetLastError();
}

bk_status bk_cuda_download(bk_cuda_ctx *c, void *dst, const void *src, size_t bytes)
{
    if (!bytes)
        return BK_OK;
    if (bytes < BK_DL_MIN || dl_setup(c) != 0) {
        BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
        BK_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        return BK_OK;
    }
    const char *s = static_cast<const char *>(src);
    char *d = static_cast<char *>(dst);
    const size_t nch = (bytes + BK_DL_CHUNK - 1) / BK_DL_CHUNK;
    /* chunk k goes to slot k & 1; chunk k + 1 is queued before chunk k is
     * copied out (its slot held chunk k - 1, already copied out) */
    for (size_t k = 0; k <= nch; k++) {
        if (k < nch) {
            const size_t off = k * BK_DL_CHUNK;
            const size_t len = bytes - off < BK_DL_CHUNK ? bytes - off : BK_DL_CHUNK;
            BK_CUDA_CHECK(cudaMemcpyAsync(c->dl_pin[k & 1], s + off, len,
                                          cudaMemcpyDeviceToHost, c->stream));
            BK_CUDA_CHECK(cudaEventRecord(c->dl_ev[k & 1], c->stream));
        }
        if (k > 0) {
            const size_t j = k - 1, off = j * BK_DL_CHUNK;
            const size_t len = bytes - off < BK_DL_CHUNK ? bytes - off : BK_DL_CHUNK;
            BK_CUDA_CHECK(cudaEventSynchronize(c->dl_ev[j & 1]));
            par_copy(d + off, static_cast<const char *>(c->dl_pin[j & 1]), len, c->dl_threads);
        }
    }
    return BK_OK;
}

/* ---------------------------------------------------------------- GEMM */

static inline cublasOperation_t op(int t)
{
    return t ? CUBLAS_OP_T : CUBLAS_OP_N;
}

/* Row-major C = alpha op(A) op(B) + beta C is column-major
 * C^T = alpha op(B)^T op(A)^T + beta C^T, and a row-major buffer read
 * column-major is the transpose: swap the operands, keep the flags. */
bk_status bk_rm_gemm(cublasHandle_t h, int ta, int tb, int64_t M, int64_t N, int64_t K,
                     double alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     double beta, float *C, int64_t ldc)
{
    if (M <= 0 || N <= 0)
        return BK_OK;
    float al = (float)alpha, be = (float)beta;
    if (K <= 0) {
        if (beta == 1.0)
            return BK_OK;
        return bk_error(BK_ERR_INTERNAL, "GEMM with an empty inner dimension and beta != 1");
    }
    BK_CUBLAS_CHECK(cublasSgemm_64(h, op(tb), op(ta), N, M, K, &al, B, ldb, A, lda, &be, C, ldc));
    return BK_OK;
}

bk_status bk_rm_gemm(cublasHandle_t h, int ta, int tb, int64_t M, int64_t N, int64_t K,
                     double alpha, const double *A, int64_t lda, const double *B, int64_t ldb,
                     double beta, double *C, int64_t ldc)
{
    if (M <= 0 || N <= 0)
        return BK_OK;
    double al = alpha, be = beta;
    if (K <= 0) {
        if (beta == 1.0)
            return BK_OK;
        return bk_error(BK_ERR_INTERNAL, "GEMM with an empty inner dimension and beta != 1");
    }
    BK_CUBLAS_CHECK(cublasDgemm_64(h, op(tb), op(ta), N, M, K, &al, B, ldb, A, lda, &be, C, ldc));
    return BK_OK;
}
