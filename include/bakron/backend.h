/* bakron — compute backends. One interface (a table of operations plus a
 * context); the CPU backend is the exact reference, the CUDA backend is
 * checked against it.
 */
#ifndef BAKRON_BACKEND_H
#define BAKRON_BACKEND_H

#include <stddef.h>

#include "bakron/model.h"
#include "bakron/solver.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bk_backend_kind {
    BK_BACKEND_AUTO = 0, /* CUDA when compiled in and a GPU is present, else CPU */
    BK_BACKEND_CPU,
    BK_BACKEND_CUDA
} bk_backend_kind;

bk_status bk_backend_kind_from_name(const char *name, bk_backend_kind *out);

typedef struct bk_backend bk_backend;

/* Settings of a backend, fixed at creation (the CLI's `--setting KEY=VALUE`,
 * README "Settings"). bk_backend_params_default gives the defaults; a field
 * a backend has no use for is ignored by it. */
typedef struct bk_backend_params {
    int device;         /* CUDA device ordinal (default 0) */
    int factor_fp64;    /* CUDA: damping + Cholesky in fp64 also for fp32 solves (default 0;
                           the CPU factors in the solve precision) */
    size_t mem_limit;   /* CUDA: refuse device allocations beyond this many bytes (default 0:
                           no limit; tests the out-of-memory paths) */
    int keep_down;      /* 1 (default): keep the down_proj inputs of all sequences between
                           the quantize stages DOWN and OUT when they fit (host memory: a
                           quarter of the physical memory; device: what is free after the
                           reserve); 0: recompute them (a third more forward work) */
    int residual_host;  /* GPU stages: 0 (default) the residual stream on the device when it
                           fits, else in pinned host memory; 1: always in pinned host memory */
    int bwd_input_cpu;  /* backprop kinds with the backward passes on the GPU: 0 (default)
                           the input-side stages (forward through the quantized layers,
                           E[a aᵀ]) on the GPU stages too, fed the flow's device Grams
                           (MPI ranks: the Grams combined in host memory first);
                           1 (setting bwd_input=cpu): on the CPU, the GPU backward's Grams
                           downloaded (slower; isolates the backward pass in tests) */
} bk_backend_params;

void bk_backend_params_default(bk_backend_params *p);
/* Set one field by name: device=N, factor_fp64=0|1, mem_limit=BYTES,
 * keep_down=0|1, residual=auto|host, bwd_input=gpu|cpu. BK_ERR_INVALID_ARG naming the key and
 * the accepted values otherwise. */
bk_status bk_backend_params_set(bk_backend_params *p, const char *key, const char *value);
/* "KEY=VALUE" as bk_backend_params_set. */
bk_status bk_backend_params_parse(bk_backend_params *p, const char *key_value);

/* BK_ERR_NO_DEVICE when CUDA is asked for and unusable (not compiled in, or
 * no GPU), with the reason in the message. params NULL: the defaults. */
bk_status bk_backend_create_params(bk_backend_kind kind, const bk_backend_params *params,
                                   bk_backend **out);
/* bk_backend_create_params with the default settings. */
bk_status bk_backend_create(bk_backend_kind kind, bk_backend **out);
/* The settings the backend was created with. */
const bk_backend_params *bk_backend_get_params(const bk_backend *b);
void bk_backend_destroy(bk_backend *b);
/* "cpu" or "cuda" */
const char *bk_backend_name(const bk_backend *b);
/* Human-readable device description ("CPU (OpenBLAS, 2 threads)",
 * "NVIDIA H200, 139 GiB, sm_90"). */
const char *bk_backend_device(const bk_backend *b);

/* Solve on this backend. Same contract as bk_solve. An operation a backend
 * lacks returns BK_ERR_UNSUPPORTED naming it. */
bk_status bk_backend_solve(bk_backend *b, const bk_solve_problem *p, const bk_solve_opts *o,
                           bk_solve_result *r);

/* The whole model on token sequences [S, T] on this backend, layer-streamed:
 * as bk_model_nll / bk_model_logits (bakron/forward.h), which are these with
 * b = NULL (the CPU). The layer driver runs the backend's layer forward (the
 * CPU's where the backend has none); batch 0: the backend's automatic
 * micro-batch. */
bk_status bk_backend_model_nll(bk_backend *b, const bk_model *m, const int32_t *tokens,
                               int64_t S, int64_t T, int64_t batch, double *nll_sum,
                               int64_t *count);
bk_status bk_backend_model_logits(bk_backend *b, const bk_model *m, const int32_t *tokens,
                                  int64_t S, int64_t T, float *logits);

/* Peak device memory (bytes) used since creation; 0 on the CPU backend. */
/* Arithmetic of the large GEMMs of the GPU forward pass and Hessian
 * accumulation (quantize's stages, eval). BK_GEMM_FP32 (the default of a new
 * backend): IEEE fp32, matches the CPU oracle to ~1e-6. BK_GEMM_TF32: tensor
 * cores with TF32 inputs (10-bit mantissa) and fp32 accumulation, several
 * times faster (docs/DEVICE.md gives the measured differences). The solver
 * itself is never affected. No effect on the CPU backend. */
typedef enum bk_gemm_math {
    BK_GEMM_FP32 = 0,
    BK_GEMM_TF32 = 1,
    BK_GEMM_BF16 = 2, /* the projections and Gram matrices with BF16 inputs (8-bit mantissa)
                         and fp32 accumulation; attention fused with BF16 operands for
                         head_dim 64 / 128, else TF32 */
    BK_GEMM_AUTO = 3  /* quantize only: BF16 for a checkpoint whose linear weights are BF16,
                         else TF32 (a backend given AUTO uses FP32) */
} bk_gemm_math;

bk_status bk_gemm_math_from_name(const char *name, bk_gemm_math *out);
const char *bk_gemm_math_name(bk_gemm_math m);
void bk_backend_set_gemm_math(bk_backend *b, bk_gemm_math m);
bk_gemm_math bk_backend_gemm_math(const bk_backend *b);
/* BK_GEMM_AUTO resolved for model m: BF16 when its linear weights are BF16,
 * else TF32; other values are returned unchanged. */
bk_gemm_math bk_gemm_math_resolve(const bk_model *m, bk_gemm_math want);

size_t bk_backend_peak_memory(const bk_backend *b);
/* Restart the peak at the memory in use now (to measure one operation). */
void bk_backend_reset_peak_memory(bk_backend *b);

/* Whether the CUDA backend was compiled in. */
int bk_cuda_compiled(void);
/* Number of usable CUDA devices (0 when not compiled in or no driver/GPU). */
int bk_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_BACKEND_H */
