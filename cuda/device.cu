/* CUDA backend — device discovery and status strings. */
#include <cstdio>
#include <cstring>

#include "common.cuh"
#include "backend_impl.h"

extern "C" int bk_cuda_count_devices(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky error: no driver / no GPU */
        return 0;
    }
    return n;
}

extern "C" int bk_cuda_device_uuid(int device, unsigned char uuid[16])
{
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    memcpy(uuid, prop.uuid.bytes, 16);
    return 1;
}

const char *bk_cublas_status_string(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUBLAS_STATUS_MAPPING_ERROR: return "mapping error";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "license error";
    }
    return "unknown cuBLAS status";
}

const char *bk_cusolver_status_string(cusolverStatus_t s)
{
    switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "success";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "allocation failed";
    case CUSOLVER_STATUS_INVALID_VALUE: return "invalid value";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "internal error";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED: return "matrix type not supported";
    default: break;
    }
    return "unknown cuSOLVER status";
}

/* Fill `buf` with "NAME, X GiB, sm_XY" of device `dev`. */
extern "C" bk_status bk_cuda_describe_device(int dev, char *buf, size_t cap)
{
    cudaDeviceProp prop;
    BK_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    snprintf(buf, cap, "%s, %.0f GiB, sm_%d%d, %d SMs", prop.name,
             (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), prop.major, prop.minor,
             prop.multiProcessorCount);
    return BK_OK;
}
