/* Host logic shared by the CPU and CUDA Hessian accumulators (src/hessian.c,
 * cuda/hessian.cu): the module groups, the checks of an add and of a
 * factor request, the exchange of the scalar sums, and the assembly of a
 * block-diagonal output factor from its per-head blocks. */
#ifndef BK_HESS_BLOCKS_H
#define BK_HESS_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/hessian.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a kind's factors need from the stages (its line in the registry,
 * src/hessian.c): the full-precision queries/keys in stage QKV (the
 * attention-local output factors of q/k/v), and the plain E[x xᵀ] besides
 * the kind's factors (the GPTQ proxy loss of the Shampoo kinds' two-sided
 * modules). */
int bk__hessian_needs_qk(bk_hessian_kind k);
int bk__hessian_keeps_plain(bk_hessian_kind k);

/* Which add feeds a module: bk_hess_add_attn (q, k, v), _o, _mlp (gate, up),
 * _down. */
enum { G_ATTN = 0, G_O, G_MLP, G_DOWN, G_COUNT };
int bk__hess_module_group(bk_module mod);
/* The input-side Grams of an accumulator a (the CPU's and the GPU's have the
 * same fields), as an initializer list of pointers. */
#define BK_HESS_GRAMS(a)                                                                      \
    &(a)->x_attn, &(a)->x_o, &(a)->x_mlp, &(a)->x_down, &(a)->a_q, &(a)->a_k, &(a)->a_gate,  \
        &(a)->a_up, &(a)->b_gate, &(a)->b_up
/* The groups of the modules in the bit set `modules` (bit m = bk_module m):
 * grp[g] = 1 for each. */
void bk__hess_groups(unsigned modules, int grp[G_COUNT]);

/* The accumulators' checks (messages name `what`, the add or the module;
 * reset: the name of the accumulator's reset function):
 *   check_broken  an earlier add failed part-way (only a reset helps);
 *   check_layer   that, then the layer weights given to an add (has_lw: not
 *                 NULL) against the layer accumulated (acc_layer, -1: none);
 *   check_input   an add of one input x: the accumulator and x not NULL,
 *                 then check_broken;
 *   check_factors the factors of a module asked: samples were added to its
 *                 group (count; add: the group's add function) and the
 *                 weights (has_lw) are of the layer accumulated. */
bk_status bk__hess_check_broken(int broken, const char *what, const char *reset);
bk_status bk__hess_check_layer(int broken, int has_lw, int lw_layer, int acc_layer,
                               const char *what, const char *reset);
bk_status bk__hess_check_input(int has_acc, int broken, const void *x, const char *what,
                               const char *reset);
bk_status bk__hess_check_factors(const char *what, int64_t count, const char *add, int has_lw,
                                 int lw_layer, int acc_layer);
/* The checks of bk_hess_add_attn / _mlp on their weights (lw_layer: the
 * layer's index): attn_in not NULL; attn2 (fully-local) needs the rotated queries and keys,
 * o_proj and, with qknorm, q_proj, k_proj, q_norm and k_norm (has_qk_norm);
 * mlp2 needs gate, up and down. */
bk_status bk__hess_check_attn(bk_hessian_kind kind, int attn2, int qknorm, int lw_layer,
                              const void *attn_in, int has_qk_rot, int has_o, int has_qk_norm);
bk_status bk__hess_check_mlp(bk_hessian_kind kind, int mlp2, int lw_layer, int has_weights);

/* The counts and scalar sums of groups grp (for the MPI ranks' exchange of
 * the sums): pack into sc (at most G_COUNT + 2 doubles; returns how many),
 * and unpack from it. */
size_t bk__hess_scalars_pack(const int grp[G_COUNT], const int64_t count[G_COUNT],
                             int64_t n_pairs, double v_wb, double *sc);
void bk__hess_scalars_unpack(const int grp[G_COUNT], const double *sc, int64_t count[G_COUNT],
                             int64_t *n_pairs, double *v_wb);

/* The backprop kinds' input-side sums of the modules' groups (MPI ranks:
 * bk_hess_acc_sums on the CPU, bk_ghess_sums on the GPU, in the same order):
 * group by group, the group's plain Gram Σ a aᵀ when `plain` (K-FAC's A; on
 * the GPU also Shampoo's E[x xᵀ] kept for the GPTQ loss), then with
 * `shampoo` each module's Σ |g_t|² a_t a_tᵀ (each rank's inputs weighed by
 * its own tokens' weights). items[k] = the module (BK_MOD_*) of a
 * per-module sum, or -1 - g for group g's plain Gram; at most
 * BK_HESS_BP_SUM_ITEMS. Returns how many. The counts of the groups follow
 * the Grams (bk__hess_bp_counts_pack). */
enum { BK_HESS_BP_SUM_ITEMS = 4 * G_COUNT };
int bk__hess_bp_sum_items(unsigned modules, int shampoo, int plain, int items[]);
/* The row counts of groups grp (only they: the backprop kinds have no other
 * scalar sums) into sc (at most G_COUNT doubles; returns how many), and back. */
size_t bk__hess_bp_counts_pack(const int grp[G_COUNT], const int64_t count[G_COUNT], double *sc);
void bk__hess_bp_counts_unpack(const int grp[G_COUNT], const double *sc, int64_t count[G_COUNT]);

/* dst [m, m], m = heads * h: zero except the diagonal h x h block of every
 * head j, which is mul * sym(S) / div with S = blk + (j / rep) * blk_stride
 * (h x h doubles) and sym(S) = (S + S^T) / 2 (the sandwiches leave ~1 ulp of
 * asymmetry). rep > 1: the heads of a group share their group's block. mul
 * and div are both given so that callers scaling by a product and by a
 * quotient round as they always have (x * 1 and x / 1 are exact). */
void bk_hess_head_blocks(float *dst, const double *blk, int64_t blk_stride, int64_t heads,
                         int64_t rep, int64_t h, double mul, double div);

#ifdef __cplusplus
}
#endif
#endif
