/* bakron merge: assemble the outputs of layer-range runs (`quantize
 * --activations DIR --layers A:B`) into the checkpoint a single full run
 * writes (docs/DISTRIBUTED.md). The parts must cover every layer exactly
 * once and agree on everything but the layer range: settings, calibration,
 * model (the tensors no part quantized must be the same bytes in every part).
 *
 * Byte identity with the full run: a part's tensors are in the order the
 * full run declares them (the model's tensors sorted by name, a quantized
 * module's tensors in place of its weight), and every "model.layers.L."
 * name is contiguous in that order. The merged output takes the sequence of
 * groups (one tensor outside the layers, or a whole layer) from the first
 * part and each layer's group from the part that quantized it; the stream
 * writer then lays out the same shards as the full run (same
 * --max-shard-size). config.json is the first part's with the layer range of
 * the whole model; report.json merges the parts' module lists and times. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "bakron/bakron.h"
#include "bakron/dist.h"
#include "bakron/pipeline.h"
#include "outdir.h"
#include "pipeline_internal.h"
#include "stop.h"
#include "util.h"

typedef struct part {
    const char *dir;
    cJSON *config;  /* config.json */
    cJSON *qc;      /* its quantization_config (or bakron_dequantized_from) */
    cJSON *b;       /* where the bakron keys are (qc, or qc.bakron for gptq) */
    cJSON *report;  /* report.json */
    int lo, hi;     /* layer range */
    bk_st_set *set;
    bk_model *model; /* the part read as a model: its checks (metadata, scales) */
    const bk_tensor_info **order; /* tensors in declaration (file) order */
    size_t n;
} part;

/* "model.layers.L." -> L, else -1. */
static int layer_of(const char *name)
{
    const char *pre = "model.layers.";
    size_t lp = strlen(pre);
    if (strncmp(name, pre, lp) != 0)
        return -1;
    char *end = NULL;
    long l = strtol(name + lp, &end, 10);
    if (end == name + lp || *end != '.' || l < 0 || l > 1000000)
        return -1;
    return (int)l;
}

/* A tensor of a linear module of its layer ("model.layers.L.<module>.*"). */
static int is_module_tensor(const char *name)
{
    int l = layer_of(name);
    if (l < 0)
        return 0;
    const char *rest = strchr(name + strlen("model.layers."), '.') + 1;
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        const char *mn = bk_module_name((bk_module)m);
        size_t lm = strlen(mn);
        if (!strncmp(rest, mn, lm) && rest[lm] == '.')
            return 1;
    }
    return 0;
}

static bk_status read_json(const char *dir, const char *file, cJSON **out)
{
    char path[BK_PATH_MAX], *text = NULL;
    bk_status st = bk_path_join(path, sizeof path, dir, file);
    if (st == BK_OK)
        st = bk_read_file(path, 256u << 20, &text, NULL);
    if (st != BK_OK)
        return bk_error(BK_ERR_INVALID_ARG, "%s: not a bakron quantize output (no readable %s)",
                        dir, file);
    *out = cJSON_Parse(text);
    free(text);
    if (!*out)
        return bk_error(BK_ERR_CONFIG, "%s: cannot parse", path);
    return BK_OK;
}

/* Path of the first difference between a and b ("" when equal). */
static int first_diff(const cJSON *a, const cJSON *b, char *path, size_t cap)
{
    if (cJSON_Compare(a, b, 1))
        return 0;
    if (cJSON_IsObject(a) && cJSON_IsObject(b)) {
        size_t len = strlen(path);
        const cJSON *it;
        cJSON_ArrayForEach(it, a)
        {
            const cJSON *o = cJSON_GetObjectItemCaseSensitive(b, it->string);
            snprintf(path + len, cap - len, "%s%s", len ? "." : "", it->string);
            if (!o || first_diff(it, o, path, cap))
                return 1;
        }
        cJSON_ArrayForEach(it, b)
        {
            if (!cJSON_GetObjectItemCaseSensitive(a, it->string)) {
                snprintf(path + len, cap - len, "%s%s", len ? "." : "", it->string);
                return 1;
            }
        }
        path[len] = 0;
    }
    return 1;
}

static int cmp_str(const void *x, const void *y)
{
    return strcmp(*(const char *const *)x, *(const char *const *)y);
}

/* The part's tensors in the order they were declared: shards in name order
 * (BASENAME-0000i-of-0000n), each file's tensors by data offset. */
static bk_status part_order(part *p)
{
    size_t nf = bk_st_set_file_count(p->set);
    const bk_st_file **files = calloc(nf ? nf : 1, sizeof *files);
    p->order = calloc(bk_st_set_count(p->set) + 1, sizeof *p->order);
    if (!files || !p->order) {
        free(files);
        return bk_error(BK_ERR_NOMEM, "merge: out of memory");
    }
    for (size_t i = 0; i < nf; i++)
        files[i] = bk_st_set_file(p->set, i);
    /* sort by path (the first member of each entry is compared as a string) */
    const char **paths = calloc(nf ? nf : 1, sizeof *paths);
    if (!paths) {
        free(files);
        return bk_error(BK_ERR_NOMEM, "merge: out of memory");
    }
    for (size_t i = 0; i < nf; i++)
        paths[i] = bk_st_path(files[i]);
    qsort(paths, nf, sizeof *paths, cmp_str);
    p->n = 0;
    for (size_t k = 0; k < nf; k++)
        for (size_t i = 0; i < nf; i++)
            if (bk_st_path(files[i]) == paths[k])
                for (size_t t = 0; t < bk_st_count(files[i]); t++)
                    p->order[p->n++] = bk_st_tensor(files[i], t);
    free(paths);
    free(files);
    return BK_OK;
}

static int64_t n_layers_of(const cJSON *cfg)
{
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(cfg, "num_hidden_layers");
    if (!cJSON_IsNumber(n)) {
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(cfg, "text_config");
        n = tc ? cJSON_GetObjectItemCaseSensitive(tc, "num_hidden_layers") : NULL;
    }
    return cJSON_IsNumber(n) ? (int64_t)n->valuedouble : -1;
}

/* What merge_report takes from a part's report.json, with its type: the
 * module entries (copied), the times (summed), the parameter count (summed),
 * the peak device memory (the largest) and the quantization block (the
 * first part's, replaced by the merged config's). A report without one of
 * them is not a bakron quantize report: refused before the merge. */
static bk_status report_check(const part *p)
{
    if (!cJSON_IsObject(p->report))
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s/report.json: not a bakron quantize report (not a JSON object)", p->dir);
    static const struct {
        const char *key;
        int type; /* cJSON_Array (of objects), cJSON_Object, cJSON_Number */
        const char *what;
    } need[] = {
        {"modules", cJSON_Array, "an array of module objects"},
        {"times_s", cJSON_Object, "an object"},
        {"quantized_parameters", cJSON_Number, "a number"},
        {"peak_device_bytes", cJSON_Number, "a number"},
        {"quantization", cJSON_Object, "an object"},
    };
    for (size_t k = 0; k < sizeof need / sizeof need[0]; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(p->report, need[k].key);
        int ok = v && (v->type & 0xFF) == need[k].type;
        const cJSON *e;
        if (ok && need[k].type == cJSON_Array)
            cJSON_ArrayForEach(e, v) ok = ok && cJSON_IsObject(e);
        if (!ok)
            return bk_error(BK_ERR_INVALID_ARG,
                            "%s/report.json: not a bakron quantize report (%s \"%s\", which merge "
                            "needs as %s)",
                            p->dir, v ? "wrong type of" : "no", need[k].key, need[k].what);
    }
    return BK_OK;
}

static bk_status part_load(part *p)
{
    bk_status st = read_json(p->dir, "config.json", &p->config);
    if (st != BK_OK)
        return st;
    p->qc = cJSON_GetObjectItemCaseSensitive(p->config, "quantization_config");
    if (!p->qc)
        p->qc = cJSON_GetObjectItemCaseSensitive(p->config, "bakron_dequantized_from");
    const cJSON *qm = p->qc ? cJSON_GetObjectItemCaseSensitive(p->qc, "quant_method") : NULL;
    p->b = p->qc;
    if (cJSON_IsString(qm) && !strcmp(qm->valuestring, "gptq"))
        p->b = cJSON_GetObjectItemCaseSensitive(p->qc, "bakron");
    const cJSON *lr = p->b ? cJSON_GetObjectItemCaseSensitive(p->b, "layers") : NULL;
    if (!cJSON_IsArray(lr) || cJSON_GetArraySize(lr) != 2 ||
        !cJSON_IsNumber(cJSON_GetArrayItem(lr, 0)) || !cJSON_IsNumber(cJSON_GetArrayItem(lr, 1)))
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s/config.json: not a bakron quantize output (no quantization_config "
                        "with a layer range)",
                        p->dir);
    p->lo = (int)cJSON_GetArrayItem(lr, 0)->valuedouble;
    p->hi = (int)cJSON_GetArrayItem(lr, 1)->valuedouble;
    /* a layer range's inputs must not depend on the layers before it */
    const cJSON *cal = cJSON_GetObjectItemCaseSensitive(p->b, "calibration");
    const cJSON *tok = cal ? cJSON_GetObjectItemCaseSensitive(cal, "tokens") : NULL;
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(p->b, "sequential");
    if (tok && cJSON_IsTrue(seq) && p->lo > 0)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: made from calibration tokens (--calib) with the sequential flow: "
                        "layers %d:%d saw unquantized layers before them, unlike a full run "
                        "(merge parts made with --activations DIR, --no-sequential or "
                        "--hessian rtn)",
                        p->dir, p->lo, p->hi);
    if ((st = read_json(p->dir, "report.json", &p->report)) != BK_OK ||
        (st = report_check(p)) != BK_OK)
        return st;
    if ((st = bk_st_set_open(p->dir, &p->set)) != BK_OK)
        return st;
    /* what bakron eval would refuse: the quantization metadata against the
     * tensors, every shape, the scales (the codes: as they are copied) */
    if ((st = bk_model_open(p->dir, &p->model)) != BK_OK)
        return st;
    return part_order(p);
}

static void part_free(part *p)
{
    cJSON_Delete(p->config);
    cJSON_Delete(p->report);
    if (p->set)
        bk_st_set_close(p->set);
    bk_model_close(p->model);
    free(p->order);
}

/* Test hook (tests/test_merge_signals.sh): BK_FAULT_PAUSE_AT=merge-write
 * holds the merge for up to 2 s (ended early by a stop request) when it
 * starts writing the tensors into its work folder, so that a test's signal
 * lands mid-merge. */
static void pause_point(const char *name)
{
    const char *e = getenv("BK_FAULT_PAUSE_AT");
    if (!e || strcmp(e, name) != 0)
        return;
    fprintf(stderr, "bakron: test hook: paused at %s (BK_FAULT_PAUSE_AT)\n", name);
    fflush(stderr);
    const struct timespec ts = {0, 10 * 1000 * 1000};
    for (int i = 0; i < 200 && !bk__stop_requested(); i++)
        nanosleep(&ts, NULL);
}

/* A stop request (SIGINT, SIGTERM, SIGHUP: bk_request_stop) ends the merge at
 * the next part or layer; bk_merge then removes the work folder. */
static bk_status stop_check(const char *what, int n)
{
    if (!bk__stop_requested())
        return BK_OK;
    if (n >= 0)
        return bk_error(BK_ERR_INTERRUPTED, "merge: interrupted %s %d", what, n);
    return bk_error(BK_ERR_INTERRUPTED, "merge: interrupted %s", what);
}

static int cmp_part(const void *x, const void *y)
{
    const part *a = x, *b = y;
    return a->lo != b->lo ? (a->lo < b->lo ? -1 : 1) : (a->hi < b->hi ? -1 : a->hi > b->hi);
}

static bk_status same_tensor(const part *p, const bk_tensor_info *t, const part *ref)
{
    const bk_tensor_info *u = bk_st_set_find(p->set, t->name);
    if (!u)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: has no tensor %s, which %s has (parts of different models?)", p->dir,
                        t->name, ref->dir);
    int same = u->dtype == t->dtype && u->ndim == t->ndim && u->nbytes == t->nbytes;
    for (int d = 0; same && d < t->ndim; d++)
        same = u->shape[d] == t->shape[d];
    if (same)
        same = memcmp(u->data, t->data, (size_t)t->nbytes) == 0;
    if (!same)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: tensor %s differs from %s's (parts of different models?)", p->dir,
                        t->name, ref->dir);
    return BK_OK;
}

/* The layer range [lo, hi) in every copy of the quantization config. */
static void set_layers(cJSON *b, int lo, int hi)
{
    cJSON *lr = cJSON_CreateArray();
    cJSON_AddItemToArray(lr, cJSON_CreateNumber(lo));
    cJSON_AddItemToArray(lr, cJSON_CreateNumber(hi));
    cJSON_ReplaceItemInObjectCaseSensitive(b, "layers", lr);
}

static bk_status write_json(const char *dir, const char *file, const cJSON *j)
{
    char path[BK_PATH_MAX];
    char *text = cJSON_Print(j);
    if (!text)
        return bk_error(BK_ERR_NOMEM, "merge: out of memory writing %s", file);
    bk_status st = bk_path_join(path, sizeof path, dir, file);
    if (st == BK_OK)
        st = bk_write_file_atomic(path, text, strlen(text));
    free(text);
    return st;
}

/* report.json: the first part's, with the merged layer range, every part's
 * modules in layer order, the times and parameter counts summed. */
static bk_status merge_report(part *ps, int n, const cJSON *qc, const char *work)
{
    cJSON *rep = cJSON_Duplicate(ps[0].report, 1);
    if (!rep)
        return bk_error(BK_ERR_NOMEM, "merge: out of memory");
    if (cJSON_GetObjectItemCaseSensitive(rep, "quantization"))
        cJSON_ReplaceItemInObjectCaseSensitive(rep, "quantization", cJSON_Duplicate(qc, 1));
    cJSON *mods = cJSON_CreateArray();
    double params = 0, peak = 0;
    for (int i = 0; i < n; i++) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(ps[i].report, "modules"), *it;
        cJSON_ArrayForEach(it, m) cJSON_AddItemToArray(mods, cJSON_Duplicate(it, 1));
        const cJSON *qp = cJSON_GetObjectItemCaseSensitive(ps[i].report, "quantized_parameters");
        const cJSON *pk = cJSON_GetObjectItemCaseSensitive(ps[i].report, "peak_device_bytes");
        params += cJSON_IsNumber(qp) ? qp->valuedouble : 0;
        if (cJSON_IsNumber(pk) && pk->valuedouble > peak)
            peak = pk->valuedouble;
        if (i == 0)
            continue;
        cJSON *t0 = cJSON_GetObjectItemCaseSensitive(rep, "times_s");
        const cJSON *ti = cJSON_GetObjectItemCaseSensitive(ps[i].report, "times_s");
        cJSON *f;
        cJSON_ArrayForEach(f, t0)
        {
            const cJSON *g = ti ? cJSON_GetObjectItemCaseSensitive(ti, f->string) : NULL;
            if (cJSON_IsNumber(f) && cJSON_IsNumber(g))
                cJSON_SetNumberValue(f, f->valuedouble + g->valuedouble);
        }
    }
    if (cJSON_GetObjectItemCaseSensitive(rep, "modules"))
        cJSON_ReplaceItemInObjectCaseSensitive(rep, "modules", mods);
    else
        cJSON_AddItemToObject(rep, "modules", mods);
    cJSON *qp = cJSON_GetObjectItemCaseSensitive(rep, "quantized_parameters");
    if (cJSON_IsNumber(qp))
        cJSON_SetNumberValue(qp, params);
    cJSON *pk = cJSON_GetObjectItemCaseSensitive(rep, "peak_device_bytes");
    if (cJSON_IsNumber(pk))
        cJSON_SetNumberValue(pk, peak);
    bk_status st = write_json(work, "report.json", rep);
    cJSON_Delete(rep);
    return st;
}

bk_status bk__merge_into(const char *const *dirs, int n, const char *work,
                         uint64_t max_shard_bytes)
{
    if (n < 1)
        return bk_error(BK_ERR_INVALID_ARG, "merge: no parts given");
    part *ps = calloc((size_t)n, sizeof *ps);
    if (!ps)
        return bk_error(BK_ERR_NOMEM, "merge: out of memory");
    bk_status st = BK_OK;
    bk_st_stream *out = NULL;
    for (int i = 0; i < n && st == BK_OK; i++) {
        ps[i].dir = dirs[i];
        if ((st = stop_check("while reading the parts", -1)) == BK_OK)
            st = part_load(&ps[i]);
    }
    if (st != BK_OK)
        goto done;
    /* everything but the layer range must agree with the first part given */
    {
        cJSON *ref = cJSON_Duplicate(ps[0].config, 1);
        for (int i = 1; i < n && st == BK_OK; i++) {
            cJSON *c = cJSON_Duplicate(ps[i].config, 1);
            if (!ref || !c) {
                cJSON_Delete(c);
                st = bk_error(BK_ERR_NOMEM, "merge: out of memory");
                break;
            }
            /* compare with the layer ranges blanked */
            cJSON *x[2] = {ref, c};
            for (int k = 0; k < 2; k++) {
                cJSON *qc = cJSON_GetObjectItemCaseSensitive(x[k], "quantization_config");
                if (!qc)
                    qc = cJSON_GetObjectItemCaseSensitive(x[k], "bakron_dequantized_from");
                cJSON *b = qc;
                if (qc && cJSON_GetObjectItemCaseSensitive(qc, "bakron"))
                    b = cJSON_GetObjectItemCaseSensitive(qc, "bakron");
                if (b)
                    set_layers(b, 0, 0);
            }
            char path[512] = "";
            if (first_diff(ref, c, path, sizeof path))
                st = bk_error(BK_ERR_INVALID_ARG,
                              "%s: made with different settings, model or calibration than %s "
                              "(config.json differs at '%s')",
                              ps[i].dir, ps[0].dir, path[0] ? path : "(top level)");
            cJSON_Delete(c);
        }
        cJSON_Delete(ref);
        if (st != BK_OK)
            goto done;
    }
    /* the ranges: every layer exactly once */
    const int64_t L = n_layers_of(ps[0].config);
    if (L <= 0) {
        st = bk_error(BK_ERR_CONFIG, "%s/config.json: no num_hidden_layers", ps[0].dir);
        goto done;
    }
    qsort(ps, (size_t)n, sizeof *ps, cmp_part);
    for (int i = 0; i < n; i++) {
        int want = i ? ps[i - 1].hi : 0;
        if (ps[i].lo < want) {
            st = bk_error(BK_ERR_INVALID_ARG, "merge: %s (layers %d:%d) overlaps %s (layers %d:%d)",
                          ps[i].dir, ps[i].lo, ps[i].hi, ps[i - 1].dir, ps[i - 1].lo,
                          ps[i - 1].hi);
            goto done;
        }
        if (ps[i].lo > want) {
            st = bk_error(BK_ERR_INVALID_ARG,
                          "merge: layers %d:%d are missing (no part quantized them; the model "
                          "has %lld layers)",
                          want, ps[i].lo, (long long)L);
            goto done;
        }
    }
    if (ps[n - 1].hi != L) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "merge: layers %d:%lld are missing (no part quantized them; the model has "
                      "%lld layers)",
                      ps[n - 1].hi, (long long)L, (long long)L);
        goto done;
    }
    /* the tensors: groups in the first part's order, each layer from its part */
    if ((st = bk_st_stream_begin(work, "model", max_shard_bytes ? max_shard_bytes : 5000000000ull,
                                 &out)) != BK_OK)
        goto done;
    for (int pass = 0; pass < 2 && st == BK_OK; pass++) {
        const part *p0 = &ps[0];
        if (pass == 1) {
            pause_point("merge-write");
            st = stop_check("before writing the tensors", -1);
        }
        for (size_t i = 0; i < p0->n && st == BK_OK;) {
            const bk_tensor_info *t = p0->order[i];
            int l = layer_of(t->name);
            if (l < 0) {
                if (pass == 0) {
                    for (int k = 1; k < n && st == BK_OK; k++)
                        st = same_tensor(&ps[k], t, p0);
                    if (st == BK_OK)
                        st = bk_st_stream_declare(out, t->name, t->dtype, t->ndim, t->shape);
                } else {
                    st = bk_st_stream_write(out, t->name, t->data);
                }
                i++;
                continue;
            }
            if ((st = stop_check(pass ? "while writing layer" : "while checking layer", l)) !=
                BK_OK)
                break;
            while (i < p0->n && layer_of(p0->order[i]->name) == l)
                i++;
            int c = 0;
            while (c < n && !(l >= ps[c].lo && l < ps[c].hi))
                c++;
            if (c == n) {
                st = bk_error(BK_ERR_INVALID_ARG, "merge: layer %d is in no part's range", l);
                break;
            }
            const part *pc = &ps[c];
            size_t k = 0;
            while (k < pc->n && layer_of(pc->order[k]->name) != l)
                k++;
            if (k == pc->n) {
                st = bk_error(BK_ERR_INVALID_ARG, "%s: has no tensors of layer %d", pc->dir, l);
                break;
            }
            for (; k < pc->n && layer_of(pc->order[k]->name) == l && st == BK_OK; k++) {
                const bk_tensor_info *u = pc->order[k];
                if (pass == 1) {
                    if (bk_ends_with(u->name, ".qweight"))
                        st = bk__model_check_qweight(pc->model, u);
                    if (st == BK_OK)
                        st = bk_st_stream_write(out, u->name, u->data);
                    continue;
                }
                if (!is_module_tensor(u->name)) /* norms: the same in every part */
                    for (int q = 0; q < n && st == BK_OK; q++)
                        if (q != c)
                            st = same_tensor(&ps[q], u, pc);
                if (st == BK_OK)
                    st = bk_st_stream_declare(out, u->name, u->dtype, u->ndim, u->shape);
            }
        }
    }
    if (st == BK_OK) {
        st = bk_st_stream_finish(out);
        out = NULL;
    }
    if (st == BK_OK)
        st = stop_check("after writing the tensors", -1);
    if (st != BK_OK)
        goto done;
    /* config.json (and quantize_config.json for gptq) with the whole range */
    set_layers(ps[0].b, 0, (int)L);
    if ((st = write_json(work, "config.json", ps[0].config)) != BK_OK ||
        (st = bk__write_model_card(work, ps[0].config)) != BK_OK)
        goto done;
    if (ps[0].b != ps[0].qc && (st = write_json(work, "quantize_config.json", ps[0].qc)) != BK_OK)
        goto done;
    if ((st = merge_report(ps, n, ps[0].qc, work)) != BK_OK)
        goto done;
    if ((st = bk__copy_aux_files(ps[0].dir, work)) == BK_OK)
        st = stop_check("before putting the output in place", -1);
done:
    if (out)
        bk_st_stream_abort(out);
    for (int i = 0; i < n; i++)
        part_free(&ps[i]);
    free(ps);
    return st;
}

/* ------------------------------------------------------------- bk_merge */

static void merge_note(void *user, const char *msg)
{
    const bk_merge_opts *o = user;
    bk__note_event(o->on_event, o->user, msg);
}

void bk_merge_opts_default(bk_merge_opts *o)
{
    memset(o, 0, sizeof *o);
}

bk_status bk_merge(const bk_merge_opts *o)
{
    if (!o->out_dir || o->n_parts < 1)
        return bk_error(BK_ERR_INVALID_ARG, "merge: parts and an output folder are required");
    const char **inputs = calloc((size_t)o->n_parts + 1, sizeof *inputs);
    if (!inputs)
        return bk_error(BK_ERR_NOMEM, "merge: out of memory");
    for (int i = 0; i < o->n_parts; i++)
        inputs[i] = o->parts[i];
    double t0 = bk_now();
    bk__stop_clear();
    bk_outdir od;
    bk_outdir_spec os = {.out = o->out_dir, .inputs = inputs, .overwrite = o->overwrite,
                         .what = "merge", .note = merge_note, .user = (void *)o};
    bk_status st = bk_outdir_open(&od, &os, NULL);
    free(inputs);
    if (st != BK_OK)
        return st;
    st = bk__merge_into(o->parts, o->n_parts, od.work, o->max_shard_bytes);
    if (st == BK_OK)
        st = bk_outdir_commit(&od);
    bk_outdir_close(&od); /* (not committed: the work folder is removed) */
    if (st == BK_ERR_INTERRUPTED) {
        char why[1024];
        snprintf(why, sizeof why, "%s", bk_last_error());
        bk_error(st, "%s (by a signal; work folder removed, nothing written to %s)", why,
                 od.final);
    }
    if (st == BK_OK && o->on_event) {
        bk_event ev;
        memset(&ev, 0, sizeof ev);
        ev.kind = BK_EV_DONE;
        ev.message = o->out_dir;
        ev.elapsed_s = bk_now() - t0;
        o->on_event(o->user, &ev);
    }
    return st;
}

/* ------------------------------------------- MPI ranks, layer parallel */

static void ranks_note(void *user, const char *msg)
{
    const bk_quantize_opts *o = user;
    bk__note_event(o->on_event, o->user, msg);
}

/* rank 0's part run: its progress, not its DONE (the merged output's comes later) */
static void part_event(void *user, const bk_event *ev)
{
    const bk_quantize_opts *o = user;
    if (ev->kind != BK_EV_DONE && o->on_event)
        o->on_event(o->user, ev);
}

bk_status bk__quantize_layer_ranks(const bk_quantize_opts *o)
{
    bk_dist *d = o->dist;
    const int rank = bk_dist_rank(d), size = bk_dist_size(d);
    const double t0 = bk_now();
    bk_status st = BK_OK;
    bk_outdir od;
    memset(&od, 0, sizeof od);
    od.lock_fd = -1;
    char work[BK_PATH_MAX] = "", part[BK_PATH_MAX] = "";
    int64_t L = 0;
    if (o->layer_begin > 0 || o->layer_end > 0)
        st = bk_error(BK_ERR_INVALID_ARG,
                      "quantize: --layers with MPI ranks: the ranks split all layers between them "
                      "(for ranges of your own, run single processes and bakron merge)");
    if (st == BK_OK && !o->out_dir)
        st = bk_error(BK_ERR_INVALID_ARG, "quantize: an output folder is required");
    /* rank 0: the output folder (lock, work folder); every rank: the layer count */
    if (st == BK_OK && rank == 0) {
        const char *inputs[] = {o->model_dir, o->activations_dir ? o->activations_dir : "",
                                o->config_path ? o->config_path : "", NULL};
        bk_outdir_spec os = {.out = o->out_dir, .inputs = inputs, .overwrite = o->overwrite,
                             .what = "quantize", .note = ranks_note, .user = (void *)o};
        st = bk_outdir_open(&od, &os, NULL);
        if (st == BK_OK)
            snprintf(work, sizeof work, "%s", od.work);
        if (st == BK_OK && (st = bk_path_join(part, sizeof part, work, ".parts")) == BK_OK)
            st = bk_mkdir_p(part);
    }
    if (st == BK_OK) {
        bk_model *m = NULL;
        st = bk_model_open(o->model_dir, &m);
        if (st == BK_OK) {
            L = bk_model_get_config(m)->n_layers;
            bk_model_close(m);
        }
    }
    st = bk_dist_sync(d, st);
    if (st == BK_OK)
        st = bk_dist_bcast(d, work, sizeof work, 0);
    if (st != BK_OK)
        goto done;
    /* this rank's layers */
    const int lo = (int)(L * rank / size), hi = (int)(L * (rank + 1) / size);
    if (lo < hi) {
        char name[64];
        snprintf(name, sizeof name, ".parts/rank-%05d", rank);
        st = bk_path_join(part, sizeof part, work, name);
        if (st == BK_OK) {
            bk_quantize_opts po = *o;
            po.dist = NULL;
            po.layer_begin = lo;
            po.layer_end = hi;
            po.out_dir = part;
            po.overwrite = 0;
            po.on_event = rank == 0 ? part_event : NULL;
            po.user = (void *)o;
            st = bk_quantize(&po);
        }
    }
    st = bk_dist_sync(d, st);
    if (st != BK_OK)
        goto done;
    /* rank 0: merge the parts into the work folder, then commit */
    if (rank == 0) {
        char **dirs = calloc((size_t)size, sizeof *dirs);
        int n = 0;
        if (!dirs)
            st = bk_error(BK_ERR_NOMEM, "out of memory");
        for (int r = 0; r < size && st == BK_OK; r++) {
            if (L * r / size == L * (r + 1) / size)
                continue;
            char name[64];
            snprintf(name, sizeof name, ".parts/rank-%05d", r);
            if (!(dirs[n] = malloc(BK_PATH_MAX)))
                st = bk_error(BK_ERR_NOMEM, "out of memory");
            else if ((st = bk_path_join(dirs[n], BK_PATH_MAX, work, name)) == BK_OK &&
                     !bk_is_dir(dirs[n]))
                st = bk_error(BK_ERR_IO,
                              "%s: rank %d's part is not visible on rank 0 (--out must be on a "
                              "file system every rank shares)",
                              dirs[n], r);
            n++;
        }
        if (st == BK_OK)
            st = bk__merge_into((const char *const *)dirs, n, work, o->max_shard_bytes);
        for (int i = 0; dirs && i < n; i++)
            free(dirs[i]);
        free(dirs);
        if (st == BK_OK) {
            char parts[BK_PATH_MAX];
            if (bk_path_join(parts, sizeof parts, work, ".parts") == BK_OK)
                bk_remove_tree(parts);
            st = bk_outdir_commit(&od);
        }
    }
    st = bk_dist_sync(d, st);
    if (st == BK_OK && rank == 0 && o->on_event) {
        bk_event ev;
        memset(&ev, 0, sizeof ev);
        ev.kind = BK_EV_DONE;
        ev.layer = (int)L;
        ev.n_layers = (int)L;
        ev.message = o->out_dir;
        ev.elapsed_s = bk_now() - t0;
        o->on_event(o->user, &ev);
    }
done:
    bk_outdir_close(&od);
    return st;
}
