/* Internal pieces of the forward pass shared by the CPU (src/forward.c) and
 * GPU (cuda/forward.cu) implementations. */
#ifndef BK_FORWARD_INTERNAL_H
#define BK_FORWARD_INTERNAL_H

#include <stdint.h>

#include "bakron/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Token sequences [S, T] for a whole-model run: at least one sequence of at
 * least min_T tokens, T within max_position_embeddings, every id in
 * [0, vocab). BK_ERR_CALIB naming the sequence and position otherwise. */
bk_status bk_fwd_check_sequences(const bk_model_config *c, const int32_t *tokens, int64_t S,
                                 int64_t T, int64_t min_T);

/* ------------------------------------------------ non-finite activations
 * A NaN/Inf produced by the float32 forward pass (typically a weight near the
 * float range's end, e.g. at the BF16 maximum) is reported by both forward
 * passes with the same line: the layer, the first operation (in the order the
 * pass runs them) whose output holds a non-finite value, where, and the
 * largest-magnitude weight feeding that operation. The CPU checks each output
 * as it is made; the GPU marks a device flag per operation inside the kernels
 * that read or write the output and names the first one after the stage. */
typedef enum bk_fwd_site {
    BK_FS_ATTN_IN = 0, /* input_layernorm output [N, hidden] */
    BK_FS_Q,           /* q_proj output (bias included) [N, q width] */
    BK_FS_K,
    BK_FS_V,
    BK_FS_QROT,        /* queries after q_norm and RoPE [N, q width] */
    BK_FS_KROT,
    BK_FS_O_IN,        /* attention output = o_proj input [N, q width] */
    BK_FS_O_OUT,       /* o_proj output (bias included) [N, hidden] */
    BK_FS_RESID_ATTN,  /* residual stream after attention */
    BK_FS_MLP_IN,      /* post_attention_layernorm output */
    BK_FS_GATE,        /* gate_proj output [N, intermediate] */
    BK_FS_UP,
    BK_FS_DOWN_IN,     /* silu(gate) * up */
    BK_FS_DOWN_OUT,    /* down_proj output (bias included) [N, hidden] */
    BK_FS_RESID_MLP,   /* residual stream after the MLP */
    BK_FS_COUNT
} bk_fwd_site;

/* A weight of the layer: a module's weight or bias, or a norm's weight. */
typedef enum bk_fwd_wkind {
    BK_FW_WEIGHT = 0,
    BK_FW_BIAS,
    BK_FW_ATTN_NORM,
    BK_FW_MLP_NORM,
    BK_FW_Q_NORM,
    BK_FW_K_NORM
} bk_fwd_wkind;
typedef struct bk_fwd_wref {
    bk_fwd_wkind kind;
    bk_module mod; /* BK_FW_WEIGHT / BK_FW_BIAS */
} bk_fwd_wref;

/* "q_proj output", "residual stream after the MLP", ... */
const char *bk_fwd_site_name(bk_fwd_site s);
/* Columns of the site's output [N, width] under c. */
int64_t bk_fwd_site_width(const bk_model_config *c, bk_fwd_site s);
/* Host values of a weight (n elements; NULL when the layer has none, e.g. no
 * bias): the caller's view of its layer (CPU: the host weights; GPU: a
 * download of the device copy). */
typedef const float *(*bk_fwd_wget)(void *ctx, bk_fwd_wref r, int64_t n);
/* BK_ERR_NONFINITE: "layer L OP: non-finite value V at row R, column C: the
 * float32 forward pass overflowed here; the largest weight feeding it is
 * model.layers.L.NAME = X (element E)" — the weights of the site read through
 * get (row and column within the site's output of the call). */
bk_status bk_fwd_nonfinite_error(const bk_model_config *c, int layer, bk_fwd_site site,
                                 float value, int64_t row, int64_t col, bk_fwd_wget get,
                                 void *ctx);

#ifdef __cplusplus
}
#endif
#endif
