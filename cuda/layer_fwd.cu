/* CUDA backend — the layer forward (bk_layer_fwd_ops, src/backend_impl.h)
 * that the layer driver (src/layer_driver.c) runs for eval and
 * dump-activations: the residual stream of all sequences on the device; the
 * four module inputs of one micro-batch computed there and downloaded into
 * the caller's host arrays (dump), or the final norm + LM head (eval). */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend_impl.h"
#include "fwd_internal.cuh"

namespace {

struct cuda_lfwd {
    bk_backend *b;
    const bk_model *m;
    bk_gfwd *f;
    int64_t T, hidden, widths[4];
    int taps;      /* created for layer_taps (dump), else layer_run (eval) */
    float *H;      /* [S*T, hidden] the residual stream */
    float *tap[4]; /* [B*T, width] one micro-batch's module inputs (taps) */
    bk_glayer *gl; /* the current layer */
};

void lfwd_destroy(void *ctx)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    if (!g)
        return;
    if (g->f) {
        bk_glayer_free(g->f, g->gl);
        bk_gpu_free(g->f, g->H);
        for (int i = 0; i < 4; i++)
            bk_gpu_free(g->f, g->tap[i]);
        bk_gfwd_free(g->f);
    }
    free(g);
}

bk_status lfwd_embed(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    return bk_gfwd_embed(g->f, g->m, tokens + s0 * g->T, sb, g->H + s0 * g->T * g->hidden);
}

void lfwd_embed_end(void *ctx)
{
    bk_gfwd_embed_release(static_cast<cuda_lfwd *>(ctx)->f);
}

bk_status lfwd_layer_begin(void *ctx, const bk_layer_weights *lw)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    bk_status st = bk_gfwd_nf_clear(g->f);
    return st == BK_OK ? bk_glayer_upload(g->f, lw, &g->gl) : st;
}

bk_status lfwd_layer_run(void *ctx, int64_t s0, int64_t sb)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    return bk_gfwd_layer(g->f, g->gl, sb, g->H + s0 * g->T * g->hidden, NULL);
}

bk_status lfwd_layer_taps(void *ctx, int64_t s0, int64_t sb, float *const taps[4])
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    bk_layer_taps t = {};
    t.attn_in = g->tap[0];
    t.o_in = g->tap[1];
    t.mlp_in = g->tap[2];
    t.down_in = g->tap[3];
    /* the per-operation non-finite flags of this micro-batch travel with its
     * (synchronous) downloads; named as the CPU names them */
    bk_status st = bk_gfwd_nf_clear(g->f);
    if (st == BK_OK)
        st = bk_gfwd_layer(g->f, g->gl, sb, g->H + s0 * g->T * g->hidden, &t);
    if (st == BK_OK)
        st = bk_gfwd_nf_fetch(g->f);
    for (int i = 0; i < 4 && st == BK_OK; i++)
        st = bk_gpu_download(g->f, taps[i], g->tap[i],
                             (size_t)(sb * g->T * g->widths[i]) * sizeof(float));
    if (st == BK_OK)
        st = bk_gpu_sync(g->f);
    if (st == BK_OK)
        st = bk_gfwd_nf_report(g->f, g->gl);
    return st;
}

bk_status lfwd_layer_end(void *ctx)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    /* eval: the layer's work is finished before its weights go (the dump's
     * synchronous downloads have finished it); a non-finite output of any of
     * its operations (flags of all micro-batches: the row is within one of
     * them) is named as the CPU names it */
    bk_status st = BK_OK;
    if (!g->taps) {
        st = bk_gfwd_nf_fetch(g->f);
        bk_status s2 = bk_gpu_sync(g->f);
        if (st == BK_OK)
            st = s2;
        if (st == BK_OK)
            st = bk_gfwd_nf_report(g->f, g->gl);
    }
    bk_glayer_free(g->f, g->gl);
    g->gl = NULL;
    return st;
}

bk_status lfwd_nll(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb, double *nll_sum,
                   int64_t *count)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    return bk_gfwd_nll(g->f, g->m, g->H + s0 * g->T * g->hidden, tokens + s0 * g->T, sb, nll_sum,
                       count);
}

bk_status lfwd_logits(void *ctx, int64_t s0, int64_t sb, float *logits)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    return bk_gfwd_logits(g->f, g->m, g->H + s0 * g->T * g->hidden, sb, logits);
}

const char *lfwd_device(void *ctx)
{
    return bk_backend_device(static_cast<cuda_lfwd *>(ctx)->b);
}

const bk_layer_fwd_ops cuda_lfwd_ops = {
    lfwd_embed,     lfwd_embed_end, lfwd_layer_begin, lfwd_layer_run, lfwd_layer_taps,
    lfwd_layer_end, lfwd_nll,       lfwd_logits,      lfwd_destroy,   lfwd_device,
    1,
};

/* Sequences per micro-batch on the GPU: scratch of one micro-batch around
 * 2 GiB. */
int64_t gpu_auto_batch(const bk_model_config *c, int64_t S, int64_t T)
{
    double per_row = 4.0 * (double)(4 * c->n_heads * c->head_dim + 4 * c->n_kv_heads * c->head_dim +
                                    3 * c->hidden + 3 * c->intermediate);
    return bk_batch_within(2048.0 * 1024 * 1024, per_row * (double)T, S);
}

} // namespace

extern "C" bk_status bk_cuda_layer_fwd_create(bk_backend *b, const bk_layer_fwd_params *p,
                                              int64_t *batch, const bk_layer_fwd_ops **ops,
                                              void **ctx)
{
    *ops = NULL;
    *ctx = NULL;
    const bk_model *m = p->model;
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t S = p->S, T = p->T;
    const int64_t B = bk_layer_fwd_batch(p, gpu_auto_batch(c, S, T));
    *batch = B;
    /* the configuration's checks, as on the CPU */
    bk_fwd *chk = NULL;
    bk_status st = bk_fwd_create(c, B, T, &chk);
    if (st != BK_OK)
        return st;
    bk_fwd_free(chk);
    cuda_lfwd *g = static_cast<cuda_lfwd *>(calloc(1, sizeof(cuda_lfwd)));
    if (!g)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    g->b = b;
    g->m = m;
    g->T = T;
    g->taps = p->taps;
    g->hidden = c->hidden;
    g->widths[0] = c->hidden;
    g->widths[1] = c->n_heads * c->head_dim;
    g->widths[2] = c->hidden;
    g->widths[3] = c->intermediate;
    const int64_t N = S * T;
    st = bk_gfwd_create(b, c, B, T, &g->f);
    if (st == BK_OK)
        st = bk_gpu_alloc(g->f, (void **)&g->H, (size_t)(N * c->hidden) * sizeof(float),
                          "residual stream of all sequences");
    for (int i = 0; i < 4 && st == BK_OK && p->taps; i++)
        st = bk_gpu_alloc(g->f, (void **)&g->tap[i],
                          (size_t)(B * T * g->widths[i]) * sizeof(float), "activation taps");
    if (st == BK_ERR_DEVICE_OOM) {
        char pre[128];
        snprintf(pre, sizeof pre,
                 "%s on the GPU (use fewer --samples, a smaller --batch or --backend cpu)",
                 p->what ? p->what : "the forward pass");
        bk_error_prefix(st, pre);
    }
    if (st != BK_OK) {
        lfwd_destroy(g);
        return st;
    }
    *ops = &cuda_lfwd_ops;
    *ctx = g;
    return BK_OK;
}
