/* The layer driver of quantize, eval and dump-activations (src/layer_driver.h). */
#include <string.h>

#include "bakron/safetensors.h"
#include "layer_driver.h"
#include "stop.h"
#include "util.h"

bk_layer_driver bk_driver_over_fwd(const bk_model *m, const int32_t *tokens, int64_t S,
                                   int64_t batch, const bk_layer_fwd_ops *ops, void *fwd,
                                   bk_status (*layer)(void *user, int l, bk_layer_weights *w),
                                   void *user)
{
    return (bk_layer_driver){.model = m, .tokens = tokens, .s_lo = 0, .s_hi = S, .batch = batch,
                             .embed = ops->embed, .embed_end = ops->embed_end, .fwd = fwd,
                             .layer = layer, .user = user, .weights = 1};
}

bk_status bk_driver_embed(bk_layer_driver *d)
{
    if (!d->tokens)
        return BK_OK;
    double t = bk_now();
    bk_status st = BK_OK;
    BK_MB_LOOP(d->s_lo, d->s_hi, d->batch, s0, sb) {
        st = d->embed(d->fwd, d->tokens, s0, sb);
        if (st != BK_OK)
            break;
    }
    if (d->embed_end)
        d->embed_end(d->fwd);
    bk_prof_add("fwd.embed", bk_now() - t);
    return st;
}

bk_status bk_driver_layer(bk_layer_driver *d, int l)
{
    bk_layer_weights w;
    memset(&w, 0, sizeof w);
    bk_status st = BK_OK;
    d->t_load_last = 0.0;
    if (d->weights) {
        double t = bk_now();
        st = bk_prefetch_take(&d->pf, d->model, l, d->bf16 && d->bf16(d->user, l), &w);
        if (st == BK_OK && (d->end <= 0 || l + 1 < d->end))
            bk_prefetch_start(&d->pf, d->model, l + 1, d->bf16 && d->bf16(d->user, l + 1));
        d->t_load_last = bk_now() - t;
        d->t_load += d->t_load_last;
        bk_prof_add("io.prefetch_wait", d->t_load_last);
    }
    if (st == BK_OK)
        st = d->layer(d->user, l, d->weights ? &w : NULL);
    bk_layer_weights_free(&w);
    if (st == BK_OK) /* the checkpoint is not changing under the run */
        st = bk_st_set_check_unchanged(bk_model_tensors(d->model));
    if (st == BK_OK && d->stop_check && bk__stop_requested())
        /* numbered as the progress lines: index, then (k/selected) */
        st = bk_error(BK_ERR_INTERRUPTED, "interrupted after layer %d (%d/%d)", l,
                      l - d->stop_first + 1, d->stop_count);
    return st;
}

bk_status bk_driver_layers(bk_layer_driver *d, int l0, int l1)
{
    bk_status st = BK_OK;
    d->end = l1;
    for (int l = l0; l < l1 && st == BK_OK; l++)
        st = bk_driver_layer(d, l);
    return st;
}

void bk_driver_end(bk_layer_driver *d)
{
    bk_prefetch_drop(&d->pf);
}
