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
 * so the two flows deliver the same a and g to the last bit.
 *
 * The flow control is written once, here (bk__bwd_flow_drive); a backend
 * supplies the operations on one micro-batch (bk_bwd_flow_ops,
 * src/backward_internal.h): the CPU's below, the GPU's in cuda/backward.cu. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/backward.h"
#include "backward_internal.h"
#include "bwd_mem.h"
#include "forward_internal.h"
#include "stop.h"
#include "util.h"

/* ------------------------------------------------------------ the driver */

typedef struct flow {
    const bk_bwd_flow_ops *ops;
    void *x; /* the backend's context */
    const bk_model_config *c;
    const int32_t *tokens;
    int64_t S, T, B, d;
    const bk_bwd_flow_opts *o;
    const bk_bwd_flow_cb *cb;
    bk_bwd_flow_stats *st;
    uint64_t cur_bytes;
} flow;

static uint64_t boundary_bytes(const flow *f)
{
    return (uint64_t)f->S * (uint64_t)f->T * (uint64_t)f->d * f->ops->elem_bytes;
}

static bk_status boundary_alloc(flow *f, int depth, void **out)
{
    uint64_t nb = boundary_bytes(f);
    *out = (nb <= SIZE_MAX) ? f->ops->boundary_alloc(f->x, (size_t)nb) : NULL;
    if (!*out)
        return bk_error(BK_ERR_NOMEM,
                        "backprop flow: out of %s for a boundary matrix of %.1f MiB at "
                        "recursion depth %d (%.1f MiB held): use %sa larger --leaf-size, "
                        "--bwd-flow naive or fewer --samples",
                        f->ops->boundary_mem, (double)nb / 1048576.0, depth,
                        (double)f->cur_bytes / 1048576.0,
                        f->o->units > 0 ? "--bwd-boundaries 0 (recursive halving's fewest), " : "");
    f->cur_bytes += nb;
    if (f->cur_bytes > f->st->peak_boundary_bytes)
        f->st->peak_boundary_bytes = f->cur_bytes;
    return BK_OK;
}

static void boundary_free(flow *f, void *p)
{
    if (!p)
        return;
    f->ops->boundary_free(f->x, p);
    f->cur_bytes -= boundary_bytes(f);
}

static bk_status sync_ops(flow *f, bk_status st)
{
    return st == BK_OK && f->ops->sync ? f->ops->sync(f->x) : st;
}

/* One sweep over every micro-batch:
 *   h = X_from (or the embedding when from == 0 and X_from == NULL);
 *   forward through [from, to), copying h into Xs[l] (when given) before
 *   layer l (not through layer to - 1 when G_to is given: its output is not
 *   needed);
 *   dh = G_to, or the head's gradient (to == n_layers), copied to G_head;
 *   backward through [grad_lo, to), with taps for layers < taps_hi, copying
 *   dh into Gs[l] (when given) after layer l's backward.
 * Xs and Gs: NULL or [n_layers + 1] boundary matrices by layer. */
static bk_status sweep(flow *f, int from, const void *X_from, void *const *Xs, int to,
                       const void *G_to, void *G_head, int grad_lo, void *const *Gs, int taps_hi)
{
    const bk_bwd_flow_ops *ops = f->ops;
    void *x = f->x;
    const int64_t T = f->T, rows_seq = T * f->d;
    double t;
    bk_status st = BK_OK;
    for (int64_t s0 = 0; s0 < f->S && st == BK_OK; s0 += f->B) {
        /* a stop request (SIGINT/SIGTERM) ends the pass at the next micro-batch:
         * a pass can take minutes at scale, longer than a batch system's grace
         * period; the layers already done stay resumable */
        if (bk__stop_requested()) {
            st = bk_error(BK_ERR_INTERRUPTED, "interrupted in backward pass %d (layers %d-%d)",
                          f->st->passes + 1, grad_lo + 1, to);
            break;
        }
        const int64_t sb = f->S - s0 < f->B ? f->S - s0 : f->B;
        const size_t mb = (size_t)(sb * rows_seq) * ops->elem_bytes;
        const size_t off = (size_t)(s0 * rows_seq) * ops->elem_bytes;
        t = bk_now();
        if (X_from)
            st = ops->load(x, BK_BWD_H, (const char *)X_from + off, mb);
        else
            st = ops->embed(x, f->tokens + s0 * T, sb);
        for (int l = from; l < to && st == BK_OK; l++) {
            if (Xs && Xs[l] && (st = ops->store(x, BK_BWD_H, (char *)Xs[l] + off, mb)) != BK_OK)
                break;
            if (l >= grad_lo && (st = ops->keep(x, l - grad_lo, sb)) != BK_OK)
                break;
            /* with its output gradient given (G_to) the last layer's output is
             * not needed: its input is kept and the backward recomputes its
             * forward from there (a leaf sweep of one layer runs no forward) */
            if (G_to && l == to - 1)
                break;
            st = ops->forward(x, l, sb);
        }
        st = sync_ops(f, st);
        f->st->time_forward_s += bk_now() - t;
        if (st != BK_OK)
            break;
        t = bk_now();
        if (G_to) {
            st = ops->load(x, BK_BWD_DH, (const char *)G_to + off, mb);
        } else {
            st = ops->head(x, f->tokens + s0 * T, sb, f->o->seq0 + s0);
            if (st == BK_OK && G_head)
                st = ops->store(x, BK_BWD_DH, (char *)G_head + off, mb);
        }
        st = sync_ops(f, st);
        f->st->time_head_s += bk_now() - t;
        if (st != BK_OK)
            break;
        t = bk_now();
        for (int l = to - 1; l >= grad_lo && st == BK_OK; l--) {
            const int want = l < taps_hi;
            st = ops->backward(x, l, l - grad_lo, sb, want);
            if (st == BK_OK && want) {
                double tc = bk_now();
                st = ops->deliver(x, l, l - grad_lo, s0, sb);
                t += bk_now() - tc; /* the consumer's time is not the backward's */
            }
            if (st == BK_OK && Gs && Gs[l])
                st = ops->store(x, BK_BWD_DH, (char *)Gs[l] + off, mb);
        }
        st = sync_ops(f, st);
        f->st->time_backward_s += bk_now() - t;
        if (st == BK_OK && f->cb->micro_done)
            f->cb->micro_done(f->cb->user, f->st->passes, s0 + sb, f->S);
    }
    if (st == BK_OK) {
        f->st->passes++;
        /* (without the last layer's when G_to is given) + the recomputation */
        f->st->layer_forwards += (to - from) - (G_to ? 1 : 0) + (to - grad_lo);
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

/* A leaf pass begins (after pass_begin): the backend's optional step (the
 * GPU's: its Grams' starting sums, bk_bwd_flow_cb.grams_start). */
static bk_status leaf_begin(flow *f, int lo, int hi)
{
    return f->ops->leaf_begin ? f->ops->leaf_begin(f->x, lo, hi) : BK_OK;
}

static bk_status leaf_done(flow *f, int lo, int hi)
{
    if (f->ops->leaf_done)
        return f->ops->leaf_done(f->x, lo, hi);
    if (!f->cb->leaf_done)
        return BK_OK;
    return f->cb->leaf_done(f->cb->user, lo, hi);
}

/* Recursive halving over [lo, hi) with the input X_lo (NULL: the embedding)
 * and the output gradient G_hi (NULL: from the head; only at the root); the
 * node may hold `budget` boundary matrices with its subtree (its ancestors'
 * not counted): a split into k children (bk_bwd_split; 2 without a budget). */
static bk_status node(flow *f, int lo, int hi, const void *X_lo, const void *G_hi, int depth,
                      int budget)
{
    const int L = (int)f->c->n_layers;
    bk_status st;
    if (hi - lo <= f->o->leaf) {
        pass_begin(f, depth, lo, hi, 1);
        st = leaf_begin(f, lo, hi);
        if (st == BK_OK)
            st = sweep(f, lo, X_lo, NULL, hi, G_hi, NULL, lo, NULL, hi);
        return st == BK_OK ? leaf_done(f, lo, hi) : st;
    }
    const int root = !G_hi;
    const int k = bk_bwd_split(lo, hi, f->o->leaf, root, budget);
    const int c1 = bk_bwd_cut(lo, hi, k, 1);
    /* by layer: X at the inner cuts (the children's inputs), G there (their
     * output gradients); the root also keeps the head's gradient G_L */
    void **Xs = calloc((size_t)L + 1, sizeof *Xs), **Gs = calloc((size_t)L + 1, sizeof *Gs);
    void *G_L = NULL;
    if (!Xs || !Gs) {
        free(Xs);
        free(Gs);
        return bk_error(BK_ERR_NOMEM, "backprop flow: out of memory");
    }
    st = BK_OK;
    for (int i = 1; i < k && st == BK_OK; i++) {
        const int c = bk_bwd_cut(lo, hi, k, i);
        st = boundary_alloc(f, depth, &Xs[c]);
        if (st == BK_OK)
            st = boundary_alloc(f, depth, &Gs[c]);
    }
    if (st == BK_OK && root && hi == L)
        st = boundary_alloc(f, depth, &G_L);
    if (st == BK_OK) {
        pass_begin(f, depth, c1, hi, 0);
        st = sweep(f, lo, X_lo, Xs, hi, G_hi, G_L, c1, Gs, c1);
    }
    for (int j = 0; j < k; j++) {
        const int a = bk_bwd_cut(lo, hi, k, j), b = bk_bwd_cut(lo, hi, k, j + 1);
        const void *g = j + 1 < k ? Gs[b] : G_hi ? G_hi : G_L;
        if (st == BK_OK)
            st = node(f, a, b, j ? Xs[a] : X_lo, g, depth + 1,
                      budget - bk_bwd_held(k, j, root));
        /* the child's output gradient and input are done with (on an error
         * too: every matrix is freed on the way out) */
        if (j + 1 < k) {
            boundary_free(f, Gs[b]);
            Gs[b] = NULL;
        }
        if (j) {
            boundary_free(f, Xs[a]);
            Xs[a] = NULL;
        }
    }
    boundary_free(f, G_L);
    free(Xs);
    free(Gs);
    return st;
}

bk_status bk__bwd_flow_check(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                             const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                             bk_bwd_flow_stats *stats, int64_t *B, int64_t *acts_layers)
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
    if (o->seq0 < 0)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: first sequence %lld must be >= 0",
                        (long long)o->seq0);
    if (cb->grams_start && !cb->grams)
        return bk_error(BK_ERR_INVALID_ARG,
                        "backprop flow: grams_start needs the host Grams (grams)");
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
    const int L = (int)c->n_layers;
    *B = o->batch < S ? o->batch : S;
    if (o->units < 0)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: boundary budget %d must be >= 0",
                        o->units);
    /* layer inputs kept per micro-batch: the most a sweep goes back through */
    *acts_layers = bk_bwd_acts_layers_b(L, (int)o->flow, o->leaf, o->units);
    return BK_OK;
}

bk_status bk__bwd_flow_drive(const bk_bwd_flow_ops *ops, void *ctx, const bk_model *m,
                             const int32_t *tokens, int64_t S, int64_t T, int64_t B,
                             const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                             bk_bwd_flow_stats *stats)
{
    const bk_model_config *c = bk_model_get_config(m);
    flow f = {.ops = ops, .x = ctx, .c = c, .tokens = tokens, .S = S, .T = T, .B = B,
              .d = c->hidden, .o = o, .cb = cb, .st = stats};
    const int L = (int)c->n_layers;
    bk_status st = BK_OK;
    if (o->flow == BK_FLOW_NAIVE) {
        for (int lo = 0; lo < L && st == BK_OK; lo += o->leaf) {
            int hi = lo + o->leaf < L ? lo + o->leaf : L;
            pass_begin(&f, 0, lo, hi, 1);
            st = leaf_begin(&f, lo, hi);
            if (st == BK_OK)
                st = sweep(&f, 0, NULL, NULL, L, NULL, NULL, lo, NULL, hi);
            if (st == BK_OK)
                st = leaf_done(&f, lo, hi);
        }
    } else {
        st = node(&f, 0, L, NULL, NULL, 0, o->units);
    }
    return st;
}

/* ------------------------------------------------------- the schedule */

typedef struct sched {
    int L, leaf, n, cap;
    bk_bwd_pass_work *out;
} sched;

/* one sweep as sweep() runs it: forward through [from, to) (without layer
 * to - 1 when the output gradient is given), the head when it is not,
 * backward through [grad_lo, to) */
static void sched_add(sched *s, int depth, int lo, int hi, int leaf, int from, int to, int g_to,
                      int grad_lo)
{
    if (s->out && s->n < s->cap) {
        bk_bwd_pass_work *w = &s->out[s->n];
        w->depth = depth;
        w->lo = lo;
        w->hi = hi;
        w->leaf = leaf;
        w->forwards = (to - from) - (g_to ? 1 : 0);
        w->backwards = to - grad_lo;
        w->head = !g_to;
        w->layer_forwards = w->forwards + w->backwards;
    }
    s->n++;
}

/* as node() */
static void sched_node(sched *s, int lo, int hi, int g_hi, int depth, int budget)
{
    if (hi - lo <= s->leaf) {
        sched_add(s, depth, lo, hi, 1, lo, hi, g_hi, lo);
        return;
    }
    const int root = !g_hi;
    const int k = bk_bwd_split(lo, hi, s->leaf, root, budget);
    const int c1 = bk_bwd_cut(lo, hi, k, 1);
    sched_add(s, depth, c1, hi, 0, lo, hi, g_hi, c1);
    /* (each child has its output gradient: a G, or the head's G_L at the root) */
    for (int j = 0; j < k; j++)
        sched_node(s, bk_bwd_cut(lo, hi, k, j), bk_bwd_cut(lo, hi, k, j + 1), 1, depth + 1,
                   budget - bk_bwd_held(k, j, root));
}

int bk_bwd_flow_schedule(int n_layers, int leaf, bk_bwd_flow_kind flow, int units,
                         bk_bwd_pass_work *out, int cap)
{
    if (n_layers < 1 || leaf < 1 || cap < 0 || units < 0 ||
        (flow != BK_FLOW_HALVING && flow != BK_FLOW_NAIVE))
        return -1;
    sched s = {n_layers, leaf, 0, out ? cap : 0, out};
    if (flow == BK_FLOW_NAIVE) {
        for (int lo = 0; lo < n_layers; lo += leaf) {
            int hi = lo + leaf < n_layers ? lo + leaf : n_layers;
            sched_add(&s, 0, lo, hi, 1, 0, n_layers, 0, lo);
        }
    } else {
        sched_node(&s, 0, n_layers, 0, 0, units);
    }
    return s.n;
}

/* ------------------------------------------------- the CPU's operations */

typedef struct cpu_flow {
    const bk_model *m;
    const bk_bwd_flow_opts *o;
    const bk_bwd_flow_cb *cb;
    int64_t mrow;         /* B*T*d */
    int64_t seq_elems;    /* T*d: one sequence of h */
    bk_bwd *bw;
    bk_layer_weights *lw; /* [n_layers], loaded on first use */
    int *loaded;
    double *h, *dh;       /* [B*T, d] */
    double *acts;         /* [acts_layers, B*T, d] layer inputs of one micro-batch */
    int32_t *labels;      /* [B*T] */
    bk_grad_taps taps;    /* of the last backward with taps */
} cpu_flow;

static bk_status weights(cpu_flow *f, int l, const bk_layer_weights **out)
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

static void *cpu_boundary_alloc(void *x, size_t bytes)
{
    (void)x;
    return bk_alloc(bytes / sizeof(double), sizeof(double));
}

static void cpu_boundary_free(void *x, void *p)
{
    (void)x;
    free(p);
}

static bk_status cpu_embed(void *x, const int32_t *tokens, int64_t sb)
{
    cpu_flow *f = x;
    return bk_bwd_embed(f->bw, f->m, tokens, sb, f->h);
}

static bk_status cpu_load(void *x, int buf, const void *src, size_t bytes)
{
    cpu_flow *f = x;
    memcpy(buf == BK_BWD_H ? f->h : f->dh, src, bytes);
    return BK_OK;
}

static bk_status cpu_store(void *x, int buf, void *dst, size_t bytes)
{
    cpu_flow *f = x;
    memcpy(dst, buf == BK_BWD_H ? f->h : f->dh, bytes);
    return BK_OK;
}

static bk_status cpu_keep(void *x, int k, int64_t sb)
{
    cpu_flow *f = x;
    memcpy(f->acts + (int64_t)k * f->mrow, f->h, (size_t)(sb * f->seq_elems) * sizeof(double));
    return BK_OK;
}

static bk_status cpu_forward(void *x, int layer, int64_t sb)
{
    cpu_flow *f = x;
    const bk_layer_weights *lw;
    bk_status st = weights(f, layer, &lw);
    return st == BK_OK ? bk_bwd_layer_forward(f->bw, lw, sb, f->h) : st;
}

static bk_status cpu_head(void *x, const int32_t *tokens, int64_t sb, int64_t seq0)
{
    cpu_flow *f = x;
    bk_status st = bk_bwd_labels(f->bw, f->m, f->h, tokens, sb, seq0, f->o->fisher, f->o->seed,
                                 f->labels);
    return st == BK_OK ? bk_bwd_head(f->bw, f->m, f->h, f->labels, sb, f->dh, NULL) : st;
}

static bk_status cpu_backward(void *x, int layer, int k, int64_t sb, int taps)
{
    cpu_flow *f = x;
    const bk_layer_weights *lw;
    bk_status st = weights(f, layer, &lw);
    if (st != BK_OK)
        return st;
    return bk_bwd_layer_backward(f->bw, lw, sb, f->acts + (int64_t)k * f->mrow, f->dh,
                                 taps ? &f->taps : NULL);
}

static bk_status cpu_deliver(void *x, int layer, int k, int64_t s0, int64_t sb)
{
    cpu_flow *f = x;
    (void)k;
    return f->cb->grads ? f->cb->grads(f->cb->user, layer, s0, sb, &f->taps) : BK_OK;
}

bk_status bk_bwd_flow_run(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                          const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                          bk_bwd_flow_stats *stats)
{
    int64_t B, acts_layers;
    bk_status st = bk__bwd_flow_check(m, tokens, S, T, o, cb, stats, &B, &acts_layers);
    if (st != BK_OK)
        return st;
    static const bk_bwd_flow_ops ops = {
        .elem_bytes = sizeof(double),
        .boundary_mem = "memory",
        .boundary_alloc = cpu_boundary_alloc,
        .boundary_free = cpu_boundary_free,
        .embed = cpu_embed,
        .load = cpu_load,
        .store = cpu_store,
        .keep = cpu_keep,
        .forward = cpu_forward,
        .head = cpu_head,
        .backward = cpu_backward,
        .deliver = cpu_deliver,
    };
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    cpu_flow f = {.m = m, .o = o, .cb = cb, .mrow = B * T * c->hidden, .seq_elems = T * c->hidden};
    st = bk_bwd_create(c, B, T, &f.bw);
    if (st != BK_OK)
        return st;
    f.lw = calloc((size_t)L, sizeof *f.lw);
    f.loaded = calloc((size_t)L, sizeof *f.loaded);
    f.h = bk_alloc((size_t)f.mrow, sizeof(double));
    f.dh = bk_alloc((size_t)f.mrow, sizeof(double));
    f.acts = bk_alloc((size_t)(f.mrow * acts_layers), sizeof(double));
    f.labels = bk_alloc((size_t)(B * T), sizeof(int32_t));
    stats->micro_bytes = (uint64_t)f.mrow * (uint64_t)(2 + acts_layers) * sizeof(double);
    if (!f.lw || !f.loaded || !f.h || !f.dh || !f.acts || !f.labels)
        st = bk_error(BK_ERR_NOMEM,
                      "backprop flow: out of memory for the micro-batch activations of %lld "
                      "layers (%.1f MiB): use a smaller --batch",
                      (long long)acts_layers, (double)stats->micro_bytes / 1048576.0);
    else
        st = bk__bwd_flow_drive(&ops, &f, m, tokens, S, T, B, o, cb, stats);
    if (f.lw && f.loaded)
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
