#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"
#include "bk_config.h"

bk_status bk_backend_kind_from_name(const char *name, bk_backend_kind *out)
{
    if (!strcmp(name, "auto"))
        *out = BK_BACKEND_AUTO;
    else if (!strcmp(name, "cpu"))
        *out = BK_BACKEND_CPU;
    else if (!strcmp(name, "cuda"))
        *out = BK_BACKEND_CUDA;
    else
        return bk_error(BK_ERR_INVALID_ARG, "unknown backend '%s' (expected auto, cpu or cuda)",
                        name);
    return BK_OK;
}

bk_status bk_gemm_math_from_name(const char *name, bk_gemm_math *out)
{
    if (!strcmp(name, "fp32"))
        *out = BK_GEMM_FP32;
    else if (!strcmp(name, "tf32"))
        *out = BK_GEMM_TF32;
    else if (!strcmp(name, "bf16"))
        *out = BK_GEMM_BF16;
    else if (!strcmp(name, "auto"))
        *out = BK_GEMM_AUTO;
    else
        return bk_error(BK_ERR_INVALID_ARG,
                        "unknown GEMM arithmetic '%s' (expected auto, fp32, tf32 or bf16)", name);
    return BK_OK;
}

const char *bk_gemm_math_name(bk_gemm_math m)
{
    return m == BK_GEMM_TF32   ? "tf32"
           : m == BK_GEMM_BF16 ? "bf16"
           : m == BK_GEMM_AUTO ? "auto"
                               : "fp32";
}

void bk_backend_set_gemm_math(bk_backend *b, bk_gemm_math m)
{
    if (b)
        b->gemm_math = (m == BK_GEMM_TF32 || m == BK_GEMM_BF16) ? m : BK_GEMM_FP32;
}

bk_gemm_math bk_backend_gemm_math(const bk_backend *b)
{
    return b ? b->gemm_math : BK_GEMM_FP32;
}

int bk_cuda_compiled(void)
{
    return BK_HAVE_CUDA;
}

int bk_cuda_device_count(void)
{
#if BK_HAVE_CUDA
    return bk_cuda_count_devices();
#else
    return 0;
#endif
}

bk_status bk_backend_create(bk_backend_kind kind, bk_backend **out)
{
    *out = NULL;
    bk_backend *b = calloc(1, sizeof *b);
    if (!b)
        return bk_error(BK_ERR_NOMEM, "out of memory creating a backend");
    bk_status st;
    if (kind == BK_BACKEND_AUTO)
        kind = bk_cuda_device_count() > 0 ? BK_BACKEND_CUDA : BK_BACKEND_CPU;
    if (kind == BK_BACKEND_CUDA) {
#if BK_HAVE_CUDA
        if (bk_cuda_count_devices() <= 0) {
            free(b);
            return bk_error(BK_ERR_NO_DEVICE,
                            "backend cuda: no usable CUDA device (no GPU or no driver); "
                            "use --backend cpu");
        }
        st = bk_cuda_backend_init(b);
#else
        free(b);
        return bk_error(BK_ERR_NO_DEVICE,
                        "backend cuda: this build has no CUDA backend (rebuild with "
                        "-Dcuda=enabled); use --backend cpu");
#endif
    } else {
        st = bk_cpu_backend_init(b);
    }
    if (st != BK_OK) {
        free(b);
        return st;
    }
    b->kind = kind;
    *out = b;
    return BK_OK;
}

void bk_backend_destroy(bk_backend *b)
{
    if (!b)
        return;
    if (b->ops && b->ops->destroy)
        b->ops->destroy(b->ctx);
    free(b);
}

const char *bk_backend_name(const bk_backend *b)
{
    return b->ops->name;
}

const char *bk_backend_device(const bk_backend *b)
{
    return b->device;
}

bk_status bk_backend_solve(bk_backend *b, const bk_solve_problem *p, const bk_solve_opts *o,
                           bk_solve_result *r)
{
    if (!b->ops->solve)
        return bk_error(BK_ERR_UNSUPPORTED, "backend %s: solve is not supported", b->ops->name);
    return b->ops->solve(b->ctx, p, o, r);
}

size_t bk_backend_peak_memory(const bk_backend *b)
{
    return b->ops->peak_memory ? b->ops->peak_memory(b->ctx) : 0;
}

void bk_backend_reset_peak_memory(bk_backend *b)
{
    if (b->ops->reset_peak_memory)
        b->ops->reset_peak_memory(b->ctx);
}
