/* Internal pieces of the backward pass (src/backward.c, src/backward_flow.c)
 * and hooks for the tests. */
#ifndef BK_BACKWARD_INTERNAL_H
#define BK_BACKWARD_INTERNAL_H

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

/* BK_OK when the model has the LM head and final norm the backward needs;
 * else a one-line error. */
bk_status bk__bwd_head_check(const bk_model *m);

#ifdef __cplusplus
}
#endif
#endif
