/* bakron — backward pass through the native model on the CPU (double
 * precision), and the flows that deliver, layer by layer, the inputs a and
 * the output gradients g of every linear module for the Backprop (Fisher)
 * Hessians (paper sections 4.1, 5; docs/hessians.md "Backprop").
 *
 * Layout as in bakron/forward.h: S sequences of T tokens, N = S*T rows,
 * row s*T + t at position t. Everything here computes in double: it is the
 * oracle a GPU implementation is checked against, op by op (the same
 * decomposition: embed, per-layer forward with recomputation, per-layer
 * backward, the LM head's cross entropy in vocabulary blocks).
 *
 * The loss of one micro-batch is the SUM over its labelled positions of
 * -log p(label | prefix). g of a module is the gradient of that sum with
 * respect to the module's output at each token (one row per token).
 */
#ifndef BAKRON_BACKWARD_H
#define BAKRON_BACKWARD_H

#include <stdint.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which labels the cross entropy uses. */
typedef enum bk_fisher_kind {
    BK_FISHER_MODEL = 0, /* sampled from the model's own predictive distribution at every
                            position (Monte-Carlo model Fisher), seeded */
    BK_FISHER_EMPIRICAL  /* the calibration text's next token (positions 0..T-2) */
} bk_fisher_kind;

const char *bk_fisher_name(bk_fisher_kind k); /* "model", "empirical" */
bk_status bk_fisher_from_name(const char *name, bk_fisher_kind *out);

/* Backward context: config, RoPE tables, buffers for micro-batches of up to
 * max_seqs sequences of seqlen tokens. */
typedef struct bk_bwd bk_bwd;

bk_status bk_bwd_create(const bk_model_config *cfg, int64_t max_seqs, int64_t seqlen,
                        bk_bwd **out);
void bk_bwd_free(bk_bwd *b);

/* h [N, hidden] = embed_tokens[tokens] in double. */
bk_status bk_bwd_embed(bk_bwd *b, const bk_model *m, const int32_t *tokens, int64_t S, double *h);

/* One decoder layer, in place on h [N, hidden] (double arithmetic with the
 * F32 weights lw). */
bk_status bk_bwd_layer_forward(bk_bwd *b, const bk_layer_weights *lw, int64_t S, double *h);

/* Per-module inputs a [N, in] and output gradients g [N, out] of one layer
 * (pointers into the context, valid until its next call). */
typedef struct bk_grad_taps {
    const double *a[BK_MOD_COUNT];
    const double *g[BK_MOD_COUNT];
} bk_grad_taps;

/* Backward through one layer. h_in [N, hidden] is the layer's input (its
 * forward is recomputed from it); dh holds dL/d(layer output) on entry and
 * dL/d(layer input) on return. taps (may be NULL) receives a and g of the
 * seven modules. A non-finite gradient is BK_ERR_NONFINITE naming the layer
 * and module. */
bk_status bk_bwd_layer_backward(bk_bwd *b, const bk_layer_weights *lw, int64_t S,
                                const double *h_in, double *dh, bk_grad_taps *taps);

/* Labels of S sequences from the final hidden states h (before the final
 * norm): BK_FISHER_MODEL samples label ~ softmax(logits) at every position
 * with a uniform drawn from (seed, seq0 + s, t) (so the labels do not depend
 * on the micro-batching); BK_FISHER_EMPIRICAL takes tokens[t + 1] and marks
 * the last position -1 (no label). labels [N]. */
bk_status bk_bwd_labels(bk_bwd *b, const bk_model *m, const double *h, const int32_t *tokens,
                        int64_t S, int64_t seq0, bk_fisher_kind fisher, uint64_t seed,
                        int32_t *labels);

/* Final norm + LM head (lm_head, or embed_tokens when tied) + cross entropy
 * summed over the positions with labels >= 0. Adds the loss to *loss (may be
 * NULL); dh (may be NULL) receives dL/dh [N, hidden]. */
bk_status bk_bwd_head(bk_bwd *b, const bk_model *m, const double *h, const int32_t *labels,
                      int64_t S, double *dh, double *loss);

/* ------------------------------------------------------------ the flows */

typedef enum bk_bwd_flow_kind {
    BK_FLOW_HALVING = 0, /* recursive halving: O(l log l) layer passes, O(log l) boundaries */
    BK_FLOW_NAIVE        /* "naive I": a full forward + backward per leaf, no boundaries */
} bk_bwd_flow_kind;

const char *bk_bwd_flow_name(bk_bwd_flow_kind k); /* "halving", "naive" */
bk_status bk_bwd_flow_from_name(const char *name, bk_bwd_flow_kind *out);

typedef struct bk_bwd_flow_opts {
    bk_bwd_flow_kind flow;
    int leaf;               /* layers per leaf (s >= 1); s >= n_layers: one pass (YAQA's flow) */
    bk_fisher_kind fisher;
    uint64_t seed;
    int64_t batch;          /* sequences per micro-batch (>= 1) */
    int64_t seq0;           /* the calibration set's index of tokens' first sequence (0: the
                               whole set; an MPI rank's share: its first sequence), which seeds
                               the model Fisher's sampled labels, so they do not depend on the
                               split */
    int units;              /* halving: the most boundary matrices [N, hidden] it may hold at
                               once (0, or fewer than halving needs: recursive halving, the
                               fewest). More lets a split have up to one child per leaf: fewer
                               passes over the model, the same a and g to the last bit
                               (docs/hessians.md "Wider splits") */
} bk_bwd_flow_opts;

/* What a pass is about to do (progress). */
typedef struct bk_bwd_pass_info {
    int index;              /* 0-based count of passes so far */
    int depth;              /* recursion depth (0 = the whole model); naive: 0 */
    int lo, hi;             /* leaf: the layers whose gradients the pass delivers;
                               split: the layers it goes back through ([mid, hi)) */
    int leaf;               /* 1: a leaf pass (delivers gradients), 0: a halving split */
} bk_bwd_pass_info;

typedef struct bk_bwd_flow_cb {
    void *user;
    /* a pass begins (may be NULL) */
    void (*pass_begin)(void *user, const bk_bwd_pass_info *info);
    /* one micro-batch [s0, s0 + S) of layer `layer`'s module inputs and output
     * gradients (full-precision model), during a leaf pass */
    bk_status (*grads)(void *user, int layer, int64_t s0, int64_t S, const bk_grad_taps *taps);
    /* every micro-batch of the leaf [lo, hi) was delivered: the caller may now
     * quantize those layers. Leaves come in increasing layer order. */
    bk_status (*leaf_done)(void *user, int lo, int hi);
    /* Optional, GPU flow only (src/backward_gpu.h; the CPU flow calls grads):
     * when set, the GPU flow forms each leaf layer's output-gradient Grams on
     * the device over the whole calibration set and, before leaf_done, calls
     * this once per layer and module, in layer then module order:
     * G [out, out] (upper triangle) = Σ g gᵀ, or Σ |a|² g gᵀ when
     * gram_weighted (Shampoo), and gw [S*T] = |g|² of each token; for
     * bk__hess_add_grad_gram (src/backward_internal.h). */
    bk_status (*grams)(void *user, int layer, bk_module mod, const double *G, const double *gw,
                       int64_t S);
    int gram_weighted;
    /* Optional, GPU flow only, instead of grams: the same Grams and token
     * weights as DEVICE arrays of the backend (G [out, out] double, row-major
     * upper triangle; gw [S*T] double, NULL unless gram_weighted), handed
     * over before leaf_done and valid until leaf_done returns (the flow then
     * clears them for the next leaf): for device stages that form the
     * factors where the Grams are (no download). */
    bk_status (*grams_dev)(void *user, int layer, bk_module mod, const double *G,
                           const double *gw, int64_t S);
    /* Optional, GPU flow with grams only: the sums the leaf's device Grams
     * start from instead of zero (MPI ranks, ordered sums: the Grams of the
     * ranks before, so each rank's micro-batches are added in the single
     * process's order). Called when a leaf pass begins (after pass_begin), once
     * per leaf layer and module, in layer then module order, with a host array
     * G [out, out]; it returns BK_OK with *set = 1 after writing G (row-major
     * upper triangle, the layout grams delivers; the rest zero), *set = 0 to
     * start from zero. The Grams then delivered to grams include them. */
    bk_status (*grams_start)(void *user, int layer, bk_module mod, double *G, int *set);
    /* Optional (both flows): a micro-batch of pass `pass` (bk_bwd_pass_info.index)
     * went through the whole sweep; done of S sequences of this process are now
     * through it (progress within a pass; called after the backend's sync, so
     * the work is finished, not just queued). */
    void (*micro_done)(void *user, int pass, int64_t done, int64_t S);
} bk_bwd_flow_cb;

typedef struct bk_bwd_flow_stats {
    int passes;                    /* sweeps over the calibration set */
    int max_depth;
    int64_t layer_forwards;        /* layer forward passes over the whole calibration set */
    int64_t layer_backwards;       /* (each counts once per layer per sweep) */
    uint64_t peak_boundary_bytes;  /* boundary activations + gradients alive at once */
    uint64_t micro_bytes;          /* per-micro-batch working memory of the flow */
    /* GPU: the layers whose weights fit on the device at once, and how often
     * a layer's weights were asked for and uploaded (0 on the CPU) */
    int resident_layers;
    int64_t weight_requests, weight_uploads;
    double time_forward_s, time_backward_s, time_head_s;
} bk_bwd_flow_stats;

/* The flow's schedule, known in advance from the layer count, the leaf size
 * and the flow (not the data, not the micro-batching): one entry per pass, in
 * the order the passes run (index = bk_bwd_pass_info.index), with the same
 * depth, lo, hi and leaf as the pass's bk_bwd_pass_info and the work of its
 * sweep over the calibration set, counted as bk_bwd_flow_stats counts it:
 * summed over the schedule, layer_forwards and layer_backwards equal the
 * stats of a completed run. For progress and ETA (docs/hessians.md). */
typedef struct bk_bwd_pass_work {
    int depth, lo, hi, leaf;     /* as bk_bwd_pass_info */
    int forwards;                /* layer forwards before the backward (the sweep's forward part) */
    int backwards;               /* layer backwards; each also recomputes the layer's forward */
    int head;                    /* 1: the sweep runs the final norm, LM head and loss */
    int layer_forwards;          /* forwards + backwards (bk_bwd_flow_stats.layer_forwards) */
} bk_bwd_pass_work;

/* Fills out[0 .. min(n, cap)) and returns n, the number of passes (cap 0,
 * out NULL: only counts); -1 for bad arguments (n_layers < 1, leaf < 1, an
 * unknown flow). */
int bk_bwd_flow_schedule(int n_layers, int leaf, bk_bwd_flow_kind flow, int units,
                         bk_bwd_pass_work *out, int cap);

/* Run the flow over the calibration tokens [S, T] of model m (its original,
 * full-precision weights). The gradients are those of the original model;
 * what the caller does in leaf_done (quantizing) does not change them. */
bk_status bk_bwd_flow_run(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                          const bk_bwd_flow_opts *o, const bk_bwd_flow_cb *cb,
                          bk_bwd_flow_stats *stats);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_BACKWARD_H */
