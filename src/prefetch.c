/* Reading the next layer's weights on a helper thread (src/prefetch.h). */
#include <stdio.h>
#include <string.h>

#include "forward_internal.h"
#include "prefetch.h"
#include "util.h"

/* Layer l as asked: F32, or (bf16) the mapped BF16 matrices where the
 * checkpoint has them */
static bk_status load_layer(const bk_model *m, int l, int bf16, bk_layer_weights *w)
{
    return bf16 ? bk__layer_weights_load_mapped_bf16(m, l, w) : bk_layer_weights_load(m, l, w);
}

static void *prefetch_main(void *arg)
{
    bk_prefetch *p = arg;
    double t = bk_now();
    p->st = load_layer(p->model, p->layer, p->bf16, &p->w);
    bk_prof_add("prefetch.load (thread)", bk_now() - t);
    if (p->st != BK_OK)
        snprintf(p->msg, sizeof p->msg, "%s", bk_last_error());
    return NULL;
}

void bk_prefetch_start(bk_prefetch *p, const bk_model *m, int l, int bf16)
{
    if (p->running || l < 0 || l >= bk_model_get_config(m)->n_layers)
        return;
    memset(&p->w, 0, sizeof p->w);
    p->layer = l;
    p->bf16 = bf16 != 0;
    p->model = m;
    p->st = BK_OK;
    p->msg[0] = 0;
    p->running = pthread_create(&p->tid, NULL, prefetch_main, p) == 0;
}

void bk_prefetch_drop(bk_prefetch *p)
{
    if (!p->running)
        return;
    pthread_join(p->tid, NULL);
    p->running = 0;
    bk_layer_weights_free(&p->w);
}

bk_status bk_prefetch_take(bk_prefetch *p, const bk_model *m, int l, int bf16,
                           bk_layer_weights *out)
{
    if (p->running && p->layer == l && p->model == m) {
        /* (read in the other form: handed over as it is; the caller widens
         * BF16 matrices it needs as F32, bk__layer_weights_widen) */
        pthread_join(p->tid, NULL);
        p->running = 0;
        if (p->st != BK_OK)
            return bk_error(p->st, "%s", p->msg);
        *out = p->w;
        memset(&p->w, 0, sizeof p->w);
        return BK_OK;
    }
    bk_prefetch_drop(p);
    return load_layer(m, l, bf16, out);
}
