/* CUDA backend — the bk_backend_ops table and the device context. */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_internal.cuh"
#include "backend_impl.h"
#include "backward_gpu.h"
#include "pipeline_gpu.h"

#include "bakron/pipeline.h"

extern "C" bk_status bk_cuda_describe_device(int dev, char *buf, size_t cap);

void bk_cuda_ctx_destroy(bk_cuda_ctx *c)
{
    if (!c)
        return;
    bk_cuda_partition_release(c);
    bk_cuda_download_release(c);
    if (c->pf_stream) /* (a prefetch was taken or dropped by its owner: bk_dprefetch) */
        cudaStreamSynchronize(c->pf_stream);
    if (c->pf_solver)
        cusolverDnDestroy(c->pf_solver);
    if (c->pf_blas)
        cublasDestroy(c->pf_blas);
    if (c->pf_ready)
        cudaEventDestroy(c->pf_ready);
    if (c->pf_stream)
        cudaStreamDestroy(c->pf_stream);
    if (c->stats_stream) /* (a job in flight was collected or dropped by its solve) */
        cudaStreamSynchronize(c->stats_stream);
    if (c->stats_blas)
        cublasDestroy(c->stats_blas);
    if (c->stats_ready)
        cudaEventDestroy(c->stats_ready);
    if (c->stats_stream)
        cudaStreamDestroy(c->stats_stream);
    if (c->ev_main_ready)
        cudaEventDestroy(c->ev_main_ready);
    if (c->ev_side_done)
        cudaEventDestroy(c->ev_side_done);
    if (c->side)
        cudaStreamDestroy(c->side);
    if (c->ev_start)
        cudaEventDestroy(c->ev_start);
    if (c->ev_stop)
        cudaEventDestroy(c->ev_stop);
    if (c->cusolver)
        cusolverDnDestroy(c->cusolver);
    if (c->cublas)
        cublasDestroy(c->cublas);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    cudaGetLastError();
    free(c);
}

/* The solver variants (bk_cuda_tuning: their defaults are settled, only the
 * dev harness and the parity test change them). */
void bk_cuda_ctx_tune(bk_cuda_ctx *c, const bk_cuda_tuning *t)
{
    c->tile = t->tile;
    c->solve_wc = t->solve_wc;
    c->overlap = t->overlap;
    c->side_band = t->side_band;
    c->far_async = t->far_async;
    c->push_split = t->push_split;
    c->push_group = t->push_group;
    c->partition = t->partition;
    c->push_mma = t->push_mma;
    c->solve_chain = t->solve_chain;
}

bk_status bk_cuda_ctx_create(int device, bk_cuda_ctx **out)
{
    *out = NULL;
    bk_cuda_ctx *c = static_cast<bk_cuda_ctx *>(calloc(1, sizeof(bk_cuda_ctx)));
    if (!c)
        return bk_error(BK_ERR_NOMEM, "out of memory creating the CUDA backend");
    bk_status st = BK_OK;
    {
        bk_cuda_tuning t;
        bk_cuda_tuning_default(&t);
        bk_cuda_ctx_tune(c, &t);
    }
    c->device = device;
    BK_CUDA_GOTO(cudaSetDevice(c->device), st, fail);
    {
        /* the main stream at the highest priority: when the overlapped pushes
         * (side stream, lowest) fill the GPU, the next solve's CTAs go first */
        int lo = 0, hi = 0;
        BK_CUDA_GOTO(cudaDeviceGetStreamPriorityRange(&lo, &hi), st, fail);
        BK_CUDA_GOTO(cudaStreamCreateWithPriority(&c->stream, cudaStreamNonBlocking, hi), st,
                     fail);
        BK_CUDA_GOTO(cudaStreamCreateWithPriority(&c->side, cudaStreamNonBlocking, lo), st, fail);
        BK_CUDA_GOTO(cudaEventCreateWithFlags(&c->ev_main_ready, cudaEventDisableTiming), st,
                     fail);
        BK_CUDA_GOTO(cudaEventCreateWithFlags(&c->ev_side_done, cudaEventDisableTiming), st,
                     fail);
    }
    BK_CUDA_GOTO(cudaEventCreate(&c->ev_start), st, fail);
    BK_CUDA_GOTO(cudaEventCreate(&c->ev_stop), st, fail);
    BK_CUBLAS_GOTO(cublasCreate(&c->cublas), st, fail);
    BK_CUBLAS_GOTO(cublasSetStream(c->cublas, c->stream), st, fail);
    /* default math: fp32 GEMMs stay IEEE fp32 (no TF32) */
    BK_CUBLAS_GOTO(cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH), st, fail);
    BK_CUSOLVER_GOTO(cusolverDnCreate(&c->cusolver), st, fail);
    BK_CUSOLVER_GOTO(cusolverDnSetStream(c->cusolver, c->stream), st, fail);
    *out = c;
    return BK_OK;
fail:
    bk_cuda_ctx_destroy(c);
    return st;
}

namespace {

bk_status cuda_solve(void *vctx, const bk_solve_problem *p, const bk_solve_opts *o,
                     bk_solve_result *r)
{
    return bk_cuda_solve(static_cast<bk_cuda_ctx *>(vctx), p, o, r);
}

size_t cuda_peak(void *vctx)
{
    return static_cast<bk_cuda_ctx *>(vctx)->mem_peak;
}

void cuda_reset_peak(void *vctx)
{
    bk_cuda_ctx *c = static_cast<bk_cuda_ctx *>(vctx);
    c->mem_peak = c->mem_current;
}

void cuda_destroy(void *vctx)
{
    bk_cuda_ctx_destroy(static_cast<bk_cuda_ctx *>(vctx));
}

/* The jobs the GPU stages implement (cuda/pipeline_cuda.cu, cuda/hessian.cu):
 * BK_ERR_UNSUPPORTED before anything is allocated for the others, and the
 * dispatcher (src/backend.c) runs the CPU stages for them. A Hessian kind
 * added to the registry after the backprop kinds runs there until it has a
 * GPU implementation and a parity test (docs/DEVELOPING.md "Add a Hessian
 * kind"). */
bk_status cuda_stages_supported(const bk_stage_params *p)
{
    const bk_model_config *cfg = bk_model_get_config(p->model);
    const bk_hessian_kind k = p->kind;
    const int mlp2 = k == BK_HESS_MLPLOCAL_KFAC || k == BK_HESS_MLPLOCAL_SHAMPOO ||
                     k == BK_HESS_FULLYLOCAL_KFAC || k == BK_HESS_FULLYLOCAL_SHAMPOO;
    if ((unsigned)k > BK_HESS_BACKPROP_SHAMPOO)
        return bk_error(BK_ERR_UNSUPPORTED, "cuda has no stages for --hessian %s",
                        bk_hessian_name(k));
    if (mlp2 && cfg->hidden_act[0] && strcmp(cfg->hidden_act, "silu") != 0)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "cuda has no stages for --hessian %s with hidden_act '%s' (only silu)",
                        bk_hessian_name(k), cfg->hidden_act);
    if (p->inputs)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "cuda has no stages for dumped activations (--activations)");
    if (p->S < 1)
        return bk_error(BK_ERR_UNSUPPORTED, "cuda has no stages without calibration sequences");
    return BK_OK;
}

bk_status cuda_stages_create(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                             const bk_stage_ops **ops, void **ctx)
{
    if (!p || !p->model || !batch)
        return bk_error(BK_ERR_INVALID_ARG, "GPU pipeline: bad arguments");
    bk_status st = cuda_stages_supported(p);
    if (st != BK_OK)
        return st;
    return bk_gpu_stages_create(b, p->model, p->kind, p->fp64, p->keep_plain, p->fully,
                                p->codes_only, p->S, p->T, p->rank, p->nranks, p->bwd, batch,
                                ops, ctx);
}

bk_status cuda_bwd_flow_run(bk_backend *b, const bk_model *m, const int32_t *tokens, int64_t S,
                            int64_t T, const bk_bwd_flow_opts *o, int precision,
                            const bk_bwd_flow_cb *cb, bk_bwd_flow_stats *stats)
{
    if (precision < BK_BWD_FP32 || precision > BK_BWD_BF16) /* (auto: resolved by the job) */
        return bk_error(BK_ERR_INTERNAL, "backward flow: precision %d is not resolved",
                        precision);
    bk_gbwd_opts go;
    bk_gbwd_opts_default(&go);
    go.fp64 = precision == BK_BWD_FP64;
    go.math = precision == BK_BWD_TF32   ? BK_GBWD_TF32
              : precision == BK_BWD_BF16 ? BK_GBWD_BF16
                                         : BK_GBWD_F32;
    return bk_cuda_bwd_flow_run(b, m, tokens, S, T, o, &go, cb, stats);
}

const bk_backend_ops cuda_ops = {
    "cuda",
    cuda_solve,
    cuda_peak,
    cuda_reset_peak,
    bk_cuda_layer_fwd_create,
    cuda_stages_create,
    cuda_bwd_flow_run,
    cuda_destroy,
};

} // namespace

extern "C" bk_status bk_cuda_backend_init(bk_backend *b)
{
    bk_cuda_ctx *c = NULL;
    bk_status st = bk_cuda_ctx_create(b->params.device, &c);
    if (st != BK_OK)
        return st;
    c->factor_fp64 = b->params.factor_fp64;
    c->mem_limit = b->params.mem_limit;
    st = bk_cuda_describe_device(c->device, b->device, sizeof b->device);
    if (st != BK_OK) {
        bk_cuda_ctx_destroy(c);
        return st;
    }
    b->ops = &cuda_ops;
    b->ctx = c;
    return BK_OK;
}

extern "C" bk_status bk_cuda_backend_tune(bk_backend *b, const bk_cuda_tuning *t)
{
    if (!b || b->ops != &cuda_ops)
        return bk_error(BK_ERR_INVALID_ARG, "CUDA tuning: not a CUDA backend");
    bk_status st = bk_cuda_tuning_check(t);
    if (st != BK_OK)
        return st;
    bk_cuda_ctx_tune(static_cast<bk_cuda_ctx *>(b->ctx), t);
    return BK_OK;
}
