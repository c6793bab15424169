/* Activation dumps: writing (bakron dump-activations) and reading
 * (bakron quantize --activations). Format: docs/activations.md. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "bk_config.h"
#include "backend_impl.h"
#include "layer_driver.h"
#include "outdir.h"
#include "pipeline_internal.h"
#include "st_internal.h"
#include "util.h"

#define ACT_FORMAT "bakron-activations"
#define ACT_VERSION 2    /* written; 1 (no identity digests) is still read */
#define ACT_MAX_HEADER ((uint64_t)1 << 20) /* a layer file's header: a few hundred bytes */

static const char *act_names[4] = {"attn_in", "o_in", "mlp_in", "down_in"};

struct bk_act_reader {
    char dir[4096];
    int64_t S, T, file_S;
    int64_t n_layers;
    bk_dtype dtype;
    int zstd;
    int version;
    char **files;
    uint64_t *image_bytes; /* each file's exact size once decompressed (zstd) */
    const bk_model_config *cfg;
    char cfg_sha[65], w_sha[65], calib_sha[65]; /* from the manifest (version 2) */
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

/* a 64-hex-digit digest under `key`, copied into out */
static int json_sha(const cJSON *obj, const char *key, char out[65])
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsString(v) || strlen(v->valuestring) != 64 ||
        strspn(v->valuestring, "0123456789abcdef") != 64)
        return 0;
    memcpy(out, v->valuestring, 65);
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
    free(r->image_bytes);
    free(r);
}

/* The header JSON of a plain .safetensors file (read, not mapped). */
static bk_status read_plain_header(const char *path, char **json)
{
    *json = NULL;
    struct stat sb;
    int fd = bk_open_regular(path, &sb);
    if (fd < 0)
        return BK_ERR_IO;
    unsigned char len8[8];
    bk_status st = BK_OK;
    if (pread(fd, len8, 8, 0) != 8) {
        close(fd);
        return bk_error(BK_ERR_ST_TOO_SHORT, "%s: shorter than the 8-byte header length", path);
    }
    uint64_t n = 0;
    for (int i = 0; i < 8; i++)
        n |= (uint64_t)len8[i] << (8 * i);
    if (n > ACT_MAX_HEADER || 8 + n > (uint64_t)sb.st_size) {
        close(fd);
        return bk_error(BK_ERR_ST_HEADER_BOUNDS,
                        "%s: header length %llu is not a layer file's (file of %lld bytes)", path,
                        (unsigned long long)n, (long long)sb.st_size);
    }
    char *j = malloc((size_t)n + 1);
    if (!j) {
        close(fd);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    if (pread(fd, j, (size_t)n, 8) != (ssize_t)n) {
        st = bk_error(BK_ERR_IO, "%s: cannot read the header: %s", path, strerror(errno));
        free(j);
        j = NULL;
    } else {
        j[n] = '\0';
    }
    close(fd);
    *json = j;
    return st;
}

/* The short form of a digest for messages. */
static const char *short_sha(const char *hex, char buf[17])
{
    memcpy(buf, hex, 16);
    buf[16] = '\0';
    return buf;
}

/* Check layer file `i` from its header alone (before any layer is processed):
 * the layer it holds, the model and calibration it was made from (version 2),
 * exactly the five tensors with the manifest's dtype and the model's shapes.
 * Sets *image to 8 + header + data bytes: the file's exact (decompressed) size. */
static bk_status check_layer_header(bk_act_reader *r, int64_t i, const char *path,
                                    const char *json, uint64_t *image)
{
    cJSON *h = cJSON_ParseWithLength(json, strlen(json));
    bk_status st = BK_OK;
    if (!cJSON_IsObject(h)) {
        st = bk_error(BK_ERR_CALIB, "%s: the safetensors header is not a JSON object", path);
        goto out;
    }
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(h, "__metadata__");
    const cJSON *lay = cJSON_GetObjectItemCaseSensitive(meta, "layer");
    if (!cJSON_IsString(lay)) {
        st = bk_error(BK_ERR_CALIB, "%s: no \"layer\" in the file's __metadata__ (not a layer "
                      "file of an activation dump)", path);
        goto out;
    }
    char *end = NULL;
    long long lv = strtoll(lay->valuestring, &end, 10);
    if (!lay->valuestring[0] || *end || lv < 0) {
        st = bk_error(BK_ERR_CALIB, "%s: __metadata__ \"layer\" is not a layer index", path);
        goto out;
    }
    if (lv != i) {
        st = bk_error(BK_ERR_CALIB,
                      "%s: holds the activations of layer %lld, but the manifest lists it as "
                      "layer %lld's file (files[%lld]): swapped or redirected dump files",
                      path, lv, (long long)i, (long long)i);
        goto out;
    }
    if (r->version >= 2) {
        struct {
            const char *key, *want, *what;
        } ids[] = {
            {"config_sha256", r->cfg_sha, "another model (its config.json differs)"},
            {"weights_sha256", r->w_sha, "another model (its weights differ)"},
            {"calibration_sha256", r->calib_sha, "other calibration tokens"},
        };
        for (size_t k = 0; k < 3; k++) {
            char got[65], a[17], b[17];
            if (!json_sha(meta, ids[k].key, got)) {
                st = bk_error(BK_ERR_CALIB, "%s: __metadata__ \"%s\" missing or not a SHA-256 "
                              "(a version 2 dump's files carry it)", path, ids[k].key);
                goto out;
            }
            if (strcmp(got, ids[k].want) != 0) {
                st = bk_error(BK_ERR_CALIB,
                              "%s: made from %s than the rest of the dump (%s %s..., "
                              "manifest.json says %s...)",
                              path, ids[k].what, ids[k].key, short_sha(got, a),
                              short_sha(ids[k].want, b));
                goto out;
            }
        }
    }
    const bk_model_config *c = r->cfg;
    const int64_t widths[4] = {c->hidden, c->n_heads * c->head_dim, c->hidden, c->intermediate};
    const int64_t N = r->file_S * r->T;
    const uint64_t esz = bk_dtype_bits(r->dtype) / 8;
    uint64_t data = 0;
    int seen = 0;
    for (const cJSON *e = h->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__"))
            continue;
        int k = -1;
        for (int a = 0; a < 4; a++)
            if (!strcmp(e->string, act_names[a]))
                k = a;
        if (!strcmp(e->string, "position_ids"))
            k = 4;
        if (k < 0) {
            st = bk_error(BK_ERR_CALIB, "%s: unexpected tensor '%s' (a layer file holds %s, %s, "
                          "%s, %s and position_ids)", path, e->string, act_names[0],
                          act_names[1], act_names[2], act_names[3]);
            goto out;
        }
        seen |= 1 << k;
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
        const cJSON *shp = cJSON_GetObjectItemCaseSensitive(e, "shape");
        bk_dtype d;
        if (!cJSON_IsString(dt) || bk_dtype_from_name(dt->valuestring, &d) != BK_OK ||
            !cJSON_IsArray(shp)) {
            st = bk_error(BK_ERR_CALIB, "%s: tensor '%s' has no valid dtype / shape", path,
                          e->string);
            goto out;
        }
        int64_t want0 = N, want1 = k < 4 ? widths[k] : -1;
        int nd = cJSON_GetArraySize(shp);
        int64_t dims[2] = {-1, -1};
        for (int a = 0; a < 2 && a < nd; a++) {
            const cJSON *x = cJSON_GetArrayItem(shp, a);
            if (cJSON_IsNumber(x) && x->valuedouble >= 0 && x->valuedouble <= 9007199254740992.0 &&
                floor(x->valuedouble) == x->valuedouble)
                dims[a] = (int64_t)x->valuedouble;
        }
        const int64_t d0 = dims[0], d1 = dims[1];
        if (k < 4) {
            if (d != r->dtype) {
                st = bk_error(BK_ERR_CALIB, "%s: tensor '%s' is %s, the manifest says %s", path,
                              e->string, bk_dtype_name(d), bk_dtype_name(r->dtype));
                goto out;
            }
            if (nd != 2 || d0 != want0 || d1 != want1) {
                st = bk_error(BK_ERR_CALIB,
                              "%s: tensor '%s' must be [%lld, %lld] (sequences x seqlen, width "
                              "of layer %lld of this model)",
                              path, e->string, (long long)want0, (long long)want1, (long long)i);
                goto out;
            }
            data += (uint64_t)N * (uint64_t)want1 * esz;
        } else {
            if ((d != BK_DT_I32 && d != BK_DT_I64) || nd != 1 || d0 != want0) {
                st = bk_error(BK_ERR_CALIB, "%s: 'position_ids' must be I32/I64 [%lld]", path,
                              (long long)N);
                goto out;
            }
            data += (uint64_t)N * (d == BK_DT_I32 ? 4u : 8u);
        }
    }
    for (int k = 0; k < 5; k++) {
        if (!(seen & (1 << k))) {
            st = bk_error(BK_ERR_CALIB, "%s: tensor '%s' is missing", path,
                          k < 4 ? act_names[k] : "position_ids");
            goto out;
        }
    }
    *image = 8 + strlen(json) + data;
out:
    cJSON_Delete(h);
    return st;
}

bk_status bk__act_open(const char *dir, const bk_model *model, int64_t samples,
                       bk_act_reader **out, int64_t *S, int64_t *T, const char **note)
{
    *out = NULL;
    *note = NULL;
    const bk_model_config *cfg = bk_model_get_config(model);
    char path[4096];
    bk_status st = bk_path_join(path, sizeof path, dir, "manifest.json");
    if (st != BK_OK)
        return st;
    char *text = NULL;
    size_t tlen = 0;
    st = bk_read_file(path, 16u << 20, &text, &tlen);
    if (st != BK_OK)
        return st;
    if ((st = bk_json_check_text(text, tlen, path, BK_ERR_CALIB)) != BK_OK) {
        free(text);
        return st;
    }
    cJSON *j = cJSON_ParseWithLength(text, tlen);
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
        !json_int(j, "version", &ver) || ver < 1 || ver > ACT_VERSION) {
        st = bk_error(BK_ERR_CALIB, "%s: not a '%s' version 1 or %d manifest", path, ACT_FORMAT,
                      ACT_VERSION);
        goto fail;
    }
    r->version = (int)ver;
    const cJSON *model_j = cJSON_GetObjectItemCaseSensitive(j, "model");
    struct {
        const char *key;
        int64_t want;
    } checks[] = {
        {"n_layers", cfg->n_layers},         {"hidden_size", cfg->hidden},
        {"intermediate_size", cfg->intermediate}, {"num_attention_heads", cfg->n_heads},
        {"num_key_value_heads", cfg->n_kv_heads}, {"head_dim", cfg->head_dim},
    };
    if (!cJSON_IsObject(model_j)) {
        st = bk_error(BK_ERR_CALIB, "%s: missing 'model' object", path);
        goto fail;
    }
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        int64_t v;
        if (!json_int(model_j, checks[i].key, &v)) {
            st = bk_error(BK_ERR_CALIB, "%s: model.%s missing or not an integer", path, checks[i].key);
            goto fail;
        }
        if (v != checks[i].want) {
            st = bk_error(BK_ERR_CALIB, "%s: model.%s = %lld but the model has %lld (dump of another model?)",
                          path, checks[i].key, (long long)v, (long long)checks[i].want);
            goto fail;
        }
    }
    if (r->version >= 2) {
        /* the identity of the model and calibration the dump was made from */
        char mc[65], mw[65], a[17], b[17];
        if (!json_sha(model_j, "config_sha256", r->cfg_sha) ||
            !json_sha(model_j, "weights_sha256", r->w_sha) ||
            !json_sha(j, "calibration_sha256", r->calib_sha)) {
            st = bk_error(BK_ERR_CALIB, "%s: model.config_sha256, model.weights_sha256 or "
                          "calibration_sha256 missing or not a SHA-256 (version 2 manifest)",
                          path);
            goto fail;
        }
        if ((st = bk__model_digest(model, mc, mw)) != BK_OK)
            goto fail;
        if (strcmp(mc, r->cfg_sha) != 0) {
            st = bk_error(BK_ERR_CALIB,
                          "%s: dumped from another model: config.json differs (config_sha256 "
                          "%s... in the dump, %s... for %s/config.json)",
                          path, short_sha(r->cfg_sha, a), short_sha(mc, b), bk_model_dir(model));
            goto fail;
        }
        if (strcmp(mw, r->w_sha) != 0) {
            st = bk_error(BK_ERR_CALIB,
                          "%s: dumped from another model: the weights differ (weights_sha256 "
                          "%s... in the dump, %s... for the checkpoint in %s)",
                          path, short_sha(r->w_sha, a), short_sha(mw, b), bk_model_dir(model));
            goto fail;
        }
    } else {
        *note = "activation dump of version 1: no model or calibration digests to check "
                "(layer indices, tensor names and shapes are checked); re-dump to get them";
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
    if (r->file_S > ((int64_t)1 << 40) / r->T) {
        st = bk_error(BK_ERR_CALIB, "%s: %lld sequences of %lld tokens is not a dump size", path,
                      (long long)r->file_S, (long long)r->T);
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
    r->image_bytes = calloc((size_t)layers, sizeof(uint64_t));
    if (!r->files || !r->image_bytes) {
        st = bk_error(BK_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < layers; i++) {
        const cJSON *f = cJSON_GetArrayItem(files, (int)i);
        if (!cJSON_IsString(f) || strchr(f->valuestring, '/') || f->valuestring[0] == '.') {
            st = bk_error(BK_ERR_CALIB, "%s: files[%lld] must be a plain file name", path, (long long)i);
            goto fail;
        }
        if (bk_ends_with(f->valuestring, ".zst") != r->zstd) {
            st = bk_error(BK_ERR_CALIB, "%s: files[%lld] '%s' %s a .zst name but compression is "
                          "\"%s\"", path, (long long)i, f->valuestring,
                          r->zstd ? "is not" : "is", r->zstd ? "zstd" : "none");
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
    /* every layer file's header now (cheap: a compressed file is decompressed
     * only as far as its header), so that a swapped, redirected or foreign file
     * fails before any work is done; a plain file is also opened and validated
     * whole (only its header is read), a compressed one when its layer is reached */
    /* the largest image the manifest's shapes allow (header at its limit, I64
     * positions): a frame that declares more is refused before decoding */
    uint64_t max_image = 8 + ACT_MAX_HEADER;
    {
        const uint64_t N = (uint64_t)(r->file_S * r->T), esz = bk_dtype_bits(r->dtype) / 8;
        max_image += N * 8 + N * esz * (uint64_t)(2 * cfg->hidden + cfg->n_heads * cfg->head_dim +
                                                  cfg->intermediate);
    }
    for (int64_t l = 0; l < layers; l++) {
        char *hdr = NULL;
        uint64_t declared = UINT64_MAX;
        st = r->zstd ? bk_st_zst_header(r->files[l], ACT_MAX_HEADER, max_image,
                                        "the manifest's shapes", &hdr, &declared)
                     : read_plain_header(r->files[l], &hdr);
        if (st == BK_OK)
            st = check_layer_header(r, l, r->files[l], hdr, &r->image_bytes[l]);
        free(hdr);
        if (st == BK_OK && r->zstd && declared != UINT64_MAX && declared != r->image_bytes[l])
            st = bk_error(BK_ERR_CALIB,
                          "%s: the zstd frame declares %llu decompressed bytes, the manifest's "
                          "shapes give %llu",
                          r->files[l], (unsigned long long)declared,
                          (unsigned long long)r->image_bytes[l]);
        if (st == BK_OK && !r->zstd) {
            bk_act_layer al;
            st = bk__act_layer_open(r, (int)l, &al);
            bk__act_layer_close(&al);
        }
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
    /* a compressed file's image is exactly the size its header (checked at
     * open) implies: no larger buffer is ever allocated */
    bk_status st = r->zstd ? bk_st_open_zst_max(path, r->image_bytes[layer],
                                                "the manifest's shapes", &al->file)
                           : bk_st_open(path, &al->file);
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

/* What one layer of a dump needs (the layer driver's body). */
typedef struct dump_run {
    const bk_dump_opts *o;
    const bk_model_config *c;
    const bk_layer_fwd_ops *fo; /* the backend's layer forward */
    void *fc;
    int64_t S, T, N, B, widths[4];
    float *acts[4]; /* [N, width] the module inputs of all sequences */
    void *conv;     /* conversion to the dump's dtype */
    int32_t *pos;   /* position_ids [N] */
    cJSON *files;   /* the manifest's list */
    const char *dir;
    const char *cfg_sha, *w_sha, *calib_sha;
    double t0;
} dump_run;

/* Layer l with the original weights w on every micro-batch, its inputs kept;
 * then its file. */
static bk_status dump_layer(void *user, int l, bk_layer_weights *w)
{
    dump_run *d = user;
    const bk_dump_opts *o = d->o;
    bk_status st = d->fo->layer_begin(d->fc, w);
    if (st != BK_OK)
        return st;
    BK_MB_LOOP(0, d->S, d->B, s0, sb) {
        const int64_t r0 = s0 * d->T;
        float *const taps[4] = {d->acts[0] + r0 * d->widths[0], d->acts[1] + r0 * d->widths[1],
                                d->acts[2] + r0 * d->widths[2], d->acts[3] + r0 * d->widths[3]};
        if ((st = d->fo->layer_taps(d->fc, s0, sb, taps)) != BK_OK)
            break;
    }
    bk_status se = d->fo->layer_end(d->fc);
    if (st == BK_OK)
        st = se;
    if (st != BK_OK)
        return st;
    char fname[64], path[4096];
    snprintf(fname, sizeof fname, "layer.%04d.safetensors%s", l, o->zstd ? ".zst" : "");
    cJSON_AddItemToArray(d->files, cJSON_CreateString(fname));
    if ((st = bk_path_join(path, sizeof path, d->dir, fname)) != BK_OK)
        return st;
    const int64_t N = d->N;
    bk_st_writer *wr = NULL;
    st = bk_st_writer_create(&wr);
    for (int i = 0; i < 4 && st == BK_OK; i++) {
        int64_t shape[2] = {N, d->widths[i]};
        if (o->dtype == BK_DT_F32) {
            st = bk_st_writer_add(wr, act_names[i], BK_DT_F32, 2, shape, d->acts[i], 0);
        } else {
            st = bk_convert(d->acts[i], BK_DT_F32, d->conv, o->dtype, (size_t)(N * d->widths[i]));
            if (st == BK_OK)
                st = bk_st_writer_add(wr, act_names[i], o->dtype, 2, shape, d->conv, 1);
        }
    }
    int64_t pshape[1] = {N};
    if (st == BK_OK)
        st = bk_st_writer_add(wr, "position_ids", BK_DT_I32, 1, pshape, d->pos, 0);
    char lbuf[32];
    snprintf(lbuf, sizeof lbuf, "%d", l);
    if (st == BK_OK)
        st = bk_st_writer_set_meta(wr, "layer", lbuf);
    if (st == BK_OK)
        st = bk_st_writer_set_meta(wr, "config_sha256", d->cfg_sha);
    if (st == BK_OK)
        st = bk_st_writer_set_meta(wr, "weights_sha256", d->w_sha);
    if (st == BK_OK)
        st = bk_st_writer_set_meta(wr, "calibration_sha256", d->calib_sha);
    if (st == BK_OK)
        st = o->zstd ? bk_st_writer_save_zst(wr, path, o->zstd_level) : bk_st_writer_save(wr, path);
    bk_st_writer_free(wr);
    if (st == BK_OK && o->on_event) {
        bk_event ev;
        memset(&ev, 0, sizeof ev);
        ev.kind = BK_EV_LAYER_DONE;
        ev.layer = l;
        ev.n_layers = (int)d->c->n_layers;
        ev.elapsed_s = bk_now() - d->t0;
        ev.eta_s = ev.elapsed_s / (l + 1) * (d->c->n_layers - l - 1);
        ev.message = fname;
        o->on_event(o->user, &ev);
    }
    return st;
}

bk_status bk_dump_activations(const bk_dump_opts *o)
{
    bk_model *model = NULL;
    bk_backend *be = NULL;
    int32_t *tokens = NULL;
    cJSON *man = NULL;
    dump_run dr;
    bk_layer_driver drv;
    memset(&dr, 0, sizeof dr);
    memset(&drv, 0, sizeof drv);
    bk_outdir od;
    memset(&od, 0, sizeof od);
    const char *tmp = od.work;
    int64_t S, T;
    bk_status st;
    dr.o = o;
    dr.t0 = bk_now();

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
    /* the identity of what the dump is made from, in the manifest and every file */
    char cfg_sha[65], w_sha[65], calib_sha[65];
    if ((st = bk__model_digest(model, cfg_sha, w_sha)) != BK_OK)
        goto done;
    bk__calib_digest(tokens, S, T, calib_sha);
    const int64_t N = S * T;
    const int64_t widths[4] = {c->hidden, c->n_heads * c->head_dim, c->hidden, c->intermediate};
    /* the forward pass on the backend (auto: the GPU when present), the
     * residual stream of all sequences held there */
    st = bk_backend_create_params(o->backend, &o->backend_params, &be);
    if (st != BK_OK)
        goto done;
    bk_backend_set_gemm_math(be, bk_gemm_math_resolve(model, o->gemm_math));
    {
        const bk_layer_fwd_params lp = {.model = model, .S = S, .T = T,
                                        .batch = o->batch > 0 ? o->batch
                                                              : bk_fwd_auto_batch(c, S, T),
                                        .taps = 1, .what = "dump-activations"};
        st = bk_backend_layer_fwd_create(be, &lp, &dr.B, &dr.fo, &dr.fc);
    }
    if (st != BK_OK)
        goto done;
    dr.c = c;
    dr.S = S;
    dr.T = T;
    dr.N = N;
    memcpy(dr.widths, widths, sizeof widths);
    dr.dir = tmp;
    dr.cfg_sha = cfg_sha;
    dr.w_sha = w_sha;
    dr.calib_sha = calib_sha;
    for (int i = 0; i < 4; i++)
        dr.acts[i] = bk_alloc((size_t)(N * widths[i]), sizeof(float));
    dr.conv = bk_alloc((size_t)(N * c->intermediate), 2);
    if (!dr.acts[0] || !dr.acts[1] || !dr.acts[2] || !dr.acts[3] || !dr.conv) {
        st = bk_error(BK_ERR_NOMEM, "dump-activations: out of memory for %lld tokens", (long long)N);
        goto done;
    }
    /* the layer driver: the embedding, then every layer (dump_layer) */
    drv = bk_driver_over_fwd(model, tokens, S, dr.B, dr.fo, dr.fc, dump_layer, &dr);
    st = bk_driver_embed(&drv);
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
    cJSON_AddStringToObject(mj, "config_sha256", cfg_sha);
    cJSON_AddStringToObject(mj, "weights_sha256", w_sha);
    cJSON_AddNumberToObject(man, "sequences", (double)S);
    cJSON_AddNumberToObject(man, "seqlen", (double)T);
    cJSON_AddStringToObject(man, "dtype", bk_dtype_name(o->dtype));
    cJSON_AddStringToObject(man, "compression", o->zstd ? "zstd" : "none");
    cJSON_AddNumberToObject(man, "layers", (double)c->n_layers);
    cJSON_AddStringToObject(man, "calibration", o->calib_path);
    cJSON_AddStringToObject(man, "calibration_sha256", calib_sha);
    cJSON_AddStringToObject(man, "device", dr.fo->device(dr.fc));
    if (dr.fo->uses_gemm_math)
        cJSON_AddStringToObject(man, "gpu_math",
                                bk_gemm_math_name(bk_gemm_math_resolve(model, o->gemm_math)));
    cJSON *files = cJSON_AddArrayToObject(man, "files");

    dr.pos = bk_alloc((size_t)N, sizeof(int32_t));
    if (!dr.pos) {
        st = bk_error(BK_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int64_t i = 0; i < N; i++)
        dr.pos[i] = (int32_t)(i % T);
    dr.files = files;
    drv.stop_check = 1;
    drv.stop_first = 0;
    drv.stop_count = (int)c->n_layers;
    st = bk_driver_layers(&drv, 0, (int)c->n_layers);
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
    bk_driver_end(&drv);
    bk_outdir_close(&od);
    cJSON_Delete(man);
    free(dr.conv);
    free(dr.pos);
    for (int i = 0; i < 4; i++)
        free(dr.acts[i]);
    free(tokens);
    if (dr.fo)
        dr.fo->destroy(dr.fc);
    bk_backend_destroy(be);
    if (model)
        bk_model_close(model);
    return st;
}
