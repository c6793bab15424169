/* Internal (not public API): the forward pass and Hessian accumulation on
 * the GPU (cuda/forward.cu, cuda/hessian.cu, cuda/pipeline_cuda.cu;
 * docs/DEVICE.md "Pipeline on the GPU"), behind the CUDA backend's table
 * entries (src/backend_impl.h: stages_create, layer_fwd_create). Only cuda/
 * and the GPU tests include this header.
 *
 * The GPU functions mirror bakron/forward.h and bakron/hessian.h with device
 * pointers (F32, same layouts: S sequences of T tokens, N = S*T rows,
 * row-major). They exist only in builds with the CUDA backend.
 */
#ifndef BK_PIPELINE_GPU_H
#define BK_PIPELINE_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "backend_impl.h"
#include "bakron/backend.h"
#include "bakron/forward.h"
#include "bakron/hessian.h"
#include "bakron/model.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------- GPU forward pass */

typedef struct bk_gfwd bk_gfwd;
/* One decoder layer's weights on the device (F32). */
typedef struct bk_glayer bk_glayer;

/* b must be a CUDA backend (its device, stream and tracked allocator are
 * used). Scratch for micro-batches of up to max_seqs sequences of seqlen
 * tokens (with the fused attention, the unfused path's buffers and the score
 * buffer only on their first use: cuda/forward.cu); RoPE tables (src/rope.c)
 * uploaded once. */
bk_status bk_gfwd_create(bk_backend *b, const bk_model_config *cfg, int64_t max_seqs,
                         int64_t seqlen, bk_gfwd **out);
void bk_gfwd_free(bk_gfwd *f);
int64_t bk_gfwd_max_seqs(const bk_gfwd *f);

/* The attention of bk_gfwd_attention fused in one kernel (cuda/attn_flash.cu:
 * BF16 products, F32 softmax and accumulation): 1 when used, i.e. BF16 GEMM
 * mode and head_dim 64 or 128; the unfused path otherwise (F32/TF32 score
 * GEMMs and softmax). bk_gfwd_set_attn_fused: tests and the dev harness, to
 * compare the two on one forward (on = 1 is refused where unsupported). */
int bk_gfwd_attn_fused(const bk_gfwd *f);
bk_status bk_gfwd_set_attn_fused(bk_gfwd *f, int on);

/* Tracked device memory and copies on the context's stream (synchronous). */
bk_status bk_gpu_alloc(bk_gfwd *f, void **p, size_t bytes, const char *what);
void bk_gpu_free(bk_gfwd *f, void *p);
bk_status bk_gpu_upload(bk_gfwd *f, void *dst, const void *src, size_t bytes);
bk_status bk_gpu_download(bk_gfwd *f, void *dst, const void *src, size_t bytes);
bk_status bk_gpu_copy(bk_gfwd *f, void *dst, const void *src, size_t bytes); /* device->device */
bk_status bk_gpu_sync(bk_gfwd *f);
/* Free device memory (bytes). */
bk_status bk_gpu_mem_info(bk_gfwd *f, size_t *free_bytes, size_t *total_bytes);

/* Host F32 src [n] to the device dst [n] (synchronous), through pinned
 * staging in chunks: a chunk whose values are all BF16 numbers (the low 16
 * bits of every F32 zero, as in a BF16 checkpoint) travels as BF16, narrowed
 * by host threads and widened on the device, the others as F32. dst is
 * byte-identical to src either way. */
bk_status bk_gpu_upload_f32(bk_gfwd *f, float *dst, const float *src, int64_t n);
/* Tests: bk_gpu_upload_f32's chunk (elements), the smallest share of one host
 * thread (elements) and its number of host threads; 0 keeps a value. */
void bk_gpu_upload_tune(bk_gfwd *f, int64_t chunk, int64_t min_part, int threads);

/* Host BF16 src [n] (any host memory, e.g. the mapped checkpoint) to the
 * device (synchronous), through the pinned staging of bk_gpu_upload_f32: dst
 * [n] F32 receives the values widened (exact); dst_bf16 [n] (device, or NULL:
 * a staging buffer is used) receives src's bytes. */
bk_status bk_gpu_upload_bf16(bk_gfwd *f, float *dst, uint16_t *dst_bf16, const uint16_t *src,
                             int64_t n);

/* The layer's weights through bk_gpu_upload_f32; a matrix given as BF16
 * (lw->wb[i], w[i] NULL: the layer driver's BF16 read) through
 * bk_gpu_upload_bf16, in BF16 GEMM mode straight into the layer's BF16 copy
 * (the same device layer, bit for bit, as from its F32 values). */
bk_status bk_glayer_upload(bk_gfwd *f, const bk_layer_weights *lw, bk_glayer **out);
/* Device copy of another device layer. */
bk_status bk_glayer_clone(bk_gfwd *f, const bk_glayer *src, bk_glayer **out);
/* Replace module mod's weight by the host array w [out, in]. */
bk_status bk_glayer_set(bk_gfwd *f, bk_glayer *g, bk_module mod, const float *w);
void bk_glayer_free(bk_gfwd *f, bk_glayer *g);
int bk_glayer_index(const bk_glayer *g);
/* Tests: module mod's device weight into w [out, in] (host F32) and, where
 * the layer has one (BF16 GEMM mode), its BF16 copy into wb (host, may be
 * NULL); *has_bf16 (may be NULL) = 1 when it has one. */
bk_status bk_glayer_download(bk_gfwd *f, const bk_glayer *g, bk_module mod, float *w,
                             uint16_t *wb, int *has_bf16);

/* Stages, as bakron/forward.h, on device arrays. tokens stay host arrays. */
bk_status bk_gfwd_embed(bk_gfwd *f, const bk_model *m, const int32_t *tokens, int64_t S,
                        float *d_h);
/* Release the embedding table uploaded by bk_gfwd_embed (it stays for
 * further calls otherwise). */
void bk_gfwd_embed_release(bk_gfwd *f);
bk_status bk_gfwd_attn_in(bk_gfwd *f, const bk_glayer *lw, const float *d_h, int64_t S,
                          float *d_x);
bk_status bk_gfwd_attention(bk_gfwd *f, const bk_glayer *lw, const float *d_x, int64_t S,
                            float *d_o, float *d_qrot, float *d_krot, float *d_v);
/* Only the rotated queries and keys of bk_gfwd_attention (q_proj / k_proj
 * (+ bias), q_norm / k_norm where the layer has them, RoPE with the model's
 * scaling): d_qrot [N, heads*head_dim], d_krot [N, kv_heads*head_dim], both
 * required; no values, scores, softmax or output. The same kernels and GEMMs
 * as bk_gfwd_attention's, so the same bits as its d_qrot / d_krot (the
 * fully-local Hessians' stage QKV, cuda/pipeline_cuda.cu). Its non-finite
 * checks are those of the q/k side: q_proj / k_proj outputs and the rotated
 * queries / keys (not v_proj nor the attention output). */
bk_status bk_gfwd_qk_rot(bk_gfwd *f, const bk_glayer *lw, const float *d_x, int64_t S,
                         float *d_qrot, float *d_krot);
bk_status bk_gfwd_attn_out(bk_gfwd *f, const bk_glayer *lw, const float *d_o, int64_t S,
                           float *d_h);
bk_status bk_gfwd_mlp_in(bk_gfwd *f, const bk_glayer *lw, const float *d_h, int64_t S,
                         float *d_x);
bk_status bk_gfwd_mlp_hidden(bk_gfwd *f, const bk_glayer *lw, const float *d_x, int64_t S,
                             float *d_down, float *d_gate_pre, float *d_up_pre);
bk_status bk_gfwd_mlp_out(bk_gfwd *f, const bk_glayer *lw, const float *d_down, int64_t S,
                          float *d_h);
/* taps: device pointers (or NULL), as bk_layer_taps. */
bk_status bk_gfwd_layer(bk_gfwd *f, const bk_glayer *lw, int64_t S, float *d_h,
                        const bk_layer_taps *taps);
/* Final norm + LM head; host logits [N, vocab]. */
bk_status bk_gfwd_logits(bk_gfwd *f, const bk_model *m, const float *d_h, int64_t S,
                         float *logits);
/* As bk_fwd_nll (tokens: host [S, T]). The head is converted to F32 on the
 * device at the first call and kept until bk_gfwd_free. */
bk_status bk_gfwd_nll(bk_gfwd *f, const bk_model *m, const float *d_h, const int32_t *tokens,
                      int64_t S, double *nll_sum, int64_t *count);

/* The layer forward on the GPU (cuda/layer_fwd.cu; the CUDA backend's
 * layer_fwd_create). Automatic batch: one micro-batch's scratch around 2 GiB. */
bk_status bk_cuda_layer_fwd_create(bk_backend *b, const bk_layer_fwd_params *p, int64_t *batch,
                                   const bk_layer_fwd_ops **ops, void **ctx);

/* ------------------------------------------------------ GPU Hessians */

typedef struct bk_ghess bk_ghess;

/* As bk_hess_acc_create (identity power-step start for the Shampoo kinds;
 * bk_hess_set_start has no GPU counterpart). keep_plain: also accumulate
 * E[x x^T] of mlp_in for the Shampoo kinds (A_plain of gate/up). */
bk_status bk_ghess_create(bk_gfwd *f, bk_hessian_kind kind, int fp64, int keep_plain,
                          bk_ghess **out);
void bk_ghess_free(bk_ghess *a);
void bk_ghess_reset(bk_ghess *a);
/* Micro-batches of S sequences (device arrays; layer weights on the device:
 * the layer's ORIGINAL weights, as bk_hess_add_*). */
bk_status bk_ghess_add_attn(bk_ghess *a, const bk_glayer *orig, const float *d_attn_in,
                            const float *d_qrot, const float *d_krot, int64_t S);
bk_status bk_ghess_add_o(bk_ghess *a, const float *d_o_in, int64_t S);
/* on = 1: the caller has checked every activation the next adds read (the GPU
 * stages: each is the output of a forward operation whose non-finite flag
 * was fetched and reported before the adds, forward_end), so the adds skip
 * their own finiteness scans (a full read of each input and a synchronization
 * per add); 0 (the default): the adds scan their inputs. */
void bk_ghess_inputs_checked(bk_ghess *a, int on);
bk_status bk_ghess_add_mlp(bk_ghess *a, const bk_glayer *orig, const float *d_mlp_in, int64_t S);
bk_status bk_ghess_add_down(bk_ghess *a, const float *d_down_in, int64_t S);
/* Host factors as bk_hess_factors (owned by the accumulator, valid until
 * the next call); A_plain may be NULL. */
bk_status bk_ghess_factors(bk_ghess *a, const bk_glayer *orig, bk_module mod, const float **A,
                           const float **B, const float **A_plain);

/* As bk_ghess_factors, but A, B and A_plain are DEVICE arrays owned by the
 * accumulator (one set, reused: valid until the next call). */
bk_status bk_ghess_factors_dev(bk_ghess *a, const bk_glayer *orig, bk_module mod,
                               const float **A, const float **B, const float **A_plain);

/* Device factor buffers of their own (bk_ghess_factors_dev_aside), apart
 * from the accumulator's one set. */
typedef struct bk_ghess_aside {
    float *A, *B, *P;
    size_t A_n, B_n, P_n;
} bk_ghess_aside;
/* As bk_ghess_factors_dev, into x's buffers (grown on demand) instead of the
 * accumulator's set, which stays as it is, and so does what
 * bk_ghess_factor_key reports: the factors of a module ahead of its turn
 * (the same kernels on the same state: the same bits as its own
 * bk_ghess_factors_dev gives later). *B: x's B (NULL: identity); *gen: the
 * accumulator's generation now. */
bk_status bk_ghess_factors_dev_aside(bk_ghess *a, const bk_glayer *orig, bk_module mod,
                                     bk_ghess_aside *x, const float **B, uint64_t *gen);
/* x's buffers released (x stays usable). */
void bk_ghess_aside_free(bk_ghess *a, bk_ghess_aside *x);

/* What the last successful bk_ghess_factors / bk_ghess_factors_dev formed its
 * input factor A from: *src names the accumulated Gram (NULL when none was
 * formed), *scale its factor and *gen the accumulator's generation then (a
 * new one after anything was accumulated, reset, exchanged or given
 * gradients; never repeated in the process), so that two calls with the same
 * (src, scale, gen) formed the same A. *shared: the Gram is one that several
 * modules take as it is (attn_in's for q/k/v, mlp_in's for gate/up). */
void bk_ghess_factor_key(const bk_ghess *a, const void **src, double *scale, uint64_t *gen,
                         int *shared);

/* MPI ranks: the running sums of modules `modules` to fn (bk_stage_ops.sums;
 * bk_hess_acc_sums's order). Backprop kinds: the input side only
 * (bk__hess_bp_sum_items, then the row counts); the output side comes
 * complete from the host accumulator (bk_ghess_set_grads). */
bk_status bk_ghess_sums(bk_ghess *a, unsigned modules, int dev, int rw, bk_stage_buf_fn fn,
                        void *user);

/* One device buffer of n elements to fn: as it is (dev 1, on the context's
 * stream), or through host copies of at most 256 MiB (dev 0; rw: download
 * before fn with BK_BUF_READ, upload after with BK_BUF_WRITE). */
bk_status bk_gpu_stage_buf(bk_gfwd *f, void *d, size_t n, int f64, int dev, int rw,
                           bk_stage_buf_fn fn, void *user);

/* Backprop kinds: the output side of the layer being accumulated, from the
 * flow's host accumulator g (bakron/hessian.h, src/backward_internal.h):
 * its B = Σ g gᵀ / N (or Σ |a|² g gᵀ / N) becomes the factors' B, and for
 * backprop-shampoo its token weights |g_t|² are uploaded for the input side
 * Σ |g_t|² a aᵀ of the adds that follow. Call after bk_ghess_reset and
 * before the layer's adds; g must stay valid until the factors are formed. */
bk_status bk_ghess_set_grads(bk_ghess *a, const bk_hess_acc *g);
/* The same from the GPU flow's device arrays (bk_bwd_flow_cb.grams_dev): G
 * [out, out] double, row-major upper triangle, over N tokens; gw [N] the
 * token weights (Shampoo; else ignored). B = (float)(G / N), as the host
 * accumulator forms it; nothing is copied: the arrays must stay valid until
 * the factors are formed. */
bk_status bk_ghess_set_grads_dev(bk_ghess *a, int layer, const double *const G[BK_MOD_COUNT],
                                 const double *const gw[BK_MOD_COUNT], int64_t N);

/* ------------------------------------------------- the GPU stage table */

/* Stages on the GPU for a token-calibrated job: residual stream of the S
 * sequences (MPI ranks, nranks > 1: of this rank's share, bk_rank_share with
 * the micro-batch returned) on the device when it fits (else pinned host
 * memory), one
 * layer's weights (original + working copy) and one layer's accumulators
 * resident. *batch: the micro-batch asked for (0 = automatic), reduced when
 * the device memory is short; the value used is returned. codes_only: the
 * export needs codes and scales only (solve_dev leaves r->weight NULL). */
bk_status bk_gpu_stages_create(bk_backend *b, const bk_model *m, bk_hessian_kind kind,
                               int fp64, int keep_plain, int fully, int codes_only, int64_t S,
                               int64_t T, int rank, int nranks,
                               struct bk_bwd_mem_params *bwd, int64_t *batch,
                               const bk_stage_ops **ops, void **ctx);

#ifdef __cplusplus
}
#endif
#endif /* BK_PIPELINE_GPU_H */
