/* Internal pieces of the backward pass (src/backward.c, src/backward_flow.c),
 * the flow driver's operations table and hooks for the tests. */
#ifndef BK_BACKWARD_INTERNAL_H
#define BK_BACKWARD_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/backward.h"
#include "bakron/hessian.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Tests (finite differences): add delta to output element (row, col) of
 * module mod of layer `layer` in every following layer forward of b
 * (NULL: off). */
typedef struct bk_bwd_perturb {
    int layer;
    bk_module mod;
    int64_t row, col;
    double delta;
} bk_bwd_perturb;
void bk__bwd_set_perturb(bk_bwd *b, const bk_bwd_perturb *p);

/* The uniform in [0, 1) that picks the sampled label of (sequence, position). */
double bk__bwd_uniform(uint64_t seed, int64_t seq, int64_t pos);

/* As bk_hess_add_grad (bakron/hessian.h) with the micro-batches' Gram already
 * formed (by the GPU flow): G [out, out] row-major, upper triangle read, is
 * Σ g gᵀ (K-FAC) or Σ |a_fp|² g gᵀ (Shampoo) over the N = S*T tokens; gw [N]
 * the |g|² of each token in order (Shampoo; ignored for K-FAC). */
bk_status bk__hess_add_grad_gram(bk_hess_acc *a, int layer, bk_module mod, const double *G,
                                 const double *gw, int64_t S);

/* The output side of a backprop accumulator holding layer `layer`, for
 * input-side stages that run elsewhere (the GPU stages): B [m, m] = Σ g gᵀ / N
 * (K-FAC) or Σ |a_fp|² g gᵀ / N (Shampoo), both triangles, N = *count, the
 * gradient rows added (exactly as bk_hess_factors forms it). */
bk_status bk__hess_bp_output(const bk_hess_acc *a, int layer, bk_module mod, float *B,
                             int64_t *count);
/* Shampoo: the |g_t|² of the *n tokens added so far, in order (the weights
 * of the input side's a aᵀ); K-FAC: *w = NULL, *n = 0. Valid until the
 * accumulator is reset or more gradients are added. */
bk_status bk__hess_bp_token_weights(const bk_hess_acc *a, bk_module mod, const double **w,
                                    int64_t *n);

/* MPI ranks: the output side of a backprop accumulator (Σ g gᵀ or
 * Σ |a_fp|² g gᵀ of every module, then the gradient rows added) through fn,
 * one buffer at a time, as bk_hess_acc_sums does for the input side; the
 * factors are allocated first (a rank that receives before adding). The
 * Shampoo token weights stay each rank's own (its input side uses them). */
bk_status bk__hess_bp_grad_sums(bk_hess_acc *a, int layer, bk_hess_sum_fn fn, void *user);

/* MPI ranks, ordered sums, the GPU flow (bk_bwd_flow_cb.grams_start): the
 * output-gradient sum of module mod received from the ranks before (Σ g gᵀ
 * or Σ |a_fp|² g gᵀ, [out, out], upper triangle) into G, and zero here, so
 * the flow's Grams start from it and the Gram delivered at the leaf's end
 * (bk__hess_add_grad_gram) replaces it. The gradient row count stays. *set
 * = 0 (G untouched) when nothing was received for the module. */
bk_status bk__hess_bp_grad_take(bk_hess_acc *a, bk_module mod, double *G, int *set);

/* Vocabulary rows per block of the backward's head, the same on the CPU and
 * the GPU: [rows, vc] logits within 2^22 and [vc, hidden] head rows within
 * 2^21 elements, at least 16, at most vocab. */
int64_t bk__bwd_vocab_block(int64_t rows, int64_t hidden, int64_t vocab);

/* BK_OK when the model has the LM head and final norm the backward needs;
 * else a one-line error. */
bk_status bk__bwd_head_check(const bk_model *m);

/* ------------------------------------------------ the flow, once for all backends
 *
 * src/backward_flow.c drives the flows (naive, recursive halving: leaves,
 * boundaries, passes, stats); a backend supplies the operations on one
 * micro-batch through this table (the CPU's in src/backward_flow.c, the
 * GPU's in cuda/backward.cu). The backend holds the micro-batch: h and dh
 * [B*T, hidden] and the kept layer inputs acts[k] (k < the acts_layers of
 * bk__bwd_flow_check); the driver holds the boundary matrices [S*T, hidden]
 * (host memory from boundary_alloc) and passes byte ranges of them. An
 * element is elem_bytes. Entries return status; optional ones may be NULL. */
enum { BK_BWD_H = 0, BK_BWD_DH = 1 };
typedef struct bk_bwd_flow_ops {
    size_t elem_bytes;
    const char *boundary_mem; /* for the message: "memory", "pinned host memory" */
    void *(*boundary_alloc)(void *ctx, size_t bytes); /* NULL: out of memory */
    void (*boundary_free)(void *ctx, void *p);
    /* h = the embedding of sb sequences of tokens */
    bk_status (*embed)(void *ctx, const int32_t *tokens, int64_t sb);
    /* buffer buf (BK_BWD_H, BK_BWD_DH) = bytes of src, or to dst */
    bk_status (*load)(void *ctx, int buf, const void *src, size_t bytes);
    bk_status (*store)(void *ctx, int buf, void *dst, size_t bytes);
    /* acts[k] = h of sb sequences (in the backend's own element: the
     * boundary's elem_bytes may be narrower) */
    bk_status (*keep)(void *ctx, int k, int64_t sb);
    /* h = layer `layer`'s forward of h, sb sequences */
    bk_status (*forward)(void *ctx, int layer, int64_t sb);
    /* dh = the head's gradient at h (labels of sequences seq0.. by the
     * flow's fisher and seed) */
    bk_status (*head)(void *ctx, const int32_t *tokens, int64_t sb, int64_t seq0);
    /* dh = the backward of layer `layer` from its input acts[k]; taps: the
     * module taps are wanted (deliver follows) */
    bk_status (*backward)(void *ctx, int layer, int k, int64_t sb, int taps);
    /* the taps of that backward (micro-batch [s0, s0 + sb)) to the consumer;
     * its time is not counted as the backward's */
    bk_status (*deliver)(void *ctx, int layer, int k, int64_t s0, int64_t sb);
    /* optional: wait for the work queued so far (each phase ends with it) */
    bk_status (*sync)(void *ctx);
    /* optional: the leaf [lo, hi) is done (instead of calling the consumer's
     * cb->leaf_done directly; the backend calls it) */
    bk_status (*leaf_done)(void *ctx, int lo, int hi);
    /* optional: a leaf pass over [lo, hi) begins (after cb->pass_begin,
     * before its sweep; the GPU's: cb->grams_start) */
    bk_status (*leaf_begin)(void *ctx, int lo, int hi);
} bk_bwd_flow_ops;

/* The checks of bk_bwd_flow_run's arguments (stats zeroed) and the
 * micro-batch plan: *B sequences a micro-batch, *acts_layers layer inputs
 * kept a micro-batch. */
bk_status bk__bwd_flow_check(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                             const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                             bk_bwd_flow_stats *stats, int64_t *B, int64_t *acts_layers);

/* Run the flow of o over the operations of one backend (ctx: its state,
 * set up for micro-batches of B sequences). stats as checked above; the
 * driver adds the passes, layer counts, boundary bytes and times. */
bk_status bk__bwd_flow_drive(const bk_bwd_flow_ops *ops, void *ctx, const bk_model *m,
                             const int32_t *tokens, int64_t S, int64_t T, int64_t B,
                             const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                             bk_bwd_flow_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
