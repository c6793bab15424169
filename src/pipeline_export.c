/* Writing quantized modules: the bakron native layout, dequantized
 * checkpoints, and GPTQ (v1) packed checkpoints (docs/formats.md). */
#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/bakron.h"
#include "bk_config.h"
#include "pipeline_internal.h"
#include "util.h"

int bk__parse_linear_name(const char *name, int *layer, bk_module *mod)
{
    const char *pre = "model.layers.";
    size_t lp = strlen(pre);
    if (strncmp(name, pre, lp) != 0)
        return 0;
    const char *p = name + lp;
    char *end = NULL;
    long l = strtol(p, &end, 10);
    if (end == p || *end != '.' || l < 0 || l > 1000000)
        return 0;
    const char *rest = end + 1;
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        const char *mn = bk_module_name((bk_module)m);
        size_t lm = strlen(mn);
        if (!strncmp(rest, mn, lm) && !strcmp(rest + lm, ".weight")) {
            *layer = (int)l;
            *mod = (bk_module)m;
            return 1;
        }
    }
    return 0;
}

/* Bits of the GPTQ export for a quantizer: levels l -> smallest b with
 * 2^(b-1) - 1 >= l; uniform -> its bits. */
static int gptq_bits(const bk_quant_spec *q)
{
    if (q->kind == BK_Q_UNIFORM)
        return q->bits;
    int b = 2;
    while ((1 << (b - 1)) - 1 < q->levels)
        b++;
    return b;
}

static int64_t groups_of(const bk_quant_spec *q, int64_t n)
{
    if (q->kind == BK_Q_UNIFORM && q->group > 0)
        return (n + q->group - 1) / q->group;
    return 1;
}

bk_status bk__check_export(const bk_quantize_opts *o, const bk_model_config *cfg)
{
    const bk_quant_spec *q = &o->solve.quant;
    if (q->kind == BK_Q_INTEGER)
        return bk_error(BK_ERR_INVALID_ARG, "quantize: the unbounded integer alphabet cannot be exported");
    if (q->kind == BK_Q_LEVELS && (q->levels < 1 || q->levels > 127))
        return bk_error(BK_ERR_INVALID_ARG, "quantize: --levels must be in [1, 127] to fit int8 codes");
    if (o->export_format != BK_EXPORT_GPTQ)
        return BK_OK;
    int b = gptq_bits(q);
    if (b != 2 && b != 3 && b != 4 && b != 8)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "export gptq: %d bits are not a GPTQ width (2, 3, 4, 8)", b);
    if (q->kind == BK_Q_UNIFORM && q->asym)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "export gptq: only symmetric quantization is exported (v1 cannot store zero point 0)");
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        int64_t out, in;
        bk_module_shape(cfg, (bk_module)m, &out, &in);
        if (in % 32 || out % 32)
            return bk_error(BK_ERR_UNSUPPORTED,
                            "export gptq: %s is [%lld, %lld]; GPTQ packing needs both dimensions divisible by 32",
                            bk_module_name((bk_module)m), (long long)out, (long long)in);
    }
    return BK_OK;
}

static void prefix_of(const char *weight_name, char *prefix, size_t cap)
{
    size_t l = strlen(weight_name) - strlen(".weight");
    if (l >= cap)
        l = cap - 1;
    memcpy(prefix, weight_name, l);
    prefix[l] = '\0';
}

bk_status bk__declare_quantized(bk_st_stream *s, const bk_quantize_opts *o,
                                const bk_model_config *cfg, const char *weight_name,
                                bk_module mod)
{
    char pre[400], name[512];
    int64_t out, in;
    bk_module_shape(cfg, mod, &out, &in);
    prefix_of(weight_name, pre, sizeof pre);
    const bk_quant_spec *q = &o->solve.quant;
    int64_t g = groups_of(q, in);
    bk_status st;
    if (o->export_format == BK_EXPORT_NATIVE) {
        int asym = q->kind == BK_Q_UNIFORM && q->asym;
        int64_t shape[2] = {out, in};
        snprintf(name, sizeof name, "%s.qweight", pre);
        st = bk_st_stream_declare(s, name, asym ? BK_DT_U8 : BK_DT_I8, 2, shape);
        if (st != BK_OK)
            return st;
        int64_t sshape[2] = {out, g};
        snprintf(name, sizeof name, "%s.scales", pre);
        st = bk_st_stream_declare(s, name, BK_DT_F32, 2, sshape);
        if (st != BK_OK || !asym)
            return st;
        snprintf(name, sizeof name, "%s.qzeros", pre);
        return bk_st_stream_declare(s, name, BK_DT_F32, 2, sshape);
    }
    /* GPTQ v1 */
    int b = gptq_bits(q);
    int64_t qw[2] = {in * b / 32, out};
    snprintf(name, sizeof name, "%s.qweight", pre);
    if ((st = bk_st_stream_declare(s, name, BK_DT_I32, 2, qw)) != BK_OK)
        return st;
    int64_t qz[2] = {g, out * b / 32};
    snprintf(name, sizeof name, "%s.qzeros", pre);
    if ((st = bk_st_stream_declare(s, name, BK_DT_I32, 2, qz)) != BK_OK)
        return st;
    int64_t sc[2] = {g, out};
    snprintf(name, sizeof name, "%s.scales", pre);
    if ((st = bk_st_stream_declare(s, name, BK_DT_F16, 2, sc)) != BK_OK)
        return st;
    int64_t gi[1] = {in};
    snprintf(name, sizeof name, "%s.g_idx", pre);
    return bk_st_stream_declare(s, name, BK_DT_I32, 1, gi);
}

/* Pack `count` values of `bits` bits (LSB first) into 32-bit words; values
 * are taken from v[i * stride]. */
static void pack_bits(const int32_t *v, int64_t count, int64_t stride, int bits, uint32_t *words,
                      int64_t word_stride)
{
    int64_t nw = count * bits / 32;
    for (int64_t w = 0; w < nw; w++)
        words[w * word_stride] = 0;
    for (int64_t i = 0; i < count; i++) {
        uint64_t val = (uint32_t)v[i * stride] & ((1u << bits) - 1);
        int64_t bit = i * bits;
        int64_t w = bit / 32;
        int off = (int)(bit % 32);
        words[w * word_stride] |= (uint32_t)(val << off);
        if (off + bits > 32)
            words[(w + 1) * word_stride] |= (uint32_t)(val >> (32 - off));
    }
}

static bk_status write_gptq(bk_st_stream *s, const bk_quantize_opts *o, const char *pre,
                            const bk_solve_result *r)
{
    const bk_quant_spec *q = &o->solve.quant;
    const int b = gptq_bits(q);
    const int64_t m = r->m, n = r->n, g = r->groups;
    const int32_t zero = 1 << (b - 1);
    /* levels: code c in [-l, l] -> c + zero; uniform symmetric: already 0..maxq
     * around zero = (maxq + 1) / 2 = 2^(b-1). */
    const int32_t shift = q->kind == BK_Q_LEVELS ? zero : 0;
    int32_t *col = malloc((size_t)n * sizeof(int32_t));
    uint32_t *qweight = bk_alloc((size_t)(n * b / 32 * m), sizeof(uint32_t));
    uint32_t *qzeros = bk_alloc((size_t)(g * m * b / 32), sizeof(uint32_t));
    uint16_t *scales = bk_alloc((size_t)(g * m), sizeof(uint16_t));
    int32_t *gidx = bk_alloc((size_t)n, sizeof(int32_t));
    int32_t *zrow = malloc((size_t)m * sizeof(int32_t));
    bk_status st = BK_OK;
    char name[512];
    if (!col || !qweight || !qzeros || !scales || !gidx || !zrow) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory packing GPTQ tensors", pre);
        goto done;
    }
    /* qweight [n*b/32, m]: column j of the output holds row j of W packed along inputs */
    for (int64_t i = 0; i < m; i++) {
        for (int64_t k = 0; k < n; k++)
            col[k] = r->codes[i * n + k] + shift;
        pack_bits(col, n, 1, b, qweight + i, m);
    }
    for (int64_t k = 0; k < g; k++) {
        for (int64_t i = 0; i < m; i++) {
            zrow[i] = zero - 1; /* v1 stores z - 1 */
            scales[k * m + i] = bk_f32_to_f16(r->scales[i * g + k]);
        }
        pack_bits(zrow, m, 1, b, qzeros + k * (m * b / 32), 1);
    }
    int64_t gs = (q->kind == BK_Q_UNIFORM && q->group > 0) ? q->group : n;
    for (int64_t k = 0; k < n; k++)
        gidx[k] = (int32_t)(k / gs);
    snprintf(name, sizeof name, "%s.qweight", pre);
    if ((st = bk_st_stream_write(s, name, qweight)) != BK_OK)
        goto done;
    snprintf(name, sizeof name, "%s.qzeros", pre);
    if ((st = bk_st_stream_write(s, name, qzeros)) != BK_OK)
        goto done;
    snprintf(name, sizeof name, "%s.scales", pre);
    if ((st = bk_st_stream_write(s, name, scales)) != BK_OK)
        goto done;
    snprintf(name, sizeof name, "%s.g_idx", pre);
    st = bk_st_stream_write(s, name, gidx);
done:
    free(col);
    free(qweight);
    free(qzeros);
    free(scales);
    free(gidx);
    free(zrow);
    return st;
}

bk_status bk__write_module(bk_st_stream *s, const bk_quantize_opts *o, const bk_model_config *cfg,
                           const bk_model *model, int layer, bk_module mod,
                           const bk_solve_result *r)
{
    (void)cfg;
    char pre[400], name[512];
    snprintf(pre, sizeof pre, "model.layers.%d.%s", layer, bk_module_name(mod));
    const int64_t m = r->m, n = r->n, g = r->groups;
    const bk_quant_spec *q = &o->solve.quant;
    bk_status st;
    if (o->export_format == BK_EXPORT_DEQUANTIZED) {
        snprintf(name, sizeof name, "%s.weight", pre);
        const bk_tensor_info *t = bk_st_set_find(bk_model_tensors(model), name);
        if (!t)
            return bk_error(BK_ERR_INTERNAL, "%s: missing from the input", name);
        void *buf = bk_alloc((size_t)(m * n), 8);
        if (!buf)
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", name);
        st = bk_convert(r->weight, BK_DT_F32, buf, t->dtype, (size_t)(m * n));
        if (st == BK_OK)
            st = bk_st_stream_write(s, name, buf);
        free(buf);
        return st;
    }
    if (o->export_format == BK_EXPORT_GPTQ)
        return write_gptq(s, o, pre, r);

    int asym = q->kind == BK_Q_UNIFORM && q->asym;
    void *codes = bk_alloc((size_t)(m * n), 1);
    if (!codes)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", pre);
    if (asym) {
        uint8_t *c = codes;
        for (int64_t i = 0; i < m * n; i++)
            c[i] = (uint8_t)r->codes[i];
    } else {
        /* centered: w = c * s */
        int32_t zero = q->kind == BK_Q_UNIFORM ? (1 << (q->bits - 1)) : 0;
        int8_t *c = codes;
        for (int64_t i = 0; i < m * n; i++)
            c[i] = (int8_t)(r->codes[i] - zero);
    }
    snprintf(name, sizeof name, "%s.qweight", pre);
    st = bk_st_stream_write(s, name, codes);
    free(codes);
    if (st != BK_OK)
        return st;
    (void)g;
    snprintf(name, sizeof name, "%s.scales", pre);
    if ((st = bk_st_stream_write(s, name, r->scales)) != BK_OK)
        return st;
    if (asym) {
        snprintf(name, sizeof name, "%s.qzeros", pre);
        st = bk_st_stream_write(s, name, r->zeros);
    }
    return st;
}

cJSON *bk__quantization_config(const bk_quantize_opts *o, const bk_model_config *cfg, int64_t S,
                               int64_t T, int layer_begin, int layer_end)
{
    (void)cfg;
    const bk_quant_spec *q = &o->solve.quant;
    cJSON *c = cJSON_CreateObject();
    if (!c)
        return NULL;
    if (o->export_format == BK_EXPORT_GPTQ) {
        cJSON_AddStringToObject(c, "quant_method", "gptq");
        cJSON_AddNumberToObject(c, "bits", gptq_bits(q));
        cJSON_AddNumberToObject(c, "group_size",
                                (q->kind == BK_Q_UNIFORM && q->group > 0) ? (double)q->group : -1);
        cJSON_AddBoolToObject(c, "desc_act", 0);
        cJSON_AddBoolToObject(c, "sym", 1);
        cJSON_AddStringToObject(c, "checkpoint_format", "gptq");
        cJSON_AddBoolToObject(c, "lm_head", 0);
        cJSON_AddBoolToObject(c, "true_sequential", o->sequential != 0);
    } else {
        cJSON_AddStringToObject(c, "quant_method", "bakron");
        cJSON_AddStringToObject(c, "format", "native");
        cJSON_AddNumberToObject(c, "format_version", 1);
    }
    cJSON *b = o->export_format == BK_EXPORT_GPTQ ? cJSON_AddObjectToObject(c, "bakron") : c;
    if (q->kind == BK_Q_LEVELS) {
        cJSON_AddStringToObject(b, "alphabet", "levels");
        cJSON_AddNumberToObject(b, "levels", q->levels);
        cJSON_AddNumberToObject(b, "bits_per_weight", log2(2.0 * q->levels + 1));
    } else {
        cJSON_AddStringToObject(b, "alphabet", "uniform");
        cJSON_AddNumberToObject(b, "bits", q->bits);
    }
    if (o->export_format != BK_EXPORT_GPTQ) {
        cJSON_AddNumberToObject(b, "group_size",
                                (q->kind == BK_Q_UNIFORM && q->group > 0) ? (double)q->group : -1);
        cJSON_AddBoolToObject(b, "sym", !(q->kind == BK_Q_UNIFORM && q->asym));
        cJSON_AddStringToObject(b, "scale_dtype", "F32");
    }
    cJSON_AddBoolToObject(b, "mse_scales", q->mse != 0);
    cJSON_AddStringToObject(b, "hessian", bk_hessian_name(o->hessian));
    cJSON_AddStringToObject(b, "algorithm", bk_algorithm_name(o->solve.algorithm));
    cJSON_AddStringToObject(b, "precision", o->solve.precision == BK_PREC_FP64 ? "fp64" : "fp32");
    cJSON_AddNumberToObject(b, "damp", o->solve.damp);
    if (o->solve.separate_damp_b)
        cJSON_AddNumberToObject(b, "damp_b", o->solve.damp_b);
    if (o->damp_b_attn >= 0.0)
        cJSON_AddNumberToObject(b, "damp_b_attn", o->damp_b_attn);
    cJSON_AddBoolToObject(b, "sequential", o->sequential != 0);
    cJSON *cal = cJSON_AddObjectToObject(b, "calibration");
    if (o->calib_path)
        cJSON_AddStringToObject(cal, "tokens", o->calib_path);
    if (o->calib_text) {
        cJSON_AddStringToObject(cal, "text", o->calib_text);
        cJSON_AddStringToObject(cal, "tokenizer", "tokenizer.json of the model");
    }
    if (o->activations_dir)
        cJSON_AddStringToObject(cal, "activations", o->activations_dir);
    cJSON_AddNumberToObject(cal, "sequences", (double)S);
    cJSON_AddNumberToObject(cal, "seqlen", (double)(S > 0 ? T : 0));
    cJSON *lr = cJSON_AddArrayToObject(b, "layers");
    cJSON_AddItemToArray(lr, cJSON_CreateNumber(layer_begin));
    cJSON_AddItemToArray(lr, cJSON_CreateNumber(layer_end));
    cJSON *mods = cJSON_AddArrayToObject(b, "modules");
    for (int m = 0; m < BK_MOD_COUNT; m++)
        cJSON_AddItemToArray(mods, cJSON_CreateString(bk_module_name((bk_module)m)));
    if (o->config_path)
        cJSON_AddStringToObject(b, "preset", o->config_path);
    cJSON_AddStringToObject(b, "bakron_version", BK_VERSION);
    return c;
}

static const char *jstr(const cJSON *o, const char *k, const char *dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : dflt;
}

static double jnum(const cJSON *o, const char *k, double dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s && s[1] ? s + 1 : p;
}

/* appends printf output to a growing buffer */
typedef struct card_buf {
    char *p;
    size_t len, cap;
    int oom;
} card_buf;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void cb_printf(card_buf *b, const char *fmt, ...)
{
    va_list ap;
    for (;;) {
        size_t room = b->cap - b->len;
        va_start(ap, fmt);
        int n = b->p ? vsnprintf(b->p + b->len, room, fmt, ap) : -1;
        va_end(ap);
        if (n >= 0 && (size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap ? b->cap * 2 : 4096;
        if (n >= 0 && nc < b->len + (size_t)n + 1)
            nc = b->len + (size_t)n + 1;
        char *q = realloc(b->p, nc);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = nc;
    }
}

bk_status bk__write_model_card(const char *out_dir, const cJSON *config)
{
    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(config, "quantization_config");
    int deq = 0;
    if (!qc) {
        qc = cJSON_GetObjectItemCaseSensitive(config, "bakron_dequantized_from");
        deq = 1;
    }
    if (!cJSON_IsObject(qc))
        return bk_error(BK_ERR_INTERNAL, "model card: config.json has no quantization settings");
    const int gptq = !strcmp(jstr(qc, "quant_method", ""), "gptq");
    const cJSON *b = gptq ? cJSON_GetObjectItemCaseSensitive(qc, "bakron") : qc;
    const char *src = jstr(config, "_name_or_path", NULL);
    const char *hess = jstr(b, "hessian", "?");
    card_buf cb = {0};
    cb_printf(&cb, "---\n");
    if (src && src[0])
        cb_printf(&cb, "base_model: %s\n", src);
    cb_printf(&cb, "tags:\n- bakron\n- quantized\n- %s\n---\n%s\n\n",
              deq ? "dequantized" : gptq ? "gptq" : "bakron-native", BK_MODEL_CARD_MARK);
    if (src && src[0])
        cb_printf(&cb, "# %s, quantized with bakron\n\n", src);
    else
        cb_printf(&cb, "# A %s model quantized with bakron\n\n", jstr(config, "model_type", "?"));
    cb_printf(&cb, "Quantized by bakron %s (GPTQ-style adaptive rounding under a "
                   "Kronecker-factored Hessian). The source model's own card is not copied: "
                   "see the source for its license, training and intended use.\n\n",
              jstr(b, "bakron_version", "?"));
    cb_printf(&cb, "| setting | value |\n|---|---|\n");
    cb_printf(&cb, "| Hessian | %s |\n", hess);
    cb_printf(&cb, "| solver | %s, %s |\n", jstr(b, "algorithm", "?"), jstr(b, "precision", "?"));
    if (!strcmp(jstr(b, "alphabet", ""), "levels"))
        cb_printf(&cb, "| quantizer | symmetric levels {-%g..%g}, %.2f bits per weight, one scale "
                       "per row%s |\n",
                  jnum(b, "levels", 0), jnum(b, "levels", 0), jnum(b, "bits_per_weight", 0),
                  cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(b, "mse_scales")) ? " (MSE scales)"
                                                                                : "");
    else {
        double g = jnum(gptq ? qc : b, "group_size", -1);
        const cJSON *sym = cJSON_GetObjectItemCaseSensitive(gptq ? qc : b, "sym");
        cb_printf(&cb, "| quantizer | uniform %g-bit, %s, ", jnum(b, "bits", 0),
                  cJSON_IsFalse(sym) ? "asymmetric" : "symmetric");
        if (g > 0)
            cb_printf(&cb, "groups of %g input columns", g);
        else
            cb_printf(&cb, "one scale per row");
        cb_printf(&cb, "%s |\n",
                  cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(b, "mse_scales")) ? " (MSE scales)"
                                                                                : "");
    }
    cb_printf(&cb, "| damping | %g", jnum(b, "damp", 0));
    if (cJSON_GetObjectItemCaseSensitive(b, "damp_b"))
        cb_printf(&cb, " (output factors %g)", jnum(b, "damp_b", 0));
    cb_printf(&cb, " |\n| order | %s |\n",
              cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(b, "sequential"))
                  ? "every module from full-precision inputs"
                  : "sequential (each module sees the quantized ones before it)");
    const cJSON *lr = cJSON_GetObjectItemCaseSensitive(b, "layers");
    if (cJSON_IsArray(lr) && cJSON_GetArraySize(lr) == 2)
        cb_printf(&cb, "| layers | %g..%g of %g (numbered from 0) |\n",
                  cJSON_GetArrayItem(lr, 0)->valuedouble,
                  cJSON_GetArrayItem(lr, 1)->valuedouble - 1,
                  jnum(config, "num_hidden_layers", 0));
    const cJSON *cal = cJSON_GetObjectItemCaseSensitive(b, "calibration");
    if (jnum(cal, "sequences", 0) > 0) {
        const char *t = jstr(cal, "tokens", NULL), *a = jstr(cal, "activations", NULL);
        const char *x = jstr(cal, "text", NULL);
        cb_printf(&cb, "| calibration | %s%s%s: %g sequences x %g tokens |\n",
                  t ? "" : x ? "text " : "activations ", base_name(t ? t : x ? x : a ? a : "?"),
                  x ? " (the model's tokenizer.json)" : "", jnum(cal, "sequences", 0),
                  jnum(cal, "seqlen", 0));
    } else {
        cb_printf(&cb, "| calibration | none (round to nearest) |\n");
    }
    if (jstr(b, "preset", NULL))
        cb_printf(&cb, "| preset | %s |\n", base_name(jstr(b, "preset", "")));
    cb_printf(&cb, "| format | %s |\n",
              deq ? "dequantized: an ordinary checkpoint in the original dtype"
              : gptq ? "GPTQ v1 (packed int32 qweight/qzeros, F16 scales; transformers, vLLM)"
                     : "bakron native (int8 codes + float scales; `bakron eval`)");
    cb_printf(&cb, "\nThe exact settings are in config.json; per-module proxy losses, damping "
                   "and stage times in report.json.\n\n## Measured perplexity\n\n"
                   "| tokens | sequences x tokens | perplexity | mean NLL |\n|---|---|---|---|\n");
    if (cb.oom) {
        free(cb.p);
        return bk_error(BK_ERR_NOMEM, "out of memory writing README.md");
    }
    char path[4096];
    bk_status st = bk_path_join(path, sizeof path, out_dir, "README.md");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, cb.p, cb.len);
    free(cb.p);
    return st;
}

bk_status bk__copy_aux_files(const char *model_dir, const char *out_dir)
{
    DIR *d = opendir(model_dir);
    if (!d)
        return bk_error(BK_ERR_IO, "%s: cannot list folder", model_dir);
    struct dirent *e;
    bk_status st = BK_OK;
    while ((e = readdir(d)) != NULL && st == BK_OK) {
        const char *nm = e->d_name;
        if (nm[0] == '.' || !strcmp(nm, "config.json") || !strcmp(nm, "README.md") ||
            bk_ends_with(nm, ".safetensors") ||
            bk_ends_with(nm, ".safetensors.index.json") || !strcmp(nm, "quantize_config.json") ||
            !strcmp(nm, "report.json"))
            continue;
        char src[4096], dst[4096];
        if (bk_path_join(src, sizeof src, model_dir, nm) != BK_OK ||
            bk_path_join(dst, sizeof dst, out_dir, nm) != BK_OK || !bk_is_file(src))
            continue;
        st = bk_copy_file(src, dst);
    }
    closedir(d);
    return st;
}

bk_status bk__layer_rtn(bk_model *model, bk_backend *be, bk_st_stream *out,
                        const bk_quantize_opts *o, const bk_model_config *cfg, int layer,
                        cJSON *report, int64_t *params)
{
    bk_status st = BK_OK;
    for (int mi = 0; mi < BK_MOD_COUNT && st == BK_OK; mi++) {
        bk_module mod = (bk_module)mi;
        int64_t m, n;
        bk_module_shape(cfg, mod, &m, &n);
        float *w = bk_alloc((size_t)(m * n), sizeof(float));
        if (!w)
            return bk_error(BK_ERR_NOMEM, "layer %d %s: out of memory", layer, bk_module_name(mod));
        st = bk_model_linear_f32(model, layer, mod, w);
        if (st != BK_OK) {
            free(w);
            return st;
        }
        char label[256];
        snprintf(label, sizeof label, "model.layers.%d.%s", layer, bk_module_name(mod));
        bk_solve_opts so = o->solve;
        so.algorithm = BK_ALG_RTN;
        so.compute_stats = 0;
        bk_solve_problem p = {.m = m, .n = n, .dtype = BK_DT_F32, .W = w, .label_w = label};
        bk_solve_result r;
        memset(&r, 0, sizeof r);
        st = bk_backend_solve(be, &p, &so, &r);
        free(w);
        if (st == BK_OK)
            st = bk__write_module(out, o, cfg, model, layer, mod, &r);
        if (st == BK_OK) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "layer", layer);
            cJSON_AddStringToObject(e, "module", bk_module_name(mod));
            cJSON_AddNumberToObject(e, "rows", (double)m);
            cJSON_AddNumberToObject(e, "cols", (double)n);
            cJSON_AddStringToObject(e, "algorithm", "rtn");
            cJSON_AddNullToObject(e, "loss");
            cJSON_AddNullToObject(e, "loss_gptq");
            cJSON_AddItemToArray(report, e);
            *params += m * n;
        }
        bk_solve_result_free(&r);
    }
    return st;
}

const char *bk_export_name(bk_export_format f)
{
    switch (f) {
    case BK_EXPORT_NATIVE: return "native";
    case BK_EXPORT_DEQUANTIZED: return "dequantized";
    case BK_EXPORT_GPTQ: return "gptq";
    }
    return "?";
}

bk_status bk_export_from_name(const char *name, bk_export_format *out)
{
    for (int f = 0; f <= BK_EXPORT_GPTQ; f++) {
        if (!strcmp(name, bk_export_name((bk_export_format)f))) {
            *out = (bk_export_format)f;
            return BK_OK;
        }
    }
    return bk_error(BK_ERR_INVALID_ARG, "unknown export format '%s' (expected native, dequantized or gptq)",
                    name);
}
