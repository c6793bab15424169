/* CUDA backend — dispatch of the core algorithms and their timing. */
#include "cuda_internal.cuh"

bk_status bk_cuda_core(bk_cuda_ctx *c, bk_algorithm alg, bk_precision prec,
                       const bk_core_args *a, float *ms)
{
    typedef bk_status (*fn)(bk_cuda_ctx *, const bk_core_args *);
    fn f32 = NULL, f64 = NULL;
    switch (alg) {
    case BK_ALG_BAKRON:
        f32 = bk_cuda_bakron_f32;
        f64 = bk_cuda_bakron_f64;
        break;
    case BK_ALG_GPTQ:
        f32 = bk_cuda_gptq_f32;
        f64 = bk_cuda_gptq_f64;
        break;
    case BK_ALG_ANTIDIAG:
        f32 = bk_cuda_antidiag_f32;
        f64 = bk_cuda_antidiag_f64;
        break;
    case BK_ALG_NAIVE:
        f32 = bk_cuda_naive_f32;
        f64 = bk_cuda_naive_f64;
        break;
    case BK_ALG_RECURSIVE:
        f32 = bk_cuda_recursive_f32;
        f64 = bk_cuda_recursive_f64;
        break;
    case BK_ALG_RTN:
        f32 = bk_cuda_rtn_f32;
        f64 = bk_cuda_rtn_f64;
        break;
    default:
        return bk_error(BK_ERR_INVALID_ARG, "backend cuda: unknown algorithm %d", (int)alg);
    }
    if (ms)
        *ms = 0.0f;
    if (a->m <= 0 || a->n <= 0)
        return BK_OK;
    bk_status st = (prec == BK_PREC_FP64 ? f64 : f32)(c, a);
    if (st != BK_OK) {
        /* leave the stream idle and the sticky state clean for the next call */
        cudaStreamSynchronize(c->stream);
        cudaGetLastError();
        return st;
    }
    if (ms)
        BK_CUDA_CHECK(cudaEventElapsedTime(ms, c->ev_start, c->ev_stop));
    return BK_OK;
}
