/* Resuming an interrupted quantization (internal; docs/formats.md "Work
 * folder and journal", README --resume).
 *
 * Every quantize run (except the backprop kinds) keeps, in WORK/.resume/:
 *   run.json              what the run was made from: its arguments, the
 *                         model's files (config.json digest, each safetensors
 *                         file's size and mtime) and the calibration (digest
 *                         of the token ids used, or the activation files'
 *                         sizes and mtimes);
 *   journal               one line per finished layer, appended and fsync'ed
 *                         after the layer's tensors are durably in the shards:
 *                         {"layer":L,"digest":"<16 hex>","files":[modules with a
 *                         module file],"modules":[report entries]};
 *   L<layer>.<module>.safetensors
 *                         the module's codes and scales (token calibration,
 *                         sequential): the quantized weights the forward pass
 *                         through finished layers needs on resume; only for a
 *                         module whose codes the shards do not hold exactly
 *                         (--export gptq or dequantized; native: none unless the
 *                         rebuilt weights were not the solver's), the others are
 *                         read back from the shards.
 * The shards are built as NAME.partial (bk_st_stream_begin_resumable).
 *
 * A later run with --resume adopts the work folder (outdir.c), checks run.json
 * against its own (a difference is refused), keeps the journaled layers whose
 * digest still matches the shards, and continues with the first other layer.
 */
#ifndef BK_RESUME_H
#define BK_RESUME_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/pipeline.h"
#include "bakron/safetensors.h"
#include "bakron/solver.h"

typedef struct bk_resume bk_resume;

/* outdir hook: whether a leftover work folder holds a resumable run. */
int bk_resume_is_resumable(void *user, const char *work_dir);

/* What the run is made from (run.json minus the version line): arguments,
 * model files, calibration. tokens: the token ids used (S*T), or NULL. */
typedef struct bk_resume_source {
    const bk_quantize_opts *o;
    const char *backend;  /* resolved backend name */
    const char *stages;   /* the stages' backend name (bk_stage_ops.name) */
    const char *gpu_math; /* resolved GEMM arithmetic */
    int64_t S, T, batch;
    int layer_begin, layer_end;
    int leaf;             /* backprop kinds: the flow's leaf size as run (--leaf-size, or
                             the one chosen for the default 0), not o->leaf_size */
    const int32_t *tokens;
} bk_resume_source;

/* Open the run's resume state in work_dir. adopted: the folder is a killed
 * run's (--resume): its run.json must equal ours, else BK_ERR_USAGE (an
 * argument differs: exit 1), BK_ERR_INVALID_ARG (a model file differs: exit 2)
 * or BK_ERR_CALIB (the calibration differs: exit 2), one line naming it. Not adopted: fresh state.
 * need_weights: save each module's codes and scales (the rebuild needs them). */
bk_status bk_resume_open(const char *work_dir, int adopted, const bk_resume_source *src,
                         int need_weights, bk_resume **out);
void bk_resume_free(bk_resume *r);

/* After the shards are open (reused: bk_st_stream_open_files) and the
 * pass-through tensors written: the journaled layers whose digest matches the
 * shards, counted as written; *next = the first layer to process
 * (layer_begin when nothing is kept). report_modules gets their report
 * entries, *params their parameter count. note(user, msg) tells what was
 * kept or dropped. */
bk_status bk_resume_restore(bk_resume *r, bk_st_stream *out, int reused, cJSON *report_modules,
                            int64_t *params, int *next, void (*note)(void *, const char *),
                            void *user);

/* Module mod of layer l was written to the stream (writer thread): keep its
 * codes and scales when need_weights, in a module file unless the stream's
 * native export holds them exactly and they rebuild the solver's weights. */
bk_status bk_resume_save_module(bk_resume *r, const bk_quant_spec *q, int layer, bk_module mod,
                                const bk_solve_result *res);

/* Layer l is complete in the stream: fsync the shards, append its journal line
 * (entries: its report entries as a JSON array text). */
bk_status bk_resume_layer_done(bk_resume *r, bk_st_stream *out, int layer, const char *entries);

/* The quantized weights of finished layer l (from its module files, or from
 * the shards' qweight/scales/qzeros for the modules without one) replace lw's
 * linear weights. */
bk_status bk_resume_load_weights(bk_resume *r, const bk_quant_spec *q, const bk_model_config *cfg,
                                 int layer, bk_layer_weights *lw);

/* The dequantized weights of codes and scales as the solvers compute them:
 * levels c*s, uniform s*(c - z) (z = 2^(bits-1) when zeros is NULL), in float. */
void bk_resume_dequantize(const bk_quant_spec *q, const int16_t *codes, const float *scales,
                          const float *zeros, int64_t m, int64_t n, int64_t groups, float *w);

/* The run is complete: remove WORK/.resume (before the commit). */
bk_status bk_resume_finish(bk_resume *r);

/* Layers journaled so far. */
int bk_resume_layers_done(const bk_resume *r);

#endif /* BK_RESUME_H */
