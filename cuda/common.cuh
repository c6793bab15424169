/* CUDA backend — error checking. Every CUDA / cuBLAS / cuSOLVER call goes
 * through one of these macros, which turn a failure into a bk_status with a
 * one-line message naming the operation, file and line. They `return` from
 * the enclosing function (which must return bk_status); use the *_GOTO forms
 * where cleanup is needed. */
#ifndef BK_CUDA_COMMON_CUH
#define BK_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "bakron/status.h"

const char *bk_cublas_status_string(cublasStatus_t s);
const char *bk_cusolver_status_string(cusolverStatus_t s);

static inline bk_status bk_cuda_status(cudaError_t e, const char *op, const char *file, int line)
{
    if (e == cudaSuccess)
        return BK_OK;
    if (e == cudaErrorMemoryAllocation)
        return bk_error(BK_ERR_DEVICE_OOM, "CUDA out of memory in %s (%s:%d)", op, file, line);
    return bk_error(BK_ERR_DEVICE, "CUDA error in %s: %s (%s:%d)", op, cudaGetErrorString(e), file,
                    line);
}

static inline bk_status bk_cublas_status(cublasStatus_t e, const char *op, const char *file,
                                         int line)
{
    if (e == CUBLAS_STATUS_SUCCESS)
        return BK_OK;
    if (e == CUBLAS_STATUS_ALLOC_FAILED)
        return bk_error(BK_ERR_DEVICE_OOM, "cuBLAS out of memory in %s (%s:%d)", op, file, line);
    return bk_error(BK_ERR_DEVICE, "cuBLAS error in %s: %s (%s:%d)", op,
                    bk_cublas_status_string(e), file, line);
}

static inline bk_status bk_cusolver_status(cusolverStatus_t e, const char *op, const char *file,
                                           int line)
{
    if (e == CUSOLVER_STATUS_SUCCESS)
        return BK_OK;
    if (e == CUSOLVER_STATUS_ALLOC_FAILED)
        return bk_error(BK_ERR_DEVICE_OOM, "cuSOLVER out of memory in %s (%s:%d)", op, file,
                        line);
    return bk_error(BK_ERR_DEVICE, "cuSOLVER error in %s: %s (%s:%d)", op,
                    bk_cusolver_status_string(e), file, line);
}

#define BK_CUDA_CHECK(call)                                                     \
    do {                                                                        \
        bk_status bk__s = bk_cuda_status((call), #call, __FILE__, __LINE__);    \
        if (bk__s != BK_OK)                                                     \
            return bk__s;                                                       \
    } while (0)

#define BK_CUBLAS_CHECK(call)                                                   \
    do {                                                                        \
        bk_status bk__s = bk_cublas_status((call), #call, __FILE__, __LINE__);  \
        if (bk__s != BK_OK)                                                     \
            return bk__s;                                                       \
    } while (0)

#define BK_CUSOLVER_CHECK(call)                                                 \
    do {                                                                        \
        bk_status bk__s = bk_cusolver_status((call), #call, __FILE__, __LINE__);\
        if (bk__s != BK_OK)                                                     \
            return bk__s;                                                       \
    } while (0)

/* Variants that store the status in `st` and jump to `label`. */
#define BK_CUDA_GOTO(call, st, label)                                           \
    do {                                                                        \
        st = bk_cuda_status((call), #call, __FILE__, __LINE__);                 \
        if (st != BK_OK)                                                        \
            goto label;                                                         \
    } while (0)
#define BK_CUBLAS_GOTO(call, st, label)                                         \
    do {                                                                        \
        st = bk_cublas_status((call), #call, __FILE__, __LINE__);               \
        if (st != BK_OK)                                                        \
            goto label;                                                         \
    } while (0)
#define BK_CUSOLVER_GOTO(call, st, label)                                       \
    do {                                                                        \
        st = bk_cusolver_status((call), #call, __FILE__, __LINE__);             \
        if (st != BK_OK)                                                        \
            goto label;                                                         \
    } while (0)

/* After a kernel launch. */
#define BK_CUDA_LAUNCH_CHECK(name) BK_CUDA_CHECK((cudaGetLastError(), cudaPeekAtLastError()))

#endif /* BK_CUDA_COMMON_CUH */
