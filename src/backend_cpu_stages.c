/* The CPU implementation of the quantize stages (bk_stage_ops,
 * src/backend_impl.h; the CPU backend's stages_create and every backend's
 * fallback): the forward pass (bk_fwd) and the Hessian accumulators
 * (bk_hess_acc) on host buffers the stages own. The quantization job drives
 * them as it drives a device's (src/quantize_layers.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend_impl.h"
#include "forward_internal.h"
#include "util.h"

typedef struct cpu_stages {
    const bk_model *model;
    const bk_model_config *cfg;
    int64_t T, batch;
    int64_t s_lo, s_hi; /* this rank's sequences (one process: all of them) */
    int fully;          /* fully-local: FP queries/keys in stage QKV */
    bk_fwd *fwd;
    bk_hess_acc *own;      /* the accumulator of the local kinds (NULL for the backprop
                              kinds: bp_grads hands each layer's) */
    bk_hess_acc *acc;      /* the one the adds go to: own, or the backprop layer's */
    bk_hess_acc *acc_gptq; /* plain E[xx^T] for the GPTQ loss of two-sided modules (shampoo) */
    const bk_layer_weights *orig; /* the layer being processed */
    const bk_layer_weights *lw;
    /* buffers */
    float *h;      /* [Nr, hidden] residual stream of this rank's sequences */
    float *o_in;   /* [Nr, heads*head_dim] (inputs: [B*T, ...] attention scratch) */
    float *x;      /* [B*T, max(hidden, ...)] micro-batch scratch */
    float *q_rot, *k_rot, *down;
    float *mlp_in; /* [B*T, hidden] (--no-sequential) */
    float *D;      /* [Nr, intermediate]: down_proj inputs of this rank's sequences, kept from
                      stage DOWN for stage OUT when they fit (else NULL: recomputed) */
    char note[512]; /* describe: why these stages run for another backend ("" otherwise) */
} cpu_stages;

/* Feed one micro-batch of every module's inputs to the accumulators (the
 * plain E[xx^T] one gets no queries/keys). */
static bk_status add_all_modules(cpu_stages *c, const float *attn_in, const float *o_in,
                                 const float *mlp_in, const float *down_in, int64_t sb,
                                 double *t_hessian)
{
    double t = bk_now();
    bk_status st = BK_OK;
    const bk_layer_weights *orig = c->orig;
    const int fully = c->fully;
    for (int k = 0; k < 2 && st == BK_OK; k++) {
        bk_hess_acc *a = k ? c->acc_gptq : c->acc;
        if (!a)
            continue;
        st = bk_hess_add_attn(a, orig, attn_in, (fully && !k) ? c->q_rot : NULL,
                              (fully && !k) ? c->k_rot : NULL, sb);
        if (st == BK_OK)
            st = bk_hess_add_o(a, o_in, sb);
        if (st == BK_OK)
            st = bk_hess_add_mlp(a, orig, mlp_in, sb);
        if (st == BK_OK)
            st = bk_hess_add_down(a, down_in, sb);
    }
    *t_hessian += bk_now() - t;
    return st;
}

static bk_status cpu_embed(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb)
{
    cpu_stages *c = ctx;
    /* (h holds this rank's sequences [s_lo, s_hi) only) */
    return bk_fwd_embed(c->fwd, c->model, tokens + s0 * c->T, sb,
                        c->h + (s0 - c->s_lo) * c->T * c->cfg->hidden);
}

static bk_status cpu_layer_begin(void *ctx, const bk_layer_weights *orig,
                                 const bk_layer_weights *lw, int hessians)
{
    cpu_stages *c = ctx;
    c->orig = orig;
    c->lw = lw;
    /* backprop kinds: the layer's accumulator comes with bp_grads (reset by
     * the job after the layer: its gradients came first) */
    c->acc = c->own;
    if (hessians) {
        if (c->own)
            bk_hess_acc_reset(c->own);
        if (c->acc_gptq)
            bk_hess_acc_reset(c->acc_gptq);
    }
    return BK_OK;
}

static bk_status cpu_run(void *ctx, bk_stage stage, int64_t s0, int64_t sb, double *t_forward,
                         double *t_hessian)
{
    cpu_stages *c = ctx;
    const bk_layer_weights *orig = c->orig, *lw = c->lw;
    const int64_t T = c->T, hid = c->cfg->hidden, qd = c->cfg->n_heads * c->cfg->head_dim;
    /* the residual stream, o_proj inputs and kept down_proj inputs: this
     * rank's sequences [s_lo, s_hi) only (all of them in one process) */
    const int64_t r0 = (s0 - c->s_lo) * T;
    float *hb = c->h + r0 * hid;
    float *ob = c->o_in + r0 * qd;
    const int fully = c->fully;
    bk_status st = BK_OK;
    double t = bk_now();
    switch (stage) {
    case BK_STAGE_QKV:
        /* q, k, v from attn_in (and, fully-local, the FP rotated queries and
         * keys only: the attention's output is not used here, stage O
         * recomputes it with the quantized q/k/v and checks v_proj and the
         * attention output for non-finite values there, as for the other
         * kinds) */
        st = bk_fwd_attn_in(c->fwd, orig, hb, sb, c->x);
        if (st == BK_OK && fully)
            st = bk__fwd_qk_rot(c->fwd, orig, c->x, sb, c->q_rot, c->k_rot);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (c->acc)
            st = bk_hess_add_attn(c->acc, orig, c->x, fully ? c->q_rot : NULL,
                                  fully ? c->k_rot : NULL, sb);
        if (st == BK_OK && c->acc_gptq)
            st = bk_hess_add_attn(c->acc_gptq, orig, c->x, NULL, NULL, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_O:
        /* o_proj sees the quantized q/k/v */
        st = bk_fwd_attn_in(c->fwd, lw, hb, sb, c->x);
        if (st == BK_OK)
            st = bk_fwd_attention(c->fwd, lw, c->x, sb, ob, NULL, NULL, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (c->acc)
            st = bk_hess_add_o(c->acc, ob, sb);
        if (st == BK_OK && c->acc_gptq)
            st = bk_hess_add_o(c->acc_gptq, ob, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_MLP:
        /* residual with the quantized o_proj; gate/up from mlp_in */
        st = bk_fwd_attn_out(c->fwd, lw, ob, sb, hb);
        if (st == BK_OK)
            st = bk_fwd_mlp_in(c->fwd, lw, hb, sb, c->x);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (c->acc)
            st = bk_hess_add_mlp(c->acc, orig, c->x, sb);
        if (st == BK_OK && c->acc_gptq)
            st = bk_hess_add_mlp(c->acc_gptq, orig, c->x, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_DOWN: {
        /* down_proj sees the quantized gate/up */
        float *d = c->D ? c->D + r0 * c->cfg->intermediate : c->down;
        st = bk_fwd_mlp_in(c->fwd, lw, hb, sb, c->x);
        if (st == BK_OK)
            st = bk_fwd_mlp_hidden(c->fwd, lw, c->x, sb, d, NULL, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (c->acc)
            st = bk_hess_add_down(c->acc, d, sb);
        if (st == BK_OK && c->acc_gptq)
            st = bk_hess_add_down(c->acc_gptq, d, sb);
        *t_hessian += bk_now() - t;
        return st;
    }
    case BK_STAGE_OUT:
        /* the layer's output with every module quantized (h is unchanged since
         * stage DOWN: its down_proj inputs are kept when they fit) */
        if (c->D) {
            st = bk_fwd_mlp_out(c->fwd, lw, c->D + r0 * c->cfg->intermediate, sb, hb);
        } else {
            st = bk_fwd_mlp_in(c->fwd, lw, hb, sb, c->x);
            if (st == BK_OK)
                st = bk_fwd_mlp_hidden(c->fwd, lw, c->x, sb, c->down, NULL, NULL);
            if (st == BK_OK)
                st = bk_fwd_mlp_out(c->fwd, lw, c->down, sb, hb);
        }
        *t_forward += bk_now() - t;
        return st;
    case BK_STAGE_FULL:
        st = bk_fwd_layer(c->fwd, orig, sb, hb, NULL);
        *t_forward += bk_now() - t;
        return st;
    case BK_STAGE_TAPS: {
        /* full-precision inputs for every module: one pass with taps */
        bk_layer_taps taps = {.attn_in = c->x, .o_in = c->o_in, .mlp_in = c->mlp_in,
                              .down_in = c->down, .q_rot = fully ? c->q_rot : NULL,
                              .k_rot = fully ? c->k_rot : NULL};
        st = bk_fwd_layer(c->fwd, orig, sb, hb, &taps);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        return add_all_modules(c, c->x, c->o_in, c->mlp_in, c->down, sb, t_hessian);
    }
    }
    return bk_error(BK_ERR_INTERNAL, "pipeline: unknown stage %d", (int)stage);
}

static bk_status cpu_add_inputs(void *ctx, int64_t s0, int64_t sb, const float *const in[4],
                                double *t_forward, double *t_hessian)
{
    cpu_stages *c = ctx;
    (void)s0;
    if (c->fully) {
        /* queries/keys after norm and RoPE, recomputed from attn_in (the
         * attention's output is not used) */
        double t = bk_now();
        bk_status st = bk__fwd_qk_rot(c->fwd, c->orig, in[0], sb, c->q_rot, c->k_rot);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
    }
    return add_all_modules(c, in[0], in[1], in[2], in[3], sb, t_hessian);
}

static bk_status cpu_factors(void *ctx, bk_module mod, const float **A, const float **B,
                             const float **A_plain)
{
    cpu_stages *c = ctx;
    bk_status st;
    *A = *B = *A_plain = NULL;
    if (c->acc && (st = bk_hess_factors(c->acc, c->orig, mod, A, B)) != BK_OK)
        return st;
    if (c->acc_gptq) {
        const float *dummy = NULL;
        return bk_hess_factors(c->acc_gptq, c->orig, mod, A_plain, &dummy);
    }
    *A_plain = *A;
    return BK_OK;
}

static bk_status cpu_weight_updated(void *ctx, bk_module mod, const float *w)
{
    (void)ctx; /* the driver updated the working copy the CPU stages read */
    (void)mod;
    (void)w;
    return BK_OK;
}

static bk_status cpu_bp_grads(void *ctx, const bk_bp_side *side)
{
    cpu_stages *c = ctx;
    if (!side->acc)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "layer %d: the CPU stages take the backprop output side from a host "
                        "accumulator, not device Grams",
                        side->layer);
    c->acc = side->acc; /* the input side goes into the layer's accumulator */
    return BK_OK;
}

typedef struct host_sum {
    bk_stage_buf_fn fn;
    void *user;
} host_sum;

static bk_status host_sum_one(void *user, void *buf, size_t n, int f64)
{
    host_sum *h = user;
    return h->fn(h->user, buf, n, f64, 0, NULL);
}

static bk_status cpu_sums(void *ctx, unsigned modules, int dev, int rw, bk_stage_buf_fn fn,
                          void *user)
{
    cpu_stages *c = ctx;
    (void)dev; /* host buffers, read and written in place */
    (void)rw;
    host_sum h = {fn, user};
    bk_status st = BK_OK;
    if (c->acc)
        st = bk_hess_acc_sums(c->acc, modules, host_sum_one, &h);
    if (st == BK_OK && c->acc_gptq)
        st = bk_hess_acc_sums(c->acc_gptq, modules, host_sum_one, &h);
    return st;
}

static void cpu_layer_end(void *ctx)
{
    cpu_stages *c = ctx;
    c->orig = NULL;
    c->lw = NULL;
    c->acc = c->own;
}

static void cpu_destroy(void *ctx)
{
    cpu_stages *c = ctx;
    if (!c)
        return;
    free(c->h);
    free(c->o_in);
    free(c->x);
    free(c->q_rot);
    free(c->k_rot);
    free(c->down);
    free(c->mlp_in);
    free(c->D);
    if (c->own)
        bk_hess_acc_free(c->own);
    if (c->acc_gptq)
        bk_hess_acc_free(c->acc_gptq);
    if (c->fwd)
        bk_fwd_free(c->fwd);
    free(c);
}

static const char *cpu_describe(void *ctx)
{
    return ((const cpu_stages *)ctx)->note;
}

/* Nothing to start ahead: the host solve factors each side when it runs
 * (bk_backend_solve), the oracle's order. */
static void cpu_prepare_next(void *ctx, bk_module next, const bk_solve_opts *o)
{
    (void)ctx;
    (void)next;
    (void)o;
}

static const bk_stage_ops cpu_stage_ops = {
    .name = "cpu",
    .embed = cpu_embed,
    .layer_begin = cpu_layer_begin,
    .run = cpu_run,
    .factors = cpu_factors,
    .weight_updated = cpu_weight_updated,
    .factors_dev = NULL, /* the solves: bk_backend_solve on the host factors */
    .solve_dev = NULL,
    .layer_end = cpu_layer_end,
    .destroy = cpu_destroy,
    .describe = cpu_describe,
    .bp_grads = cpu_bp_grads,
    .sums = cpu_sums,
    .share_weight = NULL, /* (no solve_dev) */
    .add_inputs = cpu_add_inputs,
    .bp_host_grads = 1,
    .prepare_next = cpu_prepare_next,
};

/* The host buffers: the states of this rank's sequences (token calibration)
 * and the micro-batch scratch. */
static bk_status cpu_buffers(cpu_stages *c, const bk_stage_params *p, int keep_down)
{
    const bk_model_config *cfg = c->cfg;
    const int64_t T = c->T, B = c->batch;
    const int64_t qd = cfg->n_heads * cfg->head_dim, kd = cfg->n_kv_heads * cfg->head_dim;
    const int64_t xw = cfg->hidden > qd ? cfg->hidden : qd;
    const int64_t Nr = (c->s_hi - c->s_lo) * T;
    const int tokens = !p->inputs;
    if (tokens) {
        c->h = bk_alloc((size_t)(Nr * cfg->hidden), sizeof(float));
        c->o_in = bk_alloc((size_t)(Nr * qd), sizeof(float));
    } else {
        c->o_in = bk_alloc((size_t)(B * T * qd), sizeof(float));
    }
    c->x = bk_alloc((size_t)(B * T * xw), sizeof(float));
    c->q_rot = bk_alloc((size_t)(B * T * qd), sizeof(float));
    c->k_rot = bk_alloc((size_t)(B * T * kd), sizeof(float));
    c->down = bk_alloc((size_t)(B * T * cfg->intermediate), sizeof(float));
    if (!p->sequential)
        c->mlp_in = bk_alloc((size_t)(B * T * cfg->hidden), sizeof(float));
    if ((tokens && !c->h) || !c->o_in || !c->x || !c->q_rot || !c->k_rot || !c->down ||
        (!p->sequential && !c->mlp_in))
        return bk_error(BK_ERR_NOMEM, "out of memory for calibration states (%lld tokens)",
                        (long long)Nr);
    /* keep the down_proj inputs between stages DOWN and OUT (saves recomputing
     * gate/up: a third of the forward work) when they take at most a quarter
     * of the physical memory; setting keep_down=0 turns it off */
    const long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    const double need = (double)Nr * (double)cfg->intermediate * sizeof(float);
    if (tokens && p->sequential && keep_down && pages > 0 && psize > 0 &&
        need <= 0.25 * (double)pages * (double)psize)
        c->D = bk_alloc((size_t)(Nr * cfg->intermediate), sizeof(float)); /* NULL: recompute */
    return BK_OK;
}

bk_status bk_cpu_stages_create(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                               const bk_stage_ops **ops, void **ctx)
{
    *ops = NULL;
    *ctx = NULL;
    if (!p || !p->model || !batch || p->S < 0 || p->T < 1)
        return bk_error(BK_ERR_INVALID_ARG, "CPU stages: bad arguments");
    cpu_stages *c = calloc(1, sizeof *c);
    if (!c)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    c->model = p->model;
    c->cfg = bk_model_get_config(p->model);
    c->T = p->T;
    c->fully = p->fully;
    int64_t B = *batch > 0 ? *batch : bk_fwd_auto_batch(c->cfg, 0, p->T);
    if (p->S > 0 && B > p->S)
        B = p->S;
    if (B < 1)
        B = 1;
    c->batch = B;
    bk_status st = BK_OK;
    if (p->S > 0) { /* (rtn without calibration: nothing to hold) */
        if (!bk_rank_share(p->S, B, p->rank, p->nranks, &c->s_lo, &c->s_hi))
            st = bk_error(BK_ERR_INVALID_ARG,
                          "CPU stages: %d ranks but fewer micro-batches of %lld sequences",
                          p->nranks, (long long)B);
        if (st == BK_OK)
            st = bk_fwd_create(c->cfg, B, p->T, &c->fwd);
        /* backprop kinds: the layers' accumulators are the job's (bp_grads) */
        if (st == BK_OK && !bk_hessian_is_backprop(p->kind))
            st = bk_hess_acc_create(c->cfg, p->kind, p->fp64, p->T, &c->own);
        if (st == BK_OK && p->keep_plain)
            st = bk_hess_acc_create(c->cfg, BK_HESS_GPTQ, p->fp64, p->T, &c->acc_gptq);
        if (st == BK_OK)
            st = cpu_buffers(c, p, b ? bk_backend_get_params(b)->keep_down : 1);
    }
    if (st != BK_OK) {
        cpu_destroy(c);
        return st;
    }
    c->acc = c->own;
    *batch = B;
    *ops = &cpu_stage_ops;
    *ctx = c;
    return BK_OK;
}

void bk_cpu_stages_note(void *ctx, const char *note)
{
    cpu_stages *c = ctx;
    snprintf(c->note, sizeof c->note, "%s", note);
}

int bk_cpu_stages_are(const bk_stage_ops *ops)
{
    return ops == &cpu_stage_ops;
}
