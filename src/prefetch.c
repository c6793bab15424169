/* Reading the next layer's weights on a helper thread (src/prefetch.h). */
#include <stdio.h>
#include <string.h>

#include "prefetch.h"
#include "util.h"

static void *prefetch_main(void *arg)
{
    bk_prefetch *p = arg;
    double t = bk_now();
    p->st = bk_layer_weights_load(p->model, p->layer, &p->w);
    bk_prof_add("prefetch.load (thread)", bk_now() - t);
    if (p->st != BK_OK)
        snprintf(p->msg, sizeof p->msg, "%s", bk_last_error());
    return NULL;
}

void bk_prefetch_start(bk_prefetch *p, const bk_model *m, int l)
{
    if (p->running || l < 0 || l >= bk_model_get_config(m)->n_layers)
        return;
    memset(&p->w, 0, sizeof p->w);
    p->layer = l;
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

bk_status bk_prefetch_take(bk_prefetch *p, const bk_model *m, int l, bk_layer_weights *out)
{
    if (p->running && p->layer == l && p->model == m) {
        pthread_join(p->tid, NULL);
        p->running = 0;
        if (p->st != BK_OK)
            return bk_error(p->st, "%s", p->msg);
        *out = p->w;
        memset(&p->w, 0, sizeof p->w);
        return BK_OK;
    }
    bk_prefetch_drop(p);
    return bk_layer_weights_load(m, l, out);
}
