/* bk-cuda-dev factor's candidate: the fp32 Cholesky (potrf('U'), A = U^T U)
 * and triangular inverse (U -> U^-1) with the O(n^3) updates as cuBLAS TF32
 * GEMMs on split operands (x = hi + lo, both TF32; hi.hi + hi.lo + lo.hi, fp32
 * accumulation); the diagonal blocks / leaves are cuSOLVER's fp32 potrf and
 * trtri. Column-major upper view on the leading n x n block (stride ld); the
 * strict lower part is left with leftovers (ignored by the callers).
 *
 * Dev harness only (cuda/dev/fac3x.cu): it was in the product behind the CUDA
 * tuning factor_tc from session 16 (branch fac3xprod) and left it in session
 * 17 (branch prune) when it missed its rule (cuda/dev/NOTES.md). Nothing in
 * src/ or cuda/ outside cuda/dev calls it. */
#pragma once

#include "../cuda_internal.cuh"

typedef struct bk_fac3x_cfg {
    int64_t nb;   /* Cholesky block column */
    int64_t pw;   /* panel width of the trapezoid / triangle-skipping GEMMs */
    int64_t leaf; /* inverse leaves (cuSOLVER trtri) */
    int terms;    /* 3: 3xTF32, 1: plain TF32 (for reference) */
    int64_t kc;   /* K per GEMM call in split elements, a multiple of terms (0: whole K) */
} bk_fac3x_cfg;
/* Workspace: two split buffers, a temporary, cuSOLVER's block / leaf
 * workspaces and one info slot per potrf block and trtri leaf. */
typedef struct bk_fac3x_ws {
    float *s1, *s2, *tmp;
    size_t s1n, s2n, tmpn; /* in floats */
    void *pw, *tw, *th;    /* potrf block, trtri leaf (device), trtri leaf (host) */
    int lw;
    size_t twd, twh;
    int *dinfo;
    int ninfo, used;
} bk_fac3x_ws;
/* Allocate (bk_dev_alloc) for order n, stride ld. On failure everything is
 * released, *w is zeroed, and the status is returned. */
bk_status bk_fac3x_ws_make(bk_cuda_ctx *c, bk_fac3x_ws *w, int64_t n, int64_t ld,
                           const bk_fac3x_cfg *g);
void bk_fac3x_ws_free(bk_cuda_ctx *c, bk_fac3x_ws *w);
/* Queue the factorization / the inverse on c->stream (no synchronization);
 * the cuSOLVER infos go to the workspace's slots (bk_fac3x_info). */
bk_status bk_fac3x_potrf(bk_cuda_ctx *c, float *X, int64_t n, int64_t ld, const bk_fac3x_cfg *g,
                         bk_fac3x_ws *w);
bk_status bk_fac3x_trtri(bk_cuda_ctx *c, float *X, int64_t n, int64_t ld, const bk_fac3x_cfg *g,
                         bk_fac3x_ws *w);
/* Synchronize c->stream; *info = the first nonzero info of the slots used
 * since the last call (0: every block / leaf succeeded); the slots are
 * reset. */
bk_status bk_fac3x_info(bk_cuda_ctx *c, bk_fac3x_ws *w, int *info);
