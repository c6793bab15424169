/* Resuming an interrupted quantization: run.json, the journal, the saved
 * codes and scales (resume.h; docs/formats.md "Work folder and journal"). */
#include "resume.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bakron/bakron.h"
#include "bk_config.h"
#include "st_internal.h"
#include "util.h"

#define RESUME_DIR ".resume"
#define MAX_LAYERS 100000

struct bk_resume {
    char dir[4096];     /* WORK/.resume */
    char journal[4096]; /* WORK/.resume/journal */
    int fd;             /* the journal, append */
    int need_weights;
    int native;         /* --export native: the shards hold the codes (restore_from_stream) */
    int adopted;
    int bad_line;       /* > 0: the adopted journal's line that is no record (not a journal) */
    int layer_begin;
    bk_st_stream *out;  /* the shards (bk_resume_restore): what module files are not needed for */
    /* the modules of the layer being written that got a module file */
    int pend_layer;
    unsigned pend_files;
    /* journaled layers (contiguous from layer_begin) */
    int n;
    int cap;
    uint64_t *digest;
    unsigned *files; /* per layer: bit m = module m has a module file */
    char **entries;  /* report entries per layer: JSON array text */
};

#define ALL_FILES ((1u << BK_MOD_COUNT) - 1u)
_Static_assert(BK_MOD_COUNT < 32, "module bit mask");

/* ,"files":[names of the modules of mask] (journal line) */
static void put_files(bk_strbuf *b, unsigned mask)
{
    bk_sb_puts(b, ",\"files\":[");
    int first = 1;
    for (int m = 0; m < BK_MOD_COUNT; m++)
        if (mask & (1u << m)) {
            bk_sb_printf(b, "%s\"%s\"", first ? "" : ",", bk_module_name((bk_module)m));
            first = 0;
        }
    bk_sb_puts(b, "]");
}

/* ------------------------------------------------------------ helpers */

static void hex64(uint64_t v, char out[17])
{
    snprintf(out, 17, "%016" PRIx64, v);
}

static bk_status fsync_fd(int fd, const char *what)
{
    if (fsync(fd) != 0)
        return bk_error(BK_ERR_WRITE, "%s: fsync failed: %s", what, strerror(errno));
    return BK_OK;
}

static void fsync_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int bk_resume_is_resumable(void *user, const char *work_dir)
{
    (void)user;
    char p[4096];
    if (snprintf(p, sizeof p, "%s/" RESUME_DIR "/run.json", work_dir) >= (int)sizeof p)
        return 0;
    return bk_is_file(p);
}

/* ------------------------------------------------------- fingerprints */

static void add_str(cJSON *o, const char *k, const char *v)
{
    cJSON_AddStringToObject(o, k, v ? v : "");
}

static void add_num(cJSON *o, const char *k, double v)
{
    char b[64];
    snprintf(b, sizeof b, "%.17g", v);
    cJSON_AddStringToObject(o, k, b);
}

static void add_int(cJSON *o, const char *k, long long v)
{
    char b[32];
    snprintf(b, sizeof b, "%lld", v);
    cJSON_AddStringToObject(o, k, b);
}

/* Every argument that shapes the output bytes, as strings. */
static cJSON *args_of(const bk_resume_source *s)
{
    const bk_quantize_opts *o = s->o;
    const bk_quant_spec *q = &o->solve.quant;
    cJSON *a = cJSON_CreateObject();
    add_str(a, "model folder", o->model_dir);
    add_str(a, "--calib", o->calib_path);
    add_str(a, "--calib-text", o->calib_text);
    add_str(a, "--activations", o->activations_dir);
    add_str(a, "--config", o->config_path);
    add_str(a, "--hessian", bk_hessian_name(o->hessian));
    add_str(a, "--algorithm", bk_algorithm_name(o->solve.algorithm));
    add_str(a, "--precision", o->solve.precision == BK_PREC_FP64 ? "fp64" : "fp32");
    if (q->kind == BK_Q_LEVELS) {
        add_int(a, "--levels", q->levels);
    } else {
        add_int(a, "--bits", q->bits);
        add_int(a, "--group", (long long)q->group);
        add_str(a, "--asym", q->asym ? "yes" : "no");
    }
    add_str(a, "--no-mse", q->mse ? "no" : "yes");
    add_int(a, "refit groups", q->refit_groups);
    add_num(a, "--damp", o->solve.damp);
    if (o->solve.separate_damp_b)
        add_num(a, "--damp-b", o->solve.damp_b);
    else
        add_str(a, "--damp-b", "none");
    if (o->damp_b_attn >= 0.0)
        add_num(a, "--damp-b-attn", o->damp_b_attn);
    else
        add_str(a, "--damp-b-attn", "none");
    add_int(a, "sequences (--samples)", (long long)s->S);
    add_int(a, "tokens per sequence (--seqlen)", (long long)s->T);
    char lr[64];
    snprintf(lr, sizeof lr, "%d:%d", s->layer_begin, s->layer_end);
    add_str(a, "--layers", lr);
    add_str(a, "--no-sequential", o->sequential ? "no" : "yes");
    add_str(a, "--hessian-fp64", o->hessian_fp64 ? "yes" : "no");
    add_int(a, "--batch", (long long)s->batch);
    add_str(a, "--export", bk_export_name(o->export_format));
    add_int(a, "--max-shard-size",
            (long long)(o->max_shard_bytes ? o->max_shard_bytes : 5000000000ull));
    if (bk_hessian_is_backprop(o->hessian)) { /* (other kinds: run.json as before) */
        add_str(a, "--fisher", bk_fisher_name(o->fisher));
        add_int(a, "--seed", (long long)o->seed);
        add_int(a, "--leaf-size", s->leaf); /* (as run, not 0 for "choose") */
        add_str(a, "--bwd-flow", bk_bwd_flow_name(o->bwd_flow));
        /* as resolved (the job's copy of the options: auto is never here), so
         * a run resumed with auto continues only where auto resolves to what
         * the killed run used */
        add_str(a, "--bwd-precision", bk_bwd_precision_name(o->bwd_precision));
    }
    add_str(a, "backend", s->backend);
    add_str(a, "stages", s->stages);
    add_str(a, "--gpu-math", s->gpu_math);
    add_str(a, "bakron version", BK_VERSION);
    return a;
}

static void add_file_stat(cJSON *o, const char *key, const char *path)
{
    struct stat sb;
    char b[128];
    if (stat(path, &sb) != 0)
        snprintf(b, sizeof b, "missing");
    else
        snprintf(b, sizeof b, "%lld bytes, modified %lld.%09ld", (long long)sb.st_size,
                 (long long)sb.st_mtim.tv_sec, (long)sb.st_mtim.tv_nsec);
    cJSON_AddStringToObject(o, key, b);
}

/* A name with one of the suffixes (NULL-terminated), not hidden. */
static int has_suffix(const char *name, void *user)
{
    const char *const *suffixes = user;
    int want = 0;
    for (int k = 0; suffixes[k]; k++)
        if (bk_ends_with(name, suffixes[k]))
            want = 1;
    return want && name[0] != '.';
}

/* Files of a folder with one of the suffixes (sorted), size + mtime each. */
static void add_folder(cJSON *o, const char *dir, const char *const *suffixes)
{
    char **names = NULL;
    size_t n = 0;
    if (bk_list_sorted(dir, has_suffix, (void *)suffixes, &names, &n) != 0)
        return;
    for (size_t i = 0; i < n; i++) {
        char p[4096];
        if (bk_path_join(p, sizeof p, dir, names[i]) == BK_OK)
            add_file_stat(o, names[i], p);
        free(names[i]);
    }
    free(names);
}

static cJSON *model_of(const bk_resume_source *s)
{
    cJSON *m = cJSON_CreateObject();
    char p[4096], *text = NULL;
    size_t len = 0;
    char hx[17] = "unreadable";
    if (bk_path_join(p, sizeof p, s->o->model_dir, "config.json") == BK_OK &&
        bk_read_file(p, 64u << 20, &text, &len) == BK_OK) {
        hex64(bk_digest64(text, len, 0), hx);
        free(text);
    }
    cJSON_AddStringToObject(m, "config.json", hx);
    static const char *const sfx[] = {".safetensors", ".safetensors.index.json", NULL};
    add_folder(m, s->o->model_dir, sfx);
    return m;
}

static cJSON *calib_of(const bk_resume_source *s)
{
    cJSON *c = cJSON_CreateObject();
    if (s->tokens) {
        char hx[17];
        hex64(bk_digest64(s->tokens, (size_t)(s->S * s->T) * sizeof(int32_t), 0), hx);
        cJSON_AddStringToObject(c, "token ids", hx);
    }
    if (s->o->activations_dir) {
        static const char *const sfx[] = {"", NULL};
        add_folder(c, s->o->activations_dir, sfx);
    }
    return c;
}

/* The first key of section `sec` whose value differs: one line. */
static bk_status compare(const char *work, const cJSON *was, const cJSON *now, const char *sec,
                         bk_status code, const char *what)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(was, sec);
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(now, sec);
    const cJSON *it;
    cJSON_ArrayForEach(it, b)
    {
        const cJSON *o = cJSON_GetObjectItemCaseSensitive(a, it->string);
        const char *ov = cJSON_IsString(o) ? o->valuestring : "absent";
        if (!cJSON_IsString(o) || strcmp(ov, it->valuestring))
            return bk_error(code,
                            "--resume: %s was made with another %s: %s was '%.200s', now "
                            "'%.200s' (rerun with what the interrupted run used, or without "
                            "--resume to start over)",
                            work, what, it->string, ov, it->valuestring);
    }
    cJSON_ArrayForEach(it, a)
    {
        if (!cJSON_GetObjectItemCaseSensitive(b, it->string))
            return bk_error(code,
                            "--resume: %s was made with another %s: %s was '%.200s', now "
                            "absent (rerun with what the interrupted run used, or without "
                            "--resume to start over)",
                            work, what, it->string,
                            cJSON_IsString(it) ? it->valuestring : "?");
    }
    return BK_OK;
}

/* ------------------------------------------------------------- journal */

static bk_status grow(bk_resume *r)
{
    if (r->n < r->cap)
        return BK_OK;
    int nc = r->cap ? 2 * r->cap : 64;
    uint64_t *d = realloc(r->digest, (size_t)nc * sizeof *d);
    if (!d)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    r->digest = d;
    char **e = realloc(r->entries, (size_t)nc * sizeof *e);
    if (!e)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    r->entries = e;
    unsigned *f = realloc(r->files, (size_t)nc * sizeof *f);
    if (!f)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    r->files = f;
    r->cap = nc;
    return BK_OK;
}

/* Complete lines, each a journal record for the next layer; a torn last line
 * (killed while appending: a prefix of a record) is ignored. A complete line
 * that is no such record, or a last line that cannot be the start of one, is
 * never written by a run: the file is not a valid journal, and none of its
 * records is kept (r->bad_line says which line; bk_resume_restore says so and
 * the run starts over). */
static bk_status load_journal(bk_resume *r)
{
    char *text = NULL;
    size_t len = 0;
    if (!bk_is_file(r->journal))
        return BK_OK;
    bk_status st = bk_read_file(r->journal, (size_t)1 << 30, &text, &len);
    if (st != BK_OK)
        return st;
    char *p = text;
    int line = 0;
    while (p < text + len) {
        char *nl = memchr(p, '\n', (size_t)(text + len - p));
        line++;
        if (!nl) { /* a torn last line: a prefix of '{"layer":', or longer and starting so */
            static const char head[] = "{\"layer\":";
            const size_t tl = (size_t)(text + len - p), hl = sizeof head - 1;
            if (memcmp(p, head, tl < hl ? tl : hl) != 0)
                r->bad_line = line;
            break;
        }
        *nl = '\0';
        cJSON *j = cJSON_Parse(p);
        const cJSON *l = cJSON_GetObjectItemCaseSensitive(j, "layer");
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "digest");
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "modules");
        const cJSON *fl = cJSON_GetObjectItemCaseSensitive(j, "files");
        char *ent = cJSON_IsArray(m) ? cJSON_PrintUnformatted(m) : NULL;
        int ok = cJSON_IsNumber(l) && l->valueint == r->layer_begin + r->n &&
                 cJSON_IsString(d) && strlen(d->valuestring) == 16 && ent;
        /* the modules with module files (a line without "files": every module) */
        unsigned files = fl ? 0u : ALL_FILES;
        if (fl && !cJSON_IsArray(fl))
            ok = 0;
        const cJSON *fe;
        cJSON_ArrayForEach(fe, fl)
        {
            int mk = -1;
            for (int mm = 0; cJSON_IsString(fe) && mm < BK_MOD_COUNT; mm++)
                if (!strcmp(fe->valuestring, bk_module_name((bk_module)mm)))
                    mk = mm;
            if (mk < 0)
                ok = 0;
            else
                files |= 1u << mk;
        }
        uint64_t dv = 0;
        if (ok) {
            char *end;
            dv = strtoull(d->valuestring, &end, 16);
            ok = *end == '\0';
        }
        if (ok && (st = grow(r)) != BK_OK) {
            free(ent);
            cJSON_Delete(j);
            break;
        }
        if (ok) {
            r->digest[r->n] = dv;
            r->files[r->n] = files;
            r->entries[r->n] = ent;
            r->n++;
        } else {
            free(ent);
        }
        cJSON_Delete(j);
        if (!ok) {
            r->bad_line = line;
            break;
        }
        p = nl + 1;
    }
    free(text);
    if (st == BK_OK && r->bad_line) { /* not a journal: no record of it is kept */
        for (int i = 0; i < r->n; i++)
            free(r->entries[i]);
        r->n = 0;
    }
    return st;
}

/* Rewrite the journal with its first n records (atomically). */
static bk_status rewrite_journal(bk_resume *r, int n)
{
    bk_strbuf b;
    memset(&b, 0, sizeof b);
    for (int i = 0; i < n; i++) {
        char hx[17];
        hex64(r->digest[i], hx);
        bk_sb_printf(&b, "{\"layer\":%d,\"digest\":\"%s\"", r->layer_begin + i, hx);
        put_files(&b, r->files[i]);
        bk_sb_printf(&b, ",\"modules\":%s}\n", r->entries[i]);
    }
    if (b.oom) {
        bk_sb_free(&b);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    for (int i = n; i < r->n; i++)
        free(r->entries[i]);
    r->n = n;
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    bk_status st = bk_write_file_atomic(r->journal, b.p ? b.p : "", b.len);
    bk_sb_free(&b);
    if (st != BK_OK)
        return st;
    r->fd = open(r->journal, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (r->fd < 0)
        return bk_error(BK_ERR_WRITE, "%s: cannot open: %s", r->journal, strerror(errno));
    return BK_OK;
}

/* ----------------------------------------------------------------- API */

bk_status bk_resume_open(const char *work_dir, int adopted, const bk_resume_source *src,
                         int need_weights, bk_resume **out)
{
    *out = NULL;
    bk_resume *r = calloc(1, sizeof *r);
    if (!r)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    r->fd = -1;
    r->need_weights = need_weights;
    r->native = src->o->export_format == BK_EXPORT_NATIVE;
    r->pend_layer = -1;
    r->adopted = adopted;
    r->layer_begin = src->layer_begin;
    bk_status st = BK_OK;
    if (snprintf(r->dir, sizeof r->dir, "%s/" RESUME_DIR, work_dir) >= (int)sizeof r->dir ||
        snprintf(r->journal, sizeof r->journal, "%s/journal", r->dir) >= (int)sizeof r->journal) {
        free(r);
        return bk_error(BK_ERR_INVALID_ARG, "%s: path too long", work_dir);
    }
    char runp[4200];
    snprintf(runp, sizeof runp, "%s/run.json", r->dir);
    cJSON *now = cJSON_CreateObject();
    cJSON_AddNumberToObject(now, "format", 1);
    cJSON_AddItemToObject(now, "arguments", args_of(src));
    cJSON_AddItemToObject(now, "model", model_of(src));
    cJSON_AddItemToObject(now, "calibration", calib_of(src));
    char *text = NULL;
    if (adopted) {
        char *old = NULL;
        st = bk_read_file(runp, 16u << 20, &old, NULL);
        cJSON *was = st == BK_OK ? cJSON_Parse(old) : NULL;
        free(old);
        if (st == BK_OK && !was)
            st = bk_error(BK_ERR_IO, "--resume: %s: cannot parse (start over without --resume)",
                          runp);
        if (st == BK_OK)
            st = compare(work_dir, was, now, "arguments", BK_ERR_USAGE, "argument");
        if (st == BK_OK)
            st = compare(work_dir, was, now, "model", BK_ERR_INVALID_ARG,
                         "model (a file of the model folder differs)");
        if (st == BK_OK)
            st = compare(work_dir, was, now, "calibration", BK_ERR_CALIB, "calibration");
        cJSON_Delete(was);
        if (st == BK_OK)
            st = load_journal(r);
        if (st == BK_OK)
            st = rewrite_journal(r, r->n); /* drops a torn last line */
    } else {
        bk_remove_tree(r->dir);
        if (mkdir(r->dir, 0755) != 0)
            st = bk_error(BK_ERR_WRITE, "%s: cannot create: %s", r->dir, strerror(errno));
        if (st == BK_OK)
            st = rewrite_journal(r, 0);
        if (st == BK_OK && !(text = cJSON_Print(now)))
            st = bk_error(BK_ERR_NOMEM, "out of memory");
        if (st == BK_OK) /* last: run.json makes the folder resumable */
            st = bk_write_file_atomic(runp, text, strlen(text));
        if (st == BK_OK)
            fsync_dir(r->dir);
        free(text);
    }
    cJSON_Delete(now);
    if (st != BK_OK) {
        bk_resume_free(r);
        return st;
    }
    *out = r;
    return BK_OK;
}

void bk_resume_free(bk_resume *r)
{
    if (!r)
        return;
    if (r->fd >= 0)
        close(r->fd);
    for (int i = 0; i < r->n; i++)
        free(r->entries[i]);
    free(r->entries);
    free(r->digest);
    free(r->files);
    free(r);
}

int bk_resume_layers_done(const bk_resume *r)
{
    return r ? r->n : 0;
}

static void say(void (*note)(void *, const char *), void *user, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void say(void (*note)(void *, const char *), void *user, const char *fmt, ...)
{
    char msg[4800]; /* (a path of up to 4096 bytes) */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (note)
        note(user, msg);
}

static int module_file(const bk_resume *r, int layer, bk_module mod, char *p, size_t cap)
{
    int k = snprintf(p, cap, "%s/L%05d.%s.safetensors", r->dir, layer, bk_module_name(mod));
    return k > 0 && (size_t)k < cap;
}

bk_status bk_resume_restore(bk_resume *r, bk_st_stream *out, int reused, cJSON *report_modules,
                            int64_t *params, int *next, void (*note)(void *, const char *),
                            void *user)
{
    *next = r->layer_begin;
    r->out = out;
    if (r->bad_line) {
        say(note, user, "--resume: %s: not a valid journal (line %d is not a journal record); "
            "starting over from layer %d", r->journal, r->bad_line, r->layer_begin);
        return BK_OK;
    }
    if (r->n == 0) {
        if (r->adopted)
            say(note, user, "--resume: the interrupted run had finished no layer; starting from "
                "layer %d", r->layer_begin);
        return BK_OK;
    }
    int keep = 0;
    char why[300] = "";
    if (!reused) {
        snprintf(why, sizeof why, "the shards were not complete or not the planned ones");
    } else {
        for (; keep < r->n; keep++) {
            const int l = r->layer_begin + keep;
            char pre[64], p[4400];
            snprintf(pre, sizeof pre, "model.layers.%d.", l);
            uint64_t d = 0;
            bk_status st = bk_st_stream_digest(out, pre, &d);
            if (st != BK_OK)
                return st;
            if (d != r->digest[keep]) {
                snprintf(why, sizeof why, "layer %d's tensors in the shards differ from the "
                         "journal's digest", l);
                break;
            }
            /* (the modules without a module file are read back from the shards,
             * whose bytes the digest covers) */
            int have = 1;
            for (int m = 0; r->need_weights && m < BK_MOD_COUNT; m++)
                if ((r->files[keep] & (1u << m)) &&
                    (!module_file(r, l, (bk_module)m, p, sizeof p) || !bk_is_file(p)))
                    have = 0;
            if (!have) {
                snprintf(why, sizeof why, "layer %d's saved codes are missing", l);
                break;
            }
        }
    }
    if (keep < r->n) {
        say(note, user, "--resume: %s; continuing from layer %d (%d of %d journaled layers kept)",
            why, r->layer_begin + keep, keep, r->n);
        bk_status st = rewrite_journal(r, keep);
        if (st != BK_OK)
            return st;
    }
    for (int i = 0; i < r->n; i++) {
        char pre[64];
        snprintf(pre, sizeof pre, "model.layers.%d.", r->layer_begin + i);
        bk_st_stream_mark_written(out, pre);
        cJSON *arr = cJSON_Parse(r->entries[i]);
        cJSON *e;
        while (arr && (e = cJSON_DetachItemFromArray(arr, 0)) != NULL) {
            const cJSON *rows = cJSON_GetObjectItemCaseSensitive(e, "rows");
            const cJSON *cols = cJSON_GetObjectItemCaseSensitive(e, "cols");
            if (cJSON_IsNumber(rows) && cJSON_IsNumber(cols))
                *params += (int64_t)rows->valuedouble * (int64_t)cols->valuedouble;
            cJSON_AddItemToArray(report_modules, e);
        }
        cJSON_Delete(arr);
    }
    *next = r->layer_begin + r->n;
    if (r->n > 0)
        say(note, user, "--resume: layers %d-%d were finished by the interrupted run and are "
            "kept; continuing with layer %d",
            r->layer_begin, r->layer_begin + r->n - 1, *next);
    return BK_OK;
}

/* Groups of the native export's scales for n input columns (pipeline_export.c). */
static int64_t native_groups(const bk_quant_spec *q, int64_t n)
{
    return q->kind == BK_Q_UNIFORM && q->group > 0 ? (n + q->group - 1) / q->group : 1;
}

/* Whether the native export of res (bk__write_module) holds its codes, scales
 * and zeros exactly: levels as int8 c, uniform symmetric as int8 c - 2^(bits-1)
 * with no zeros, asymmetric as uint8 c with F32 zeros; every code in range. */
static int in_shards(const bk_resume *r, const bk_quant_spec *q, const bk_solve_result *res)
{
    if (!r->native || !res->codes || !res->scales || res->groups != native_groups(q, res->n))
        return 0;
    int lo, hi;
    if (q->kind == BK_Q_LEVELS) {
        lo = -128, hi = 127;
    } else if (q->kind == BK_Q_UNIFORM && q->bits >= 1 && q->bits <= 8) {
        if (q->asym ? !res->zeros : res->zeros != NULL)
            return 0;
        lo = q->asym ? 0 : (1 << (q->bits - 1)) - 128;
        hi = q->asym ? 255 : (1 << (q->bits - 1)) + 127;
    } else {
        return 0; /* (the integer alphabet: wide codes) */
    }
    for (int64_t i = 0; i < res->m * res->n; i++)
        if (res->codes[i] < lo || res->codes[i] > hi)
            return 0;
    return 1;
}

/* Codes of a module: I8 (levels), U8 (uniform), else I16. Not written when the
 * shards hold them exactly (in_shards) and they rebuild the solver's weights. */
bk_status bk_resume_save_module(bk_resume *r, const bk_quant_spec *q, int layer, bk_module mod,
                                const bk_solve_result *res)
{
    if (!r || !r->need_weights)
        return BK_OK;
    if (r->pend_layer != layer) {
        r->pend_layer = layer;
        r->pend_files = 0;
    }
    char p[4400];
    if (!module_file(r, layer, mod, p, sizeof p))
        return bk_error(BK_ERR_INVALID_ARG, "%s: path too long", r->dir);
    const int64_t m = res->m, n = res->n, g = res->groups;
    if (!res->codes || !res->scales)
        return bk_error(BK_ERR_INTERNAL, "resume: layer %d %s: no codes", layer,
                        bk_module_name(mod));
    bk_dtype dt = q->kind == BK_Q_LEVELS ? BK_DT_I8 : q->kind == BK_Q_UNIFORM ? BK_DT_U8 : BK_DT_I16;
    void *codes = dt == BK_DT_I16 ? NULL : malloc((size_t)(m * n));
    float *wr = NULL;
    bk_st_writer *w = NULL;
    bk_status st = BK_OK;
    if (dt != BK_DT_I16 && !codes)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; codes && i < m * n; i++) {
        if (dt == BK_DT_I8)
            ((int8_t *)codes)[i] = (int8_t)res->codes[i];
        else
            ((uint8_t *)codes)[i] = (uint8_t)res->codes[i];
    }
    /* the weights rebuilt from the codes must be the solver's (checked where
     * the solver returned them; else they are stored as they are) */
    int exact = 1;
    if (res->weight) {
        wr = malloc((size_t)(m * n) * sizeof(float));
        if (!wr) {
            free(codes);
            return bk_error(BK_ERR_NOMEM, "out of memory");
        }
        bk_resume_dequantize(q, res->codes, res->scales, res->zeros, m, n, g, wr);
        for (int64_t i = 0; i < m * n && exact; i++)
            exact = wr[i] == res->weight[i];
    }
    if (exact && in_shards(r, q, res)) { /* read back from the shards on --resume */
        free(codes);
        free(wr);
        return BK_OK;
    }
    int64_t shp[2] = {m, n}, sshp[2] = {m, g};
    st = bk_st_writer_create(&w);
    if (st == BK_OK)
        st = bk_st_writer_add(w, "codes", dt, 2, shp, codes ? codes : (void *)res->codes, 0);
    if (st == BK_OK)
        st = bk_st_writer_add(w, "scales", BK_DT_F32, 2, sshp, res->scales, 0);
    if (st == BK_OK && res->zeros)
        st = bk_st_writer_add(w, "zeros", BK_DT_F32, 2, sshp, res->zeros, 0);
    if (st == BK_OK && !exact)
        st = bk_st_writer_add(w, "weight", BK_DT_F32, 2, shp, res->weight, 0);
    if (st == BK_OK)
        st = bk_st_writer_save(w, p);
    if (st == BK_OK)
        r->pend_files |= 1u << mod;
    bk_st_writer_free(w);
    free(codes);
    free(wr);
    return st;
}

/* value of code c of group entry gi */
#define DQ_VALUE(c)                                                                     \
    (q->kind == BK_Q_UNIFORM ? scales[gi] * ((float)(c) - (zeros ? zeros[gi] : zsym))   \
     : q->kind == BK_Q_LEVELS ? (float)(c) * scales[gi] : (float)(c))

/* codes of type T (int8_t, uint8_t, int16_t) -> w */
#define DQ_LOOP(T)                                                                      \
    for (int64_t i = 0; i < m; i++)                                                     \
        for (int64_t j = 0; j < n; j++) {                                               \
            const int64_t gi = i * groups + j / gsz;                                    \
            T c;                                                                        \
            memcpy(&c, (const char *)codes + (size_t)(i * n + j) * sizeof(T), sizeof(T)); \
            w[i * n + j] = DQ_VALUE(c);                                                 \
        }

static void dequantize_any(const bk_quant_spec *q, bk_dtype dt, const void *codes,
                           const float *scales, const float *zeros, int64_t m, int64_t n,
                           int64_t groups, float *w)
{
    const int64_t gw = groups > 1 ? (n + groups - 1) / groups : n;
    const int64_t gsz = (q->kind == BK_Q_UNIFORM && q->group > 0) ? q->group : gw;
    const float zsym = q->kind == BK_Q_UNIFORM ? (float)(1 << (q->bits - 1)) : 0.0f;
    if (dt == BK_DT_I8) {
        DQ_LOOP(int8_t)
    } else if (dt == BK_DT_U8) {
        DQ_LOOP(uint8_t)
    } else {
        DQ_LOOP(int16_t)
    }
}

void bk_resume_dequantize(const bk_quant_spec *q, const int16_t *codes, const float *scales,
                          const float *zeros, int64_t m, int64_t n, int64_t groups, float *w)
{
    dequantize_any(q, BK_DT_I16, codes, scales, zeros, m, n, groups, w);
}

bk_status bk_resume_layer_done(bk_resume *r, bk_st_stream *out, int layer, const char *entries)
{
    if (!r)
        return BK_OK;
    if (layer != r->layer_begin + r->n)
        return bk_error(BK_ERR_INTERNAL, "resume: layer %d finished out of order (expected %d)",
                        layer, r->layer_begin + r->n);
    bk_status st = bk_st_stream_sync(out);
    char pre[64];
    snprintf(pre, sizeof pre, "model.layers.%d.", layer);
    uint64_t d = 0;
    if (st == BK_OK)
        st = bk_st_stream_digest(out, pre, &d);
    if (st == BK_OK && r->need_weights)
        fsync_dir(r->dir); /* the module files' names */
    if (st == BK_OK)
        st = grow(r);
    if (st != BK_OK)
        return st;
    char *ent = strdup(entries ? entries : "[]");
    if (!ent)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    char hx[17];
    hex64(d, hx);
    bk_strbuf b;
    memset(&b, 0, sizeof b);
    const unsigned files = r->pend_layer == layer ? r->pend_files : 0u;
    bk_sb_printf(&b, "{\"layer\":%d,\"digest\":\"%s\"", layer, hx);
    put_files(&b, files);
    bk_sb_printf(&b, ",\"modules\":%s}\n", ent);
    if (b.oom) {
        free(ent);
        bk_sb_free(&b);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    size_t off = 0;
    while (off < b.len) {
        ssize_t k = write(r->fd, b.p + off, b.len - off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            int e = errno;
            free(ent);
            bk_sb_free(&b);
            return bk_error(BK_ERR_WRITE, "%s: write failed: %s", r->journal, strerror(e));
        }
        off += (size_t)k;
    }
    bk_sb_free(&b);
    st = fsync_fd(r->fd, r->journal);
    if (st != BK_OK) {
        free(ent);
        return st;
    }
    r->digest[r->n] = d;
    r->files[r->n] = files;
    r->entries[r->n] = ent;
    r->n++;
    return BK_OK;
}

/* Module mod of layer l from the shards (its native export: in_shards),
 * dequantized as from its module file: the same codes, scales and zeros. */
static bk_status from_shards(bk_resume *r, const bk_quant_spec *q, int layer, bk_module mod,
                             int64_t m, int64_t n, float *w)
{
    if (!r->out)
        return bk_error(BK_ERR_INTERNAL, "resume: layer %d %s: no shards to read back", layer,
                        bk_module_name(mod));
    const int asym = q->kind == BK_Q_UNIFORM && q->asym;
    const int64_t g = native_groups(q, n);
    uint8_t *c = malloc((size_t)(m * n));
    float *sc = malloc((size_t)(m * g) * sizeof(float));
    float *zs = asym ? malloc((size_t)(m * g) * sizeof(float)) : NULL;
    bk_status st = BK_OK;
    if (!c || !sc || (asym && !zs))
        st = bk_error(BK_ERR_NOMEM, "out of memory");
    char name[512];
    snprintf(name, sizeof name, "model.layers.%d.%s.qweight", layer, bk_module_name(mod));
    if (st == BK_OK)
        st = bk_st_stream_read(r->out, name, asym ? BK_DT_U8 : BK_DT_I8, c, (uint64_t)(m * n));
    snprintf(name, sizeof name, "model.layers.%d.%s.scales", layer, bk_module_name(mod));
    if (st == BK_OK)
        st = bk_st_stream_read(r->out, name, BK_DT_F32, sc, (uint64_t)(m * g) * sizeof(float));
    snprintf(name, sizeof name, "model.layers.%d.%s.qzeros", layer, bk_module_name(mod));
    if (st == BK_OK && asym)
        st = bk_st_stream_read(r->out, name, BK_DT_F32, zs, (uint64_t)(m * g) * sizeof(float));
    if (st == BK_OK) {
        if (q->kind == BK_Q_LEVELS) {
            dequantize_any(q, BK_DT_I8, c, sc, NULL, m, n, g, w);
        } else {
            /* symmetric: int8 c - 2^(bits-1) back to the uint8 code c */
            const int zero = asym ? 0 : 1 << (q->bits - 1);
            for (int64_t i = 0; zero && i < m * n; i++)
                c[i] = (uint8_t)((int)(int8_t)c[i] + zero);
            dequantize_any(q, BK_DT_U8, c, sc, zs, m, n, g, w);
        }
    } else {
        st = bk_error(st, "--resume: %s (start over without --resume)", bk_last_error());
    }
    free(c);
    free(sc);
    free(zs);
    return st;
}

bk_status bk_resume_load_weights(bk_resume *r, const bk_quant_spec *q, const bk_model_config *cfg,
                                 int layer, bk_layer_weights *lw)
{
    bk_status st = BK_OK;
    const int k = layer - r->layer_begin;
    if (k < 0 || k >= r->n)
        return bk_error(BK_ERR_INTERNAL, "resume: layer %d is not journaled", layer);
    for (int mi = 0; mi < BK_MOD_COUNT && st == BK_OK; mi++) {
        const bk_module mod = (bk_module)mi;
        char p[4400];
        int64_t m, n;
        bk_module_shape(cfg, mod, &m, &n);
        if (!(r->files[k] & (1u << mi))) {
            st = from_shards(r, q, layer, mod, m, n, lw->w[mod]);
            continue;
        }
        if (!module_file(r, layer, mod, p, sizeof p))
            return bk_error(BK_ERR_INVALID_ARG, "%s: path too long", r->dir);
        bk_st_file *f = NULL;
        if ((st = bk_st_open(p, &f)) != BK_OK)
            return bk_error(st, "--resume: %s (start over without --resume)", bk_last_error());
        const bk_tensor_info *tc = bk_st_find(f, "codes"), *ts = bk_st_find(f, "scales"),
                             *tz = bk_st_find(f, "zeros"), *tw = bk_st_find(f, "weight");
        if (!tc || !ts || tc->ndim != 2 || tc->shape[0] != m || tc->shape[1] != n ||
            ts->ndim != 2 || ts->shape[0] != m || ts->dtype != BK_DT_F32 ||
            (tz && (tz->dtype != BK_DT_F32 || tz->ndim != 2 || tz->shape[0] != m ||
                    tz->shape[1] != ts->shape[1])) ||
            (tw && (tw->dtype != BK_DT_F32 || tw->ndim != 2 || tw->shape[0] != m ||
                    tw->shape[1] != n)) ||
            (tc->dtype != BK_DT_I8 && tc->dtype != BK_DT_U8 && tc->dtype != BK_DT_I16)) {
            bk_st_close(f);
            return bk_error(BK_ERR_IO,
                            "--resume: %s: not the saved codes of a [%lld, %lld] module (start "
                            "over without --resume)",
                            p, (long long)m, (long long)n);
        }
        const int64_t g = ts->shape[1];
        float *sc = NULL, *zs = NULL;
        if (tw) {
            memcpy(lw->w[mod], tw->data, (size_t)(m * n) * sizeof(float));
        } else if (!(sc = malloc((size_t)(m * g) * sizeof(float))) ||
                   (tz && !(zs = malloc((size_t)(m * g) * sizeof(float))))) {
            free(sc);
            bk_st_close(f);
            return bk_error(BK_ERR_NOMEM, "out of memory");
        } else {
            /* (scales and zeros copied: the mapped data need not be aligned) */
            memcpy(sc, ts->data, (size_t)(m * g) * sizeof(float));
            if (zs)
                memcpy(zs, tz->data, (size_t)(m * g) * sizeof(float));
            dequantize_any(q, tc->dtype, tc->data, sc, zs, m, n, g, lw->w[mod]);
        }
        free(sc);
        free(zs);
        bk_st_close(f);
    }
    return st;
}

bk_status bk_resume_finish(bk_resume *r)
{
    if (!r)
        return BK_OK;
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    bk_remove_tree(r->dir);
    struct stat sb;
    if (lstat(r->dir, &sb) == 0)
        return bk_error(BK_ERR_WRITE, "%s: cannot remove the resume state", r->dir);
    return BK_OK;
}
