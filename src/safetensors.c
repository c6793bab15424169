/* safetensors.c — validated, read-only reading of .safetensors files, their
 * zstd-compressed variant, and sharded checkpoints (index.json).
 *
 * Every rule of docs/formats.md ("## safetensors") is checked before a handle is
 * returned; every failure names the file, the tensor where there is one, and the
 * rule, with its own status code.
 */
#include "bakron/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "mapguard.h"
#include "st_internal.h"
#include "util.h"

struct bk_st_file {
    char *path;               /* label used in messages and bk_tensor_info.file */
    const unsigned char *base; /* the whole image */
    size_t len;
    void *map;                /* mmap'd region, or NULL */
    size_t map_len;
    void *owned;              /* malloc'd image, or NULL */
    int fd;                   /* the mapped file (kept open to check it), or -1 */
    int guard;                /* mapguard slot of the mapping, or -1 */
    struct stat snap;         /* the mapped file at open: size and mtime checked later */
    uint64_t header_n;
    int header_only;          /* validate(): base holds only 8 + N bytes; set image_len */
    uint64_t image_len;       /* header_only: the image size the header declares */
    size_t n;
    bk_tensor_info *t;        /* file order */
    size_t *by_name;          /* indices into t, sorted by name */
    size_t nmeta;
    char **meta_key, **meta_val;
};

/* ------------------------------------------------------------- helpers */

bk_status bk_st_tensor_size(bk_dtype dt, int ndim, const int64_t *shape, uint64_t *numel,
                            uint64_t *nbytes)
{
    uint64_t ne = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || bk_mul_u64(ne, (uint64_t)shape[d], &ne))
            return BK_ERR_ST_OVERFLOW;
    }
    uint64_t bits;
    if (bk_mul_u64(ne, bk_dtype_bits(dt), &bits))
        return BK_ERR_ST_OVERFLOW;
    *numel = ne;
    if (bits % 8)
        return BK_ERR_ST_SUBBYTE;
    *nbytes = bits / 8;
    return BK_OK;
}

static const char *json_type_name(const cJSON *j)
{
    return bk_json_kind(j, "nothing");
}

/* A JSON integer read from the double cJSON stores: whole and in [0, 2^53]. */
static int json_uint(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return 0;
    double d = j->valuedouble;
    if (!(d >= 0.0 && d <= BK_ST_MAX_JSON_INT) || d != floor(d))
        return 0;
    *out = (uint64_t)d;
    return 1;
}

/* Text describing a rejected JSON value, for "(got X)". */
static void describe(const cJSON *j, char *buf, size_t cap)
{
    if (cJSON_IsNumber(j))
        snprintf(buf, cap, "%.17g", j->valuedouble);
    else
        snprintf(buf, cap, "%s", json_type_name(j));
}

static void file_free(bk_st_file *f)
{
    if (!f)
        return;
    if (f->t) {
        for (size_t i = 0; i < f->n; i++)
            free((char *)f->t[i].name);
        free(f->t);
    }
    free(f->by_name);
    for (size_t i = 0; i < f->nmeta; i++) {
        free(f->meta_key[i]);
        free(f->meta_val[i]);
    }
    free(f->meta_key);
    free(f->meta_val);
    bk_mapguard_remove(f->guard);
    if (f->map)
        munmap(f->map, f->map_len);
    if (f->fd >= 0)
        close(f->fd);
    free(f->owned);
    free(f->path);
    free(f);
}

void bk_st_close(bk_st_file *f)
{
    file_free(f);
}

/* ------------------------------------------------------------ validation */

typedef struct raw_tensor {
    const char *name; /* into the cJSON tree */
    bk_dtype dtype;
    int ndim;
    int64_t shape[BK_MAX_DIMS];
    uint64_t begin, end;
} raw_tensor;

/* Stable merge sort of index arrays (qsort has no context argument). */
typedef int (*idx_cmp)(const raw_tensor *base, size_t a, size_t b);

static int icmp_name(const raw_tensor *base, size_t a, size_t b)
{
    return strcmp(base[a].name, base[b].name);
}

static int icmp_offset(const raw_tensor *base, size_t a, size_t b)
{
    const raw_tensor *x = &base[a], *y = &base[b];
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static void merge_sort(size_t *idx, size_t *tmp, size_t n, const raw_tensor *base, idx_cmp cmp)
{
    if (n < 2)
        return;
    size_t h = n / 2;
    merge_sort(idx, tmp, h, base, cmp);
    merge_sort(idx + h, tmp, n - h, base, cmp);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n)
        tmp[k++] = cmp(base, idx[i], idx[j]) <= 0 ? idx[i++] : idx[j++];
    while (i < h)
        tmp[k++] = idx[i++];
    while (j < n)
        tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
}

static int is_json_ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* Parse the entry of one tensor. */
static bk_status parse_entry(const char *label, const cJSON *e, raw_tensor *rt)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return bk_error(BK_ERR_ST_SCHEMA,
                        "%s: tensor '%s': entry must be an object with dtype, shape and "
                        "data_offsets (got %s)",
                        label, name, json_type_name(e));
    const cJSON *dt = NULL, *shape = NULL, *offs = NULL;
    for (const cJSON *c = e->child; c; c = c->next) {
        const cJSON **slot = NULL;
        if (!c->string)
            continue;
        if (!strcmp(c->string, "dtype"))
            slot = &dt;
        else if (!strcmp(c->string, "shape"))
            slot = &shape;
        else if (!strcmp(c->string, "data_offsets"))
            slot = &offs;
        else
            continue; /* rule 6: unknown keys are ignored */
        if (*slot)
            return bk_error(BK_ERR_ST_SCHEMA, "%s: tensor '%s': field '%s' appears twice", label,
                            name, c->string);
        *slot = c;
    }
    const char *missing = !dt ? "dtype" : !shape ? "shape" : !offs ? "data_offsets" : NULL;
    if (missing)
        return bk_error(BK_ERR_ST_SCHEMA, "%s: tensor '%s': missing field '%s'", label, name,
                        missing);
    if (!cJSON_IsString(dt))
        return bk_error(BK_ERR_ST_SCHEMA, "%s: tensor '%s': dtype must be a string (got %s)",
                        label, name, json_type_name(dt));
    if (bk_dtype_from_name(dt->valuestring, &rt->dtype) != BK_OK)
        return bk_error(BK_ERR_ST_DTYPE,
                        "%s: tensor '%s': unknown dtype '%.64s' (expected a safetensors dtype "
                        "name such as F32, BF16, F16, I32, U8, F8_E4M3)",
                        label, name, dt->valuestring);
    if (!cJSON_IsArray(shape))
        return bk_error(BK_ERR_ST_SCHEMA, "%s: tensor '%s': shape must be an array (got %s)",
                        label, name, json_type_name(shape));
    int nd = cJSON_GetArraySize(shape);
    if (nd > BK_MAX_DIMS)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "%s: tensor '%s': too many dimensions (got %d, bakron supports at most %d)",
                        label, name, nd, BK_MAX_DIMS);
    rt->ndim = nd;
    int d = 0;
    for (const cJSON *c = shape->child; c; c = c->next, d++) {
        uint64_t v;
        if (!json_uint(c, &v)) {
            char got[64];
            describe(c, got, sizeof got);
            return bk_error(BK_ERR_ST_SCHEMA,
                            "%s: tensor '%s': shape[%d] must be a whole number in [0, 2^53] "
                            "(got %s)",
                            label, name, d, got);
        }
        rt->shape[d] = (int64_t)v;
    }
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2) {
        if (!cJSON_IsArray(offs))
            return bk_error(BK_ERR_ST_SCHEMA,
                            "%s: tensor '%s': data_offsets must be an array [begin, end] (got %s)",
                            label, name, json_type_name(offs));
        return bk_error(BK_ERR_ST_SCHEMA,
                        "%s: tensor '%s': data_offsets must have 2 elements (got %d, expected 2)",
                        label, name, cJSON_GetArraySize(offs));
    }
    const cJSON *b = offs->child, *en = offs->child->next;
    uint64_t vb, ve;
    if (!json_uint(b, &vb) || !json_uint(en, &ve)) {
        char got[64];
        int which = !json_uint(b, &vb) ? 0 : 1;
        describe(which ? en : b, got, sizeof got);
        return bk_error(BK_ERR_ST_SCHEMA,
                        "%s: tensor '%s': data_offsets[%d] must be a whole number in [0, 2^53] "
                        "(got %s)",
                        label, name, which, got);
    }
    rt->begin = vb;
    rt->end = ve;
    rt->name = name;
    return BK_OK;
}

static bk_status parse_metadata(const char *label, const cJSON *m, bk_st_file *f)
{
    if (cJSON_IsNull(m))
        return BK_OK;
    if (!cJSON_IsObject(m))
        return bk_error(BK_ERR_ST_SCHEMA,
                        "%s: __metadata__ must be an object of strings (got %s)", label,
                        json_type_name(m));
    size_t k = 0;
    for (const cJSON *c = m->child; c; c = c->next)
        k++;
    if (k == 0)
        return BK_OK;
    f->meta_key = calloc(k, sizeof *f->meta_key);
    f->meta_val = calloc(k, sizeof *f->meta_val);
    if (!f->meta_key || !f->meta_val)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for metadata", label);
    for (const cJSON *c = m->child; c; c = c->next) {
        if (!cJSON_IsString(c))
            return bk_error(BK_ERR_ST_SCHEMA,
                            "%s: __metadata__ '%s': value must be a string (got %s)", label,
                            c->string, json_type_name(c));
        for (size_t i = 0; i < f->nmeta; i++)
            if (!strcmp(f->meta_key[i], c->string))
                return bk_error(BK_ERR_ST_DUPLICATE, "%s: __metadata__ key '%s' appears twice",
                                label, c->string);
        f->meta_key[f->nmeta] = strdup(c->string);
        f->meta_val[f->nmeta] = strdup(c->valuestring);
        f->nmeta++;
        if (!f->meta_key[f->nmeta - 1] || !f->meta_val[f->nmeta - 1])
            return bk_error(BK_ERR_NOMEM, "%s: out of memory for metadata", label);
    }
    return BK_OK;
}

/* Validate f->base[0..len) (rules 1-11 + duplicates) and fill the tables. */
static bk_status validate(bk_st_file *f)
{
    const char *label = f->path;
    const unsigned char *p = f->base;
    size_t len = f->len;
    bk_status st = BK_OK;
    char *hdr = NULL;
    cJSON *root = NULL;
    raw_tensor *raw = NULL;
    size_t *order = NULL, *tmp = NULL;

    /* rule 1 */
    if (len < 8)
        return bk_error(BK_ERR_ST_TOO_SHORT,
                        "%s: file too short for the 8-byte header length (got %zu bytes, expected "
                        "at least 8)",
                        label, len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | p[i];
    /* rule 2 */
    if (n > BK_ST_MAX_HEADER)
        return bk_error(BK_ERR_ST_HEADER_TOO_LARGE,
                        "%s: header too large (got N = %llu bytes, expected at most %llu)", label,
                        (unsigned long long)n, BK_ST_MAX_HEADER);
    /* rule 3 */
    uint64_t hend;
    if (bk_add_u64(8, n, &hend) || hend > len)
        return bk_error(BK_ERR_ST_HEADER_BOUNDS,
                        "%s: header runs past the end of the file (got 8 + N = %llu, file size "
                        "%zu)",
                        label, (unsigned long long)(8 + n), len);
    f->header_n = n;
    const unsigned char *h = p + 8;
    /* rule 4 */
    size_t bad = bk_utf8_invalid_at(h, (size_t)n);
    if (bad < n)
        return bk_error(BK_ERR_ST_UTF8,
                        "%s: header is not valid UTF-8 (got byte 0x%02x at header offset %zu)",
                        label, h[bad], bad);
    /* rule 5: JSON */
    int kind = 0;
    bad = bk_json_problem_at(h, (size_t)n, &kind);
    if (bad < n && kind == 3)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "%s: header string contains the escape \\u0000 at header offset %zu "
                        "(names and metadata with NUL characters are not supported)",
                        label, bad);
    if (bad < n)
        return bk_error(BK_ERR_ST_JSON,
                        "%s: header is not valid JSON (got raw control character 0x%02x %s at "
                        "header offset %zu)",
                        label, h[bad], kind == 1 ? "inside a string" : "between tokens", bad);
    hdr = malloc((size_t)n + 1);
    if (!hdr)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a %llu-byte header", label,
                        (unsigned long long)n);
    memcpy(hdr, h, (size_t)n);
    hdr[n] = '\0';
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!root) {
        size_t at = end && end >= hdr && end <= hdr + n ? (size_t)(end - hdr) : 0;
        st = bk_error(BK_ERR_ST_JSON, "%s: header is not valid JSON (parse error at header offset "
                      "%zu of %llu)",
                      label, at, (unsigned long long)n);
        goto fail;
    }
    for (const char *q = end; q < hdr + n; q++) {
        if (!is_json_ws((unsigned char)*q)) {
            st = bk_error(BK_ERR_ST_JSON,
                          "%s: header is not valid JSON (got trailing characters after the "
                          "object at header offset %zu)",
                          label, (size_t)(q - hdr));
            goto fail;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = bk_error(BK_ERR_ST_SCHEMA, "%s: header must be a JSON object (got %s)", label,
                      json_type_name(root));
        goto fail;
    }
    /* rule 5: schema */
    size_t cap = 0;
    for (const cJSON *c = root->child; c; c = c->next)
        cap++;
    raw = calloc(cap ? cap : 1, sizeof *raw);
    if (!raw) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for %zu tensors", label, cap);
        goto fail;
    }
    size_t nt = 0;
    int seen_meta = 0;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (!strcmp(c->string, "__metadata__")) {
            if (seen_meta) {
                st = bk_error(BK_ERR_ST_DUPLICATE, "%s: __metadata__ appears twice", label);
                goto fail;
            }
            seen_meta = 1;
            if ((st = parse_metadata(label, c, f)) != BK_OK)
                goto fail;
            continue;
        }
        if ((st = parse_entry(label, c, &raw[nt])) != BK_OK)
            goto fail;
        nt++;
    }
    order = malloc((nt ? nt : 1) * sizeof *order);
    tmp = malloc((nt ? nt : 1) * sizeof *tmp);
    if (!order || !tmp) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for %zu tensors", label, nt);
        goto fail;
    }
    /* duplicate names */
    for (size_t i = 0; i < nt; i++)
        order[i] = i;
    merge_sort(order, tmp, nt, raw, icmp_name);
    for (size_t i = 1; i < nt; i++) {
        if (!strcmp(raw[order[i]].name, raw[order[i - 1]].name)) {
            st = bk_error(BK_ERR_ST_DUPLICATE, "%s: tensor '%s': name appears twice in the header",
                          label, raw[order[i]].name);
            goto fail;
        }
    }
    f->by_name = malloc((nt ? nt : 1) * sizeof *f->by_name);
    if (!f->by_name) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
        goto fail;
    }
    /* rules 7-10, in offset order */
    for (size_t i = 0; i < nt; i++)
        tmp[i] = order[i]; /* keep the name order for later */
    memcpy(f->by_name, tmp, nt * sizeof *tmp);
    for (size_t i = 0; i < nt; i++)
        order[i] = i;
    merge_sort(order, tmp, nt, raw, icmp_offset);
    uint64_t start = 0;
    const char *prev = NULL;
    uint64_t *numel = calloc(nt ? nt : 1, sizeof *numel);
    uint64_t *nbytes = calloc(nt ? nt : 1, sizeof *nbytes);
    if (!numel || !nbytes) {
        free(numel);
        free(nbytes);
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
        goto fail;
    }
    for (size_t k = 0; k < nt; k++) {
        const raw_tensor *r = &raw[order[k]];
        if (r->begin != start || r->end < r->begin) {
            if (r->end < r->begin)
                st = bk_error(BK_ERR_ST_LAYOUT,
                              "%s: tensor '%s': data_offsets end before they begin (got [%llu, "
                              "%llu], expected end >= begin)",
                              label, r->name, (unsigned long long)r->begin,
                              (unsigned long long)r->end);
            else if (r->begin > start)
                st = bk_error(BK_ERR_ST_LAYOUT,
                              "%s: tensor '%s': hole in the data buffer (got begin %llu, expected "
                              "%llu, the end of %s%s%s)",
                              label, r->name, (unsigned long long)r->begin,
                              (unsigned long long)start, prev ? "tensor '" : "the header",
                              prev ? prev : "", prev ? "'" : "");
            else
                st = bk_error(BK_ERR_ST_LAYOUT,
                              "%s: tensor '%s': overlaps tensor '%s' (got begin %llu, expected "
                              "%llu)",
                              label, r->name, prev ? prev : "?", (unsigned long long)r->begin,
                              (unsigned long long)start);
            goto fail_sizes;
        }
        start = r->end;
        prev = r->name;
        bk_status s2 = bk_st_tensor_size(r->dtype, r->ndim, r->shape, &numel[order[k]],
                                         &nbytes[order[k]]);
        if (s2 == BK_ERR_ST_OVERFLOW) {
            st = bk_error(BK_ERR_ST_OVERFLOW,
                          "%s: tensor '%s': element count x %u bits overflows 64 bits (shape of "
                          "%d dims)",
                          label, r->name, bk_dtype_bits(r->dtype), r->ndim);
            goto fail_sizes;
        }
        if (s2 == BK_ERR_ST_SUBBYTE) {
            st = bk_error(BK_ERR_ST_SUBBYTE,
                          "%s: tensor '%s': %llu elements x %u bits (%s) is not a whole number of "
                          "bytes",
                          label, r->name, (unsigned long long)numel[order[k]],
                          bk_dtype_bits(r->dtype), bk_dtype_name(r->dtype));
            goto fail_sizes;
        }
        if (r->end - r->begin != nbytes[order[k]]) {
            st = bk_error(BK_ERR_ST_SIZE_MISMATCH,
                          "%s: tensor '%s': data size does not match dtype and shape (got end - "
                          "begin = %llu bytes, expected %llu elements x %s = %llu)",
                          label, r->name, (unsigned long long)(r->end - r->begin),
                          (unsigned long long)numel[order[k]], bk_dtype_name(r->dtype),
                          (unsigned long long)nbytes[order[k]]);
            goto fail_sizes;
        }
    }
    /* rule 11 */
    uint64_t total;
    if (f->header_only) {
        if (bk_add_u64(hend, start, &total)) {
            st = bk_error(BK_ERR_ST_OVERFLOW, "%s: 8 + N + last end overflows 64 bits", label);
            goto fail_sizes;
        }
        f->image_len = total; /* no tables: the data is not there */
        goto fail_sizes;
    }
    if (bk_add_u64(hend, start, &total) || total != len) {
        st = bk_error(BK_ERR_ST_FILE_SIZE,
                      "%s: file size does not match the header (got %zu bytes, expected 8 + N + "
                      "last end = %llu: %s)",
                      label, len, (unsigned long long)(hend + start),
                      total > len ? "file truncated" : "trailing bytes");
        goto fail_sizes;
    }
    /* fill the public tables, in file order */
    f->t = calloc(nt ? nt : 1, sizeof *f->t);
    size_t *pos = malloc((nt ? nt : 1) * sizeof *pos); /* raw index -> file position */
    if (!f->t || !pos) {
        free(pos);
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
        goto fail_sizes;
    }
    for (size_t k = 0; k < nt; k++) {
        const raw_tensor *r = &raw[order[k]];
        bk_tensor_info *ti = &f->t[k];
        pos[order[k]] = k;
        ti->name = strdup(r->name);
        f->n = k + 1;
        if (!ti->name) {
            free(pos);
            st = bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
            goto fail_sizes;
        }
        ti->dtype = r->dtype;
        ti->ndim = r->ndim;
        memcpy(ti->shape, r->shape, sizeof ti->shape);
        ti->numel = numel[order[k]];
        ti->nbytes = nbytes[order[k]];
        ti->data = p + hend + r->begin;
        ti->file = f->path;
    }
    for (size_t i = 0; i < nt; i++)
        f->by_name[i] = pos[f->by_name[i]];
    free(pos);
    f->n = nt;
fail_sizes:
    free(numel);
    free(nbytes);
fail:
    free(order);
    free(tmp);
    free(raw);
    cJSON_Delete(root);
    free(hdr);
    return st;
}

static bk_status file_new(const char *label, bk_st_file **out)
{
    *out = NULL;
    bk_st_file *f = calloc(1, sizeof *f);
    if (!f)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    f->fd = -1;
    f->guard = -1;
    f->path = strdup(label ? label : "<memory>");
    if (!f->path) {
        free(f);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    *out = f;
    return BK_OK;
}

bk_status bk_st_open_memory(const void *buf, size_t len, int copy, const char *label,
                            bk_st_file **out)
{
    if (!out)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_open_memory: NULL output handle");
    *out = NULL;
    if (!buf && len)
        return bk_error(BK_ERR_INVALID_ARG, "%s: NULL buffer of %zu bytes",
                        label ? label : "<memory>", len);
    bk_st_file *f;
    bk_status st = file_new(label, &f);
    if (st != BK_OK)
        return st;
    if (copy) {
        f->owned = malloc(len ? len : 1);
        if (!f->owned) {
            file_free(f);
            return bk_error(BK_ERR_NOMEM, "%s: out of memory copying %zu bytes",
                            label ? label : "<memory>", len);
        }
        if (len)
            memcpy(f->owned, buf, len);
        f->base = f->owned;
    } else {
        f->base = buf;
    }
    f->len = len;
    if ((st = validate(f)) != BK_OK) {
        file_free(f);
        return st;
    }
    *out = f;
    return BK_OK;
}

bk_status bk_st_open(const char *path, bk_st_file **out)
{
    if (!out || !path)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_open: NULL argument");
    *out = NULL;
    struct stat sb;
    int fd = bk_open_regular(path, &sb);
    if (fd < 0)
        return BK_ERR_IO;
    bk_st_file *f;
    bk_status st = file_new(path, &f);
    if (st != BK_OK) {
        close(fd);
        return st;
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        file_free(f);
        return bk_error(BK_ERR_IO, "%s: file too large to map", path);
    }
    size_t len = (size_t)sb.st_size;
    static const unsigned char empty[1];
    if (len == 0) {
        f->base = empty;
    } else {
        void *m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            file_free(f);
            return bk_error(BK_ERR_IO, "%s: cannot map %zu bytes: %s", path, len, strerror(e));
        }
        f->map = m;
        f->map_len = len;
        f->base = m;
        f->guard = bk_mapguard_add(m, len);
    }
    f->fd = fd;
    f->snap = sb;
    f->len = len;
    if ((st = validate(f)) == BK_OK)
        st = bk_st_check_unchanged(f); /* the header was read from what is there now */
    if (st != BK_OK) {
        file_free(f);
        return st;
    }
    *out = f;
    return BK_OK;
}

/* "the file changed while it was read": size, mtime or a lost mapped page */
static bk_status changed_error(const char *path, const struct stat *was, const struct stat *now,
                               int faulted)
{
    if (now && now->st_size != was->st_size)
        return bk_error(BK_ERR_IO,
                        "%s: the file changed while it was being read (size %lld bytes, now "
                        "%lld): it must stay unchanged for the whole run",
                        path, (long long)was->st_size, (long long)now->st_size);
    if (faulted)
        return bk_error(BK_ERR_IO,
                        "%s: the file shrank while it was being read (part of it vanished): it "
                        "must stay unchanged for the whole run",
                        path);
    return bk_error(BK_ERR_IO,
                    "%s: the file changed while it was being read (modified at %lld.%09ld, "
                    "opened when modified at %lld.%09ld): it must stay unchanged for the whole "
                    "run",
                    path, (long long)now->st_mtim.tv_sec, (long)now->st_mtim.tv_nsec,
                    (long long)was->st_mtim.tv_sec, (long)was->st_mtim.tv_nsec);
}

static int same_version(const struct stat *a, const struct stat *b)
{
    return a->st_size == b->st_size && a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
           a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

bk_status bk_st_check_unchanged(const bk_st_file *f)
{
    if (!f || f->fd < 0)
        return BK_OK; /* in memory (a buffer, or a decompressed image checked at open) */
    struct stat now;
    if (fstat(f->fd, &now) != 0)
        return bk_error(BK_ERR_IO, "%s: cannot stat: %s", f->path, strerror(errno));
    const int faulted = bk_mapguard_faulted(f->guard);
    if (faulted || !same_version(&f->snap, &now))
        return changed_error(f->path, &f->snap, &now, faulted);
    return BK_OK;
}

static bk_status zst_prefix(const char *path, uint64_t max_header, uint64_t max_image,
                            const char *bound_why, unsigned char **prefix, size_t *prefix_len,
                            uint64_t *declared);

/* Largest decompressed / compressed ratio of a zstd frame: a block decodes to
 * at most 128 KiB (Block_Maximum_Size) and is at least 4 bytes long (3-byte
 * block header + 1 byte of an RLE block); RFC 8878 section 3.1.1.2. */
#define ZST_MAX_RATIO 32768ull

/* A frame declaring more than its file can hold is refused before its
 * declared size is trusted for anything (a decoding window, a buffer). */
static bk_status zst_ratio_check(const char *path, unsigned long long want, size_t clen)
{
    if (want / ZST_MAX_RATIO <= clen)
        return BK_OK;
    return bk_error(BK_ERR_ZSTD,
                    "%s: truncated or corrupt zstd stream (the frame declares %llu decompressed "
                    "bytes; %zu compressed bytes hold at most %llu)",
                    path, want, clen, (unsigned long long)clen * ZST_MAX_RATIO);
}

/* Decode the whole stream into a small scratch buffer (nothing kept, at most
 * BK_ST_ZST_MAX_BYTES of output) and report a corrupt or truncated stream
 * as BK_ERR_ZSTD; BK_OK otherwise. */
static bk_status zst_verify(const char *path)
{
    struct stat sb;
    int fd = bk_open_regular(path, &sb);
    if (fd < 0)
        return BK_ERR_IO;
    size_t clen = (size_t)sb.st_size;
    void *cmap = clen ? mmap(NULL, clen, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    if (cmap == MAP_FAILED) {
        close(fd);
        return BK_OK; /* nothing to add to the caller's error */
    }
    const int guard = bk_mapguard_add(cmap, clen);
    bk_status st = BK_OK;
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    const size_t cap = 1u << 17;
    unsigned char *buf = malloc(cap);
    if (dctx && buf) {
        ZSTD_inBuffer in = {cmap, clen, 0};
        uint64_t total = 0;
        for (;;) {
            ZSTD_outBuffer ob = {buf, cap, 0};
            size_t before = in.pos;
            size_t ret = ZSTD_decompressStream(dctx, &ob, &in);
            if (ZSTD_isError(ret)) {
                st = bk_error(BK_ERR_ZSTD, "%s: corrupt zstd stream: %s", path,
                              ZSTD_getErrorName(ret));
                break;
            }
            total += ob.pos;
            if (ret == 0 && in.pos == in.size)
                break;
            if (total > BK_ST_ZST_MAX_BYTES)
                break;
            if (ob.pos < cap && (in.pos == in.size || in.pos == before)) {
                st = bk_error(BK_ERR_ZSTD, "%s: truncated zstd stream (ends inside a frame)",
                              path);
                break;
            }
        }
    }
    free(buf);
    ZSTD_freeDCtx(dctx);
    bk_mapguard_remove(guard);
    munmap(cmap, clen);
    close(fd);
    return st;
}

bk_status bk_st_open_zst(const char *path, bk_st_file **out)
{
    if (!out || !path)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_open_zst: NULL argument");
    *out = NULL;
    /* The safetensors header inside declares the image's size (8 + N + the
     * tensors' data): decode only the header, validate it, and let the frame
     * decode into no more than that (issue 14 point 9: a tiny .zst may declare
     * any size in its frame header). */
    unsigned char *prefix = NULL;
    size_t plen = 0;
    uint64_t declared;
    bk_status st = zst_prefix(path, BK_ST_MAX_HEADER, BK_ST_ZST_MAX_BYTES, NULL, &prefix, &plen,
                              &declared);
    if (st != BK_OK)
        return st;
    bk_st_file *h = NULL;
    if ((st = file_new(path, &h)) != BK_OK) {
        free(prefix);
        return st;
    }
    h->base = prefix;
    h->len = plen;
    h->header_only = 1;
    st = validate(h);
    const uint64_t image = h->image_len;
    file_free(h);
    free(prefix);
    if (st != BK_OK) {
        /* a header spoilt by a corrupt stream: say so, as the whole decode would */
        char why[1024];
        snprintf(why, sizeof why, "%s", bk_last_error());
        if (zst_verify(path) == BK_ERR_ZSTD)
            return BK_ERR_ZSTD;
        return bk_error(st, "%s", why);
    }
    if (image > BK_ST_ZST_MAX_BYTES)
        return bk_error(BK_ERR_ZSTD,
                        "%s: the safetensors header declares a %llu-byte image (8 + N + the "
                        "tensors' data), more than the %llu bytes the reader decompresses",
                        path, (unsigned long long)image, (unsigned long long)BK_ST_ZST_MAX_BYTES);
    /* a frame declaring more is refused before decoding; one declaring less
     * decodes to an image that fails rule 11 (file truncated) */
    return bk_st_open_zst_max(path, image, "the safetensors header's shapes", out);
}

bk_status bk_st_open_zst_max(const char *path, uint64_t max_bytes, const char *bound_why,
                             bk_st_file **out)
{
    if (!out || !path)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_open_zst: NULL argument");
    if (max_bytes > BK_ST_ZST_MAX_BYTES)
        max_bytes = BK_ST_ZST_MAX_BYTES;
    if (!bound_why)
        bound_why = "the reader's limit";
    *out = NULL;
    bk_status st = BK_OK;
    unsigned char *dbuf = NULL;
    ZSTD_DCtx *dctx = NULL;
    struct stat sb;
    int fd = bk_open_regular(path, &sb);
    if (fd < 0)
        return BK_ERR_IO;
    size_t clen = (size_t)sb.st_size;
    void *cmap = NULL;
    if (clen == 0) {
        close(fd);
        return bk_error(BK_ERR_ZSTD, "%s: empty file is not a zstd stream", path);
    }
    cmap = mmap(NULL, clen, PROT_READ, MAP_PRIVATE, fd, 0);
    if (cmap == MAP_FAILED) {
        int e = errno;
        close(fd);
        return bk_error(BK_ERR_IO, "%s: cannot map %zu bytes: %s", path, clen, strerror(e));
    }
    const int guard = bk_mapguard_add(cmap, clen);

    /* size of the image: exact when every frame records it, else grown as needed */
    /* a single frame that records its size (what our writer makes) is decoded into
     * a buffer of exactly that size; otherwise the buffer grows as needed */
    unsigned long long want = ZSTD_getFrameContentSize(cmap, clen);
    if (want == ZSTD_CONTENTSIZE_ERROR) {
        st = bk_error(BK_ERR_ZSTD, "%s: not a zstd stream (bad or truncated frame header)", path);
        goto done;
    }
    size_t first = ZSTD_findFrameCompressedSize(cmap, clen);
    int known = want != ZSTD_CONTENTSIZE_UNKNOWN && !ZSTD_isError(first) && first == clen;
    if (known && want > max_bytes) {
        /* before any allocation: a tiny file may declare any size */
        st = bk_error(BK_ERR_ZSTD,
                      "%s: the zstd frame declares %llu decompressed bytes, more than the "
                      "%llu bytes allowed by %s",
                      path, want, (unsigned long long)max_bytes, bound_why);
        goto done;
    }
    if (known && (st = zst_ratio_check(path, want, clen)) != BK_OK)
        goto done;
    /* with a known size, one spare byte makes any excess output visible */
    size_t cap = known ? (size_t)want + 1 : (clen < (1u << 20) ? (1u << 20) : clen * 4);
    if (!known && cap > max_bytes)
        cap = (size_t)max_bytes + 1;
    dbuf = malloc(cap);
    dctx = ZSTD_createDCtx();
    if (!dbuf || !dctx) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a %zu-byte decompression buffer", path,
                      cap);
        goto done;
    }
    ZSTD_inBuffer in = {cmap, clen, 0};
    size_t produced = 0;
    for (;;) {
        ZSTD_outBuffer ob = {dbuf, cap, produced};
        size_t ret = ZSTD_decompressStream(dctx, &ob, &in);
        if (ZSTD_isError(ret)) {
            st = bk_error(BK_ERR_ZSTD, "%s: corrupt zstd stream: %s", path,
                          ZSTD_getErrorName(ret));
            goto done;
        }
        produced = ob.pos;
        if (known && produced > (size_t)want) {
            st = bk_error(BK_ERR_ZSTD,
                          "%s: corrupt zstd stream (more data than the %llu bytes the frame "
                          "header declares)",
                          path, want);
            goto done;
        }
        if (ret == 0 && in.pos == in.size)
            break; /* last frame complete and flushed */
        if (produced < cap) {
            if (in.pos == in.size) {
                st = bk_error(BK_ERR_ZSTD, "%s: truncated zstd stream (ends inside a frame)",
                              path);
                goto done;
            }
            continue;
        }
        /* output full: grow (only possible when the size is unknown) */
        if (cap > max_bytes) {
            st = bk_error(BK_ERR_ZSTD,
                          "%s: decompressed size exceeds the %llu bytes allowed by %s", path,
                          (unsigned long long)max_bytes, bound_why);
            goto done;
        }
        size_t ncap = cap > max_bytes / 2 ? (size_t)max_bytes + 1 : cap * 2;
        unsigned char *nb = realloc(dbuf, ncap);
        if (!nb) {
            st = bk_error(BK_ERR_NOMEM, "%s: out of memory growing to %zu bytes", path, ncap);
            goto done;
        }
        dbuf = nb;
        cap = ncap;
    }
    if (known && produced != (size_t)want) {
        st = bk_error(BK_ERR_ZSTD,
                      "%s: truncated zstd stream (got %zu bytes, the frame header declares %llu)",
                      path, produced, want);
        goto done;
    }
    {
        /* the image is complete in memory: was it made from one version of the file? */
        struct stat now;
        if (fstat(fd, &now) != 0) {
            st = bk_error(BK_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
            goto done;
        }
        if (bk_mapguard_faulted(guard) || !same_version(&sb, &now)) {
            st = changed_error(path, &sb, &now, bk_mapguard_faulted(guard));
            goto done;
        }
    }
    bk_st_file *f;
    if ((st = file_new(path, &f)) != BK_OK)
        goto done;
    f->owned = dbuf;
    f->base = dbuf;
    f->len = produced;
    dbuf = NULL;
    if ((st = validate(f)) != BK_OK) {
        file_free(f);
        goto done;
    }
    *out = f;
done:
    ZSTD_freeDCtx(dctx);
    free(dbuf);
    bk_mapguard_remove(guard);
    munmap(cmap, clen);
    close(fd);
    return st;
}

bk_status bk_st_open_any(const char *path, bk_st_file **out)
{
    if (path && bk_ends_with(path, ".zst"))
        return bk_st_open_zst(path, out);
    return bk_st_open(path, out);
}

bk_status bk_st_zst_header(const char *path, uint64_t max_header, uint64_t max_image,
                           const char *bound_why, char **json, uint64_t *declared)
{
    *json = NULL;
    unsigned char *prefix = NULL;
    size_t plen = 0;
    bk_status st = zst_prefix(path, max_header, max_image, bound_why, &prefix, &plen, declared);
    if (st != BK_OK)
        return st;
    char *j = malloc(plen - 8 + 1);
    if (!j) {
        free(prefix);
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", path);
    }
    memcpy(j, prefix + 8, plen - 8);
    j[plen - 8] = '\0';
    free(prefix);
    *json = j;
    return BK_OK;
}

/* Decode the first 8 + N bytes of a .safetensors.zst (the length and the
 * header it announces, N <= max_header) into *prefix (to free, *prefix_len =
 * 8 + N); *declared as in bk_st_zst_header. */
static bk_status zst_prefix(const char *path, uint64_t max_header, uint64_t max_image,
                            const char *bound_why, unsigned char **prefix, size_t *prefix_len,
                            uint64_t *declared)
{
    *prefix = NULL;
    *prefix_len = 0;
    *declared = UINT64_MAX;
    if (!bound_why)
        bound_why = "the reader's limit";
    bk_status st = BK_OK;
    struct stat sb;
    int fd = bk_open_regular(path, &sb);
    if (fd < 0)
        return BK_ERR_IO;
    size_t clen = (size_t)sb.st_size;
    if (clen == 0) {
        close(fd);
        return bk_error(BK_ERR_ZSTD, "%s: empty file is not a zstd stream", path);
    }
    void *cmap = mmap(NULL, clen, PROT_READ, MAP_PRIVATE, fd, 0);
    if (cmap == MAP_FAILED) {
        int e = errno;
        close(fd);
        return bk_error(BK_ERR_IO, "%s: cannot map %zu bytes: %s", path, clen, strerror(e));
    }
    const int guard = bk_mapguard_add(cmap, clen);
    unsigned char *buf = NULL;
    ZSTD_DCtx *dctx = NULL;
    unsigned long long want = ZSTD_getFrameContentSize(cmap, clen);
    if (want == ZSTD_CONTENTSIZE_ERROR) {
        st = bk_error(BK_ERR_ZSTD, "%s: not a zstd stream (bad or truncated frame header)", path);
        goto done;
    }
    size_t first = ZSTD_findFrameCompressedSize(cmap, clen);
    if (want != ZSTD_CONTENTSIZE_UNKNOWN && !ZSTD_isError(first) && first == clen)
        *declared = want;
    if (want != ZSTD_CONTENTSIZE_UNKNOWN && want > max_image) {
        /* before decoding anything: a tiny file may declare any size */
        st = bk_error(BK_ERR_ZSTD,
                      "%s: the zstd frame declares %llu decompressed bytes, more than the "
                      "%llu bytes allowed by %s",
                      path, want, (unsigned long long)max_image, bound_why);
        goto done;
    }
    if (want != ZSTD_CONTENTSIZE_UNKNOWN && (st = zst_ratio_check(path, want, clen)) != BK_OK)
        goto done;
    /* decode the 8-byte length, then the header it announces, and stop */
    size_t cap = 8;
    buf = malloc(8);
    dctx = ZSTD_createDCtx();
    if (!buf || !dctx) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    ZSTD_inBuffer in = {cmap, clen, 0};
    size_t got = 0;
    for (int phase = 0; phase < 2; phase++) {
        while (got < cap) {
            ZSTD_outBuffer ob = {buf, cap, got};
            size_t before = in.pos;
            size_t ret = ZSTD_decompressStream(dctx, &ob, &in);
            if (ZSTD_isError(ret)) {
                st = bk_error(BK_ERR_ZSTD, "%s: corrupt zstd stream: %s", path,
                              ZSTD_getErrorName(ret));
                goto done;
            }
            if (ob.pos == got && (in.pos == in.size || in.pos == before)) {
                st = bk_error(BK_ERR_ZSTD,
                              "%s: the stream ends after %zu bytes, inside the safetensors "
                              "header",
                              path, ob.pos);
                goto done;
            }
            got = ob.pos;
        }
        if (phase == 0) {
            uint64_t n = 0;
            for (int i = 0; i < 8; i++)
                n |= (uint64_t)buf[i] << (8 * i);
            if (n > max_header) {
                st = bk_error(BK_ERR_ST_HEADER_TOO_LARGE,
                              "%s: header length %llu exceeds the %llu bytes allowed here", path,
                              (unsigned long long)n, (unsigned long long)max_header);
                goto done;
            }
            cap = 8 + (size_t)n;
            unsigned char *nb = realloc(buf, cap);
            if (!nb) {
                st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a %llu-byte header", path,
                              (unsigned long long)n);
                goto done;
            }
            buf = nb;
        }
    }
    *prefix = buf;
    *prefix_len = cap;
    buf = NULL;
done:
    ZSTD_freeDCtx(dctx);
    free(buf);
    bk_mapguard_remove(guard);
    munmap(cmap, clen);
    close(fd);
    return st;
}

/* ------------------------------------------------------------- accessors */

const char *bk_st_path(const bk_st_file *f)
{
    return f ? f->path : NULL;
}

size_t bk_st_count(const bk_st_file *f)
{
    return f ? f->n : 0;
}

const bk_tensor_info *bk_st_tensor(const bk_st_file *f, size_t i)
{
    return f && i < f->n ? &f->t[i] : NULL;
}

const bk_tensor_info *bk_st_find(const bk_st_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->t[f->by_name[mid]].name, name);
        if (c == 0)
            return &f->t[f->by_name[mid]];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

size_t bk_st_meta_count(const bk_st_file *f)
{
    return f ? f->nmeta : 0;
}

void bk_st_meta_get(const bk_st_file *f, size_t i, const char **key, const char **value)
{
    const char *k = NULL, *v = NULL;
    if (f && i < f->nmeta) {
        k = f->meta_key[i];
        v = f->meta_val[i];
    }
    if (key)
        *key = k;
    if (value)
        *value = v;
}

const char *bk_st_meta_find(const bk_st_file *f, const char *key)
{
    if (!f || !key)
        return NULL;
    for (size_t i = 0; i < f->nmeta; i++)
        if (!strcmp(f->meta_key[i], key))
            return f->meta_val[i];
    return NULL;
}

uint64_t bk_st_header_size(const bk_st_file *f)
{
    return f ? f->header_n : 0;
}

/* ----------------------------------------------------------- checkpoints */

struct bk_st_set {
    bk_st_file **files;
    size_t nfiles;
    bk_tensor_info *t; /* sorted by name */
    size_t n;
    uint64_t total;
};

void bk_st_set_close(bk_st_set *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->nfiles; i++)
        bk_st_close(s->files[i]);
    free(s->files);
    free(s->t);
    free(s);
}

static int cmp_info_name(const void *a, const void *b)
{
    return strcmp(((const bk_tensor_info *)a)->name, ((const bk_tensor_info *)b)->name);
}

/* Take ownership of files[0..nf) and build the name-sorted table. */
static bk_status set_build(bk_st_file **files, size_t nf, bk_st_set **out)
{
    bk_st_set *s = calloc(1, sizeof *s);
    if (!s) {
        for (size_t i = 0; i < nf; i++)
            bk_st_close(files[i]);
        free(files);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    s->files = files;
    s->nfiles = nf;
    size_t n = 0;
    for (size_t i = 0; i < nf; i++)
        n += files[i]->n;
    s->t = calloc(n ? n : 1, sizeof *s->t);
    if (!s->t) {
        bk_st_set_close(s);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < nf; i++) {
        for (size_t k = 0; k < files[i]->n; k++) {
            s->t[s->n++] = files[i]->t[k];
            s->total += files[i]->t[k].nbytes;
        }
    }
    qsort(s->t, s->n, sizeof *s->t, cmp_info_name);
    *out = s;
    return BK_OK;
}

static bk_status set_single(const char *path, bk_st_set **out)
{
    bk_st_file **files = calloc(1, sizeof *files);
    if (!files)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    bk_status st = bk_st_open_any(path, &files[0]);
    if (st != BK_OK) {
        free(files);
        return st;
    }
    return set_build(files, 1, out);
}

typedef struct wm_entry {
    const char *name; /* into the cJSON tree */
    const char *file;
    size_t shard;     /* index into the sorted unique shard list */
} wm_entry;

static int cmp_wm_name(const void *a, const void *b)
{
    return strcmp(((const wm_entry *)a)->name, ((const wm_entry *)b)->name);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static const wm_entry *wm_find(const wm_entry *wm, size_t n, const char *name)
{
    wm_entry key = {name, NULL, 0};
    return bsearch(&key, wm, n, sizeof *wm, cmp_wm_name);
}

/* A shard name must stay inside the index's folder. */
static int shard_name_ok(const char *s)
{
    if (!s[0] || s[0] == '/')
        return 0;
    const char *p = s;
    while (*p) {
        const char *q = strchr(p, '/');
        size_t l = q ? (size_t)(q - p) : strlen(p);
        if (l == 0 || (l == 1 && p[0] == '.') || (l == 2 && p[0] == '.' && p[1] == '.'))
            return 0;
        p += l;
        if (*p == '/')
            p++;
    }
    return 1;
}

static bk_status set_index(const char *path, bk_st_set **out)
{
    char *text = NULL;
    size_t tlen = 0;
    cJSON *root = NULL;
    wm_entry *wm = NULL;
    const char **shards = NULL;
    bk_st_file **files = NULL;
    size_t nwm = 0, nsh = 0, nopen = 0;
    bk_status st = bk_read_file(path, (size_t)256 << 20, &text, &tlen);
    if (st != BK_OK)
        return st;

    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (slash) {
        size_t dl = (size_t)(slash - path);
        if (dl >= sizeof dir) {
            st = bk_error(BK_ERR_INVALID_ARG, "%s: path too long", path);
            goto fail;
        }
        memcpy(dir, path, dl);
        dir[dl] = '\0';
        if (dl == 0)
            strcpy(dir, "/");
    } else {
        strcpy(dir, ".");
    }

    size_t bad = bk_utf8_invalid_at((const unsigned char *)text, tlen);
    if (bad < tlen) {
        st = bk_error(BK_ERR_ST_INDEX, "%s: index is not valid UTF-8 (byte 0x%02x at offset %zu)",
                      path, (unsigned char)text[bad], bad);
        goto fail;
    }
    if ((st = bk_json_check_text(text, tlen, path, BK_ERR_ST_INDEX)) != BK_OK)
        goto fail;
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(text, tlen, &end, 0);
    if (!root) {
        size_t at = end && end >= text && end <= text + tlen ? (size_t)(end - text) : 0;
        st = bk_error(BK_ERR_ST_INDEX, "%s: index is not valid JSON (parse error at offset %zu)",
                      path, at);
        goto fail;
    }
    for (const char *q = end; q < text + tlen; q++) {
        if (!is_json_ws((unsigned char)*q)) {
            st = bk_error(BK_ERR_ST_INDEX,
                          "%s: index is not valid JSON (trailing characters at offset %zu)", path,
                          (size_t)(q - text));
            goto fail;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = bk_error(BK_ERR_ST_INDEX, "%s: index must be a JSON object (got %s)", path,
                      json_type_name(root));
        goto fail;
    }
    const cJSON *map = NULL;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (!strcmp(c->string, "weight_map")) {
            if (map) {
                st = bk_error(BK_ERR_ST_INDEX, "%s: 'weight_map' appears twice", path);
                goto fail;
            }
            map = c;
        }
    }
    if (!map || !cJSON_IsObject(map)) {
        st = bk_error(BK_ERR_ST_INDEX,
                      "%s: index needs a 'weight_map' object of tensor name -> file (got %s)",
                      path, json_type_name(map));
        goto fail;
    }
    for (const cJSON *c = map->child; c; c = c->next)
        nwm++;
    if (nwm == 0) {
        st = bk_error(BK_ERR_ST_INDEX, "%s: weight_map is empty (expected at least one tensor)",
                      path);
        goto fail;
    }
    wm = calloc(nwm, sizeof *wm);
    shards = calloc(nwm, sizeof *shards);
    if (!wm || !shards) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    size_t k = 0;
    for (const cJSON *c = map->child; c; c = c->next, k++) {
        if (!cJSON_IsString(c)) {
            st = bk_error(BK_ERR_ST_INDEX,
                          "%s: weight_map '%s': value must be a file name string (got %s)", path,
                          c->string, json_type_name(c));
            goto fail;
        }
        if (!shard_name_ok(c->valuestring)) {
            st = bk_error(BK_ERR_ST_INDEX,
                          "%s: weight_map '%s': file '%s' must be a relative path inside the "
                          "index's folder",
                          path, c->string, c->valuestring);
            goto fail;
        }
        wm[k].name = c->string;
        wm[k].file = c->valuestring;
        shards[k] = c->valuestring;
    }
    qsort(wm, nwm, sizeof *wm, cmp_wm_name);
    for (size_t i = 1; i < nwm; i++) {
        if (!strcmp(wm[i].name, wm[i - 1].name)) {
            st = bk_error(BK_ERR_ST_INDEX, "%s: tensor '%s': listed twice in weight_map", path,
                          wm[i].name);
            goto fail;
        }
    }
    qsort(shards, nwm, sizeof *shards, cmp_str);
    for (size_t i = 0; i < nwm; i++)
        if (nsh == 0 || strcmp(shards[i], shards[nsh - 1]))
            shards[nsh++] = shards[i];
    for (size_t i = 0; i < nwm; i++) {
        const char **hit = bsearch(&wm[i].file, shards, nsh, sizeof *shards, cmp_str);
        wm[i].shard = (size_t)(hit - shards);
    }
    files = calloc(nsh, sizeof *files);
    if (!files) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    for (size_t i = 0; i < nsh; i++) {
        char sp[4096];
        if ((st = bk_path_join(sp, sizeof sp, dir, shards[i])) != BK_OK)
            goto fail;
        struct stat ssb;
        if (stat(sp, &ssb) != 0 || !S_ISREG(ssb.st_mode)) {
            const char *who = "?";
            for (size_t j = 0; j < nwm; j++)
                if (wm[j].shard == i) {
                    who = wm[j].name;
                    break;
                }
            if (stat(sp, &ssb) != 0 && errno == ENOENT)
                st = bk_error(BK_ERR_ST_INDEX,
                              "%s: tensor '%s': mapped to shard '%s', which does not exist (%s)",
                              path, who, shards[i], sp);
            else if (stat(sp, &ssb) != 0)
                st = bk_error(BK_ERR_ST_INDEX,
                              "%s: tensor '%s': mapped to shard '%s', which cannot be opened "
                              "(%s: %s)",
                              path, who, shards[i], sp, strerror(errno));
            else
                st = bk_error(BK_ERR_ST_INDEX,
                              "%s: tensor '%s': mapped to shard '%s', which is %s, not a file "
                              "(%s)",
                              path, who, shards[i], bk_file_kind(ssb.st_mode), sp);
            goto fail;
        }
        if ((st = bk_st_open_any(sp, &files[i])) != BK_OK) {
            bk_error_prefix(st, path);
            goto fail;
        }
        nopen = i + 1;
    }
    /* every listed tensor is in the shard the map names */
    for (size_t i = 0; i < nwm; i++) {
        if (bk_st_find(files[wm[i].shard], wm[i].name))
            continue;
        const char *where = NULL;
        for (size_t j = 0; j < nsh && !where; j++)
            if (bk_st_find(files[j], wm[i].name))
                where = shards[j];
        if (where)
            st = bk_error(BK_ERR_ST_INDEX,
                          "%s: tensor '%s': not in shard '%s' named by weight_map (found in '%s')",
                          path, wm[i].name, wm[i].file, where);
        else
            st = bk_error(BK_ERR_ST_INDEX,
                          "%s: tensor '%s': not in shard '%s' named by weight_map (nor in any "
                          "other shard)",
                          path, wm[i].name, wm[i].file);
        goto fail;
    }
    /* every tensor a shard holds is listed, and listed for that shard */
    for (size_t i = 0; i < nsh; i++) {
        for (size_t j = 0; j < files[i]->n; j++) {
            const char *name = files[i]->t[j].name;
            const wm_entry *e = wm_find(wm, nwm, name);
            if (!e) {
                st = bk_error(BK_ERR_ST_INDEX,
                              "%s: tensor '%s': held by shard '%s' but not listed in weight_map",
                              path, name, shards[i]);
                goto fail;
            }
            if (e->shard != i) {
                st = bk_error(BK_ERR_ST_INDEX,
                              "%s: tensor '%s': also held by shard '%s' (weight_map names '%s')",
                              path, name, shards[i], e->file);
                goto fail;
            }
        }
    }
    cJSON_Delete(root);
    free(text);
    free(wm);
    free(shards);
    return set_build(files, nsh, out);

fail:
    for (size_t i = 0; i < nopen; i++)
        bk_st_close(files[i]);
    free(files);
    free(shards);
    free(wm);
    cJSON_Delete(root);
    free(text);
    return st;
}

static bk_status set_dir(const char *path, bk_st_set **out)
{
    char p[4096];
    bk_status st;
    if ((st = bk_path_join(p, sizeof p, path, "model.safetensors.index.json")) != BK_OK)
        return st;
    if (bk_is_file(p))
        return set_index(p, out);
    if ((st = bk_path_join(p, sizeof p, path, "model.safetensors")) != BK_OK)
        return st;
    if (bk_is_file(p))
        return set_single(p, out);
    DIR *d = opendir(path);
    if (!d)
        return bk_error(BK_ERR_IO, "%s: cannot open folder: %s", path, strerror(errno));
    char idx[4096] = "", one[4096] = "";
    int nidx = 0, none = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        if (bk_ends_with(e->d_name, ".safetensors.index.json")) {
            if (nidx++ == 0 && bk_path_join(idx, sizeof idx, path, e->d_name) != BK_OK)
                idx[0] = '\0';
        } else if (bk_ends_with(e->d_name, ".safetensors")) {
            if (none++ == 0 && bk_path_join(one, sizeof one, path, e->d_name) != BK_OK)
                one[0] = '\0';
        }
    }
    closedir(d);
    if (nidx == 1 && idx[0] && bk_is_file(idx))
        return set_index(idx, out);
    if (nidx > 1)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: folder holds %d *.safetensors.index.json files and no "
                        "model.safetensors.index.json (pass the index to use)",
                        path, nidx);
    if (none == 1 && one[0] && bk_is_file(one))
        return set_single(one, out);
    if (none == 0)
        return bk_error(BK_ERR_IO,
                        "%s: no model.safetensors.index.json, model.safetensors or other "
                        "*.safetensors file in this folder",
                        path);
    return bk_error(BK_ERR_INVALID_ARG,
                    "%s: folder holds %d *.safetensors files and no model.safetensors(.index.json) "
                    "(pass the file to use)",
                    path, none);
}

bk_status bk_st_set_check_unchanged(const bk_st_set *s)
{
    for (size_t i = 0; s && i < s->nfiles; i++) {
        bk_status st = bk_st_check_unchanged(s->files[i]);
        if (st != BK_OK)
            return st;
    }
    return BK_OK;
}

bk_status bk_st_set_open(const char *path, bk_st_set **out)
{
    if (!out || !path)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_set_open: NULL argument");
    *out = NULL;
    if (bk_is_dir(path))
        return set_dir(path, out);
    if (bk_ends_with(path, ".json"))
        return set_index(path, out);
    return set_single(path, out);
}

size_t bk_st_set_count(const bk_st_set *s)
{
    return s ? s->n : 0;
}

const bk_tensor_info *bk_st_set_tensor(const bk_st_set *s, size_t i)
{
    return s && i < s->n ? &s->t[i] : NULL;
}

const bk_tensor_info *bk_st_set_find(const bk_st_set *s, const char *name)
{
    if (!s || !name)
        return NULL;
    bk_tensor_info key;
    memset(&key, 0, sizeof key);
    key.name = name;
    return bsearch(&key, s->t, s->n, sizeof *s->t, cmp_info_name);
}

size_t bk_st_set_file_count(const bk_st_set *s)
{
    return s ? s->nfiles : 0;
}

const bk_st_file *bk_st_set_file(const bk_st_set *s, size_t i)
{
    return s && i < s->nfiles ? s->files[i] : NULL;
}

uint64_t bk_st_set_total_bytes(const bk_st_set *s)
{
    return s ? s->total : 0;
}
