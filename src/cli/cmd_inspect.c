/* bakron inspect PATH [--json] — describe a model folder, a checkpoint
 * (.safetensors, .safetensors.zst, *.index.json, a folder without
 * config.json) or a lone config.json. Everything is gathered first, then
 * printed, so a failure never leaves half a report on stdout. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "util.h"

static void print_help(void)
{
    printf("usage: bakron inspect PATH [--json]\n"
           "\n"
           "Describe a checkpoint. PATH is one of:\n"
           "  a model folder (config.json + model.safetensors, or shards listed in\n"
           "      model.safetensors.index.json): architecture, layers, sizes, heads,\n"
           "      RoPE settings, tied embeddings, biases / q-k norms, dtypes, parameter\n"
           "      count and bytes, then the tensor table. Every tensor the config\n"
           "      implies is checked first (present, right shape, floating dtype, no\n"
           "      unexpected weights);\n"
           "  a .safetensors or .safetensors.zst file, a *.index.json file or a folder\n"
           "      without config.json: the tensor table, totals and metadata;\n"
           "  any other .json file: read as a config.json and summarized.\n"
           "\n"
           "options:\n"
           "  --json       print one JSON document with the same content\n"
           "  -h, --help   print this help\n"
           "\n"
           "exit codes: 0 ok, 1 usage error, 2 bad input (one line on stderr naming the\n"
           "file or tensor and the rule), 3 runtime error.\n");
}

typedef enum kind { K_MODEL, K_CHECKPOINT, K_INDEX, K_FILE, K_CONFIG } kind;
static const char *const kind_names[] = {"model folder", "checkpoint folder", "sharded index",
                                         "safetensors file", "config.json"};
static const char *const kind_json[] = {"model", "checkpoint", "index", "file", "config"};

typedef struct dt_stat {
    uint64_t tensors, params, bytes;
} dt_stat;

typedef struct report {
    const char *path;
    kind k;
    bk_model *model;      /* K_MODEL */
    bk_st_set *set;       /* K_CHECKPOINT, K_INDEX */
    bk_st_file *file;     /* K_FILE */
    bk_model_config cfg;  /* K_MODEL, K_CONFIG */
    int have_cfg;
    int quantized;
    const char *qformat;
    char arch[128];       /* architectures[0] of config.json, or "" */
    const bk_tensor_info **t; /* natural order */
    size_t n;
    const bk_st_file **files;
    size_t n_files;
    dt_stat dt[BK_DT_COUNT];
    uint64_t params, bytes;
} report;

/* ------------------------------------------------------------- gathering */

/* "layers.2." before "layers.10.": digit runs compare by value. */
static int natural_cmp(const char *a, const char *b)
{
    while (*a && *b) {
        if (*a >= '0' && *a <= '9' && *b >= '0' && *b <= '9') {
            while (*a == '0' && a[1] >= '0' && a[1] <= '9')
                a++;
            while (*b == '0' && b[1] >= '0' && b[1] <= '9')
                b++;
            const char *ea = a, *eb = b;
            while (*ea >= '0' && *ea <= '9')
                ea++;
            while (*eb >= '0' && *eb <= '9')
                eb++;
            size_t la = (size_t)(ea - a), lb = (size_t)(eb - b);
            if (la != lb)
                return la < lb ? -1 : 1;
            int c = memcmp(a, b, la);
            if (c)
                return c;
            a = ea;
            b = eb;
            continue;
        }
        if (*a != *b)
            return (unsigned char)*a < (unsigned char)*b ? -1 : 1;
        a++;
        b++;
    }
    return *a ? 1 : (*b ? -1 : 0);
}

static int cmp_tensor(const void *x, const void *y)
{
    const bk_tensor_info *a = *(const bk_tensor_info *const *)x;
    const bk_tensor_info *b = *(const bk_tensor_info *const *)y;
    int c = natural_cmp(a->name, b->name);
    return c ? c : strcmp(a->name, b->name);
}

/* architectures[0] from a config.json (best effort: only for display). */
static void read_architecture(const char *config_path, char *out, size_t cap)
{
    out[0] = '\0';
    char *buf = NULL;
    size_t len = 0;
    if (bk_read_file(config_path, BK_CONFIG_MAX_BYTES, &buf, &len) != BK_OK) {
        bk_clear_error();
        return;
    }
    cJSON *root = cJSON_ParseWithLength(buf, len);
    const cJSON *a = root ? cJSON_GetObjectItemCaseSensitive(root, "architectures") : NULL;
    const cJSON *first = cJSON_IsArray(a) ? a->child : NULL;
    if (cJSON_IsString(first))
        snprintf(out, cap, "%s", first->valuestring);
    cJSON_Delete(root);
    free(buf);
}

static bk_status collect(report *r)
{
    if (r->k == K_CONFIG)
        return BK_OK;
    const bk_st_set *set = r->model ? bk_model_tensors(r->model) : r->set;
    if (set) {
        r->n = bk_st_set_count(set);
        r->n_files = bk_st_set_file_count(set);
    } else {
        r->n = bk_st_count(r->file);
        r->n_files = 1;
    }
    r->t = calloc(r->n ? r->n : 1, sizeof *r->t);
    r->files = calloc(r->n_files ? r->n_files : 1, sizeof *r->files);
    if (!r->t || !r->files)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", r->path);
    for (size_t i = 0; i < r->n; i++)
        r->t[i] = set ? bk_st_set_tensor(set, i) : bk_st_tensor(r->file, i);
    for (size_t i = 0; i < r->n_files; i++)
        r->files[i] = set ? bk_st_set_file(set, i) : r->file;
    qsort(r->t, r->n, sizeof *r->t, cmp_tensor);
    for (size_t i = 0; i < r->n; i++) {
        const bk_tensor_info *t = r->t[i];
        dt_stat *d = &r->dt[(unsigned)t->dtype < BK_DT_COUNT ? t->dtype : 0];
        d->tensors++;
        d->params += t->numel;
        d->bytes += t->nbytes;
        r->params += t->numel;
        r->bytes += t->nbytes;
    }
    return BK_OK;
}

static bk_status open_report(report *r)
{
    const char *p = r->path;
    char cfg_path[4096];
    bk_status st;
    if (bk_is_dir(p)) {
        if ((st = bk_path_join(cfg_path, sizeof cfg_path, p, "config.json")) != BK_OK)
            return st;
        if (bk_is_file(cfg_path)) {
            r->k = K_MODEL;
            /* (the metadata and scales are checked at open; the codes are
             * not read: inspect stays a look at the headers, also for a
             * model of many GB; eval and merge check every code) */
            if ((st = bk_model_open(p, &r->model)) != BK_OK)
                return st;
            r->cfg = *bk_model_get_config(r->model);
            r->have_cfg = 1;
            r->quantized = bk_model_is_quantized(r->model) != 0;
            r->qformat = bk_model_quant_format(r->model);
            read_architecture(cfg_path, r->arch, sizeof r->arch);
        } else {
            r->k = K_CHECKPOINT;
            if ((st = bk_st_set_open(p, &r->set)) != BK_OK)
                return st;
        }
    } else if (bk_is_file(p)) {
        if (bk_ends_with(p, ".index.json")) {
            r->k = K_INDEX;
            if ((st = bk_st_set_open(p, &r->set)) != BK_OK)
                return st;
        } else if (bk_ends_with(p, ".json")) {
            r->k = K_CONFIG;
            if ((st = bk_model_config_load(p, &r->cfg)) != BK_OK)
                return st;
            r->have_cfg = 1;
            read_architecture(p, r->arch, sizeof r->arch);
        } else {
            r->k = K_FILE;
            if ((st = bk_st_open_any(p, &r->file)) != BK_OK)
                return st;
        }
    } else {
        struct stat sb;
        if (stat(p, &sb) == 0) /* there, but a device, FIFO or socket */
            return bk_error(BK_ERR_IO, "%s: is %s, not a regular file or a folder", p,
                            bk_file_kind(sb.st_mode));
        return bk_error(BK_ERR_IO, "%s: %s", p,
                        errno == ENOENT ? "no such file or directory" : strerror(errno));
    }
    return collect(r);
}

static void close_report(report *r)
{
    bk_model_close(r->model);
    if (r->set)
        bk_st_set_close(r->set);
    if (r->file)
        bk_st_close(r->file);
    free(r->t);
    free(r->files);
}

/* ------------------------------------------------------------ formatting */

static const char *rope_name(bk_rope_type t)
{
    switch (t) {
    case BK_ROPE_LINEAR: return "linear";
    case BK_ROPE_LLAMA3: return "llama3";
    default: return "default";
    }
}

static const char *yes_no(int v)
{
    return v ? "yes" : "no";
}

static void human(double v, const char *const *units, double step, char *out, size_t cap)
{
    int u = 0;
    while (v >= step && units[u + 1]) {
        v /= step;
        u++;
    }
    if (u == 0)
        snprintf(out, cap, "%.0f %s", v, units[0]);
    else
        snprintf(out, cap, "%.2f %s", v, units[u]);
}

static void human_bytes(uint64_t b, char *out, size_t cap)
{
    static const char *const u[] = {"B", "KiB", "MiB", "GiB", "TiB", NULL};
    human((double)b, u, 1024.0, out, cap);
}

static void human_count(uint64_t n, char *out, size_t cap)
{
    static const char *const u[] = {"", "K", "M", "B", "T", NULL};
    human((double)n, u, 1000.0, out, cap);
    size_t l = strlen(out);
    if (l && out[l - 1] == ' ')
        out[l - 1] = '\0';
}

static void fmt_shape(const bk_tensor_info *t, char *out, size_t cap)
{
    size_t l = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < t->ndim && l < cap; i++)
        l += (size_t)snprintf(out + l, cap - l, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (l < cap)
        snprintf(out + l, cap - l, "]");
}

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

static void rope_text(const bk_model_config *c, char *out, size_t cap)
{
    int l = snprintf(out, cap, "%s, theta %.10g", rope_name(c->rope_type), c->rope_theta);
    if (l < 0 || (size_t)l >= cap)
        return;
    if (c->rope_type == BK_ROPE_LINEAR)
        snprintf(out + l, cap - (size_t)l, ", factor %g", c->rope_factor);
    else if (c->rope_type == BK_ROPE_LLAMA3)
        snprintf(out + l, cap - (size_t)l,
                 ", factor %g, low_freq_factor %g, high_freq_factor %g, "
                 "original_max_position_embeddings %lld",
                 c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor,
                 (long long)c->rope_original_max_positions);
}

/* ------------------------------------------------------------------ text */

#define ROW(key, ...)                      \
    do {                                   \
        printf("  %-19s ", key);           \
        printf(__VA_ARGS__);               \
        printf("\n");                      \
    } while (0)

static void print_config_text(const report *r)
{
    const bk_model_config *c = &r->cfg;
    char buf[512];
    if (r->arch[0])
        ROW("architecture", "%s (model_type %s)", r->arch, c->model_type);
    else
        ROW("architecture", "model_type %s", c->model_type);
    ROW("layers", "%lld", (long long)c->n_layers);
    ROW("hidden size", "%lld", (long long)c->hidden);
    ROW("intermediate size", "%lld", (long long)c->intermediate);
    ROW("attention heads", "%lld (kv heads %lld, head_dim %lld)", (long long)c->n_heads,
        (long long)c->n_kv_heads, (long long)c->head_dim);
    ROW("vocab size", "%lld", (long long)c->vocab);
    ROW("max positions", "%lld", (long long)c->max_positions);
    ROW("rms_norm_eps", "%g", c->rms_eps);
    rope_text(c, buf, sizeof buf);
    ROW("rope", "%s", buf);
    ROW("tied embeddings", "%s", yes_no(c->tie_embeddings));
    ROW("biases", "q/k/v %s, o_proj %s, mlp %s", yes_no(c->qkv_bias), yes_no(c->o_bias),
        yes_no(c->mlp_bias));
    ROW("q/k norms", "%s", yes_no(c->qk_norm));
    ROW("activation", "%s", c->hidden_act);
    ROW("config dtype", "%s", bk_dtype_name(c->dtype));
    char bos[32] = "none", eos[32] = "none";
    if (c->bos_token_id >= 0)
        snprintf(bos, sizeof bos, "%lld", (long long)c->bos_token_id);
    if (c->eos_token_id >= 0)
        snprintf(eos, sizeof eos, "%lld", (long long)c->eos_token_id);
    ROW("bos / eos token", "%s / %s", bos, eos);
    uint64_t implied = bk_model_config_param_count(c);
    human_count(implied, buf, sizeof buf);
    ROW("implied parameters", "%llu (%s)", (unsigned long long)implied, buf);
}

static void print_tensors_text(const report *r)
{
    char a[64], b[64];
    int first = 1;
    for (int d = 0; d < BK_DT_COUNT; d++)
        if (r->dt[d].tensors) {
            human_bytes(r->dt[d].bytes, a, sizeof a);
            ROW(first ? "dtypes" : "", "%s: %llu tensor%s, %llu parameters, %s",
                bk_dtype_name((bk_dtype)d), (unsigned long long)r->dt[d].tensors,
                r->dt[d].tensors == 1 ? "" : "s", (unsigned long long)r->dt[d].params, a);
            first = 0;
        }
    human_count(r->params, a, sizeof a);
    ROW("parameters", "%llu (%s)", (unsigned long long)r->params, a);
    human_bytes(r->bytes, b, sizeof b);
    ROW("bytes", "%llu (%s)", (unsigned long long)r->bytes, b);
    ROW("tensors", "%zu", r->n);
    ROW("files", "%zu", r->n_files);
    for (size_t i = 0; i < r->n_files; i++) {
        const bk_st_file *f = r->files[i];
        uint64_t fb = 0;
        for (size_t k = 0; k < bk_st_count(f); k++)
            fb += bk_st_tensor(f, k)->nbytes;
        human_bytes(fb, a, sizeof a);
        printf("    %s: %zu tensor%s, %s",
               r->n_files > 1 ? base_name(bk_st_path(f)) : bk_st_path(f), bk_st_count(f),
               bk_st_count(f) == 1 ? "" : "s", a);
        size_t nm = bk_st_meta_count(f);
        if (nm) {
            printf(", metadata");
            for (size_t k = 0; k < nm; k++) {
                const char *key, *val;
                bk_st_meta_get(f, k, &key, &val);
                printf(" %s=%s", key, val);
            }
        }
        printf("\n");
    }

    size_t wn = 6, ws = 5, wd = 5;
    char shape[256];
    for (size_t i = 0; i < r->n; i++) {
        size_t l = strlen(r->t[i]->name);
        if (l > wn)
            wn = l;
        l = strlen(bk_dtype_name(r->t[i]->dtype));
        if (l > wd)
            wd = l;
        fmt_shape(r->t[i], shape, sizeof shape);
        if (strlen(shape) > ws)
            ws = strlen(shape);
    }
    int sharded = r->n_files > 1;
    printf("\n  %-*s  %-*s  %-*s  %12s%s\n", (int)wn, "tensor", (int)wd, "dtype", (int)ws,
           "shape", "bytes", sharded ? "  file" : "");
    for (size_t i = 0; i < r->n; i++) {
        const bk_tensor_info *t = r->t[i];
        fmt_shape(t, shape, sizeof shape);
        printf("  %-*s  %-*s  %-*s  %12llu", (int)wn, t->name, (int)wd,
               bk_dtype_name(t->dtype), (int)ws, shape, (unsigned long long)t->nbytes);
        if (sharded)
            printf("  %s", base_name(t->file));
        printf("\n");
    }
}

static void print_text(const report *r)
{
    printf("%s: %s\n", r->path, kind_names[r->k]);
    if (r->have_cfg)
        print_config_text(r);
    if (r->k == K_MODEL)
        ROW("quantized", "%s%s%s", r->quantized ? "yes (" : "no",
            r->quantized && r->qformat ? r->qformat : "", r->quantized ? ")" : "");
    if (r->k != K_CONFIG)
        print_tensors_text(r);
}

#undef ROW

/* ------------------------------------------------------------------ JSON */

typedef struct jb {
    int oom;
} jb;

static cJSON *jchk(jb *b, cJSON *v)
{
    if (!v)
        b->oom = 1;
    return v;
}

static void jnum(jb *b, cJSON *o, const char *k, double v)
{
    if (o)
        jchk(b, cJSON_AddNumberToObject(o, k, v));
}

static void jstr(jb *b, cJSON *o, const char *k, const char *v)
{
    if (o)
        jchk(b, cJSON_AddStringToObject(o, k, v));
}

static void jbool(jb *b, cJSON *o, const char *k, int v)
{
    if (o)
        jchk(b, cJSON_AddBoolToObject(o, k, v));
}

static cJSON *jobj(jb *b, cJSON *parent, const char *k)
{
    cJSON *o = jchk(b, cJSON_CreateObject());
    if (o && parent && !cJSON_AddItemToObject(parent, k, o)) {
        cJSON_Delete(o);
        b->oom = 1;
        return NULL;
    }
    return o;
}

static cJSON *jarr(jb *b, cJSON *parent, const char *k)
{
    cJSON *o = jchk(b, cJSON_CreateArray());
    if (o && parent && !cJSON_AddItemToObject(parent, k, o)) {
        cJSON_Delete(o);
        b->oom = 1;
        return NULL;
    }
    return o;
}

static cJSON *jpush_obj(jb *b, cJSON *arr)
{
    cJSON *o = jchk(b, cJSON_CreateObject());
    if (o && arr && !cJSON_AddItemToArray(arr, o)) {
        cJSON_Delete(o);
        b->oom = 1;
        return NULL;
    }
    return o;
}

static void json_config(jb *b, cJSON *root, const report *r)
{
    const bk_model_config *c = &r->cfg;
    cJSON *o = jobj(b, root, "config");
    if (r->arch[0])
        jstr(b, o, "architecture", r->arch);
    jstr(b, o, "model_type", c->model_type);
    jnum(b, o, "num_hidden_layers", (double)c->n_layers);
    jnum(b, o, "hidden_size", (double)c->hidden);
    jnum(b, o, "intermediate_size", (double)c->intermediate);
    jnum(b, o, "num_attention_heads", (double)c->n_heads);
    jnum(b, o, "num_key_value_heads", (double)c->n_kv_heads);
    jnum(b, o, "head_dim", (double)c->head_dim);
    jnum(b, o, "vocab_size", (double)c->vocab);
    jnum(b, o, "max_position_embeddings", (double)c->max_positions);
    jnum(b, o, "rms_norm_eps", c->rms_eps);
    cJSON *rp = jobj(b, o, "rope");
    jstr(b, rp, "type", rope_name(c->rope_type));
    jnum(b, rp, "theta", c->rope_theta);
    if (c->rope_type != BK_ROPE_DEFAULT)
        jnum(b, rp, "factor", c->rope_factor);
    if (c->rope_type == BK_ROPE_LLAMA3) {
        jnum(b, rp, "low_freq_factor", c->rope_low_freq_factor);
        jnum(b, rp, "high_freq_factor", c->rope_high_freq_factor);
        jnum(b, rp, "original_max_position_embeddings", (double)c->rope_original_max_positions);
    }
    jbool(b, o, "tie_word_embeddings", c->tie_embeddings);
    jbool(b, o, "qkv_bias", c->qkv_bias);
    jbool(b, o, "o_bias", c->o_bias);
    jbool(b, o, "mlp_bias", c->mlp_bias);
    jbool(b, o, "qk_norm", c->qk_norm);
    jstr(b, o, "hidden_act", c->hidden_act);
    jstr(b, o, "dtype", bk_dtype_name(c->dtype));
    if (c->bos_token_id >= 0)
        jnum(b, o, "bos_token_id", (double)c->bos_token_id);
    else if (o)
        jchk(b, cJSON_AddNullToObject(o, "bos_token_id"));
    if (c->eos_token_id >= 0)
        jnum(b, o, "eos_token_id", (double)c->eos_token_id);
    else if (o)
        jchk(b, cJSON_AddNullToObject(o, "eos_token_id"));
    jnum(b, o, "implied_parameters", (double)bk_model_config_param_count(c));
}

static void json_tensors(jb *b, cJSON *root, const report *r)
{
    jnum(b, root, "parameters", (double)r->params);
    jnum(b, root, "bytes", (double)r->bytes);
    cJSON *d = jobj(b, root, "dtypes");
    for (int k = 0; k < BK_DT_COUNT; k++)
        if (r->dt[k].tensors) {
            cJSON *e = jobj(b, d, bk_dtype_name((bk_dtype)k));
            jnum(b, e, "tensors", (double)r->dt[k].tensors);
            jnum(b, e, "parameters", (double)r->dt[k].params);
            jnum(b, e, "bytes", (double)r->dt[k].bytes);
        }
    cJSON *fa = jarr(b, root, "files");
    for (size_t i = 0; i < r->n_files; i++) {
        const bk_st_file *f = r->files[i];
        cJSON *e = jpush_obj(b, fa);
        uint64_t fb = 0;
        for (size_t k = 0; k < bk_st_count(f); k++)
            fb += bk_st_tensor(f, k)->nbytes;
        jstr(b, e, "path", bk_st_path(f));
        jnum(b, e, "tensors", (double)bk_st_count(f));
        jnum(b, e, "bytes", (double)fb);
        jnum(b, e, "header_bytes", (double)bk_st_header_size(f));
        cJSON *md = jobj(b, e, "metadata");
        for (size_t k = 0; k < bk_st_meta_count(f); k++) {
            const char *key, *val;
            bk_st_meta_get(f, k, &key, &val);
            jstr(b, md, key, val);
        }
    }
    cJSON *ta = jarr(b, root, "tensors");
    for (size_t i = 0; i < r->n && !b->oom; i++) {
        const bk_tensor_info *t = r->t[i];
        cJSON *e = jpush_obj(b, ta);
        jstr(b, e, "name", t->name);
        jstr(b, e, "dtype", bk_dtype_name(t->dtype));
        cJSON *sh = jarr(b, e, "shape");
        for (int k = 0; k < t->ndim && sh; k++) {
            cJSON *n = jchk(b, cJSON_CreateNumber((double)t->shape[k]));
            if (n && !cJSON_AddItemToArray(sh, n)) {
                cJSON_Delete(n);
                b->oom = 1;
            }
        }
        jnum(b, e, "bytes", (double)t->nbytes);
        jstr(b, e, "file", r->n_files > 1 ? base_name(t->file) : t->file);
    }
}

static bk_status print_json(const report *r)
{
    jb b = {0};
    cJSON *root = jobj(&b, NULL, NULL);
    jstr(&b, root, "path", r->path);
    jstr(&b, root, "kind", kind_json[r->k]);
    if (r->have_cfg)
        json_config(&b, root, r);
    if (r->k == K_MODEL)
        jbool(&b, root, "quantized", r->quantized);
    if (r->k == K_MODEL && r->quantized && r->qformat)
        jstr(&b, root, "quantization_format", r->qformat);
    if (r->k != K_CONFIG)
        json_tensors(&b, root, r);
    char *text = b.oom ? NULL : cJSON_Print(root);
    cJSON_Delete(root);
    if (!text)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory building the JSON report", r->path);
    fputs(text, stdout);
    fputc('\n', stdout);
    cJSON_free(text);
    return BK_OK;
}

/* ------------------------------------------------------------------ main */

bk_status bk_cmd_inspect(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        print_help();
        return BK_OK;
    }
    const char *path = NULL;
    int json = 0, opts_done = 0;
    cli_once once = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!opts_done && !strcmp(a, "--")) {
            opts_done = 1;
        } else if (!opts_done && !strcmp(a, "--json")) {
            bk_status ost = cli_once_add(&once, "json", NULL);
            if (ost != BK_OK)
                return ost;
            json = 1;
        } else if (!opts_done && a[0] == '-' && a[1] != '\0') {
            return cli_usage_error("unknown option '%s'", a);
        } else if (path) {
            return cli_usage_error("expected one PATH, got '%s' and '%s'", path, a);
        } else {
            path = a;
        }
    }
    if (!path)
        return cli_usage_error("missing PATH (a model folder, a .safetensors file or an "
                               "index.json)");

    report r;
    memset(&r, 0, sizeof r);
    r.path = path;
    bk_status st = open_report(&r);
    if (st == BK_OK) {
        if (json)
            st = print_json(&r);
        else
            print_text(&r);
        if (st == BK_OK && fflush(stdout) != 0)
            st = bk_error(BK_ERR_WRITE, "inspect: cannot write to standard output");
    }
    close_report(&r);
    return st;
}
