/* bakron — native forward pass of decoder-only Llama / Mistral / Qwen2 / Qwen3
 * models on the CPU (F32 compute with BLAS, weights BF16/F16/F32 converted per
 * layer).
 *
 * Activations are batches of S sequences of T tokens stored as N = S*T rows,
 * sequence-major (row s*T + t is token t of sequence s, at position t).
 * The driver streams layers: it keeps the residual stream of all calibration
 * (or evaluation) sequences and runs one layer at a time over micro-batches,
 * so only one layer's weights are resident.
 */
#ifndef BAKRON_FORWARD_H
#define BAKRON_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/model.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One decoder layer's weights as F32 (native quantized folders are
 * dequantized). Every pointer is owned by the struct, but wb.
 * wb: set only by the layer driver's BF16 read for the GPU stages
 * (src/layer_driver.h; bk_layer_weights_load leaves it NULL): matrix i is
 * then BF16 [out, in] inside the mapped checkpoint (not owned) and w[i] is
 * NULL; biases and norms stay F32. */
typedef struct bk_layer_weights {
    int layer;
    float *w[BK_MOD_COUNT];  /* [out, in] row-major */
    const uint16_t *wb[BK_MOD_COUNT]; /* see above; NULL for every F32 load */
    float *b[BK_MOD_COUNT];  /* bias [out] or NULL */
    float *attn_norm;        /* input_layernorm.weight [hidden] */
    float *mlp_norm;         /* post_attention_layernorm.weight [hidden] */
    float *q_norm, *k_norm;  /* self_attn.{q,k}_norm.weight [head_dim] (Qwen3) or NULL */
} bk_layer_weights;

bk_status bk_layer_weights_load(const bk_model *m, int layer, bk_layer_weights *lw);
void bk_layer_weights_free(bk_layer_weights *lw);

/* One decoder layer's weights for the GPU backward's bf16 mode
 * (cuda/backward.cu): the matrices in BF16, biases and norms in F32 (owned).
 * A matrix stored as BF16 [out, in] in an unquantized checkpoint points into
 * the mapped file (no host copy; own[i] NULL); any other is loaded as F32
 * and rounded into own[i] by bk_f32_to_bf16_rn_dev (the device's rounding).
 * Every matrix is checked finite, as bk_layer_weights_load does. */
typedef struct bk_layer_weights_bf16 {
    int layer;
    const uint16_t *w[BK_MOD_COUNT]; /* [out, in] BF16 */
    uint16_t *own[BK_MOD_COUNT];     /* w[i]'s copy, or NULL when w[i] is mapped */
    float *b[BK_MOD_COUNT];
    float *attn_norm, *mlp_norm, *q_norm, *k_norm;
    uint64_t host_bytes; /* heap bytes the struct owns: copies, biases, norms */
} bk_layer_weights_bf16;

bk_status bk_layer_weights_bf16_load(const bk_model *m, int layer, bk_layer_weights_bf16 *lw);
void bk_layer_weights_bf16_free(bk_layer_weights_bf16 *lw);
/* 1 when every layer's every matrix is BF16 in the mapped checkpoint (the
 * bf16 load then copies no matrix), else 0 */
int bk_model_linears_mapped_bf16(const bk_model *m);

/* Forward context: config, RoPE tables for positions < seqlen, scratch
 * buffers for micro-batches of up to max_seqs sequences. */
typedef struct bk_fwd bk_fwd;

bk_status bk_fwd_create(const bk_model_config *cfg, int64_t max_seqs, int64_t seqlen,
                        bk_fwd **out);
/* Sequences per micro-batch on the CPU when the caller leaves it to bakron
 * (quantize, dump-activations, eval): one micro-batch's widest activations
 * and attention scores around 64 MiB; between 1 and min(64, S) (S <= 0: no
 * bound by S). */
int64_t bk_fwd_auto_batch(const bk_model_config *cfg, int64_t S, int64_t T);
void bk_fwd_free(bk_fwd *f);

/* ---- stages (S sequences of the context's seqlen T; N = S*T rows) ---- */

/* h[N, hidden] = embed_tokens[tokens]. Token ids outside [0, vocab) ->
 * BK_ERR_CALIB naming the sequence, position and value. */
bk_status bk_fwd_embed(bk_fwd *f, const bk_model *m, const int32_t *tokens, int64_t S, float *h);

/* x = RMSNorm(h) with input_layernorm (the input of q/k/v). */
bk_status bk_fwd_attn_in(bk_fwd *f, const bk_layer_weights *lw, const float *h, int64_t S,
                         float *x);

/* q/k/v projections (+biases), q_norm/k_norm (Qwen3), RoPE, causal
 * grouped-query softmax attention. o_in [N, heads*head_dim] is the input of
 * o_proj. Optional outputs (NULL to skip): q_rot [N, heads*head_dim] and
 * k_rot [N, kv_heads*head_dim] after normalization and RoPE, v [N, kv_heads*head_dim]. */
bk_status bk_fwd_attention(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                           float *o_in, float *q_rot, float *k_rot, float *v);

/* h += o_proj(o_in) (+bias). */
bk_status bk_fwd_attn_out(bk_fwd *f, const bk_layer_weights *lw, const float *o_in, int64_t S,
                          float *h);

/* x = RMSNorm(h) with post_attention_layernorm (the input of gate/up). */
bk_status bk_fwd_mlp_in(bk_fwd *f, const bk_layer_weights *lw, const float *h, int64_t S,
                        float *x);

/* down_in [N, intermediate] = silu(gate_proj(x)) * up_proj(x). Optional
 * gate_pre / up_pre [N, intermediate]: the projections before the product. */
bk_status bk_fwd_mlp_hidden(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                            float *down_in, float *gate_pre, float *up_pre);

/* h += down_proj(down_in) (+bias). */
bk_status bk_fwd_mlp_out(bk_fwd *f, const bk_layer_weights *lw, const float *down_in, int64_t S,
                         float *h);

/* Optional captures of one layer's linear-module inputs (NULL to skip). */
typedef struct bk_layer_taps {
    float *attn_in;  /* [N, hidden] */
    float *o_in;     /* [N, heads*head_dim] */
    float *mlp_in;   /* [N, hidden] */
    float *down_in;  /* [N, intermediate] */
    float *q_rot;    /* [N, heads*head_dim] after q_norm and RoPE */
    float *k_rot;    /* [N, kv_heads*head_dim] after k_norm and RoPE */
} bk_layer_taps;

/* The whole decoder layer on h [N, hidden] in place. */
bk_status bk_fwd_layer(bk_fwd *f, const bk_layer_weights *lw, int64_t S, float *h,
                       const bk_layer_taps *taps);

/* Final norm + LM head (lm_head, or embed_tokens when tied):
 * logits [N, vocab]. */
bk_status bk_fwd_logits(bk_fwd *f, const bk_model *m, const float *h, int64_t S, float *logits);

/* Sum of next-token negative log-likelihoods over positions 1..T-1 of the S
 * sequences given final hidden states h (before the final norm); adds to
 * *nll_sum (nats) and *count. Does not materialize more than one
 * micro-batch of logits. */
bk_status bk_fwd_nll(bk_fwd *f, const bk_model *m, const float *h, const int32_t *tokens,
                     int64_t S, double *nll_sum, int64_t *count);

/* ---- whole model ---- */

/* Perplexity of a model on token sequences [S, T]: layer-streamed
 * (all hidden states resident, one layer's weights at a time), micro-batches
 * of `batch` sequences (0 = automatic). ppl = exp(nll_sum / count). */
bk_status bk_model_nll(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                       int64_t batch, double *nll_sum, int64_t *count);

/* Logits of a model on token sequences [S, T] -> logits [S*T, vocab]
 * (for tests and small inputs). */
bk_status bk_model_logits(const bk_model *m, const int32_t *tokens, int64_t S, int64_t T,
                          float *logits);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_FORWARD_H */
