/* bakron — model configuration (config.json) and checkpoint access for
 * decoder-only Llama / Mistral / Qwen2 / Qwen3 models.
 */
#ifndef BAKRON_MODEL_H
#define BAKRON_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/safetensors.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bk_arch {
    BK_ARCH_LLAMA = 0,   /* model_type "llama" (also Llama-3.x rope scaling) */
    BK_ARCH_MISTRAL,     /* model_type "mistral": a Llama without biases, own defaults */
    BK_ARCH_QWEN2,       /* "qwen2": biases on q/k/v */
    BK_ARCH_QWEN3        /* "qwen3": q_norm / k_norm, explicit head_dim */
} bk_arch;

typedef enum bk_rope_type {
    BK_ROPE_DEFAULT = 0,
    BK_ROPE_LINEAR,
    BK_ROPE_LLAMA3
} bk_rope_type;

typedef struct bk_model_config {
    bk_arch arch;
    char model_type[32];
    int64_t n_layers;
    int64_t hidden;         /* hidden_size */
    int64_t intermediate;   /* intermediate_size */
    int64_t n_heads;        /* num_attention_heads */
    int64_t n_kv_heads;     /* num_key_value_heads (defaults to n_heads) */
    int64_t head_dim;       /* explicit head_dim, else hidden / n_heads */
    int64_t vocab;
    int64_t max_positions;  /* max_position_embeddings */
    double rms_eps;
    /* RoPE */
    double rope_theta;
    bk_rope_type rope_type;
    double rope_factor;            /* linear, llama3 */
    double rope_low_freq_factor;   /* llama3 */
    double rope_high_freq_factor;  /* llama3 */
    int64_t rope_original_max_positions; /* llama3 */
    /* structure */
    int tie_embeddings;
    int qkv_bias;           /* Qwen2, or attention_bias=true */
    int o_bias;             /* attention_bias=true on Llama puts a bias on o_proj too */
    int mlp_bias;
    int qk_norm;            /* Qwen3 */
    char hidden_act[16];    /* "silu" is the only one supported */
    bk_dtype dtype;         /* "torch_dtype"/"dtype" of the checkpoint (informational) */
    int64_t bos_token_id;   /* -1 when absent */
    int64_t eos_token_id;   /* -1 when absent */
    int64_t sliding_window; /* Mistral-style sliding-window attention span, 0 = none
                               (full causal attention). The forward pass refuses
                               sequences longer than it. */
} bk_model_config;

/* Parse config.json text. `label` names the file in error messages.
 * Unsupported model_type -> BK_ERR_UNSUPPORTED listing the supported ones;
 * missing fields -> BK_ERR_CONFIG listing what is missing. Both the
 * transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`)
 * styles are accepted. */
bk_status bk_model_config_parse(const char *json, size_t len, const char *label,
                                bk_model_config *cfg);
bk_status bk_model_config_load(const char *path, bk_model_config *cfg);

/* Linear modules of one decoder layer, in the order they are quantized. */
typedef enum bk_module {
    BK_MOD_Q = 0,
    BK_MOD_K,
    BK_MOD_V,
    BK_MOD_O,
    BK_MOD_GATE,
    BK_MOD_UP,
    BK_MOD_DOWN,
    BK_MOD_COUNT
} bk_module;

/* "self_attn.q_proj", ..., "mlp.down_proj" */
const char *bk_module_name(bk_module m);
/* [out, in] of a module's weight under cfg. */
void bk_module_shape(const bk_model_config *cfg, bk_module m, int64_t *out_features,
                     int64_t *in_features);

/* Count of parameters implied by the config (embeddings counted once when tied). */
uint64_t bk_model_config_param_count(const bk_model_config *cfg);

/* ------------------------------------------------------------------ a model */

typedef struct bk_model bk_model;

/* Open a model folder (config.json + safetensors, single or sharded) and
 * cross-check every tensor the config implies (present, right shape, numeric
 * dtype) and that no unexpected linear weight is present. Also opens folders
 * written by `bakron quantize --export native` (quantization_config with
 * quant_method "bakron"), whose linear weights are stored as codes + scales,
 * and GPTQ v1 checkpoints (quant_method "gptq", `--export gptq`: packed I32
 * qweight/qzeros, scales, g_idx). */
bk_status bk_model_open(const char *dir, bk_model **out);
void bk_model_close(bk_model *m);

const bk_model_config *bk_model_get_config(const bk_model *m);
const bk_st_set *bk_model_tensors(const bk_model *m);
const char *bk_model_dir(const bk_model *m);
/* Non-zero when the linear weights are stored quantized (a native or GPTQ v1
 * export; read back dequantized by bk_model_linear_f32). */
int bk_model_is_quantized(const bk_model *m);
/* "bakron native", "GPTQ v1", or NULL when not quantized. */
const char *bk_model_quant_format(const bk_model *m);

/* Tensor "model.layers.{layer}.{suffix}" (layer < 0: "model.{suffix}" or the
 * bare name, e.g. "lm_head.weight"); NULL when absent. */
const bk_tensor_info *bk_model_find(const bk_model *m, int layer, const char *suffix);

/* A linear module's weight [out, in] as float, dequantizing native codes
 * (a code outside the alphabet is an error naming the tensor). */
bk_status bk_model_linear_f32(const bk_model *m, int layer, bk_module mod, float *dst);
/* The same weight's BF16 [out, in] elements in the mapped checkpoint when it
 * is stored so there (unquantized, dtype BF16, that shape), else NULL (no
 * error set). Valid while the model is open. */
const uint16_t *bk_model_linear_bf16_mapped(const bk_model *m, int layer, bk_module mod);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_MODEL_H */
