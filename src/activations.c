/* Activation dumps: writing (bakron dump-activations) and reading
 * (bakron quantize --activations). Format: docs/activations.md. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "bk_config.h"
#include "outdir.h"
#include "pipeline_internal.h"
#include "pipeline_gpu.h"
#include "util.h"

#define ACT_FORMAT "bakron-activations"
#define ACT_VERSION 1

static const char *act_names[4] = {"attn_in", "o_in", "mlp_in", "down_in"};

struct bk_act_reader {
    char dir[4096];
    int64_t S, T, file_S;
    int64_t n_layers;
    bk_dtype dtype;
    int zstd;
    char **files;
    const bk_model_config *cfg;
};

void bk_dump_opts_default(bk_dump_opts *o)
{
    memset(o, 0, sizeof *o);
    o->dtype = BK_DT_F32;
    o->zstd_level = 3;
    bk_backend_params_default(&o->backend_params);
}

/* ------------------------------------------------------------------ reader */

static int json_int(const cJSON *obj, const char *key, int64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v))
        return 0;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || floor(d) != d)
        return 0;
    *out = (int64_t)d;
    return 1;
}

void bk__act_close(bk_act_reader *r)
{
    if (!r)
        return;
    if (r->files) {
        for (int64_t i = 0; i < r->n_layers; i++)
            free(r->files[i]);
        free(r->files);
    }
    free(r);
}

bk_status bk__act_open(const char *dir, const bk_model_config *cfg, int64_t samples,
                       bk_act_reader **out, int64_t *S, int64_t *T)
{
    *out = NULL;
    char path[4096];
    bk_status st = bk_path_join(path, sizeof path, dir, "manifest.json");
    if (st != BK_OK)
        return st;
    char *text = NULL;
    st = bk_read_file(path, 16u << 20, &text, NULL);
    if (st != BK_OK)
        return st;
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j)
        return bk_error(BK_ERR_CALIB, "%s: not valid JSON", path);
    bk_act_reader *r = calloc(1, sizeof *r);
    if (!r) {
        cJSON_Delete(j);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    r->cfg = cfg;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format");
    int64_t ver = 0;
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, ACT_FORMAT) != 0 ||
        !json_int(j, "version", &ver) || ver != ACT_VERSION) {
        st = bk_error(BK_ERR_CALIB, "%s: not a '%s' version %d manifest", path, ACT_FORMAT,
                      ACT_VERSION);
        goto fail;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    struct {
        const char *key;
        int64_t want;
    } checks[] = {
        {"n_layers", cfg->n_layers},         {"hidden_size", cfg->hidden},
        {"intermediate_size", cfg->intermediate}, {"num_attention_heads", cfg->n_heads},
        {"num_key_value_heads", cfg->n_kv_heads}, {"head_dim", cfg->head_dim},
    };
    if (!cJSON_IsObject(model)) {
        st = bk_error(BK_ERR_CALIB, "%s: missing 'model' object", path);
        goto fail;
    }
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        int64_t v;
        if (!json_int(model, checks[i].key, &v)) {
            st = bk_error(BK_ERR_CALIB, "%s: model.%s missing or not an integer", path, checks[i].key);
            goto fail;
        }
        if (v != checks[i].want) {
            st = bk_error(BK_ERR_CALIB, "%s: model.%s = %lld but the model has %lld (dump of another model?)",
                          path, checks[i].key, (long long)v, (long long)checks[i].want);
            goto fail;
        }
    }
    int64_t layers;
    if (!json_int(j, "sequences", &r->file_S) || !json_int(j, "seqlen", &r->T) ||
        !json_int(j, "layers", &layers) || r->file_S < 1 || r->T < 1) {
        st = bk_error(BK_ERR_CALIB, "%s: sequences / seqlen / layers missing or invalid", path);
        goto fail;
    }
    if (layers != cfg->n_layers) {
        st = bk_error(BK_ERR_CALIB, "%s: %lld layers dumped, the model has %lld", path,
                      (long long)layers, (long long)cfg->n_layers);
        goto fail;
    }
    if (r->T > cfg->max_positions) {
        st = bk_error(BK_ERR_CALIB, "%s: seqlen %lld exceeds max_position_embeddings %lld", path,
                      (long long)r->T, (long long)cfg->max_positions);
        goto fail;
    }
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(j, "dtype");
    if (!cJSON_IsString(dt) || bk_dtype_from_name(dt->valuestring, &r->dtype) != BK_OK ||
        (r->dtype != BK_DT_F32 && r->dtype != BK_DT_BF16 && r->dtype != BK_DT_F16)) {
        st = bk_error(BK_ERR_CALIB, "%s: dtype must be F32, BF16 or F16", path);
        goto fail;
    }
    const cJSON *comp = cJSON_GetObjectItemCaseSensitive(j, "compression");
    if (cJSON_IsString(comp) && !strcmp(comp->valuestring, "zstd"))
        r->zstd = 1;
    else if (comp && !(cJSON_IsString(comp) && !strcmp(comp->valuestring, "none"))) {
        st = bk_error(BK_ERR_CALIB, "%s: compression must be \"none\" or \"zstd\"", path);
        goto fail;
    }
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(j, "files");
    if (!cJSON_IsArray(files) || cJSON_GetArraySize(files) != layers) {
        st = bk_error(BK_ERR_CALIB, "%s: 'files' must list %lld layer files", path, (long long)layers);
        goto fail;
    }
    r->n_layers = layers;
    r->files = calloc((size_t)layers, sizeof(char *));
    if (!r->files) {
        st = bk_error(BK_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < layers; i++) {
        const cJSON *f = cJSON_GetArrayItem(files, (int)i);
        if (!cJSON_IsString(f) || strchr(f->valuestring, '/') || f->valuestring[0] == '.') {
            st = bk_error(BK_ERR_CALIB, "%s: files[%lld] must be a plain file name", path, (long long)i);
            goto fail;
        }
        char p[4096];
        if ((st = bk_path_join(p, sizeof p, dir, f->valuestring)) != BK_OK)
            goto fail;
        if (!bk_is_file(p)) {
            st = bk_error(BK_ERR_CALIB, "%s: layer %lld file is missing", p, (long long)i);
            goto fail;
        }
        r->files[i] = strdup(p);
        if (!r->files[i]) {
            st = bk_error(BK_ERR_NOMEM, "out of memory");
            goto fail;
        }
    }
    r->S = samples > 0 ? samples : r->file_S;
    if (r->S > r->file_S) {
        st = bk_error(BK_ERR_CALIB, "%s: asked for %lld sequences, the dump has %lld", path,
                      (long long)r->S, (long long)r->file_S);
        goto fail;
    }
    cJSON_Delete(j);
    j = NULL;
    /* check every layer file's tensors now (cheap for plain files: only the
     * headers are read), so a bad dump fails before any work is done; a
     * compressed dump is checked on its first layer here, the others when
     * they are reached */
    for (int64_t l = 0; l < (r->zstd ? 1 : layers); l++) {
        bk_act_layer al;
        st = bk__act_layer_open(r, (int)l, &al);
        bk__act_layer_close(&al);
        if (st != BK_OK)
            goto fail;
    }
    *out = r;
    *S = r->S;
    *T = r->T;
    return BK_OK;
fail:
    cJSON_Delete(j);
    bk__act_close(r);
    return st;
}

bk_status bk__act_layer_open(bk_act_reader *r, int layer, bk_act_layer *al)
{
    memset(al, 0, sizeof *al);
    const char *path = r->files[layer];
    bk_status st = bk_st_open_any(path, &al->file);
    if (st != BK_OK)
        return st;
    const bk_model_config *c = r->cfg;
    int64_t widths[4] = {c->hidden, c->n_heads * c->head_dim, c->hidden, c->intermediate};
    int64_t N = r->file_S * r->T;
    for (int i = 0; i < 4; i++) {
        const bk_tensor_info *t = bk_st_find(al->file, act_names[i]);
        if (!t) {
            st = bk_error(BK_ERR_CALIB, "%s: tensor '%s' is missing", path, act_names[i]);
            goto fail;
        }
        if (t->dtype != r->dtype) {
            st = bk_error(BK_ERR_CALIB, "%s: tensor '%s' is %s, the manifest says %s", path,
                          act_names[i], bk_dtype_name(t->dtype), bk_dtype_name(r->dtype));
            goto fail;
        }
        if (t->ndim != 2 || t->shape[0] != N || t->shape[1] != widths[i]) {
            st = bk_error(BK_ERR_CALIB, "%s: tensor '%s' must be [%lld, %lld] (sequences x seqlen, width)",
                          path, act_names[i], (long long)N, (long long)widths[i]);
            goto fail;
        }
        al->t[i] = t;
    }
    const bk_tensor_info *pos = bk_st_find(al->file, "position_ids");
    if (!pos || pos->ndim != 1 || pos->shape[0] != N ||
        (pos->dtype != BK_DT_I32 && pos->dtype != BK_DT_I64)) {
        st = bk_error(BK_ERR_CALIB, "%s: 'position_ids' must be I32/I64 [%lld]", path, (long long)N);
        goto fail;
    }
    /* positions must be 0..T-1 in every sequence (the causal structure the
     * Hessians assume) */
    for (int64_t i = 0; i < N; i++) {
        int64_t v;
        if (pos->dtype == BK_DT_I32) {
            int32_t x;
            memcpy(&x, (const char *)pos->data + i * 4, 4);
            v = x;
        } else {
            memcpy(&v, (const char *)pos->data + i * 8, 8);
        }
        if (v != i % r->T) {
            st = bk_error(BK_ERR_CALIB, "%s: position_ids[%lld] = %lld, expected %lld (sequences of %lld tokens from position 0)",
                          path, (long long)i, (long long)v, (long long)(i % r->T), (long long)r->T);
            goto fail;
        }
    }
    for (int i = 0; i < 4; i++) {
        if (bk_dtype_is_numeric(al->t[i]->dtype)) {
            /* finiteness is checked row by row when read */
        }
    }
    return BK_OK;
fail:
    bk__act_layer_close(al);
    return st;
}

void bk__act_layer_close(bk_act_layer *al)
{
    if (al->file)
        bk_st_close(al->file);
    memset(al, 0, sizeof *al);
}

bk_status bk__act_rows(const bk_act_layer *al, const char *name, int64_t r0, int64_t nr,
                       int64_t width, float *dst)
{
    const bk_tensor_info *t = NULL;
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, act_names[i]))
            t = al->t[i];
    if (!t)
        return bk_error(BK_ERR_INTERNAL, "activation '%s' not open", name);
    size_t esz = bk_dtype_bits(t->dtype) / 8;
    const char *src = (const char *)t->data + (size_t)(r0 * width) * esz;
    bk_status st = bk_convert(src, t->dtype, dst, BK_DT_F32, (size_t)(nr * width));
    if (st != BK_OK)
        return st;
    for (int64_t i = 0; i < nr * width; i++) {
        if (!isfinite(dst[i]))
            return bk_error(BK_ERR_NONFINITE, "%s: tensor '%s' row %lld holds a non-finite value",
                            t->file, name, (long long)(r0 + i / width));
    }
    return BK_OK;
}

/* ------------------------------------------------------------------ writer */

/* The GPU side of a dump: the residual stream of all sequences on the
 * device, the four taps of one micro-batch, downloaded into the host arrays. */
typedef struct gdump {
    bk_backend *b;
    bk_gfwd *f;
    float *H, *tap[4];
} gdump;

static void gdump_free(gdump *g)
{
#if BK_HAVE_CUDA
    if (g->f) {
        bk_gpu_free(g->f, g->H);
        for (int i = 0; i < 4; i++)
            bk_gpu_free(g->f, g->tap[i]);
        bk_gfwd_free(g->f);
    }
#endif
    bk_backend_destroy(g->b);
    memset(g, 0, sizeof *g);
}

#if BK_HAVE_CUDA
static bk_status gdump_setup(gdump *g, const bk_dump_opts *o, const bk_model *model,
                             const bk_model_config *c, int64_t N,
                             int64_t B, int64_t T, const int64_t *widths)
{
    bk_status st = bk_backend_create_params(BK_BACKEND_CUDA, &o->backend_params, &g->b);
    if (st != BK_OK)
        return st;
    bk_backend_set_gemm_math(g->b, bk_gemm_math_resolve(model, o->gemm_math));
    st = bk_gfwd_create(g->b, c, B, T, &g->f);
    if (st == BK_OK)
        st = bk_gpu_alloc(g->f, (void **)&g->H, (size_t)(N * c->hidden) * sizeof(float),
                          "residual stream of all sequences");
    for (int i = 0; i < 4 && st == BK_OK; i++)
        st = bk_gpu_alloc(g->f, (void **)&g->tap[i], (size_t)(B * T * widths[i]) * sizeof(float),
                          "activation taps");
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "dump-activations on the GPU (use fewer --samples, a smaller --batch "
                            "or --backend cpu)");
    return st;
}
#endif

static void dump_note(void *user, const char *msg)
{
    const bk_dump_opts *o = user;
    if (!o->on_event)
        return;
    bk_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = BK_EV_NOTE;
    ev.message = msg;
    o->on_event(o->user, &ev);
}

bk_status bk_dump_activations(const bk_dump_opts *o)
{
    bk_model *model = NULL;
    bk_fwd *fwd = NULL;
    gdump gd;
    memset(&gd, 0, sizeof gd);
    int gpu = o->backend == BK_BACKEND_CUDA ||
              (o->backend == BK_BACKEND_AUTO && bk_cuda_device_count() > 0);
    int32_t *tokens = NULL;
    float *h = NULL, *acts[4] = {NULL, NULL, NULL, NULL};
    void *conv = NULL;
    cJSON *man = NULL;
    bk_outdir od;
    memset(&od, 0, sizeof od);
    const char *tmp = od.work;
    int64_t S, T;
    bk_status st;
    double t0 = bk_now();

    if (o->dtype != BK_DT_F32 && o->dtype != BK_DT_BF16 && o->dtype != BK_DT_F16)
        return bk_error(BK_ERR_INVALID_ARG, "dump-activations: dtype must be F32, BF16 or F16");
    {
        /* the output folder first: refused (unsafe, exists), locked, leftovers cleaned */
        const char *inputs[] = {o->model_dir, o->calib_path ? o->calib_path : "", NULL};
        bk_outdir_spec os = {.out = o->out_dir, .inputs = inputs, .overwrite = o->overwrite,
                             .what = "dump-activations", .note = dump_note, .user = (void *)o};
        st = bk_outdir_open(&od, &os, NULL);
        if (st != BK_OK)
            return st;
    }
    st = bk_model_open(o->model_dir, &model);
    if (st != BK_OK)
        goto done;
    const bk_model_config *c = bk_model_get_config(model);
    st = bk_load_tokens(o->calib_path, c->vocab, o->samples, o->seqlen, &tokens, &S, &T);
    if (st != BK_OK)
        goto done;
    if (T > c->max_positions) {
        st = bk_error(BK_ERR_CALIB, "%s: sequence length %lld exceeds max_position_embeddings %lld",
                      o->calib_path, (long long)T, (long long)c->max_positions);
        goto done;
    }
    int64_t N = S * T, B = o->batch > 0 ? o->batch : bk_fwd_auto_batch(c, S, T);
    if (B > S)
        B = S;
    int64_t widths[4] = {c->hidden, c->n_heads * c->head_dim, c->hidden, c->intermediate};
    if (gpu) {
#if BK_HAVE_CUDA
        st = gdump_setup(&gd, o, model, c, N, B, T, widths);
#else
        st = bk_error(BK_ERR_NO_DEVICE, "dump-activations --backend cuda: this build has no CUDA "
                      "backend (rebuild with -Dcuda=enabled); use --backend cpu");
#endif
        if (st != BK_OK)
            goto done;
    }
    st = bk_fwd_create(c, B, T, &fwd); /* also the configuration's checks for the GPU */
    if (st != BK_OK)
        goto done;
    if (!gpu) /* the GPU keeps the residual stream on the device */
        h = bk_alloc((size_t)(N * c->hidden), sizeof(float));
    for (int i = 0; i < 4; i++)
        acts[i] = bk_alloc((size_t)(N * widths[i]), sizeof(float));
    conv = bk_alloc((size_t)(N * c->intermediate), 2);
    if ((!gpu && !h) || !acts[0] || !acts[1] || !acts[2] || !acts[3] || !conv) {
        st = bk_error(BK_ERR_NOMEM, "dump-activations: out of memory for %lld tokens", (long long)N);
        goto done;
    }
    for (int64_t s0 = 0; s0 < S && st == BK_OK; s0 += B) {
        int64_t sb = S - s0 < B ? S - s0 : B;
#if BK_HAVE_CUDA
        if (gpu) {
            st = bk_gfwd_embed(gd.f, model, tokens + s0 * T, sb, gd.H + s0 * T * c->hidden);
            continue;
        }
#endif
        st = bk_fwd_embed(fwd, model, tokens + s0 * T, sb, h + s0 * T * c->hidden);
    }
#if BK_HAVE_CUDA
    if (gpu)
        bk_gfwd_embed_release(gd.f);
#endif
    if (st != BK_OK)
        goto done;

    man = cJSON_CreateObject();
    cJSON_AddStringToObject(man, "format", ACT_FORMAT);
    cJSON_AddNumberToObject(man, "version", ACT_VERSION);
    cJSON_AddStringToObject(man, "producer", "bakron dump-activations " BK_VERSION);
    cJSON *mj = cJSON_AddObjectToObject(man, "model");
    cJSON_AddStringToObject(mj, "model_type", c->model_type);
    cJSON_AddNumberToObject(mj, "n_layers", (double)c->n_layers);
    cJSON_AddNumberToObject(mj, "hidden_size", (double)c->hidden);
    cJSON_AddNumberToObject(mj, "intermediate_size", (double)c->intermediate);
    cJSON_AddNumberToObject(mj, "num_attention_heads", (double)c->n_heads);
    cJSON_AddNumberToObject(mj, "num_key_value_heads", (double)c->n_kv_heads);
    cJSON_AddNumberToObject(mj, "head_dim", (double)c->head_dim);
    cJSON_AddNumberToObject(mj, "vocab_size", (double)c->vocab);
    cJSON_AddNumberToObject(man, "sequences", (double)S);
    cJSON_AddNumberToObject(man, "seqlen", (double)T);
    cJSON_AddStringToObject(man, "dtype", bk_dtype_name(o->dtype));
    cJSON_AddStringToObject(man, "compression", o->zstd ? "zstd" : "none");
    cJSON_AddNumberToObject(man, "layers", (double)c->n_layers);
    cJSON_AddStringToObject(man, "calibration", o->calib_path);
    cJSON_AddStringToObject(man, "device", gpu ? bk_backend_device(gd.b) : "cpu");
    if (gpu)
        cJSON_AddStringToObject(man, "gpu_math",
                                bk_gemm_math_name(bk_gemm_math_resolve(model, o->gemm_math)));
    cJSON *files = cJSON_AddArrayToObject(man, "files");

    int32_t *pos = bk_alloc((size_t)N, sizeof(int32_t));
    if (!pos) {
        st = bk_error(BK_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int64_t i = 0; i < N; i++)
        pos[i] = (int32_t)(i % T);

    for (int l = 0; l < c->n_layers && st == BK_OK; l++) {
        bk_layer_weights lw;
        memset(&lw, 0, sizeof lw);
        st = bk_layer_weights_load(model, l, &lw);
        if (st == BK_OK) /* the checkpoint is not changing under the run */
            st = bk_st_set_check_unchanged(bk_model_tensors(model));
#if BK_HAVE_CUDA
        if (gpu) {
            bk_glayer *gl = NULL;
            if (st == BK_OK)
                st = bk_glayer_upload(gd.f, &lw, &gl);
            for (int64_t s0 = 0; s0 < S && st == BK_OK; s0 += B) {
                int64_t sb = S - s0 < B ? S - s0 : B;
                bk_layer_taps taps = {.attn_in = gd.tap[0], .o_in = gd.tap[1],
                                      .mlp_in = gd.tap[2], .down_in = gd.tap[3]};
                st = bk_gfwd_layer(gd.f, gl, sb, gd.H + s0 * T * c->hidden, &taps);
                for (int i = 0; i < 4 && st == BK_OK; i++)
                    st = bk_gpu_download(gd.f, acts[i] + s0 * T * widths[i], gd.tap[i],
                                         (size_t)(sb * T * widths[i]) * sizeof(float));
            }
            bk_glayer_free(gd.f, gl);
        } else
#endif
        for (int64_t s0 = 0; s0 < S && st == BK_OK; s0 += B) {
            int64_t sb = S - s0 < B ? S - s0 : B;
            bk_layer_taps taps = {
                .attn_in = acts[0] + s0 * T * widths[0], .o_in = acts[1] + s0 * T * widths[1],
                .mlp_in = acts[2] + s0 * T * widths[2], .down_in = acts[3] + s0 * T * widths[3]};
            st = bk_fwd_layer(fwd, &lw, sb, h + s0 * T * c->hidden, &taps);
        }
        bk_layer_weights_free(&lw);
        if (st != BK_OK)
            break;
        char fname[64], path[4096];
        snprintf(fname, sizeof fname, "layer.%04d.safetensors%s", l, o->zstd ? ".zst" : "");
        cJSON_AddItemToArray(files, cJSON_CreateString(fname));
        if ((st = bk_path_join(path, sizeof path, tmp, fname)) != BK_OK)
            break;
        bk_st_writer *w = NULL;
        st = bk_st_writer_create(&w);
        for (int i = 0; i < 4 && st == BK_OK; i++) {
            int64_t shape[2] = {N, widths[i]};
            if (o->dtype == BK_DT_F32) {
                st = bk_st_writer_add(w, act_names[i], BK_DT_F32, 2, shape, acts[i], 0);
            } else {
                st = bk_convert(acts[i], BK_DT_F32, conv, o->dtype, (size_t)(N * widths[i]));
                if (st == BK_OK)
                    st = bk_st_writer_add(w, act_names[i], o->dtype, 2, shape, conv, 1);
            }
        }
        int64_t pshape[1] = {N};
        if (st == BK_OK)
            st = bk_st_writer_add(w, "position_ids", BK_DT_I32, 1, pshape, pos, 0);
        char lbuf[32];
        snprintf(lbuf, sizeof lbuf, "%d", l);
        if (st == BK_OK)
            st = bk_st_writer_set_meta(w, "layer", lbuf);
        if (st == BK_OK)
            st = o->zstd ? bk_st_writer_save_zst(w, path, o->zstd_level) : bk_st_writer_save(w, path);
        bk_st_writer_free(w);
        if (st == BK_OK && o->on_event) {
            bk_event ev;
            memset(&ev, 0, sizeof ev);
            ev.kind = BK_EV_LAYER_DONE;
            ev.layer = l;
            ev.n_layers = (int)c->n_layers;
            ev.elapsed_s = bk_now() - t0;
            ev.eta_s = ev.elapsed_s / (l + 1) * (c->n_layers - l - 1);
            ev.message = fname;
            o->on_event(o->user, &ev);
        }
        if (st == BK_OK && bk__stop_requested())
            st = bk_error(BK_ERR_INTERRUPTED, "interrupted after layer %d", l);
    }
    free(pos);
    if (st != BK_OK)
        goto done;
    {
        char *text = cJSON_Print(man);
        char path[4096];
        if (!text) {
            st = bk_error(BK_ERR_NOMEM, "out of memory");
            goto done;
        }
        st = bk_path_join(path, sizeof path, tmp, "manifest.json");
        if (st == BK_OK)
            st = bk_write_file_atomic(path, text, strlen(text));
        free(text);
    }
    if (st == BK_OK) /* nothing read has changed since it was opened */
        st = bk_st_set_check_unchanged(bk_model_tensors(model));
    if (st == BK_OK)
        st = bk_outdir_commit(&od);
done:
    bk_outdir_close(&od);
    cJSON_Delete(man);
    free(conv);
    for (int i = 0; i < 4; i++)
        free(acts[i]);
    free(h);
    free(tokens);
    if (fwd)
        bk_fwd_free(fwd);
    gdump_free(&gd);
    if (model)
        bk_model_close(model);
    return st;
}
