/* Internal pieces of the quantization job (src/pipeline*.c, src/activations.c). */
#ifndef BK_PIPELINE_INTERNAL_H
#define BK_PIPELINE_INTERNAL_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "bakron/backend.h"
#include "bakron/model.h"
#include "bakron/pipeline.h"
#include "bakron/safetensors.h"
#include "bakron/solver.h"

#include "stop.h"

/* A NOTE event with msg to on_event (nothing when NULL). */
static inline void bk__note_event(bk_event_fn on_event, void *user, const char *msg)
{
    if (!on_event)
        return;
    const bk_event ev = {.kind = BK_EV_NOTE, .message = msg};
    on_event(user, &ev);
}

/* "model.layers.N.<module>.weight" -> layer, module. */
int bk__parse_linear_name(const char *name, int *layer, bk_module *mod);

/* Export (src/pipeline_export.c). */
/* Bits of the GPTQ export for a quantizer: levels l -> smallest b with
 * 2^(b-1) - 1 >= l; uniform -> its bits. */
int bk__gptq_bits(const bk_quant_spec *q);
bk_status bk__check_export(const bk_quantize_opts *o, const bk_model_config *cfg);
bk_status bk__declare_quantized(bk_st_stream *s, const bk_quantize_opts *o,
                                const bk_model_config *cfg, const char *weight_name,
                                bk_module mod);
bk_status bk__write_module(bk_st_stream *s, const bk_quantize_opts *o, const bk_model_config *cfg,
                           const bk_model *model, int layer, bk_module mod,
                           const bk_solve_result *r);
cJSON *bk__quantization_config(const bk_quantize_opts *o, const bk_model_config *cfg, int64_t S,
                               int64_t T, int layer_begin, int layer_end);
bk_status bk__copy_aux_files(const char *model_dir, const char *out_dir);
/* README.md of an output folder: a short model card made from its config.json
 * object (quantization_config or bakron_dequantized_from: method, settings,
 * calibration), deterministic (no times, no folders). The source model's
 * README.md is not copied (bk__copy_aux_files skips it). `bakron eval`
 * records measured perplexities in it (BK_MODEL_CARD_MARK, "## Measured
 * perplexity"). */
#define BK_MODEL_CARD_MARK "<!-- bakron model card -->"
bk_status bk__write_model_card(const char *out_dir, const cJSON *config);
/* RTN without calibration data: quantize one layer's modules. */
bk_status bk__layer_rtn(bk_model *model, bk_backend *be, bk_st_stream *out,
                        const bk_quantize_opts *o, const bk_model_config *cfg, int layer,
                        cJSON *report, int64_t *params);

/* bakron merge (src/merge.c): the merged output of the part folders dirs[n]
 * written into the folder work (which exists). */
bk_status bk__merge_into(const char *const *dirs, int n, const char *work,
                         uint64_t max_shard_bytes);
/* MPI ranks with --activations (or rtn without calibration): every rank
 * quantizes a contiguous layer range into a part folder inside rank 0's work
 * folder, rank 0 merges them (src/merge.c). */
bk_status bk__quantize_layer_ranks(const bk_quantize_opts *o);

/* Activation dumps (src/activations.c). */
typedef struct bk_act_reader bk_act_reader;
typedef struct bk_act_layer {
    bk_st_file *file;
    const bk_tensor_info *t[4]; /* attn_in, o_in, mlp_in, down_in */
} bk_act_layer;

/* Open and check a dump for `model` (docs/activations.md "Checks"): the
 * manifest, every layer file's header (layer index, tensor names, dtypes and
 * shapes, model and calibration digests). *note: a line for the user or NULL. */
bk_status bk__act_open(const char *dir, const bk_model *model, int64_t samples,
                       bk_act_reader **out, int64_t *S, int64_t *T, const char **note);
void bk__act_close(bk_act_reader *r);
bk_status bk__act_layer_open(bk_act_reader *r, int layer, bk_act_layer *al);
void bk__act_layer_close(bk_act_layer *al);
/* Rows [r0, r0+nr) of tensor `name` ("attn_in", ...) as F32 into dst [nr, width]. */
bk_status bk__act_rows(const bk_act_layer *al, const char *name, int64_t r0, int64_t nr,
                       int64_t width, float *dst);

/* Identity digests (src/digest.c): SHA-256 of config.json's bytes, and of every
 * tensor's name, dtype, shape and a sample of its bytes (docs/activations.md);
 * of the calibration tokens [S, T] actually used. 64 hex digits + NUL. */
bk_status bk__model_digest(const bk_model *m, char config_hex[65], char weights_hex[65]);
void bk__calib_digest(const int32_t *tokens, int64_t S, int64_t T, char hex[65]);

/* The codes of one P.qweight tensor t (of m's checkpoint, or the same tensor
 * mapped elsewhere) against m's native alphabet (src/model.c; BK_OK for
 * models that are not native exports). Used by merge as it copies codes. */
bk_status bk__model_check_qweight(const bk_model *m, const bk_tensor_info *t);

#endif
