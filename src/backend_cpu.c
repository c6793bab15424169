/* The CPU backend: the exact reference (BLAS/LAPACK). */
#include <stdio.h>
#include <stdlib.h>

#include <cblas.h>

#include "backend_impl.h"
#include "bakron/forward.h"
#include "bakron/solver.h"
#include "util.h"

static bk_status cpu_solve(void *ctx, const bk_solve_problem *p, const bk_solve_opts *o,
                           bk_solve_result *r)
{
    (void)ctx;
    return bk_solve(p, o, r);
}

/* ------------------------------------------------------- the layer forward */

typedef struct cpu_lfwd {
    bk_fwd *f;
    const bk_model *m;
    int64_t T, hidden;
    float *h; /* [S*T, hidden] the residual stream */
    const bk_layer_weights *lw;
} cpu_lfwd;

static void lfwd_destroy(void *ctx)
{
    cpu_lfwd *c = ctx;
    if (!c)
        return;
    if (c->f)
        bk_fwd_free(c->f);
    free(c->h);
    free(c);
}

static bk_status lfwd_embed(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb)
{
    cpu_lfwd *c = ctx;
    return bk_fwd_embed(c->f, c->m, tokens + s0 * c->T, sb, c->h + s0 * c->T * c->hidden);
}

static void lfwd_embed_end(void *ctx)
{
    (void)ctx;
}

static bk_status lfwd_layer_begin(void *ctx, const bk_layer_weights *lw)
{
    ((cpu_lfwd *)ctx)->lw = lw;
    return BK_OK;
}

static bk_status lfwd_layer_run(void *ctx, int64_t s0, int64_t sb)
{
    cpu_lfwd *c = ctx;
    return bk_fwd_layer(c->f, c->lw, sb, c->h + s0 * c->T * c->hidden, NULL);
}

static bk_status lfwd_layer_taps(void *ctx, int64_t s0, int64_t sb, float *const taps[4])
{
    cpu_lfwd *c = ctx;
    bk_layer_taps t = {.attn_in = taps[0], .o_in = taps[1], .mlp_in = taps[2],
                       .down_in = taps[3]};
    return bk_fwd_layer(c->f, c->lw, sb, c->h + s0 * c->T * c->hidden, &t);
}

static bk_status lfwd_layer_end(void *ctx)
{
    ((cpu_lfwd *)ctx)->lw = NULL;
    return BK_OK;
}

static bk_status lfwd_nll(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb,
                          double *nll_sum, int64_t *count)
{
    cpu_lfwd *c = ctx;
    return bk_fwd_nll(c->f, c->m, c->h + s0 * c->T * c->hidden, tokens + s0 * c->T, sb, nll_sum,
                      count);
}

static bk_status lfwd_logits(void *ctx, int64_t s0, int64_t sb, float *logits)
{
    cpu_lfwd *c = ctx;
    return bk_fwd_logits(c->f, c->m, c->h + s0 * c->T * c->hidden, sb, logits);
}

static const char *lfwd_device(void *ctx)
{
    (void)ctx;
    return "cpu";
}

static const bk_layer_fwd_ops cpu_lfwd_ops = {
    .embed = lfwd_embed,
    .embed_end = lfwd_embed_end,
    .layer_begin = lfwd_layer_begin,
    .layer_run = lfwd_layer_run,
    .layer_taps = lfwd_layer_taps,
    .layer_end = lfwd_layer_end,
    .nll = lfwd_nll,
    .logits = lfwd_logits,
    .destroy = lfwd_destroy,
    .device = lfwd_device,
    .uses_gemm_math = 0,
};

bk_status bk_cpu_layer_fwd_create(bk_backend *b, const bk_layer_fwd_params *p, int64_t *batch,
                                  const bk_layer_fwd_ops **ops, void **ctx)
{
    (void)b;
    *ops = NULL;
    *ctx = NULL;
    const bk_model *m = p->model;
    const bk_model_config *cfg = bk_model_get_config(m);
    const int64_t S = p->S, T = p->T;
    const int64_t B = bk_layer_fwd_batch(p, bk_fwd_auto_batch(cfg, S, T));
    *batch = B;
    cpu_lfwd *c = calloc(1, sizeof *c);
    if (!c)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    c->m = m;
    c->T = T;
    c->hidden = cfg->hidden;
    bk_status st = bk_fwd_create(cfg, B, T, &c->f);
    if (st == BK_OK && !(c->h = bk_alloc((size_t)(S * T * cfg->hidden), sizeof(float))))
        st = bk_error(BK_ERR_NOMEM, "out of memory for the residual stream of %lld tokens",
                      (long long)(S * T));
    if (st != BK_OK) {
        lfwd_destroy(c);
        return st;
    }
    *ops = &cpu_lfwd_ops;
    *ctx = c;
    return BK_OK;
}

static void cpu_destroy(void *ctx)
{
    (void)ctx;
}

static const bk_backend_ops cpu_ops = {
    .name = "cpu",
    .solve = cpu_solve,
    .peak_memory = NULL,
    .reset_peak_memory = NULL,
    .layer_fwd_create = bk_cpu_layer_fwd_create,
    .stages_create = bk_cpu_stages_create, /* src/backend_cpu_stages.c */
    .bwd_flow_run = NULL,  /* the CPU's flow, bk_bwd_flow_run (the dispatcher's fallback) */
    .destroy = cpu_destroy,
};

bk_status bk_cpu_backend_init(bk_backend *b)
{
    b->ops = &cpu_ops;
    b->ctx = NULL;
    snprintf(b->device, sizeof b->device, "CPU (OpenBLAS %s, %d threads)",
             openblas_get_config(), openblas_get_num_threads());
    return BK_OK;
}
