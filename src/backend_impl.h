/* The backend interface: a table of operations plus a context (internal). */
#ifndef BK_BACKEND_IMPL_H
#define BK_BACKEND_IMPL_H

#include <stddef.h>

#include "bakron/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

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
    bk_backend_params params; /* the settings it was created with */
    char device[256];
};

/* Fill b (ops, ctx, device); b->params is set. */
bk_status bk_cpu_backend_init(bk_backend *b);

/* Variant selectors of the CUDA BaKron solver. Their defaults are settled by
 * the measurements in cuda/dev/NOTES.md; only the dev harness (bk-cuda-dev)
 * and the GPU parity test change them (bk_cuda_backend_tune), the product
 * never does. */
typedef struct bk_cuda_tuning {
    int tile;       /* tile size: 32 or 64 (64) */
    int solve_wc;   /* tile solve: columns per warp, 8 (16 warps per 64-tile) or 16 (16) */
    int overlap;    /* far pushes on a second, low-priority stream: 0 or 1 (1) */
    int side_band;  /* the overlapped push in two launches, the next flush's band first:
                       -1 auto = with the SM partition, 0 or 1 (-1) */
    int far_async;  /* the overlapped pushes load with cp.async: 0 or 1 (1) */
    int push_split; /* critical-path pushes in 2 x 2 parts per target tile (2) or whole (1) */
    int push_group; /* far pushes every this many tile anti-diagonals, 0..64 (4; 0 = eager) */
    int partition;  /* SMs kept free of the side stream: -1 auto, 0 none, 1..4096 (-1) */
} bk_cuda_tuning;

void bk_cuda_tuning_default(bk_cuda_tuning *t);
/* Check t (BK_ERR_INVALID_ARG naming the field and its accepted values). */
bk_status bk_cuda_tuning_check(const bk_cuda_tuning *t);

/* Implemented in cuda/ when BK_HAVE_CUDA. b->params is set. */
bk_status bk_cuda_backend_init(bk_backend *b);
/* Replace the solver variants of a CUDA backend (dev harness and tests only);
 * BK_ERR_INVALID_ARG for another backend or a bad value. */
bk_status bk_cuda_backend_tune(bk_backend *b, const bk_cuda_tuning *t);
int bk_cuda_count_devices(void);
#ifdef __cplusplus
}
#endif

#endif /* BK_BACKEND_IMPL_H */
