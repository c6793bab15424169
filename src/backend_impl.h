/* The backend interface: a table of operations plus a context (internal). */
#ifndef BK_BACKEND_IMPL_H
#define BK_BACKEND_IMPL_H

#include <stddef.h>

#include "bakron/backend.h"

typedef struct bk_backend_ops {
    const char *name;
    /* Required. */
    bk_status (*solve)(void *ctx, const bk_solve_problem *p, const bk_solve_opts *o,
                       bk_solve_result *r);
    /* Optional (NULL: 0). */
    size_t (*peak_memory)(void *ctx);
    /* Optional: restart the high-water mark at the current usage. */
    void (*reset_peak_memory)(void *ctx);
    /* Required. */
    void (*destroy)(void *ctx);
} bk_backend_ops;

struct bk_backend {
    const bk_backend_ops *ops;
    void *ctx;
    bk_backend_kind kind;
    bk_gemm_math gemm_math; /* forward/Hessian GEMMs of the GPU pipeline and eval */
    char device[256];
};

/* Fill b (ops, ctx, device). */
bk_status bk_cpu_backend_init(bk_backend *b);

#ifdef __cplusplus
extern "C" {
#endif
/* Implemented in cuda/ when BK_HAVE_CUDA. */
bk_status bk_cuda_backend_init(bk_backend *b);
int bk_cuda_count_devices(void);
#ifdef __cplusplus
}
#endif

#endif /* BK_BACKEND_IMPL_H */
