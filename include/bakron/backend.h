/* bakron — compute backends. One interface (a table of operations plus a
 * context); the CPU backend is the exact reference, the CUDA backend is
 * checked against it.
 */
#ifndef BAKRON_BACKEND_H
#define BAKRON_BACKEND_H

#include <stddef.h>

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

/* BK_ERR_NO_DEVICE when CUDA is asked for and unusable (not compiled in, or
 * no GPU), with the reason in the message. */
bk_status bk_backend_create(bk_backend_kind kind, bk_backend **out);
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
                         and fp32 accumulation, attention in TF32 */
    BK_GEMM_AUTO = 3  /* quantize only: BF16 for a checkpoint whose linear weights are BF16,
                         else TF32 (a backend given AUTO uses FP32) */
} bk_gemm_math;

bk_status bk_gemm_math_from_name(const char *name, bk_gemm_math *out);
const char *bk_gemm_math_name(bk_gemm_math m);
void bk_backend_set_gemm_math(bk_backend *b, bk_gemm_math m);
bk_gemm_math bk_backend_gemm_math(const bk_backend *b);

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
