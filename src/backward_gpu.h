/* Internal (not public API): the backward pass and its flows on the GPU
 * (cuda/backward.cu; docs/hessians.md "Backprop", "On the GPU").
 *
 * The same decomposition as the CPU oracle (bakron/backward.h,
 * src/backward.c, src/backward_flow.c), op by op, on one micro-batch at a
 * time: embedding rows gathered on the device, per-layer forward with
 * recomputation, per-layer backward, the LM head's cross entropy in
 * vocabulary blocks, the model-Fisher labels by the same inverse CDF with
 * the same uniforms (bk__bwd_uniform, computed on the host).
 *
 * Arithmetic (bk_gbwd_opts.fp64):
 *   fp64 = 1  every GEMM in double (cuBLAS DGEMM), activations and gradients
 *             stored in double: the CPU oracle's arithmetic up to the order
 *             of the sums (parity mode, what the GPU test checks tightly);
 *   fp64 = 0  GEMMs in IEEE F32 (cuBLAS SGEMM, no TF32), activations,
 *             gradients and boundary matrices stored in F32; every
 *             elementwise step and every reduction (RMSNorm sums, softmax
 *             sums, log-sum-exp, the label CDF) in double. math TF32 / BF16
 *             (bk_gbwd_opts.math): GEMMs on tensor cores, the output-gradient
 *             Grams per micro-batch too (F32, summed in double); BF16 also
 *             keeps the layer weights as BF16 on the device and runs the
 *             layer forward's and backward's attention fused (attn_flash.cu,
 *             attn_flash_bwd.cu) at head_dim 64 / 128 (docs/hessians.md "On
 *             the GPU").
 *
 * Memory: boundary matrices (recursive halving) in pinned host memory,
 * copied to and from the device micro-batch by micro-batch; on the device
 * one micro-batch (its hidden state, gradient and the layer inputs it goes
 * back through), the layer weights in use (a small cache of layers,
 * bk_gbwd_opts.max_resident_layers) and the LM head.
 *
 * Only in builds with the CUDA backend. */
#ifndef BK_BACKWARD_GPU_H
#define BK_BACKWARD_GPU_H

#include <stdint.h>

#include "bakron/backend.h"
#include "bakron/backward.h"
#include "bakron/model.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* GEMMs of the F32 mode (bk_gbwd_opts.math) */
enum { BK_GBWD_F32 = 0, BK_GBWD_TF32 = 1, BK_GBWD_BF16 = 2 };

typedef struct bk_gbwd_opts {
    int fp64;                /* 1: double arithmetic (parity with the CPU); 0: F32 storage */
    int max_resident_layers; /* layers' weights kept on the device at once; 0: as many as
                                fit in half the free device memory (within the setting
                                mem_limit, when set; at least 1) */
    int math;                /* fp64 = 0: BK_GBWD_F32 (IEEE F32 GEMMs, default), _TF32 or
                                _BF16 (F32 arrays on tensor cores, F32 accumulation:
                                cuBLAS compute types 32F_FAST_TF32 / 32F_FAST_16BF); the
                                elementwise steps and reductions stay in double */
    int f32_weights;         /* _BF16 only, tests: the layers' F32 host copies uploaded and
                                rounded on the device (the path before session 13) instead
                                of BF16 host weights; the same device bits */
} bk_gbwd_opts;

void bk_gbwd_opts_default(bk_gbwd_opts *o);

/* As bk_bwd_flow_run, on the CUDA backend b. The taps given to cb->grads are
 * host arrays of double (converted from F32 in fp32 mode), valid during the
 * call. stats->peak_boundary_bytes counts the pinned host boundaries;
 * stats->micro_bytes the device bytes of one micro-batch's buffers. */
bk_status bk_cuda_bwd_flow_run(bk_backend *b, const bk_model *m, const int32_t *tokens,
                               int64_t S, int64_t T, const bk_bwd_flow_opts *o,
                               const bk_gbwd_opts *g, const bk_bwd_flow_cb *cb,
                               bk_bwd_flow_stats *stats);

/* Whether the flow's layer forward and backward run the fused attention
 * (cuda/attn_flash.cu, attn_flash_bwd.cu) with options g at this head_dim:
 * BK_GBWD_BF16 (not fp64) and head_dim 64 / 128; else the unfused path
 * (cuBLAS products over [B, T, T] arrays). */
int bk__cuda_bwd_attn_fused(const bk_gbwd_opts *g, int64_t head_dim);

/* Tests: bytes from device memory of backend b (e.g. the arrays handed to
 * bk_bwd_flow_cb.grams_dev) to host memory, on the backend's stream. */
bk_status bk__cuda_download(bk_backend *b, void *dst, const void *src, size_t bytes);

/* Tests: the labels and the head of one micro-batch of S sequences of T
 * tokens on the GPU from the host hidden states h [S*T, hidden] (double):
 * as bk_bwd_labels (labels [S*T] out; fisher, seed, seq0 as there) followed
 * by bk_bwd_head (dh [S*T, hidden] out, may be NULL; *loss += the loss). */
bk_status bk__cuda_bwd_head(bk_backend *b, const bk_model *m, const bk_gbwd_opts *g, int64_t T,
                            const double *h, const int32_t *tokens, int64_t S, int64_t seq0,
                            bk_fisher_kind fisher, uint64_t seed, int32_t *labels, double *dh,
                            double *loss);

#ifdef __cplusplus
}
#endif
#endif /* BK_BACKWARD_GPU_H */
