/* CUDA backend — the bk_backend_ops table. Operations not yet implemented
 * on the GPU report BK_ERR_UNSUPPORTED naming the operation. */
#include <cstdio>
#include <cstdlib>

#include "common.cuh"
#include "backend_impl.h"

extern "C" bk_status bk_cuda_describe_device(int dev, char *buf, size_t cap);

namespace {

struct cuda_ctx {
    int device;
    cublasHandle_t cublas;
    cusolverDnHandle_t cusolver;
    cudaStream_t stream;
};

bk_status cuda_solve(void *vctx, const bk_solve_problem *p, const bk_solve_opts *o,
                     bk_solve_result *r)
{
    (void)vctx;
    (void)p;
    (void)o;
    (void)r;
    return bk_error(BK_ERR_UNSUPPORTED, "backend cuda: solve is not implemented yet");
}

void cuda_destroy(void *vctx)
{
    cuda_ctx *c = static_cast<cuda_ctx *>(vctx);
    if (!c)
        return;
    if (c->cusolver)
        cusolverDnDestroy(c->cusolver);
    if (c->cublas)
        cublasDestroy(c->cublas);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

const bk_backend_ops cuda_ops = {
    "cuda",
    cuda_solve,
    nullptr,
    cuda_destroy,
};

} // namespace

extern "C" bk_status bk_cuda_backend_init(bk_backend *b)
{
    cuda_ctx *c = static_cast<cuda_ctx *>(calloc(1, sizeof(cuda_ctx)));
    if (!c)
        return bk_error(BK_ERR_NOMEM, "out of memory creating the CUDA backend");
    bk_status st = BK_OK;
    c->device = 0;
    BK_CUDA_GOTO(cudaSetDevice(c->device), st, fail);
    BK_CUDA_GOTO(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), st, fail);
    BK_CUBLAS_GOTO(cublasCreate(&c->cublas), st, fail);
    BK_CUBLAS_GOTO(cublasSetStream(c->cublas, c->stream), st, fail);
    BK_CUSOLVER_GOTO(cusolverDnCreate(&c->cusolver), st, fail);
    BK_CUSOLVER_GOTO(cusolverDnSetStream(c->cusolver, c->stream), st, fail);
    st = bk_cuda_describe_device(c->device, b->device, sizeof b->device);
    if (st != BK_OK)
        goto fail;
    b->ops = &cuda_ops;
    b->ctx = c;
    return BK_OK;
fail:
    cuda_destroy(c);
    return st;
}
