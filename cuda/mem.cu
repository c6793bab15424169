/* CUDA backend — tracked device allocations (for bk_backend_peak_memory and
 * the optional limit (setting mem_limit) used to test the out-of-memory path) and
 * the row-major GEMM wrapper over cuBLAS. */
#include <cstdio>
#include <cstdlib>

#include "cuda_internal.cuh"

/* Each allocation carries its size in a 256-byte header so that frees can
 * be accounted for without a table. */
#define BK_DEV_HDR 256

bk_status bk_dev_alloc(bk_cuda_ctx *c, void **p, size_t bytes, const char *what)
{
    *p = NULL;
    if (bytes > SIZE_MAX - BK_DEV_HDR)
        return bk_error(BK_ERR_DEVICE_OOM, "CUDA: %s: size overflows (%zu bytes)", what, bytes);
    size_t total = bytes + BK_DEV_HDR;
    if (c->mem_limit && c->mem_current + total > c->mem_limit)
        return bk_error(BK_ERR_DEVICE_OOM,
                        "CUDA out of memory: %s needs %zu bytes, %zu of the %zu-byte limit "
                        "(setting mem_limit) in use",
                        what, bytes, c->mem_current, c->mem_limit);
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
    c->mem_current += total;
    if (c->mem_current > c->mem_peak)
        c->mem_peak = c->mem_current;
    *p = raw + BK_DEV_HDR;
    return BK_OK;
}

void bk_dev_free(bk_cuda_ctx *c, void *p)
{
    if (!p)
        return;
    unsigned char *raw = static_cast<unsigned char *>(p) - BK_DEV_HDR;
    size_t total = 0;
    if (cudaMemcpy(&total, raw, sizeof total, cudaMemcpyDeviceToHost) == cudaSuccess &&
        total <= c->mem_current)
        c->mem_current -= total;
    else
        cudaGetLastError();
    cudaFree(raw);
    cudaGetLastError();
}

void bk_dev_note_transient(bk_cuda_ctx *c, size_t bytes)
{
    if (c->mem_current + bytes > c->mem_peak)
        c->mem_peak = c->mem_current + bytes;
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
