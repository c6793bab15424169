/* Whole-model NLL and logits (bakron eval): the layer driver
 * (src/layer_driver.c) over the backend's layer forward, then the head on
 * every micro-batch. */
#include <string.h>

#include "backend_impl.h"
#include "forward_internal.h"
#include "layer_driver.h"
#include "util.h"

typedef struct eval_run {
    const bk_layer_fwd_ops *ops;
    void *ctx;
    int64_t S, B;
} eval_run;

/* The body of one layer: the layer on every micro-batch. */
static bk_status eval_layer(void *user, int l, bk_layer_weights *w)
{
    (void)l;
    eval_run *e = user;
    bk_status st = e->ops->layer_begin(e->ctx, w);
    if (st != BK_OK)
        return st;
    BK_MB_LOOP(0, e->S, e->B, s0, sb) {
        if ((st = e->ops->layer_run(e->ctx, s0, sb)) != BK_OK)
            break;
    }
    bk_status se = e->ops->layer_end(e->ctx);
    return st != BK_OK ? st : se;
}

/* Every layer over S sequences in micro-batches of `batch` (0: the backend's
 * rule); then nll_sum/count (logits NULL) or the logits. */
static bk_status eval_model(bk_backend *b, const bk_model *m, const int32_t *tokens, int64_t S,
                            int64_t T, int64_t batch, double *nll_sum, int64_t *count,
                            float *logits)
{
    const bk_model_config *c = bk_model_get_config(m);
    bk_status st = bk_fwd_check_sequences(c, tokens, S, T, logits ? 1 : 2);
    if (st != BK_OK)
        return st;
    const bk_layer_fwd_params p = {.model = m, .S = S, .T = T, .batch = batch, .taps = 0,
                                   .what = "eval"};
    eval_run e = {NULL, NULL, S, 0};
    st = bk_backend_layer_fwd_create(b, &p, &e.B, &e.ops, &e.ctx);
    if (st != BK_OK)
        return st;
    bk_layer_driver d = bk_driver_over_fwd(m, tokens, S, e.B, e.ops, e.ctx, eval_layer, &e);
    st = bk_driver_embed(&d);
    if (st == BK_OK)
        st = bk_driver_layers(&d, 0, (int)c->n_layers);
    bk_driver_end(&d);
    if (logits) {
        BK_MB_LOOP(0, S, e.B, s0, sb) {
            if (st != BK_OK)
                break;
            st = e.ops->logits(e.ctx, s0, sb, logits + s0 * T * c->vocab);
        }
    } else {
        double sum = 0.0;
        int64_t cnt = 0;
        BK_MB_LOOP(0, S, e.B, s0, sb) {
            if (st != BK_OK)
                break;
            st = e.ops->nll(e.ctx, tokens, s0, sb, &sum, &cnt);
        }
        if (st == BK_OK) {
            *nll_sum += sum;
            *count += cnt;
        }
    }
    e.ops->destroy(e.ctx);
    return st;
}

bk_status bk_backend_model_nll(bk_backend *b, const bk_model *m, const int32_t *tokens,
                               int64_t S, int64_t T, int64_t batch, double *nll_sum,
                               int64_t *count)
{
    if (!m || !nll_sum || !count)
        return bk_error(BK_ERR_INVALID_ARG, "model nll: NULL argument");
    if (batch < 0)
        return bk_error(BK_ERR_INVALID_ARG, "model nll: batch %lld must be >= 0",
                        (long long)batch);
    return eval_model(b, m, tokens, S, T, batch, nll_sum, count, NULL);
}

bk_status bk_backend_model_logits(bk_backend *b, const bk_model *m, const int32_t *tokens,
                                  int64_t S, int64_t T, float *logits)
{
    if (!m || !logits)
        return bk_error(BK_ERR_INVALID_ARG, "model logits: NULL argument");
    /* one micro-batch of every sequence */
    return eval_model(b, m, tokens, S, T, S, NULL, NULL, logits);
}

bk_status bk_model_nll(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                       int64_t batch, double *nll_sum, int64_t *count)
{
    return bk_backend_model_nll(NULL, m, tokens, S, T, batch, nll_sum, count);
}

bk_status bk_model_logits(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                          float *logits)
{
    return bk_backend_model_logits(NULL, m, tokens, S, T, logits);
}
