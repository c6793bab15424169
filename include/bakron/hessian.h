/* bakron — Kronecker-factored Hessians H ≈ A ⊗ B per linear module (paper
 * section 4, appendix A, Table 4; derivations in docs/hessians.md).
 *
 * Accumulation streams over calibration micro-batches (layout as in
 * bakron/forward.h: S sequences of T tokens, N = S*T rows, row s*T + t at
 * position t). One accumulator serves one decoder layer at a time.
 */
#ifndef BAKRON_HESSIAN_H
#define BAKRON_HESSIAN_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bk_hessian_kind {
    BK_HESS_RTN = 0,              /* plain rounding, no Hessian */
    BK_HESS_GPTQ,                 /* E[x x^T] ⊗ I for every module */
    BK_HESS_MLPLOCAL_KFAC,        /* gate/up: MLP-local two-sided, K-FAC factorization */
    BK_HESS_MLPLOCAL_SHAMPOO,     /* gate/up: MLP-local two-sided, one Shampoo power step */
    BK_HESS_FULLYLOCAL_KFAC,      /* + q/k/v attention-local output factors, K-FAC */
    BK_HESS_FULLYLOCAL_SHAMPOO,   /* + q/k/v attention-local output factors, Shampoo */
    BK_HESS_BACKPROP_KFAC,        /* every module: E[a aᵀ] ⊗ E[g gᵀ], g the backpropagated
                                     output gradient of the model's loss (Fisher), K-FAC */
    BK_HESS_BACKPROP_SHAMPOO,     /* the same Fisher, one Shampoo power step */
    BK_HESS_COUNT
} bk_hessian_kind;

/* "rtn", "gptq", "mlplocal-kfac", ... */
const char *bk_hessian_name(bk_hessian_kind k);
bk_status bk_hessian_from_name(const char *name, bk_hessian_kind *out);
/* 1 if module `mod` gets a two-sided factor (B != I) under `k`. */
int bk_hessian_is_two_sided(bk_hessian_kind k, bk_module mod);
/* 1 for the backprop kinds (they need output gradients, bakron/backward.h). */
int bk_hessian_is_backprop(bk_hessian_kind k);

typedef struct bk_hess_acc bk_hess_acc;

/* fp64: accumulate in double (factors are still returned as float). */
bk_status bk_hess_acc_create(const bk_model_config *cfg, bk_hessian_kind kind, int fp64,
                             int64_t seqlen, bk_hess_acc **out);
void bk_hess_acc_free(bk_hess_acc *a);
/* Zero all accumulators (before the next layer). */
void bk_hess_acc_reset(bk_hess_acc *a);

/* Feed one micro-batch. `lw` holds the layer's ORIGINAL full-precision
 * weights (output-side factors are built from them). q_rot / k_rot are the
 * queries / keys after q_norm/k_norm and RoPE (bk_fwd_attention); they may be
 * NULL unless the kind is fully-local. */
bk_status bk_hess_add_attn(bk_hess_acc *a, const bk_layer_weights *lw, const float *attn_in,
                           const float *q_rot, const float *k_rot, int64_t S);
bk_status bk_hess_add_o(bk_hess_acc *a, const float *o_in, int64_t S);
bk_status bk_hess_add_mlp(bk_hess_acc *a, const bk_layer_weights *lw, const float *mlp_in,
                          int64_t S);
bk_status bk_hess_add_down(bk_hess_acc *a, const float *down_in, int64_t S);

/* Backprop kinds: one micro-batch of module `mod`'s output gradients
 * g [S*T, out] of layer `layer` (and, for Shampoo, the module's inputs in
 * the full-precision model a_fp [S*T, in], whose |a|² weight the output
 * factor). B = (1/N) Σ g gᵀ (K-FAC) or (1/N) Σ |a_fp|² g gᵀ (Shampoo),
 * accumulated in double. The input factor comes from the ordinary adds
 * (bk_hess_add_attn, ..._o, ..._mlp, ..._down): A = (1/N) Σ a aᵀ, or for
 * Shampoo (1/N) Σ |g|² a aᵀ with the |g|² of the same token, so every
 * gradient of a layer is added before its inputs, micro-batches in the same
 * order. Non-finite gradients: BK_ERR_NONFINITE naming layer and module. */
bk_status bk_hess_add_grad(bk_hess_acc *a, int layer, bk_module mod, const double *g,
                           const double *a_fp, int64_t S);

/* Factors of module `mod` from everything added so far: A [in, in] and
 * B [out, out], or *B = NULL for the identity. Averaged over samples, not
 * damped (the solver damps). Arrays are owned by the accumulator and stay
 * valid until the next add / reset / free. BK_ERR_CALIB when nothing was
 * added for that module. */
bk_status bk_hess_factors(bk_hess_acc *a, const bk_layer_weights *lw, bk_module mod,
                          const float **A, const float **B);

/* The running sums of the modules in `modules` (bit m = bk_module m; a
 * module shares its sums with the others fed by the same add), one buffer at
 * a time: fn may read, overwrite or add to the buffer (MPI ranks: pass the
 * sums along or add them up, src/pipeline.c). f64: double elements, else
 * float. The token counts come as doubles and are written back. Not for
 * the backprop kinds. */
typedef bk_status (*bk_hess_sum_fn)(void *user, void *buf, size_t n, int f64);
bk_status bk_hess_acc_sums(bk_hess_acc *a, unsigned modules, bk_hess_sum_fn fn, void *user);

/* Shampoo kinds, two-sided modules: continue the power iteration of
 * appendix A.2. The next pass accumulates A = E[tr(bᵀ B0 b) a aᵀ] and
 * B = E[(aᵀ A0 a) b bᵀ] instead of the step from the identity. A0 [n, n],
 * B0 [m, m] are symmetric PSD (NULL = identity; n, m must be the module's
 * [in], [out]); they are copied. Call after bk_hess_acc_reset and before the
 * layer's first add of that module; reset clears them. Feeding the previous
 * pass's factors (rescaled) converges to the best Kronecker approximation. */
bk_status bk_hess_set_start(bk_hess_acc *a, bk_module mod, const float *A0, int64_t n,
                            const float *B0, int64_t m);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_HESSIAN_H */
