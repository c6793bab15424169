/* The flows that deliver every layer's module inputs a and output
 * gradients g (paper section 5, Table 2; docs/hessians.md "Backprop"):
 *
 *   naive I    for each leaf [lo, hi): one sweep embed -> all layers -> head
 *              -> backward down to lo. O(l²/s) layer passes, no boundaries.
 *   halving    node(lo, hi; X_lo, G_hi): one sweep X_lo -> [lo, mid) (keep
 *              X_mid) -> [mid, hi) -> G_hi (the head at the root) -> backward
 *              to mid (keep G_mid); then node(lo, mid; X_lo, G_mid) and
 *              node(mid, hi; X_mid, G_hi). A node of at most s layers is a
 *              leaf: one sweep X_lo -> [lo, hi) -> backward from G_hi, with
 *              the module taps of its layers. O(l log(l/s)) layer passes,
 *              at most two boundary matrices [N, hidden] per level alive.
 *
 * Every sweep goes micro-batch by micro-batch; inside one micro-batch the
 * inputs of the layers it will go back through are kept ([B*T, hidden] per
 * layer) and each layer's forward is recomputed from its input during the
 * backward. X and G are those of the original (full-precision) model: a
 * sweep's arithmetic on a micro-batch is the same whichever flow runs it,
 * so the two flows deliver the same a and g to the last bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/backward.h"
#include "backward_internal.h"
#include "forward_internal.h"
#include "util.h"

typedef struct flow {
    const bk_model *m;
    const bk_model_config *c;
    const int32_t *tokens;
    int64_t S, T, B, d;
    const bk_bwd_flow_opts *o;
    const bk_bwd_flow_cb *cb;
    bk_bwd_flow_stats *st;
    bk_bwd *bw;
    bk_layer_weights *lw; /* [n_layers], loaded on first use */
    int *loaded;
    double *h, *dh;       /* [B*T, d] */
    double *acts;         /* [n_layers, B*T, d] layer inputs of one micro-batch */
    int64_t acts_layers;
    int32_t *labels;      /* [B*T] */
    uint64_t cur_bytes;
} flow;

static uint64_t boundary_bytes(const flow *f)
{
    return (uint64_t)f->S * (uint64_t)f->T * (uint64_t)f->d * sizeof(double);
}

static bk_status boundary_alloc(flow *f, int depth, double **out)
{
    uint64_t nb = boundary_bytes(f);
    *out = (nb <= SIZE_MAX) ? bk_alloc((size_t)(f->S * f->T * f->d), sizeof(double)) : NULL;
    if (!*out)
        return bk_error(BK_ERR_NOMEM,
                        "backprop flow: out of memory for a boundary matrix of %.1f MiB at "
                        "recursion depth %d (%.1f MiB held): use a larger --leaf-size, "
                        "--bwd-flow naive or fewer --samples",
                        (double)nb / 1048576.0, depth, (double)f->cur_bytes / 1048576.0);
    f->cur_bytes += nb;
    if (f->cur_bytes > f->st->peak_boundary_bytes)
        f->st->peak_boundary_bytes = f->cur_bytes;
    return BK_OK;
}

static void boundary_free(flow *f, double *p)
{
    if (!p)
        return;
    free(p);
    f->cur_bytes -= boundary_bytes(f);
}

static bk_status weights(flow *f, int l, const bk_layer_weights **out)
{
    if (!f->loaded[l]) {
        bk_status st = bk_layer_weights_load(f->m, l, &f->lw[l]);
        if (st != BK_OK)
            return st;
        f->loaded[l] = 1;
    }
    *out = &f->lw[l];
    return BK_OK;
}

/* One sweep over every micro-batch:
 *   h = X_from (or the embedding when from == 0 and X_from == NULL);
 *   forward through [from, to), copying h into X_save before layer save_at;
 *   dh = G_to, or the head's gradient (to == n_layers), copied to G_head;
 *   backward through [grad_lo, to), with taps for layers < taps_hi;
 *   G_out = dh. */
static bk_status sweep(flow *f, int from, const double *X_from, int save_at, double *X_save,
                       int to, const double *G_to, double *G_head, int grad_lo, double *G_out,
                       int taps_hi)
{
    const int64_t T = f->T, d = f->d, rows_seq = T * d;
    double t;
    bk_status st = BK_OK;
    for (int64_t s0 = 0; s0 < f->S && st == BK_OK; s0 += f->B) {
        const int64_t sb = f->S - s0 < f->B ? f->S - s0 : f->B;
        const size_t mb = (size_t)(sb * rows_seq) * sizeof(double);
        t = bk_now();
        if (X_from)
            memcpy(f->h, X_from + s0 * rows_seq, mb);
        else if ((st = bk_bwd_embed(f->bw, f->m, f->tokens + s0 * T, sb, f->h)) != BK_OK)
            break;
        for (int l = from; l < to && st == BK_OK; l++) {
            const bk_layer_weights *lw;
            if (l == save_at)
                memcpy(X_save + s0 * rows_seq, f->h, mb);
            if (l >= grad_lo)
                memcpy(f->acts + (int64_t)(l - grad_lo) * f->B * rows_seq, f->h, mb);
            if ((st = weights(f, l, &lw)) == BK_OK)
                st = bk_bwd_layer_forward(f->bw, lw, sb, f->h);
        }
        f->st->time_forward_s += bk_now() - t;
        if (st != BK_OK)
            break;
        t = bk_now();
        if (G_to) {
            memcpy(f->dh, G_to + s0 * rows_seq, mb);
        } else {
            st = bk_bwd_labels(f->bw, f->m, f->h, f->tokens + s0 * T, sb, f->o->seq0 + s0,
                               f->o->fisher, f->o->seed, f->labels);
            if (st == BK_OK)
                st = bk_bwd_head(f->bw, f->m, f->h, f->labels, sb, f->dh, NULL);
            if (st != BK_OK)
                break;
            if (G_head)
                memcpy(G_head + s0 * rows_seq, f->dh, mb);
        }
        f->st->time_head_s += bk_now() - t;
        t = bk_now();
        for (int l = to - 1; l >= grad_lo && st == BK_OK; l--) {
            const bk_layer_weights *lw;
            bk_grad_taps taps;
            const int want = l < taps_hi;
            if ((st = weights(f, l, &lw)) != BK_OK)
                break;
            st = bk_bwd_layer_backward(f->bw, lw, sb,
                                       f->acts + (int64_t)(l - grad_lo) * f->B * rows_seq, f->dh,
                                       want ? &taps : NULL);
            if (st == BK_OK && want && f->cb->grads) {
                double tc = bk_now();
                st = f->cb->grads(f->cb->user, l, s0, sb, &taps);
                t += bk_now() - tc; /* the consumer's time is not the backward's */
            }
        }
        if (st == BK_OK && G_out)
            memcpy(G_out + s0 * rows_seq, f->dh, mb);
        f->st->time_backward_s += bk_now() - t;
    }
    if (st == BK_OK) {
        f->st->passes++;
        f->st->layer_forwards += (to - from) + (to - grad_lo); /* + the recomputation */
        f->st->layer_backwards += to - grad_lo;
    }
    return st;
}

static void pass_begin(flow *f, int depth, int lo, int hi, int leaf)
{
    if (depth > f->st->max_depth)
        f->st->max_depth = depth;
    if (!f->cb->pass_begin)
        return;
    bk_bwd_pass_info info = {f->st->passes, depth, lo, hi, leaf};
    f->cb->pass_begin(f->cb->user, &info);
}

static bk_status leaf_done(flow *f, int lo, int hi)
{
    if (!f->cb->leaf_done)
        return BK_OK;
    return f->cb->leaf_done(f->cb->user, lo, hi);
}

/* Recursive halving over [lo, hi) with the input X_lo (NULL: the embedding)
 * and the output gradient G_hi (NULL: from the head; only at the root). */
static bk_status node(flow *f, int lo, int hi, const double *X_lo, const double *G_hi, int depth)
{
    const int L = (int)f->c->n_layers;
    bk_status st;
    if (hi - lo <= f->o->leaf) {
        pass_begin(f, depth, lo, hi, 1);
        st = sweep(f, lo, X_lo, -1, NULL, hi, G_hi, NULL, lo, NULL, hi);
        return st == BK_OK ? leaf_done(f, lo, hi) : st;
    }
    const int mid = lo + (hi - lo) / 2;
    double *X_mid = NULL, *G_mid = NULL, *G_L = NULL;
    st = boundary_alloc(f, depth, &X_mid);
    if (st == BK_OK)
        st = boundary_alloc(f, depth, &G_mid);
    if (st == BK_OK && !G_hi && hi == L)
        st = boundary_alloc(f, depth, &G_L);
    if (st == BK_OK) {
        pass_begin(f, depth, mid, hi, 0);
        st = sweep(f, lo, X_lo, mid, X_mid, hi, G_hi, G_L, mid, G_mid, mid);
    }
    if (st == BK_OK)
        st = node(f, lo, mid, X_lo, G_mid, depth + 1);
    boundary_free(f, G_mid);
    G_mid = NULL;
    if (st == BK_OK)
        st = node(f, mid, hi, X_mid, G_hi ? G_hi : G_L, depth + 1);
    boundary_free(f, X_mid);
    boundary_free(f, G_mid);
    boundary_free(f, G_L);
    return st;
}

bk_status bk_bwd_flow_run(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                          const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                          bk_bwd_flow_stats *stats)
{
    if (!m || !tokens || !o || !cb || !stats)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: NULL argument");
    memset(stats, 0, sizeof *stats);
    const bk_model_config *c = bk_model_get_config(m);
    if (o->leaf < 1)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: leaf size %d must be >= 1", o->leaf);
    if (o->batch < 1)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: micro-batch %lld must be >= 1",
                        (long long)o->batch);
    if (o->flow != BK_FLOW_HALVING && o->flow != BK_FLOW_NAIVE)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: unknown flow %d", (int)o->flow);
    bk_status st = bk_fwd_check_sequences(c, tokens, S, T, o->fisher == BK_FISHER_EMPIRICAL ? 2 : 1);
    if (st != BK_OK) {
        if (o->fisher == BK_FISHER_EMPIRICAL && T < 2)
            return bk_error(BK_ERR_CALIB,
                            "calibration sequences of %lld token have no next-token label "
                            "(--fisher empirical needs --seqlen >= 2)",
                            (long long)T);
        return st;
    }
    st = bk__bwd_head_check(m);
    if (st != BK_OK)
        return st;
    flow f = {.m = m, .c = c, .tokens = tokens, .S = S, .T = T,
              .B = o->batch < S ? o->batch : S, .d = c->hidden, .o = o, .cb = cb, .st = stats};
    const int L = (int)c->n_layers;
    /* layer inputs kept per micro-batch: the most a sweep goes back through */
    f.acts_layers = o->flow == BK_FLOW_NAIVE ? L : (L + 1) / 2;
    if (o->leaf > f.acts_layers)
        f.acts_layers = o->leaf < L ? o->leaf : L;
    const int64_t mrow = f.B * T * f.d;
    st = bk_bwd_create(c, f.B, T, &f.bw);
    if (st != BK_OK)
        return st;
    f.lw = calloc((size_t)L, sizeof *f.lw);
    f.loaded = calloc((size_t)L, sizeof *f.loaded);
    f.h = bk_alloc((size_t)mrow, sizeof(double));
    f.dh = bk_alloc((size_t)mrow, sizeof(double));
    f.acts = bk_alloc((size_t)(mrow * f.acts_layers), sizeof(double));
    f.labels = bk_alloc((size_t)(f.B * T), sizeof(int32_t));
    stats->micro_bytes = (uint64_t)mrow * (uint64_t)(2 + f.acts_layers) * sizeof(double);
    if (!f.lw || !f.loaded || !f.h || !f.dh || !f.acts || !f.labels) {
        st = bk_error(BK_ERR_NOMEM,
                      "backprop flow: out of memory for the micro-batch activations of %lld "
                      "layers (%.1f MiB): use a smaller --batch",
                      (long long)f.acts_layers, (double)stats->micro_bytes / 1048576.0);
        goto done;
    }
    if (o->flow == BK_FLOW_NAIVE) {
        for (int lo = 0; lo < L && st == BK_OK; lo += o->leaf) {
            int hi = lo + o->leaf < L ? lo + o->leaf : L;
            pass_begin(&f, 0, lo, hi, 1);
            st = sweep(&f, 0, NULL, -1, NULL, L, NULL, NULL, lo, NULL, hi);
            if (st == BK_OK)
                st = leaf_done(&f, lo, hi);
        }
    } else {
        st = node(&f, 0, L, NULL, NULL, 0);
    }
done:
    if (f.lw)
        for (int l = 0; l < L; l++)
            if (f.loaded[l])
                bk_layer_weights_free(&f.lw[l]);
    free(f.lw);
    free(f.loaded);
    free(f.h);
    free(f.dh);
    free(f.acts);
    free(f.labels);
    bk_bwd_free(f.bw);
    return st;
}
