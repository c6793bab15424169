/* Reading the next layer's weights on a helper thread while the current
 * layer is processed (internal; src/prefetch.c). */
#ifndef BK_PREFETCH_H
#define BK_PREFETCH_H

#include <pthread.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/status.h"

typedef struct bk_prefetch {
    pthread_t tid;
    int running, layer, bf16;
    const bk_model *model;
    bk_layer_weights w;
    bk_status st;
    char msg[1024];
} bk_prefetch;

/* Start reading layer l of model m in the background (nothing when out of
 * range, when a read is running, or when a thread cannot be started: take
 * then reads it itself). bf16: the GPU stages' form
 * (bk__layer_weights_load_mapped_bf16: the matrices left in the mapped
 * checkpoint as BF16, their pages faulted in by the finiteness check, where
 * every one is BF16 there), else F32 (bk_layer_weights_load). */
void bk_prefetch_start(bk_prefetch *p, const bk_model *m, int l, int bf16);
/* Layer l's weights: from the background read when it was for l (in the form
 * it was started with, whatever bf16 says now), else read now in the form
 * bf16 asks for (a read of another layer is dropped). */
bk_status bk_prefetch_take(bk_prefetch *p, const bk_model *m, int l, int bf16,
                           bk_layer_weights *out);
/* Wait for a read in flight and release what it read. */
void bk_prefetch_drop(bk_prefetch *p);

#endif
