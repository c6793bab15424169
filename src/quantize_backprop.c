/* The backprop Hessian kinds in the quantization job: the backward flow
 * (bk_backend_bwd_flow_run) drives the layers; each leaf's layers are then
 * quantized by the layer driver. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quantize_job.h"
#include "util.h"

/* ------------------------------------- backprop kinds: the flow drives the layers */

static void bp_add_flow_time(job *j)
{
    const double t = j->bp_stats.time_forward_s + j->bp_stats.time_backward_s +
                     j->bp_stats.time_head_s;
    j->t_forward += t - j->bp_time_counted;
    j->bp_time_counted = t;
}

static void bp_pass_begin(void *user, const bk_bwd_pass_info *info)
{
    job *j = user;
    char msg[160];
    if (info->leaf)
        snprintf(msg, sizeof msg, "backward pass %d (%s, depth %d): gradients of layers %d-%d",
                 info->index + 1, bk_bwd_flow_name(j->o->bwd_flow), info->depth, info->lo + 1,
                 info->hi);
    else
        snprintf(msg, sizeof msg,
                 "backward pass %d (%s, depth %d): boundary gradient at layer %d (back through "
                 "layers %d-%d)",
                 info->index + 1, bk_bwd_flow_name(j->o->bwd_flow), info->depth, info->lo + 1,
                 info->lo + 1, info->hi);
    if (info->leaf)
        j->bp_leaf_lo = info->lo;
    bp_add_flow_time(j);
    bk__q_emit(j, BK_EV_BACKWARD, info->lo, NULL, msg);
    if (info->leaf) /* MPI ranks, ordered: the sums of the ranks before, first */
        bk__q_bp_leaf_begin(j, info->lo, info->hi);
}

/* The accumulator of a leaf layer: *acc = NULL for a layer not quantized. */
static bk_status leaf_acc(job *j, int layer, bk_hess_acc **acc)
{
    *acc = NULL;
    if (!bk__q_in_range(j, layer))
        return BK_OK;
    int k = layer - j->bp_leaf_lo;
    if (k < 0 || k >= j->bp_leaf)
        return bk_error(BK_ERR_INTERNAL, "backprop: layer %d outside the leaf at %d", layer,
                        j->bp_leaf_lo);
    *acc = j->bp_acc[k];
    return BK_OK;
}

/* leaf_acc, unless a receive from the ranks before failed (bp_chain_st: that
 * error, returned at the next tap; *acc NULL). */
static bk_status chain_acc(job *j, int layer, bk_hess_acc **acc)
{
    *acc = NULL;
    return j->bp_chain_st != BK_OK ? j->bp_chain_st : leaf_acc(j, layer, acc);
}

static bk_status bp_grads(void *user, int layer, int64_t s0, int64_t S, const bk_grad_taps *t)
{
    job *j = user;
    (void)s0;
    bk_hess_acc *acc;
    bk_status st = chain_acc(j, layer, &acc);
    if (st != BK_OK || !acc)
        return st;
    double t0 = bk_now();
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
        st = bk_hess_add_grad(acc, layer, (bk_module)m, t->g[m], t->a[m], S);
    j->t_hessian += bk_now() - t0;
    return st;
}

/* A device's flow: a leaf layer's output-gradient Grams over the whole calibration set */
static bk_status bp_grams(void *user, int layer, bk_module mod, const double *G, const double *gw,
                          int64_t S)
{
    job *j = user;
    bk_hess_acc *acc;
    bk_status st = leaf_acc(j, layer, &acc);
    if (st != BK_OK || !acc)
        return st;
    double t0 = bk_now();
    st = bk__hess_add_grad_gram(acc, layer, mod, G, gw, S);
    j->t_hessian += bk_now() - t0;
    return st;
}

/* MPI ranks, ordered sums, the GPU flow: the leaf layer's Grams start from
 * the sums the ranks before passed on (received in bp_pass_begin), so the
 * GPU adds this rank's micro-batches onto exactly the sums one process would
 * hold there */
static bk_status bp_grams_start(void *user, int layer, bk_module mod, double *G, int *set)
{
    job *j = user;
    *set = 0;
    bk_hess_acc *acc;
    bk_status st = chain_acc(j, layer, &acc);
    if (st != BK_OK || !acc)
        return st;
    return bk__hess_bp_grad_take(acc, mod, G, set);
}

/* The GPU flow with the GPU stages: the leaf layer's device Grams, kept for
 * the stages (bp_grads) until bp_leaf_done returns */
static bk_status bp_grams_dev(void *user, int layer, bk_module mod, const double *G,
                              const double *gw, int64_t S)
{
    job *j = user;
    int k = layer - j->bp_leaf_lo;
    if (k < 0 || k >= j->bp_leaf || !j->bp_dev)
        return bk_error(BK_ERR_INTERNAL, "backprop: layer %d outside the leaf at %d", layer,
                        j->bp_leaf_lo);
    j->bp_dev[k].G[mod] = G;
    j->bp_dev[k].gw[mod] = gw;
    j->bp_dev[k].N = S * j->T;
    j->bp_dev[k].layer = layer;
    return BK_OK;
}

static bk_status bp_leaf_done(void *user, int lo, int hi)
{
    job *j = user;
    bp_add_flow_time(j);
    const double t0 = bk_now();
    bk_status st = j->bp_chain_st;
    if (st == BK_OK && j->nranks > 1) { /* the output-gradient sums over the ranks */
        st = bk__q_bp_leaf_sums(j, lo, hi);
        bk_prof_add("bp.gradient_sums (MPI ranks)", bk_now() - t0);
    }
    if (st != BK_OK)
        return st;
    j->bp_in_layers = 1; /* (the stages' and solves' exchanges tell every rank) */
    for (int l = lo; l < hi && l < j->layer_end && st == BK_OK; l++) {
        j->acc = j->bp_acc[l - lo];
        /* the layer, the checks after it (unchanged checkpoint, stop) */
        st = bk_driver_layer(&j->drv, l);
        bk_hess_acc_reset(j->acc);
    }
    if (st == BK_OK)
        j->bp_in_layers = 0;
    j->acc = j->bp_acc[0];
    if (j->bp_dev) /* the flow reuses its Grams for the next leaf */
        memset(j->bp_dev, 0, (size_t)j->bp_leaf * sizeof *j->bp_dev);
    bk_prof_add("bp.leaf_layers (input stages, solves)", bk_now() - t0);
    return st;
}

bk_status bk__q_run_backprop(job *j)
{
    /* MPI ranks: this rank's share of the sequences (whole micro-batches);
     * seq0 keeps the sampled labels those of the whole set */
    bk_bwd_flow_opts fo = {j->o->bwd_flow, j->bp_leaf, j->o->fisher, j->o->seed, j->batch,
                           j->s_lo};
    bk_bwd_flow_cb cb = {j, bp_pass_begin, bp_grads, bp_leaf_done, NULL, 0, NULL, NULL};
    bk_status st;
    const double t0 = bk_now();
    if (j->bp_gpu) {
        /* the Grams on the device, not the taps on the host; they stay there
         * for stages that take them (the GPU stages), else are downloaded
         * into the host accumulators. MPI ranks: always downloaded, and
         * combined there (bk__q_bp_leaf_sums); the GPU stages then take the
         * complete sums from the host accumulator (bk_bp_side.acc) and their
         * input side goes through their own sums (bk__q_stage_ranks) */
        cb.grads = NULL;
        if (!j->ops->bp_host_grads && j->nranks <= 1) {
            j->bp_dev = calloc((size_t)j->bp_leaf, sizeof *j->bp_dev);
            if (!j->bp_dev)
                return bk_error(BK_ERR_NOMEM, "quantize: out of memory");
            cb.grams_dev = bp_grams_dev;
        } else {
            cb.grams = bp_grams;
            /* MPI ranks, ordered: rank r > 0 starts from the sums of the ranks before */
            if (j->nranks > 1 && j->rank > 0 && j->o->dist_reduce == BK_DIST_ORDERED)
                cb.grams_start = bp_grams_start;
        }
        cb.gram_weighted = j->o->hessian == BK_HESS_BACKPROP_SHAMPOO;
    }
    /* (the backend's flow, or the CPU's: --cpu-stages, a backend without one) */
    st = bk_backend_bwd_flow_run(j->bp_gpu ? j->backend : NULL, j->model,
                                 j->tokens + j->s_lo * j->T, j->s_hi - j->s_lo, j->T, &fo,
                                 (int)j->o->bwd_precision, &cb, &j->bp_stats);
    if (st != BK_OK)
        bk__q_bp_chain_fail(j, st);
    bk_prof_add("bp.total (flow and leaf layers)", bk_now() - t0);
    bp_add_flow_time(j);
    return st;
}
