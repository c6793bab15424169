/* The layer driver (internal): what quantize, eval and dump-activations have
 * in common. It embeds the calibration sequences micro-batch by micro-batch
 * on the backend's forward (a bk_stage_ops or bk_layer_fwd_ops of
 * src/backend_impl.h), then walks the decoder layers: each layer's weights
 * are read (the next one on a helper thread meanwhile, src/prefetch.c), the
 * command's body runs the layer on the backend, the weights are released,
 * and the checkpoint is checked to be unchanged under the run.
 *
 *   quantize          body: the stages and solves of a layer (src/quantize_layers.c)
 *   eval              body: the layer on every micro-batch (src/eval.c),
 *                     then the head (nll / logits entries)
 *   dump-activations  body: the layer with taps, then the layer file
 *                     (src/activations.c)
 *
 * docs/DEVELOPING.md "Architecture" and docs/BACKEND.md. */
#ifndef BK_LAYER_DRIVER_H
#define BK_LAYER_DRIVER_H

#include <stdint.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/status.h"
#include "backend_impl.h"
#include "prefetch.h"

/* The micro-batches [s0, s0+sb) of sequences [lo, hi), b sequences each
 * (the last one shorter). */
#define BK_MB_LOOP(lo, hi, b, s0, sb)                                                       \
    for (int64_t s0 = (lo), sb = 0; s0 < (hi) && ((sb = ((hi) - s0 < (b) ? (hi) - s0 : (b))), 1); \
         s0 += sb)

typedef struct bk_layer_driver {
    const bk_model *model;
    /* The embedding: sequences [s_lo, s_hi) of tokens [S, T] in micro-batches
     * of batch sequences, by embed(fwd, tokens, s0, sb); then embed_end
     * (optional). */
    const int32_t *tokens;
    int64_t s_lo, s_hi, batch;
    bk_status (*embed)(void *fwd, const int32_t *tokens, int64_t s0, int64_t sb);
    void (*embed_end)(void *fwd);
    void *fwd;
    /* One layer. w: its weights (read by the driver, released after the
     * body; the body may change them), or NULL when weights is 0 (the body
     * reads what it needs itself). */
    bk_status (*layer)(void *user, int l, bk_layer_weights *w);
    void *user;
    int weights;
    /* The form of layer l's weights (with weights): NULL or 0 F32 (every
     * matrix in w[i]); 1 the BF16 read for the GPU stages (the matrices of
     * a BF16 checkpoint left in the mapping, wb[i]: bk_prefetch_start). The
     * body gets the form the read-ahead was started with (it may differ for
     * the first layer, started before the stages exist) and widens to F32
     * what it needs as F32 (bk__layer_weights_widen). */
    int (*bf16)(void *user, int l);
    /* No read-ahead beyond layer end - 1 (0: the model's last layer);
     * bk_driver_layers sets it to its l1. */
    int end;
    /* After each layer: a stop request (bk_request_stop) ends the run with
     * "interrupted after layer L (k/n)", k counted from stop_first over
     * stop_count layers. 0: the body checks it itself. */
    int stop_check;
    int stop_first, stop_count;
    /* Out: seconds spent reading weights (waiting for the helper thread
     * included) for the last layer, and in all. */
    double t_load_last, t_load;
    bk_prefetch pf; /* (the driver's) */
} bk_layer_driver;

/* A driver over a layer forward (eval, dump-activations): the embedding of
 * sequences [0, S) of tokens in micro-batches of batch on ops/fwd, then
 * layer(user, l, weights) for every layer; no stop check. */
bk_layer_driver bk_driver_over_fwd(const bk_model *m, const int32_t *tokens, int64_t S,
                                   int64_t batch, const bk_layer_fwd_ops *ops, void *fwd,
                                   bk_status (*layer)(void *user, int l, bk_layer_weights *w),
                                   void *user);
/* The embedding (nothing without tokens). */
bk_status bk_driver_embed(bk_layer_driver *d);
/* One layer: its weights, the body, the checks after it. */
bk_status bk_driver_layer(bk_layer_driver *d, int l);
/* Layers [l0, l1), in order. */
bk_status bk_driver_layers(bk_layer_driver *d, int l0, int l1);
/* Release what the driver holds (a read-ahead in flight). */
void bk_driver_end(bk_layer_driver *d);

#endif
