/* Internal pieces of the forward pass shared by the CPU (src/forward.c) and
 * GPU (cuda/forward.cu) implementations. */
#ifndef BK_FORWARD_INTERNAL_H
#define BK_FORWARD_INTERNAL_H

#include <stdint.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The sizes of a micro-batch context of the forward or backward pass (the
 * CPU's bk_fwd and bk_bwd, the GPU's bk_gfwd and the GPU backward's), derived
 * from the configuration in one place. */
typedef struct bk_dims {
    int64_t max_seqs, T, rows; /* sequences, tokens each, rows = max_seqs * T */
    int64_t hidden, nh, nkv, hd, inter, qdim, kvdim, rep, vocab;
} bk_dims;
/* Fill d from c for max_seqs sequences of seqlen tokens (the product checked
 * by the caller). */
void bk__dims_set(bk_dims *d, const bk_model_config *c, int64_t max_seqs, int64_t seqlen);

/* The checks the operations of a forward context (CPU and GPU) begin with;
 * who ("forward", "GPU forward") and what (the operation) name it in the
 * messages. check_batch: d NULL is a NULL context, S within 1..max_seqs;
 * check_call: check_batch, m's sizes those of the context, and (tokens not
 * NULL) every id of the S sequences in the vocabulary. */
bk_status bk__fwd_check_batch(const bk_dims *d, int64_t S, const char *who, const char *what);
bk_status bk__fwd_check_call(const bk_dims *d, const bk_model *m, const int32_t *tokens,
                             int64_t S, const char *who, const char *what);
/* The embedding's checks: check_call, and *t the model's embed_tokens.weight
 * [vocab, hidden]. */
bk_status bk__fwd_check_embed(const bk_dims *d, const bk_model *m, const int32_t *tokens,
                              int64_t S, const char *who, const bk_tensor_info **t);
/* The NLL's checks: check_call; *predict = 0 when the sequences predict
 * nothing (fewer than 2 tokens). */
bk_status bk__fwd_check_nll(const bk_dims *d, const bk_model *m, const int32_t *tokens, int64_t S,
                            const char *who, int *predict);
/* A 2-D [rows, cols] tensor of the model (top level) whose dtype converts
 * (to F32 and F64); why (may be NULL) says in the missing tensor's error
 * what needs it. bk__fwd_find_matrix: why NULL. */
bk_status bk__fwd_find_matrix_for(const bk_model *m, const char *suffix, int64_t rows,
                                  int64_t cols, const char *why, const bk_tensor_info **out);
bk_status bk__fwd_find_matrix(const bk_model *m, const char *suffix, int64_t rows, int64_t cols,
                              const bk_tensor_info **out);
/* Rows [r0, r1) of a tensor found by bk__fwd_find_matrix, converted to dt
 * (F32 or F64) into dst. */
bk_status bk__fwd_matrix_rows(const bk_tensor_info *t, int64_t r0, int64_t r1, void *dst,
                              bk_dtype dt);
/* The embedding rows of tokens [N] (t: embed_tokens.weight) into h [N,
 * hidden] of dtype dt (F32 or F64). */
bk_status bk__fwd_embed_rows(const bk_tensor_info *t, const int32_t *tokens, int64_t N, void *h,
                             bk_dtype dt);
/* Vocabulary rows per block of the head so that [rows, vc] logits and
 * [vc, hidden] weights each stay within their block size. */
int64_t bk__fwd_vocab_block(const bk_dims *d, int64_t rows);

/* Only the rotated queries and keys of bk_fwd_attention (q_rot, k_rot both
 * required): the same operations, without v_proj, scores, softmax or the
 * output, so the same bits as its q_rot / k_rot; the non-finite checks of the
 * q/k side only (q_proj, k_proj outputs and the rotated queries and keys).
 * The fully-local Hessians' stage QKV (src/backend_cpu_stages.c; the GPU's
 * bk_gfwd_qk_rot, src/pipeline_gpu.h). */
bk_status bk__fwd_qk_rot(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                         float *q_rot, float *k_rot);

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

/* The end of an NLL over S sequences of T tokens (rows r = s*T + t; the
 * last position of each sequence predicts nothing): per row the online
 * log-sum-exp se[r] (with the running max mx[r]) and the target's logit
 * tgt[r]; log(se) + mx - tgt summed in row order into *nll_sum, S*(T-1)
 * added to *count. A non-finite term: BK_ERR_NONFINITE naming its place,
 * nothing added. (src/forward.c; the GPU's NLL ends here too.) */
bk_status bk_fwd_nll_rows(const double *se, const float *mx, const float *tgt, int64_t S,
                          int64_t T, double *nll_sum, int64_t *count);

/* Layer `layer` for the GPU stages' upload (the layer driver's BF16 read):
 * when every matrix of the layer is BF16 in the mapped checkpoint, lw->wb[i]
 * point into the mapping (w[i] NULL), each matrix checked finite on its BF16
 * elements (which also faults its pages in), biases and norms loaded as F32
 * as bk_layer_weights_load does; otherwise exactly bk_layer_weights_load.
 * Free with bk_layer_weights_free. */
bk_status bk__layer_weights_load_mapped_bf16(const bk_model *m, int layer, bk_layer_weights *lw);
/* Every BF16 matrix of lw (wb[i]) as an owned F32 copy in w[i] (exact), wb[i]
 * then NULL: lw becomes what bk_layer_weights_load gives. */
bk_status bk__layer_weights_widen(const bk_model_config *c, bk_layer_weights *lw);

#ifdef __cplusplus
}
#endif
#endif
