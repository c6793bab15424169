/* The checks of a quantize job before any work, and its plan (--dry-run):
 * bk_quantize_check (bakron/pipeline.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bakron/pipeline.h"
#include "outdir.h"
#include "pipeline_internal.h"
#include "util.h"

typedef struct checker {
    bk_check_fn report;
    void *user;
    bk_status first;
} checker;

static void failed(checker *c, bk_status st)
{
    if (st == BK_OK)
        return;
    if (c->first == BK_OK)
        c->first = st;
    if (c->report)
        c->report(c->user, st);
}

/* Estimated bytes of one quantized module [m, n] in the output. */
static uint64_t module_out_bytes(const bk_quantize_opts *o, int64_t m, int64_t n, uint64_t orig)
{
    const bk_quant_spec *q = &o->solve.quant;
    int64_t g = (q->kind == BK_Q_UNIFORM && q->group > 0) ? (n + q->group - 1) / q->group : 1;
    switch (o->export_format) {
    case BK_EXPORT_DEQUANTIZED: return orig;
    case BK_EXPORT_GPTQ: {
        int b = bk__gptq_bits(q);
        return (uint64_t)(n * b / 32 * m) * 4 + (uint64_t)(g * m * b / 32) * 4 +
               (uint64_t)(g * m) * 2 + (uint64_t)n * 4;
    }
    case BK_EXPORT_NATIVE:
    default:
        return (uint64_t)(m * n) + (uint64_t)(g * m) * 4 * (q->asym ? 2 : 1);
    }
}

/* config.json as the output will re-read it (write_config_and_report):
 * the same size limit as the model reader, parsed as one JSON object. */
static bk_status check_config_reread(const char *model_dir)
{
    char path[4096];
    char *text = NULL;
    size_t len = 0;
    bk_status st = bk_path_join(path, sizeof path, model_dir, "config.json");
    if (st == BK_OK)
        st = bk_read_file(path, BK_CONFIG_MAX_BYTES, &text, &len);
    if (st != BK_OK)
        return st;
    if (memchr(text, '\0', len)) {
        size_t at = (size_t)((const char *)memchr(text, '\0', len) - text);
        free(text);
        return bk_error(BK_ERR_CONFIG, "%s: a NUL byte at offset %zu (JSON text has none)", path,
                        at);
    }
    cJSON *j = cJSON_Parse(text);
    free(text);
    int ok = cJSON_IsObject(j);
    cJSON_Delete(j);
    if (!ok)
        return bk_error(BK_ERR_CONFIG, "%s: not a JSON object", path);
    return BK_OK;
}

static void estimate_memory(const bk_quantize_opts *o, bk_quantize_plan *p)
{
    const bk_model_config *c = &p->cfg;
    const int64_t qd = c->n_heads * c->head_dim;
    const uint64_t N = (uint64_t)(p->S * p->T);
    uint64_t acts = 0, hess = 0, layer = 0, solve = 0;
    if (N > 0) {
        /* residual stream, attention outputs, down_proj inputs */
        acts = N * (uint64_t)(c->hidden + qd + c->intermediate) * 4;
        /* input factors: attention in, o in, mlp in, down in */
        uint64_t a = (uint64_t)(2 * c->hidden * c->hidden + qd * qd +
                                c->intermediate * c->intermediate);
        uint64_t b = 0;
        for (int m = 0; m < BK_MOD_COUNT; m++)
            if (p->modules[m].two_sided)
                b += (uint64_t)(p->modules[m].rows * p->modules[m].rows);
        hess = (a + b) * (o->hessian_fp64 ? 8 : 4);
    }
    uint64_t mx = 0, mxf = 0;
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        uint64_t e = (uint64_t)(p->modules[m].rows * p->modules[m].cols);
        uint64_t f = (uint64_t)(p->modules[m].rows > p->modules[m].cols ? p->modules[m].rows
                                                                         : p->modules[m].cols);
        layer += e * 4;
        if (e > mx)
            mx = e;
        if (f * f > mxf)
            mxf = f * f;
    }
    /* the layer being quantized (original + working copy) and the prefetched
     * next one; the solver's weight, codes and error buffers and factors */
    layer *= 3;
    solve = mx * 4 * 4 + mxf * 4 * 2 * (o->solve.precision == BK_PREC_FP64 ? 2 : 1);
    p->host_bytes = acts + hess + layer + solve;
}

bk_status bk_quantize_check(const bk_quantize_opts *o, bk_quantize_plan *plan,
                            bk_check_fn report, void *user)
{
    checker ck = {report, user, BK_OK}, *c = &ck;
    bk_quantize_plan local, *p = plan ? plan : &local;
    memset(p, 0, sizeof *p);

    /* ------------------------------------------------- options alone */
    if (!o->model_dir || !o->model_dir[0])
        failed(c, bk_error(BK_ERR_USAGE, "MODEL_DIR is required"));
    if (!o->out_dir)
        failed(c, bk_error(BK_ERR_USAGE, "--out OUT_DIR is required"));
    else if (!o->out_dir[0])
        failed(c, bk_error(BK_ERR_USAGE, "--out: empty path"));
    const int bp = bk_hessian_is_backprop(o->hessian);
    if (!!o->calib_path + !!o->calib_text + !!o->activations_dir > 1)
        failed(c, bk_error(BK_ERR_USAGE,
                           "give one of --calib-text, --calib or --activations, not several"));
    if (!o->calib_path && !o->calib_text && !o->activations_dir && o->hessian != BK_HESS_RTN)
        failed(c, bk_error(BK_ERR_USAGE,
                           "--hessian %s needs calibration data (--calib-text TEXT, --calib "
                           "TOKENS or --activations DIR; only --hessian rtn runs without)",
                           bk_hessian_name(o->hessian)));
    else if (bp && o->activations_dir)
        failed(c, bk_error(BK_ERR_USAGE,
                           "--hessian %s needs calibration tokens (--calib-text or --calib), not "
                           "--activations: the backward pass runs the model",
                           bk_hessian_name(o->hessian)));
    if (bp && o->leaf_size < 0)
        failed(c, bk_error(BK_ERR_USAGE, "--leaf-size %d must be >= 1", o->leaf_size));
    if (bp && (o->bwd_boundaries < -1 || o->bwd_boundaries > 4096))
        failed(c, bk_error(BK_ERR_USAGE,
                           "--bwd-boundaries %d: expected auto (-1) or an integer in [0, 4096]",
                           o->bwd_boundaries));
    else if (bp && o->bwd_boundaries > 0 && o->bwd_flow == BK_FLOW_NAIVE)
        failed(c, bk_error(BK_ERR_USAGE,
                           "--bwd-boundaries %d and --bwd-flow naive contradict each other (the "
                           "naive flow holds no boundary matrices; the budget is the halving "
                           "flow's)",
                           o->bwd_boundaries));
    if (o->gpu_pipeline && o->cpu_stages)
        failed(c, bk_error(BK_ERR_USAGE, "--gpu-pipeline and --cpu-stages contradict each other"));
    if (o->gpu_pipeline && o->backend == BK_BACKEND_CPU)
        failed(c, bk_error(BK_ERR_USAGE,
                           "--gpu-pipeline and --backend cpu contradict each other (the GPU "
                           "pipeline needs --backend cuda or auto)"));
    if (o->gpu_pipeline && o->activations_dir && !o->calib_path && !o->calib_text)
        failed(c, bk_error(BK_ERR_USAGE,
                           "--gpu-pipeline needs token calibration (--calib-text or --calib), not "
                           "--activations"));
    const bk_quant_spec *q = &o->solve.quant;
    if (q->kind == BK_Q_INTEGER)
        failed(c, bk_error(BK_ERR_USAGE, "the unbounded integer alphabet cannot be exported"));
    if (q->kind == BK_Q_LEVELS && (q->levels < 1 || q->levels > 127))
        failed(c, bk_error(BK_ERR_USAGE, "--levels must be in [1, 127] to fit int8 codes"));
    const int gptq = o->export_format == BK_EXPORT_GPTQ;
    if (gptq) {
        int b = bk__gptq_bits(q);
        if (b != 2 && b != 3 && b != 4 && b != 8)
            failed(c, bk_error(BK_ERR_USAGE,
                               "--export gptq: %d bits (--levels %d) are not a GPTQ width (2, 3, "
                               "4, 8)",
                               b, q->levels));
        if (q->kind == BK_Q_UNIFORM && q->asym)
            failed(c, bk_error(BK_ERR_USAGE,
                               "--asym and --export gptq conflict: GPTQ v1 stores symmetric "
                               "grids only (it cannot store zero point 0)"));
    }

    /* ---------------------------------------------------------- model */
    bk_model *m = NULL;
    if (o->model_dir && o->model_dir[0]) {
        bk_status st = bk_model_open(o->model_dir, &m);
        if (st != BK_OK) {
            failed(c, st);
            m = NULL;
        }
    }
    if (m) {
        p->model_ok = 1;
        p->cfg = *bk_model_get_config(m);
        p->layers_total = (int)p->cfg.n_layers;
        const bk_tensor_info *t = bk_model_find(m, 0, "self_attn.q_proj.weight");
        p->model_dtype = t ? bk_dtype_name(t->dtype) : "?";
        p->input_bytes = bk_st_set_total_bytes(bk_model_tensors(m));
        /* the backward flow: on the GPU with the CUDA backend (auto: a GPU
         * present) and token calibration, unless --cpu-stages (as bk_quantize
         * decides with the backend made); --bwd-precision auto resolved from
         * the forward's GEMM arithmetic as the job will */
        if (bp) {
            const int cuda = o->backend == BK_BACKEND_CUDA ||
                             (o->backend == BK_BACKEND_AUTO && bk_cuda_device_count() > 0);
            p->bwd_gpu = cuda && bk_cuda_compiled() && !o->cpu_stages &&
                         (o->calib_path || o->calib_text) && !o->activations_dir;
            p->bwd_precision_auto = o->bwd_precision == BK_BWD_AUTO;
            p->bwd_precision = bk_bwd_precision_resolve(
                o->bwd_precision, p->bwd_gpu, bk_gemm_math_resolve(m, o->gemm_math));
        }
        if (bk_model_is_quantized(m))
            failed(c, bk_error(BK_ERR_UNSUPPORTED,
                               "%s: the model is already quantized (give the original checkpoint)",
                               o->model_dir));
        failed(c, check_config_reread(o->model_dir));
        const int L = p->layers_total;
        const int b = o->layer_begin < 0 ? 0 : o->layer_begin;
        const int e = o->layer_end <= 0 ? L : o->layer_end;
        if (b >= L || e > L)
            failed(c, bk_error(BK_ERR_USAGE,
                               "--layers %d:%d: the model has %d layers (numbered 0..%d); give a "
                               "range within 0:%d",
                               b, o->layer_end <= 0 ? L : o->layer_end, L, L - 1, L));
        else if (b >= e)
            failed(c, bk_error(BK_ERR_USAGE, "--layers %d:%d: empty range", b, e));
        p->layer_begin = b < L ? b : L;
        p->layer_end = e < L ? e : L;
        if (p->layer_end < p->layer_begin)
            p->layer_end = p->layer_begin;
        for (int k = 0; k < BK_MOD_COUNT; k++) {
            bk_module_shape(&p->cfg, (bk_module)k, &p->modules[k].rows, &p->modules[k].cols);
            p->modules[k].two_sided = bk_hessian_is_two_sided(o->hessian, (bk_module)k);
        }
        if (gptq) {
            char bad[512] = "";
            for (int k = 0; k < BK_MOD_COUNT; k++) {
                int64_t out = p->modules[k].rows, in = p->modules[k].cols;
                if (in % 32 || out % 32)
                    failed(c, bk_error(BK_ERR_USAGE,
                                       "--export gptq: %s is [%lld, %lld]; GPTQ packing needs "
                                       "both dimensions divisible by 32",
                                       bk_module_name((bk_module)k), (long long)out,
                                       (long long)in));
                else if (q->kind == BK_Q_UNIFORM && q->group > 0 && in % q->group) {
                    size_t l = strlen(bad);
                    snprintf(bad + l, sizeof bad - l, "%s%s (%lld)", l ? ", " : "",
                             bk_module_name((bk_module)k), (long long)in);
                }
            }
            if (bad[0])
                failed(c, bk_error(BK_ERR_USAGE,
                                   "--export gptq: --group %lld does not divide the input "
                                   "dimension of %s; GPTQ loaders need whole groups",
                                   (long long)q->group, bad));
        }
    }

    /* ---------------------------------------------------- calibration */
    if (o->calib_path && !o->activations_dir) {
        int32_t *tok = NULL;
        bk_status st = bk_load_tokens(o->calib_path, m ? p->cfg.vocab : INT64_MAX, o->samples,
                                      o->seqlen, &tok, &p->S, &p->T);
        free(tok);
        if (st != BK_OK)
            failed(c, st);
        else if (m && p->T > p->cfg.max_positions)
            failed(c, bk_error(BK_ERR_CALIB,
                               "%s: sequence length %lld exceeds the model's "
                               "max_position_embeddings %lld",
                               o->calib_path, (long long)p->T, (long long)p->cfg.max_positions));
    } else if (o->calib_text && !o->calib_path && !o->activations_dir && m) {
        /* tokenized here and again by the job (~1 s per few MB of text) */
        int32_t *tok = NULL;
        int64_t T = o->seqlen > 0 ? o->seqlen : bk_text_default_seqlen(p->cfg.max_positions);
        if (p->cfg.max_positions > 0 && T > p->cfg.max_positions)
            failed(c, bk_error(BK_ERR_CALIB,
                               "--seqlen %lld exceeds the model's max_position_embeddings %lld",
                               (long long)T, (long long)p->cfg.max_positions));
        else
            failed(c, bk_load_text_tokens(o->model_dir, o->calib_text, p->cfg.vocab,
                                          p->cfg.bos_token_id, o->samples, T, &tok, &p->S,
                                          &p->T));
        free(tok);
    } else if (o->activations_dir && !o->calib_path && m && !bp) {
        bk_act_reader *r = NULL;
        const char *note = NULL;
        bk_status st = bk__act_open(o->activations_dir, m, o->samples, &r, &p->S, &p->T, &note);
        if (st != BK_OK)
            failed(c, st);
        else
            bk__act_close(r);
    }

    /* ----------------------------------------------------- the output */
    if (m) {
        uint64_t out = 64 << 10; /* config.json, report.json, small files */
        const bk_st_set *set = bk_model_tensors(m);
        for (size_t i = 0; i < bk_st_set_count(set); i++) {
            const bk_tensor_info *t = bk_st_set_tensor(set, i);
            int layer;
            bk_module mod;
            if (bk__parse_linear_name(t->name, &layer, &mod) && layer >= p->layer_begin &&
                layer < p->layer_end && t->ndim == 2)
                out += module_out_bytes(o, t->shape[0], t->shape[1], t->nbytes);
            else
                out += t->nbytes;
        }
        p->output_bytes = out;
        estimate_memory(o, p);
    }
    if (o->out_dir && o->out_dir[0]) {
        const char *inputs[] = {o->model_dir ? o->model_dir : "", o->calib_path ? o->calib_path : "",
                                o->calib_text ? o->calib_text : "",
                                o->activations_dir ? o->activations_dir : "",
                                o->config_path ? o->config_path : "", NULL};
        bk_outdir_spec os = {.out = o->out_dir, .inputs = inputs, .overwrite = o->overwrite,
                             .what = "quantize"};
        bk_status st = bk_outdir_check(&os, &p->free_bytes);
        if (st != BK_OK)
            failed(c, st);
        else if (!o->resume && /* (a killed run's work folder holds the space already) */
                 p->output_bytes && p->free_bytes && p->free_bytes < p->output_bytes)
            failed(c, bk_error(BK_ERR_WRITE,
                               "--out %s: the output needs about %.1f MiB and %.1f MiB are free "
                               "there",
                               o->out_dir, (double)p->output_bytes / 1048576.0,
                               (double)p->free_bytes / 1048576.0));
    }
    if (m)
        bk_model_close(m);
    return c->first;
}
