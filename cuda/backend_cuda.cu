/* CUDA backend — the bk_backend_ops table and the device context. */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_internal.cuh"
#include "backend_impl.h"

extern "C" bk_status bk_cuda_describe_device(int dev, char *buf, size_t cap);

void bk_cuda_ctx_destroy(bk_cuda_ctx *c)
{
    if (!c)
        return;
    bk_cuda_partition_release(c);
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

/* Knobs read from the environment (docs/DEVICE.md):
 *   BK_CUDA_TILE       BaKron tile size, 32 or 64 (default 64)
 *   BK_CUDA_MEM_LIMIT  refuse device allocations beyond this many bytes
 *                      (tests the out-of-memory path without filling the GPU)
 *   BK_CUDA_FACTOR_FP64=1  damping + Cholesky in fp64 also for fp32 solves
 *                      (the CPU factors in the solve precision)
 *   BK_CUDA_PUSH_GROUP BaKron: far pushes every N tile anti-diagonals
 *                      (default 4; 0 = every push eager)
 *   BK_CUDA_SOLVE_WC   BaKron tile solve v3: columns per warp, 16 (8 warps per 64-tile,
 *                      the default) or 8 (16 warps)
 *   BK_CUDA_OVERLAP    BaKron: 1 (default) runs most of the far pushes on a second,
 *                      low-priority stream while the next diagonals are solved
 *   BK_CUDA_PARTITION  BaKron: SMs kept free of that stream (partition.cu): auto
 *                      (default), 0 (no partition) or a number of SMs
 *   BK_CUDA_SIDE_BAND  BaKron: the overlapped push in two launches, the next
 *                      flush's band first: auto (with the partition), 0, 1
 *   BK_CUDA_PUSH_SPLIT BaKron: critical-path pushes in 2 x 2 parts per target
 *                      tile (2, default) or whole (1)
 *   BK_CUDA_FAR_ASYNC  BaKron: the overlapped pushes load with cp.async (1, default) */
/* A knob with two values a, b (and "auto" = -1 when auto_ok); def when unset. */
static bk_status env_choice(const char *name, int def, int a, int b, int auto_ok, int *out)
{
    const char *v = getenv(name);
    *out = def;
    if (!v || !*v)
        return BK_OK;
    char sa[16], sb[16];
    snprintf(sa, sizeof sa, "%d", a);
    snprintf(sb, sizeof sb, "%d", b);
    if (auto_ok && !strcmp(v, "auto"))
        *out = -1;
    else if (!strcmp(v, sa))
        *out = a;
    else if (!strcmp(v, sb))
        *out = b;
    else
        return bk_error(BK_ERR_INVALID_ARG, "%s: expected %s%s or %s (got '%s')", name,
                        auto_ok ? "auto, " : "", sa, sb, v);
    return BK_OK;
}

static bk_status read_env(bk_cuda_ctx *c)
{
    bk_status st;
    if ((st = env_choice("BK_CUDA_TILE", 64, 32, 64, 0, &c->tile)) != BK_OK ||
        (st = env_choice("BK_CUDA_SOLVE_WC", 16, 8, 16, 0, &c->solve_wc)) != BK_OK ||
        (st = env_choice("BK_CUDA_OVERLAP", 1, 0, 1, 0, &c->overlap)) != BK_OK ||
        (st = env_choice("BK_CUDA_SIDE_BAND", -1, 0, 1, 1, &c->side_band)) != BK_OK ||
        (st = env_choice("BK_CUDA_FAR_ASYNC", 1, 0, 1, 0, &c->far_async)) != BK_OK ||
        (st = env_choice("BK_CUDA_PUSH_SPLIT", 2, 1, 2, 0, &c->push_split)) != BK_OK)
        return st;
    const char *g = getenv("BK_CUDA_PUSH_GROUP");
    c->push_group = 4;
    if (g && *g) {
        char *end = NULL;
        long v = strtol(g, &end, 10);
        if (end == g || *end || v < 0 || v > 64)
            return bk_error(BK_ERR_INVALID_ARG,
                            "BK_CUDA_PUSH_GROUP: expected an integer in [0, 64] (got '%s')", g);
        c->push_group = (int)v;
    }
    const char *pa = getenv("BK_CUDA_PARTITION");
    c->partition = -1;
    if (pa && *pa && strcmp(pa, "auto")) {
        char *end = NULL;
        long v = strtol(pa, &end, 10);
        if (end == pa || *end || v < 0 || v > 4096)
            return bk_error(BK_ERR_INVALID_ARG,
                            "BK_CUDA_PARTITION: expected auto, 0 or a number of SMs (got '%s')",
                            pa);
        c->partition = (int)v;
    }
    const char *f = getenv("BK_CUDA_FACTOR_FP64");
    c->factor_fp64 = f && !strcmp(f, "1");
    const char *l = getenv("BK_CUDA_MEM_LIMIT");
    c->mem_limit = 0;
    if (l && *l) {
        char *end = NULL;
        unsigned long long v = strtoull(l, &end, 10);
        if (end == l || *end)
            return bk_error(BK_ERR_INVALID_ARG,
                            "BK_CUDA_MEM_LIMIT: expected a number of bytes (got '%s')", l);
        c->mem_limit = (size_t)v;
    }
    return BK_OK;
}

bk_status bk_cuda_ctx_create(int device, bk_cuda_ctx **out)
{
    *out = NULL;
    bk_cuda_ctx *c = static_cast<bk_cuda_ctx *>(calloc(1, sizeof(bk_cuda_ctx)));
    if (!c)
        return bk_error(BK_ERR_NOMEM, "out of memory creating the CUDA backend");
    bk_status st = read_env(c);
    if (st != BK_OK)
        goto fail;
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

const bk_backend_ops cuda_ops = {
    "cuda",
    cuda_solve,
    cuda_peak,
    cuda_reset_peak,
    cuda_destroy,
};

} // namespace

extern "C" bk_status bk_cuda_backend_init(bk_backend *b)
{
    bk_cuda_ctx *c = NULL;
    bk_status st = bk_cuda_ctx_create(0, &c);
    if (st != BK_OK)
        return st;
    st = bk_cuda_describe_device(c->device, b->device, sizeof b->device);
    if (st != BK_OK) {
        bk_cuda_ctx_destroy(c);
        return st;
    }
    b->ops = &cuda_ops;
    b->ctx = c;
    return BK_OK;
}
