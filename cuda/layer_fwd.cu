/* CUDA backend — the layer forward with taps (bk_layer_fwd_ops,
 * src/backend_impl.h) for dump-activations: the residual stream of all
 * sequences on the device, the four module inputs of one micro-batch
 * computed there and downloaded into the caller's host arrays. */
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
    float *H;      /* [S*T, hidden] the residual stream */
    float *tap[4]; /* [B*T, width] one micro-batch's module inputs */
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
    return bk_glayer_upload(g->f, lw, &g->gl);
}

bk_status lfwd_layer_taps(void *ctx, int64_t s0, int64_t sb, float *const taps[4])
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    bk_layer_taps t = {};
    t.attn_in = g->tap[0];
    t.o_in = g->tap[1];
    t.mlp_in = g->tap[2];
    t.down_in = g->tap[3];
    bk_status st = bk_gfwd_layer(g->f, g->gl, sb, g->H + s0 * g->T * g->hidden, &t);
    for (int i = 0; i < 4 && st == BK_OK; i++)
        st = bk_gpu_download(g->f, taps[i], g->tap[i],
                             (size_t)(sb * g->T * g->widths[i]) * sizeof(float));
    return st;
}

void lfwd_layer_end(void *ctx)
{
    cuda_lfwd *g = static_cast<cuda_lfwd *>(ctx);
    bk_glayer_free(g->f, g->gl);
    g->gl = NULL;
}

const char *lfwd_device(void *ctx)
{
    return bk_backend_device(static_cast<cuda_lfwd *>(ctx)->b);
}

const bk_layer_fwd_ops cuda_lfwd_ops = {
    lfwd_embed,     lfwd_embed_end, lfwd_layer_begin, lfwd_layer_taps,
    lfwd_layer_end, lfwd_destroy,   lfwd_device,      1,
};

} // namespace

extern "C" bk_status bk_cuda_layer_fwd_create(bk_backend *b, const bk_model *m, int64_t S,
                                              int64_t T, int64_t B, const bk_layer_fwd_ops **ops,
                                              void **ctx)
{
    *ops = NULL;
    *ctx = NULL;
    const bk_model_config *c = bk_model_get_config(m);
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
    for (int i = 0; i < 4 && st == BK_OK; i++)
        st = bk_gpu_alloc(g->f, (void **)&g->tap[i],
                          (size_t)(B * T * g->widths[i]) * sizeof(float), "activation taps");
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "dump-activations on the GPU (use fewer --samples, a smaller --batch "
                            "or --backend cpu)");
    if (st != BK_OK) {
        lfwd_destroy(g);
        return st;
    }
    *ops = &cuda_lfwd_ops;
    *ctx = g;
    return BK_OK;
}
