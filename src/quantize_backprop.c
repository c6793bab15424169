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

/* ------------------------------------------------- progress and ETA */

/* Kinds of work unit: a layer forward over the calibration set (the sweep's
 * forward part), a layer backward (with its recomputed forward), the head
 * (final norm, LM head, loss and its gradient), a quantized leaf layer's
 * stages (its input-side forward, factors, solves, writes), another layer of
 * a leaf (run as it is or rebuilt from kept codes). */
enum { BP_U_FWD, BP_U_BWD, BP_U_HEAD, BP_U_QUANT, BP_U_OTHER, BP_U_LBWD, BP_U_N };
/* (BP_U_LBWD: a leaf pass's layer backward, which also forms the layer's
 * output-gradient Grams or hands its taps to the accumulators) */

/* Relative cost of the units before they are measured, in layer forwards:
 * a backward is the recomputed forward, the input gradient's GEMMs (as many
 * flops as the forward's) and the attention backward (about a forward's);
 * the head's forward and input-gradient GEMMs against a layer's weights:
 * 2 vocab hidden / (layer parameters) (4.8 for Llama-3-8B); a quantized
 * layer's stages: its forward on the quantized model with the input Grams
 * plus the factorizations and solves; another leaf layer: one forward; a
 * leaf pass's backward: a backward and the layer's output-gradient Grams,
 * whose GEMMs (N Σ out² against a forward's N params) run at about 0.6 of
 * the forward's cost per flop. Calibrated on the H200's 8B backprop-kfac job
 * (session 14, bf16: 0.53 s a layer forward, 1.14 s a backward, 0.68 s a
 * layer's Grams, ≈ 2 s a quantized layer's stages). Only the ratios matter,
 * and only until each kind is measured. */
static void bp_unit_weights(const bk_model_config *c, double w[BP_U_N])
{
    const double q = (double)c->n_heads * (double)c->head_dim,
                 kv = (double)c->n_kv_heads * (double)c->head_dim, d = (double)c->hidden,
                 I = (double)c->intermediate;
    const double layer = d * (2 * q + 2 * kv) + 3 * d * I;
    const double outsq = q * q + 2 * kv * kv + 2 * d * d + 2 * I * I;
    w[BP_U_FWD] = 1;
    w[BP_U_BWD] = 2.2;
    w[BP_U_HEAD] = layer > 0 ? 2 * (double)c->vocab * d / layer : 1;
    w[BP_U_QUANT] = 3.8;
    w[BP_U_OTHER] = 1;
    w[BP_U_LBWD] = w[BP_U_BWD] + (layer > 0 ? 0.6 * outsq / layer : 1);
}

/* The flow's units done: the passes before the running one, and the running
 * one's share of micro-batches. */
static void bp_flow_done(const job *j, double done[BP_U_N])
{
    done[BP_U_FWD] = done[BP_U_BWD] = done[BP_U_HEAD] = done[BP_U_LBWD] = 0;
    for (int p = 0; p <= j->bp_pass && p < j->bp_npass; p++) {
        const bk_bwd_pass_work *w = &j->bp_sched[p];
        double f = 1;
        if (p == j->bp_pass) {
            const int64_t S = j->s_hi - j->s_lo;
            f = S > 0 ? (double)j->bp_pass_done / (double)S : 0;
        }
        done[BP_U_FWD] += f * w->forwards;
        done[w->leaf ? BP_U_LBWD : BP_U_BWD] += f * w->backwards;
        done[BP_U_HEAD] += f * w->head;
    }
}

void bk__q_bp_progress(job *j, bk_event *ev)
{
    const double now = bk_now();
    if (ev->kind == BK_EV_LAYER_DONE && !ev->message && j->bp_lt0 > 0 && !j->bp_layer_counted) {
        /* a quantized leaf layer's stages are done (bp_leaf_done adds the rest
         * of its time after this event) */
        j->bp_done[BP_U_QUANT] += 1;
        j->bp_time[BP_U_QUANT] += now - j->bp_lt0;
        j->bp_lt0 = now;
        j->bp_layer_counted = 1;
    }
    bp_flow_done(j, j->bp_done);
    j->bp_time[BP_U_FWD] = j->bp_stats.time_forward_s;
    {
        /* the backward time of the passes so far by kind, and the running one's */
        const double run = j->bp_stats.time_backward_s - j->bp_bwd_mark;
        j->bp_time[BP_U_BWD] = j->bp_bwd_split[0] + (j->bp_cur_leaf ? 0 : run);
        j->bp_time[BP_U_LBWD] = j->bp_bwd_split[1] + (j->bp_cur_leaf ? run : 0);
    }
    j->bp_time[BP_U_HEAD] = j->bp_stats.time_head_s;
    double w[BP_U_N];
    bp_unit_weights(j->cfg, w);
    /* seconds per weight unit over what was measured: for the kinds not measured yet */
    double mt = 0, mw = 0, all = 0, done = 0;
    for (int u = 0; u < BP_U_N; u++) {
        if (j->bp_done[u] > 0 && j->bp_time[u] > 0) {
            mt += j->bp_time[u];
            mw += w[u] * j->bp_done[u];
        }
        all += w[u] * j->bp_total[u];
        done += w[u] * (j->bp_done[u] < j->bp_total[u] ? j->bp_done[u] : j->bp_total[u]);
    }
    double left = 0;
    for (int u = 0; u < BP_U_N; u++) {
        double n = j->bp_total[u] - j->bp_done[u];
        if (n <= 0)
            continue;
        double rate = (j->bp_done[u] > 0 && j->bp_time[u] > 0) ? j->bp_time[u] / j->bp_done[u]
                                                               : w[u] * (mw > 0 ? mt / mw : 0);
        left += n * rate;
    }
    ev->pass = j->bp_pass + 1;
    ev->passes = j->bp_npass;
    ev->pass_seqs_done = j->bp_pass_done;
    ev->pass_seqs = j->s_hi - j->s_lo;
    ev->work_done = all > 0 ? done / all : 0;
    ev->eta_s = ev->kind == BK_EV_DONE ? 0 : mw > 0 ? left : -1;
}

static void bp_micro_done(void *user, int pass, int64_t done, int64_t S)
{
    job *j = user;
    (void)S;
    j->bp_pass = pass;
    j->bp_pass_done = done;
    bk__q_emit(j, BK_EV_BACKWARD_PROGRESS, j->bp_sched ? j->bp_sched[pass].lo : 0, NULL, NULL);
}

/* The schedule and the work in all (bk__q_bp_progress) */
static bk_status bp_progress_init(job *j)
{
    const int L = (int)j->cfg->n_layers;
    int n = bk_bwd_flow_schedule(L, j->bp_leaf, j->o->bwd_flow, j->bp_units, NULL, 0);
    if (n < 1)
        return BK_OK; /* (the flow reports the bad argument) */
    j->bp_sched = calloc((size_t)n, sizeof *j->bp_sched);
    if (!j->bp_sched)
        return bk_error(BK_ERR_NOMEM, "quantize: out of memory");
    bk_bwd_flow_schedule(L, j->bp_leaf, j->o->bwd_flow, j->bp_units, j->bp_sched, n);
    j->bp_npass = n;
    j->bp_pass = -1;
    memset(j->bp_total, 0, sizeof j->bp_total);
    for (int p = 0; p < n; p++) {
        j->bp_total[BP_U_FWD] += j->bp_sched[p].forwards;
        j->bp_total[j->bp_sched[p].leaf ? BP_U_LBWD : BP_U_BWD] += j->bp_sched[p].backwards;
        j->bp_total[BP_U_HEAD] += j->bp_sched[p].head;
    }
    /* the leaf layers: bp_leaf_done runs [0, layer_end); it quantizes those in
     * range and not kept by --resume */
    for (int l = 0; l < j->layer_end && l < L; l++)
        j->bp_total[bk__q_in_range(j, l) && l >= j->first_layer ? BP_U_QUANT : BP_U_OTHER] += 1;
    return BK_OK;
}

static void bp_pass_begin(void *user, const bk_bwd_pass_info *info)
{
    job *j = user;
    char msg[160];
    char of[32] = "";
    if (j->bp_npass > 0)
        snprintf(of, sizeof of, " of %d", j->bp_npass);
    if (info->leaf)
        snprintf(msg, sizeof msg, "backward pass %d%s (%s, depth %d): gradients of layers %d-%d",
                 info->index + 1, of, bk_bwd_flow_name(j->o->bwd_flow), info->depth,
                 info->lo + 1, info->hi);
    else
        snprintf(msg, sizeof msg,
                 "backward pass %d%s (%s, depth %d): boundary gradient at layer %d (back through "
                 "layers %d-%d)",
                 info->index + 1, of, bk_bwd_flow_name(j->o->bwd_flow), info->depth,
                 info->lo + 1, info->lo + 1, info->hi);
    j->bp_pass = info->index;
    j->bp_pass_done = 0;
    /* the finished pass's backward time to its kind */
    j->bp_bwd_split[j->bp_cur_leaf ? 1 : 0] += j->bp_stats.time_backward_s - j->bp_bwd_mark;
    j->bp_bwd_mark = j->bp_stats.time_backward_s;
    j->bp_cur_leaf = info->leaf;
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
        /* the layer, the checks after it (unchanged checkpoint, stop); its
         * time for the ETA (a quantized layer's counted at its LAYER_DONE) */
        j->bp_lt0 = bk_now();
        j->bp_layer_counted = 0;
        st = bk_driver_layer(&j->drv, l);
        bk_hess_acc_reset(j->acc);
        const int u = j->bp_layer_counted ? BP_U_QUANT : BP_U_OTHER;
        j->bp_time[u] += bk_now() - j->bp_lt0;
        if (!j->bp_layer_counted)
            j->bp_done[u] += 1;
        j->bp_lt0 = 0;
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
                           j->s_lo, j->bp_units};
    bk_bwd_flow_cb cb = {j, bp_pass_begin, bp_grads, bp_leaf_done, NULL, 0, NULL, NULL,
                         bp_micro_done};
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
    st = bp_progress_init(j);
    if (st != BK_OK)
        return st;
    st = bk_backend_bwd_flow_run(j->bp_gpu ? j->backend : NULL, j->model,
                                 j->tokens + j->s_lo * j->T, j->s_hi - j->s_lo, j->T, &fo,
                                 (int)j->o->bwd_precision, &cb, &j->bp_stats);
    if (st != BK_OK)
        bk__q_bp_chain_fail(j, st);
    bk_prof_add("bp.total (flow and leaf layers)", bk_now() - t0);
    bp_add_flow_time(j);
    free(j->bp_sched); /* (the events after the flow: the layer count's ETA) */
    j->bp_sched = NULL;
    j->bp_npass = 0;
    return st;
}
