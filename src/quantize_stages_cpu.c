/* The CPU stages of the quantization job (bk_stage_ops, src/backend_impl.h):
 * the forward pass (bk_fwd) and the Hessian accumulators (bk_hess_acc) on the
 * job's host buffers. A device backend brings its own (stages_create). */
#include <stdio.h>
#include <string.h>

#include "quantize_job.h"
#include "util.h"

/* Feed one micro-batch of every module's inputs to the accumulators (the
 * plain E[xx^T] one gets no queries/keys). */
bk_status bk__q_add_all_modules(job *j, const bk_layer_weights *orig, const float *attn_in,
                                 const float *o_in, const float *mlp_in, const float *down_in,
                                 int fully, int64_t sb, double *t_hessian)
{
    double t = bk_now();
    bk_status st = BK_OK;
    for (int k = 0; k < 2 && st == BK_OK; k++) {
        bk_hess_acc *a = k ? j->acc_gptq : j->acc;
        if (!a)
            continue;
        st = bk_hess_add_attn(a, orig, attn_in, (fully && !k) ? j->q_rot : NULL,
                              (fully && !k) ? j->k_rot : NULL, sb);
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

/* ------------------------------------------------- the CPU stages (bk_stage_ops) */

static bk_status cpu_embed(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb)
{
    job *j = ctx;
    /* (j->h holds this rank's sequences [s_lo, s_hi) only) */
    return bk_fwd_embed(j->fwd, j->model, tokens + s0 * j->T, sb,
                        j->h + (s0 - j->s_lo) * j->T * j->cfg->hidden);
}

static bk_status cpu_layer_begin(void *ctx, const bk_layer_weights *orig,
                                 const bk_layer_weights *lw, int hessians)
{
    job *j = ctx;
    j->cur_orig = orig;
    j->cur_lw = (bk_layer_weights *)lw;
    if (hessians) {
        if (j->acc && !j->bp) /* backprop: reset after the layer (its gradients came first) */
            bk_hess_acc_reset(j->acc);
        if (j->acc_gptq)
            bk_hess_acc_reset(j->acc_gptq);
    }
    return BK_OK;
}

static bk_status cpu_run(void *ctx, bk_stage stage, int64_t s0, int64_t sb, double *t_forward,
                         double *t_hessian)
{
    job *j = ctx;
    const bk_layer_weights *orig = j->cur_orig, *lw = j->cur_lw;
    const int64_t T = j->T, hid = j->cfg->hidden, qd = j->cfg->n_heads * j->cfg->head_dim;
    /* the residual stream, o_proj inputs and kept down_proj inputs: this
     * rank's sequences [s_lo, s_hi) only (all of them in one process) */
    const int64_t r0 = (s0 - j->s_lo) * T;
    float *hb = j->h + r0 * hid;
    float *ob = j->o_in + r0 * qd;
    const int fully = j->fully;
    bk_status st = BK_OK;
    double t = bk_now();
    switch (stage) {
    case BK_STAGE_QKV:
        /* q, k, v from attn_in (and, fully-local, the FP queries/keys) */
        st = bk_fwd_attn_in(j->fwd, orig, hb, sb, j->x);
        if (st == BK_OK && fully)
            st = bk_fwd_attention(j->fwd, orig, j->x, sb, ob, j->q_rot, j->k_rot, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_attn(j->acc, orig, j->x, fully ? j->q_rot : NULL,
                                  fully ? j->k_rot : NULL, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_attn(j->acc_gptq, orig, j->x, NULL, NULL, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_O:
        /* o_proj sees the quantized q/k/v */
        st = bk_fwd_attn_in(j->fwd, lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_attention(j->fwd, lw, j->x, sb, ob, NULL, NULL, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_o(j->acc, ob, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_o(j->acc_gptq, ob, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_MLP:
        /* residual with the quantized o_proj; gate/up from mlp_in */
        st = bk_fwd_attn_out(j->fwd, lw, ob, sb, hb);
        if (st == BK_OK)
            st = bk_fwd_mlp_in(j->fwd, lw, hb, sb, j->x);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_mlp(j->acc, orig, j->x, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_mlp(j->acc_gptq, orig, j->x, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_DOWN: {
        /* down_proj sees the quantized gate/up */
        float *d = j->D ? j->D + r0 * j->cfg->intermediate : j->down;
        st = bk_fwd_mlp_in(j->fwd, lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_mlp_hidden(j->fwd, lw, j->x, sb, d, NULL, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_down(j->acc, d, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_down(j->acc_gptq, d, sb);
        *t_hessian += bk_now() - t;
        return st;
    }
    case BK_STAGE_OUT:
        /* the layer's output with every module quantized (h is unchanged since
         * stage DOWN: its down_proj inputs are kept when they fit) */
        if (j->D) {
            st = bk_fwd_mlp_out(j->fwd, lw, j->D + r0 * j->cfg->intermediate, sb, hb);
        } else {
            st = bk_fwd_mlp_in(j->fwd, lw, hb, sb, j->x);
            if (st == BK_OK)
                st = bk_fwd_mlp_hidden(j->fwd, lw, j->x, sb, j->down, NULL, NULL);
            if (st == BK_OK)
                st = bk_fwd_mlp_out(j->fwd, lw, j->down, sb, hb);
        }
        *t_forward += bk_now() - t;
        return st;
    case BK_STAGE_FULL:
        st = bk_fwd_layer(j->fwd, orig, sb, hb, NULL);
        *t_forward += bk_now() - t;
        return st;
    case BK_STAGE_TAPS: {
        /* full-precision inputs for every module: one pass with taps */
        bk_layer_taps taps = {.attn_in = j->x, .o_in = j->o_in, .mlp_in = j->mlp_in,
                              .down_in = j->down, .q_rot = fully ? j->q_rot : NULL,
                              .k_rot = fully ? j->k_rot : NULL};
        st = bk_fwd_layer(j->fwd, orig, sb, hb, &taps);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        return bk__q_add_all_modules(j, orig, j->x, j->o_in, j->mlp_in, j->down, fully, sb,
                               t_hessian);
    }
    }
    return bk_error(BK_ERR_INTERNAL, "pipeline: unknown stage %d", (int)stage);
}

static bk_status cpu_factors(void *ctx, bk_module mod, const float **A, const float **B,
                             const float **A_plain)
{
    job *j = ctx;
    bk_status st;
    *A = *B = *A_plain = NULL;
    if (j->acc && (st = bk_hess_factors(j->acc, j->cur_orig, mod, A, B)) != BK_OK)
        return st;
    if (j->acc_gptq) {
        const float *dummy = NULL;
        return bk_hess_factors(j->acc_gptq, j->cur_orig, mod, A_plain, &dummy);
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

static void cpu_layer_end(void *ctx)
{
    job *j = ctx;
    j->cur_orig = NULL;
    j->cur_lw = NULL;
}

static void cpu_destroy(void *ctx)
{
    (void)ctx; /* the job owns the CPU state */
}

static const char *cpu_describe(void *ctx)
{
    (void)ctx;
    return "";
}

const bk_stage_ops bk__q_cpu_stages = {
    "cpu", cpu_embed, cpu_layer_begin, cpu_run, cpu_factors, cpu_weight_updated,
    NULL, NULL, cpu_layer_end, cpu_destroy, cpu_describe, NULL,
    NULL, NULL, /* sums, share_weight: the driver holds the CPU stages' sums (j->acc) */
};
