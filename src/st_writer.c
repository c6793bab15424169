/* st_writer.c — writing safetensors files: in memory (single file, sharded +
 * index, zstd-compressed) and streaming (declare, then pwrite in any order).
 *
 * Conventions (docs/formats.md): header JSON is compact, "__metadata__" first
 * with "format": "pt", then the tensors in the order they were added; padded with
 * spaces so that 8 + N is a multiple of 8. Every file is written under a
 * temporary name in its final folder, fsync'd, then renamed; a failure removes
 * the temporary files, so nothing half-written ever carries a final name.
 */
#include "bakron/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "st_internal.h"
#include "util.h"

/* ------------------------------------------------------------ strbuf */

static void sb_grow(bk_strbuf *b, size_t extra)
{
    if (b->oom)
        return;
    if (b->cap - b->len > extra)
        return;
    size_t need = b->len + extra + 1;
    if (need < b->len) {
        b->oom = 1;
        return;
    }
    size_t nc = b->cap ? b->cap : 256;
    while (nc < need) {
        if (nc > SIZE_MAX / 2) {
            nc = need;
            break;
        }
        nc *= 2;
    }
    char *p = realloc(b->p, nc);
    if (!p) {
        b->oom = 1;
        return;
    }
    b->p = p;
    b->cap = nc;
}

void bk_sb_put(bk_strbuf *b, const void *s, size_t n)
{
    sb_grow(b, n);
    if (b->oom)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void bk_sb_puts(bk_strbuf *b, const char *s)
{
    bk_sb_put(b, s, strlen(s));
}

void bk_sb_printf(bk_strbuf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = 1;
        return;
    }
    if ((size_t)n < sizeof tmp) {
        bk_sb_put(b, tmp, (size_t)n);
        return;
    }
    sb_grow(b, (size_t)n);
    if (b->oom)
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void bk_sb_json_string(bk_strbuf *b, const char *s)
{
    cJSON *j = cJSON_CreateString(s);
    char *t = j ? cJSON_PrintUnformatted(j) : NULL;
    if (!t)
        b->oom = 1;
    else
        bk_sb_puts(b, t);
    cJSON_free(t);
    cJSON_Delete(j);
}

void bk_sb_free(bk_strbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------ shared pieces */

typedef struct entry {
    char *name;
    bk_dtype dtype;
    int ndim;
    int64_t shape[BK_MAX_DIMS];
    uint64_t nbytes;
    const void *data; /* in-memory writer */
    void *owned;      /* copy, when the writer owns the data */
    size_t shard;     /* shard index */
    uint64_t offset;  /* begin within the shard's data buffer */
    int written;      /* streaming writer */
} entry;

typedef struct entry_list {
    entry *e;
    size_t n, cap;
    size_t *hash; /* open addressing, SIZE_MAX = empty; index into e */
    size_t hcap;
    char **mkey, **mval;
    size_t nmeta, mcap;
} entry_list;

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static size_t list_find(const entry_list *L, const char *name)
{
    if (!L->hcap)
        return SIZE_MAX;
    size_t m = L->hcap - 1;
    for (size_t i = (size_t)hash_str(name) & m;; i = (i + 1) & m) {
        size_t k = L->hash[i];
        if (k == SIZE_MAX)
            return SIZE_MAX;
        if (!strcmp(L->e[k].name, name))
            return k;
    }
}

static int hash_rebuild(entry_list *L, size_t hcap)
{
    size_t *h = malloc(hcap * sizeof *h);
    if (!h)
        return -1;
    for (size_t i = 0; i < hcap; i++)
        h[i] = SIZE_MAX;
    for (size_t k = 0; k < L->n; k++) {
        size_t i = (size_t)hash_str(L->e[k].name) & (hcap - 1);
        while (h[i] != SIZE_MAX)
            i = (i + 1) & (hcap - 1);
        h[i] = k;
    }
    free(L->hash);
    L->hash = h;
    L->hcap = hcap;
    return 0;
}

static void list_free(entry_list *L)
{
    for (size_t i = 0; i < L->n; i++) {
        free(L->e[i].name);
        free(L->e[i].owned);
    }
    free(L->e);
    free(L->hash);
    for (size_t i = 0; i < L->nmeta; i++) {
        free(L->mkey[i]);
        free(L->mval[i]);
    }
    free(L->mkey);
    free(L->mval);
    memset(L, 0, sizeof *L);
}

static int utf8_ok(const char *s)
{
    size_t n = strlen(s);
    return bk_utf8_invalid_at((const unsigned char *)s, n) == n;
}

/* Validate a declaration: name, dtype, rank, shape, size, uniqueness. */
static bk_status list_check(const entry_list *L, const char *who, const char *name, bk_dtype dt,
                            int ndim, const int64_t *shape, uint64_t *nbytes_out)
{
    if (!name || !name[0])
        return bk_error(BK_ERR_INVALID_ARG, "%s: tensor name must be a non-empty string", who);
    if (!strcmp(name, "__metadata__") || !utf8_ok(name))
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: tensor '%s': name must be valid UTF-8 and not '__metadata__'", who,
                        name);
    if ((int)dt < 0 || dt >= BK_DT_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "%s: tensor '%s': invalid dtype value %d", who, name,
                        (int)dt);
    if (ndim < 0 || ndim > BK_MAX_DIMS || (ndim > 0 && !shape))
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: tensor '%s': bad rank (got %d, expected 0..%d with a shape)", who,
                        name, ndim, BK_MAX_DIMS);
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0 || (double)shape[d] > BK_ST_MAX_JSON_INT)
            return bk_error(BK_ERR_INVALID_ARG,
                            "%s: tensor '%s': shape[%d] out of range (got %lld, expected 0..2^53)",
                            who, name, d, (long long)shape[d]);
    uint64_t numel, nbytes;
    bk_status st = bk_st_tensor_size(dt, ndim, shape, &numel, &nbytes);
    if (st == BK_ERR_ST_OVERFLOW)
        return bk_error(st, "%s: tensor '%s': element count x dtype size overflows 64 bits", who,
                        name);
    if (st == BK_ERR_ST_SUBBYTE)
        return bk_error(st, "%s: tensor '%s': %llu elements of %s is not a whole number of bytes",
                        who, name, (unsigned long long)numel, bk_dtype_name(dt));
    if (nbytes > (uint64_t)BK_ST_MAX_JSON_INT)
        return bk_error(BK_ERR_INVALID_ARG, "%s: tensor '%s': %llu bytes is too large", who, name,
                        (unsigned long long)nbytes);
    if (list_find(L, name) != SIZE_MAX)
        return bk_error(BK_ERR_ST_DUPLICATE, "%s: tensor '%s': added twice", who, name);
    *nbytes_out = nbytes;
    return BK_OK;
}

/* Append a checked declaration. Only fails for lack of memory, leaving L as it was. */
static bk_status list_append(entry_list *L, const char *who, const char *name, bk_dtype dt,
                             int ndim, const int64_t *shape, uint64_t nbytes, entry **out)
{
    if (L->n == L->cap) {
        size_t nc = L->cap ? L->cap * 2 : 16;
        entry *ne = realloc(L->e, nc * sizeof *ne);
        if (!ne)
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
        L->e = ne;
        L->cap = nc;
    }
    if ((L->n + 1) * 2 > L->hcap && hash_rebuild(L, L->hcap ? L->hcap * 2 : 64) != 0)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
    char *nm = strdup(name);
    if (!nm)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
    entry *e = &L->e[L->n];
    memset(e, 0, sizeof *e);
    e->name = nm;
    e->dtype = dt;
    e->ndim = ndim;
    for (int d = 0; d < ndim; d++)
        e->shape[d] = shape[d];
    e->nbytes = nbytes;
    size_t i = (size_t)hash_str(nm) & (L->hcap - 1);
    while (L->hash[i] != SIZE_MAX)
        i = (i + 1) & (L->hcap - 1);
    L->hash[i] = L->n;
    L->n++;
    *out = e;
    return BK_OK;
}

static bk_status list_set_meta(entry_list *L, const char *who, const char *key, const char *value)
{
    if (!key || !value || !utf8_ok(key) || !utf8_ok(value))
        return bk_error(BK_ERR_INVALID_ARG, "%s: metadata key and value must be UTF-8 strings",
                        who);
    if (!strcmp(key, "format")) {
        if (strcmp(value, "pt"))
            return bk_error(BK_ERR_INVALID_ARG,
                            "%s: metadata 'format' is always \"pt\" (got \"%s\")", who, value);
        return BK_OK;
    }
    for (size_t i = 0; i < L->nmeta; i++) {
        if (!strcmp(L->mkey[i], key)) {
            char *v = strdup(value);
            if (!v)
                return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
            free(L->mval[i]);
            L->mval[i] = v;
            return BK_OK;
        }
    }
    if (L->nmeta == L->mcap) {
        size_t nc = L->mcap ? L->mcap * 2 : 8;
        char **k = realloc(L->mkey, nc * sizeof *k);
        if (!k)
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
        L->mkey = k;
        char **v = realloc(L->mval, nc * sizeof *v);
        if (!v)
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
        L->mval = v;
        L->mcap = nc;
    }
    char *k = strdup(key), *v = strdup(value);
    if (!k || !v) {
        free(k);
        free(v);
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", who);
    }
    L->mkey[L->nmeta] = k;
    L->mval[L->nmeta] = v;
    L->nmeta++;
    return BK_OK;
}

/* Assign shards and offsets; returns the number of shards (>= 1). max == 0: no limit. */
static size_t plan_shards(entry_list *L, uint64_t max)
{
    size_t shard = 0;
    uint64_t cur = 0;
    for (size_t i = 0; i < L->n; i++) {
        entry *e = &L->e[i];
        /* a zero-byte tensor never opens a shard of its own */
        if (max && cur > 0 && e->nbytes > 0 && (cur + e->nbytes > max || cur + e->nbytes < cur)) {
            shard++;
            cur = 0;
        }
        e->shard = shard;
        e->offset = cur;
        cur += e->nbytes;
    }
    return shard + 1;
}

/* Header of shard s: 8-byte length + JSON padded with spaces to a multiple of 8. */
static bk_status build_header(const entry_list *L, size_t s, bk_strbuf *b, uint64_t *data_bytes)
{
    memset(b, 0, sizeof *b);
    bk_sb_put(b, "\0\0\0\0\0\0\0\0", 8);
    bk_sb_puts(b, "{\"__metadata__\":{\"format\":\"pt\"");
    for (size_t i = 0; i < L->nmeta; i++) {
        bk_sb_puts(b, ",");
        bk_sb_json_string(b, L->mkey[i]);
        bk_sb_puts(b, ":");
        bk_sb_json_string(b, L->mval[i]);
    }
    bk_sb_puts(b, "}");
    uint64_t total = 0;
    for (size_t i = 0; i < L->n; i++) {
        const entry *e = &L->e[i];
        if (e->shard != s)
            continue;
        bk_sb_puts(b, ",");
        bk_sb_json_string(b, e->name);
        bk_sb_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", bk_dtype_name(e->dtype));
        for (int d = 0; d < e->ndim; d++)
            bk_sb_printf(b, d ? ",%lld" : "%lld", (long long)e->shape[d]);
        bk_sb_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)e->offset,
                     (unsigned long long)(e->offset + e->nbytes));
        total = e->offset + e->nbytes;
    }
    bk_sb_puts(b, "}");
    while (!b->oom && b->len % 8)
        bk_sb_puts(b, " ");
    if (b->oom) {
        bk_sb_free(b);
        return bk_error(BK_ERR_NOMEM, "out of memory building a safetensors header");
    }
    uint64_t n = b->len - 8;
    if (n > BK_ST_MAX_HEADER) {
        bk_sb_free(b);
        return bk_error(BK_ERR_INVALID_ARG,
                        "safetensors header too large (got %llu bytes, limit %llu): too many "
                        "tensors or too much metadata for one file",
                        (unsigned long long)n, BK_ST_MAX_HEADER);
    }
    for (int i = 0; i < 8; i++)
        b->p[i] = (char)((n >> (8 * i)) & 0xff);
    *data_bytes = total;
    return BK_OK;
}

static char *shard_name(const char *base, size_t i, size_t n)
{
    char buf[4096];
    int k;
    if (n == 1)
        k = snprintf(buf, sizeof buf, "%s.safetensors", base);
    else
        k = snprintf(buf, sizeof buf, "%s-%05zu-of-%05zu.safetensors", base, i + 1, n);
    if (k < 0 || (size_t)k >= sizeof buf)
        return NULL;
    return strdup(buf);
}

/* An output file under construction: FINAL.tmp.XXXXXX in the same folder. */
typedef struct outfile {
    char *final_path;
    char *tmp_path;
    int fd;
    int renamed;
} outfile;

/* o emptied (no descriptor), its final path and the temporary one
 * (final_path + suffix) allocated. */
static bk_status out_names(outfile *o, const char *final_path, const char *suffix)
{
    memset(o, 0, sizeof *o);
    o->fd = -1;
    size_t l = strlen(final_path), ls = strlen(suffix) + 1;
    o->final_path = strdup(final_path);
    o->tmp_path = malloc(l + ls);
    if (!o->final_path || !o->tmp_path)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    memcpy(o->tmp_path, final_path, l);
    memcpy(o->tmp_path + l, suffix, ls);
    return BK_OK;
}

static bk_status out_create(outfile *o, const char *final_path)
{
    bk_status st = out_names(o, final_path, ".tmp.XXXXXX");
    if (st != BK_OK)
        return st;
    o->fd = mkstemp(o->tmp_path);
    if (o->fd < 0) {
        int e = errno;
        free(o->tmp_path);
        o->tmp_path = NULL;
        return bk_error(BK_ERR_WRITE, "%s: cannot create a temporary file: %s", final_path,
                        strerror(e));
    }
    return BK_OK;
}

/* The fixed temporary name FINAL.partial (resumable streams): opened, created
 * when missing; *existing = 1 when it was there. */
static bk_status out_open_fixed(outfile *o, const char *final_path, int *existing)
{
    *existing = 0;
    bk_status st = out_names(o, final_path, ".partial");
    if (st != BK_OK)
        return st;
    o->fd = open(o->tmp_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (o->fd >= 0) {
        *existing = 1;
        return BK_OK;
    }
    o->fd = open(o->tmp_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (o->fd < 0) {
        int e = errno;
        free(o->tmp_path);
        o->tmp_path = NULL;
        return bk_error(BK_ERR_WRITE, "%s: cannot create %s.partial: %s", final_path,
                        final_path, strerror(e));
    }
    return BK_OK;
}

/* Remove the temporary (and, if asked, an already renamed final) file. */
static void out_discard(outfile *o, int remove_final)
{
    if (o->fd >= 0)
        close(o->fd);
    o->fd = -1;
    if (o->tmp_path && !o->renamed)
        unlink(o->tmp_path);
    if (o->renamed && remove_final && o->final_path)
        unlink(o->final_path);
    free(o->tmp_path);
    free(o->final_path);
    o->tmp_path = o->final_path = NULL;
}

/* All len bytes of buf into the file: at offset off (pwrite), or at the
 * current position when off < 0 (write); in chunks of at most 1 GiB,
 * EINTR retried. */
static bk_status write_at(outfile *o, const void *buf, uint64_t len, int64_t off)
{
    const char *p = buf;
    while (len > 0) {
        size_t chunk = len > ((uint64_t)1 << 30) ? ((size_t)1 << 30) : (size_t)len;
        ssize_t w = off < 0 ? write(o->fd, p, chunk) : pwrite(o->fd, p, chunk, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return bk_error(BK_ERR_WRITE, "%s: write failed: %s", o->final_path, strerror(errno));
        }
        if (w == 0)
            return bk_error(BK_ERR_WRITE, "%s: write made no progress", o->final_path);
        p += w;
        len -= (uint64_t)w;
        if (off >= 0)
            off += (int64_t)w;
    }
    return BK_OK;
}

static bk_status write_all(outfile *o, const void *buf, size_t len)
{
    return write_at(o, buf, (uint64_t)len, -1);
}

static bk_status pwrite_all(outfile *o, const void *buf, uint64_t len, uint64_t off)
{
    return write_at(o, buf, len, (int64_t)off);
}

/* fsync + close (the file stays under its temporary name). */
static bk_status out_close(outfile *o)
{
    if (fsync(o->fd) != 0)
        return bk_error(BK_ERR_WRITE, "%s: fsync failed: %s", o->final_path, strerror(errno));
    if (fchmod(o->fd, 0644) != 0)
        return bk_error(BK_ERR_WRITE, "%s: chmod failed: %s", o->final_path, strerror(errno));
    int fd = o->fd;
    o->fd = -1;
    if (close(fd) != 0)
        return bk_error(BK_ERR_WRITE, "%s: close failed: %s", o->final_path, strerror(errno));
    return BK_OK;
}

static bk_status out_rename(outfile *o)
{
    if (rename(o->tmp_path, o->final_path) != 0)
        return bk_error(BK_ERR_WRITE, "%s: cannot rename the temporary file into place: %s",
                        o->final_path, strerror(errno));
    o->renamed = 1;
    return BK_OK;
}

static void fsync_dir_of(const char *path)
{
    char d[4096];
    const char *s = strrchr(path, '/');
    if (!s) {
        strcpy(d, ".");
    } else {
        size_t l = (size_t)(s - path);
        if (l >= sizeof d)
            return;
        memcpy(d, path, l ? l : 1);
        d[l ? l : 1] = '\0';
    }
    int fd = open(d, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* A single file's end when st is BK_OK: closed (fsync), renamed to its
 * final name, the folder synced. Returns st or the first failure. */
static bk_status out_commit(outfile *o, bk_status st)
{
    if (st == BK_OK)
        st = out_close(o);
    if (st == BK_OK)
        st = out_rename(o);
    if (st == BK_OK)
        fsync_dir_of(o->final_path);
    return st;
}

/* The index JSON exactly as transformers writes it: sort_keys, indent 2. */
static int cmp_entry_ptr_name(const void *a, const void *b)
{
    return strcmp((*(const entry *const *)a)->name, (*(const entry *const *)b)->name);
}

static bk_status build_index(const entry_list *L, char *const *names, bk_strbuf *b)
{
    memset(b, 0, sizeof *b);
    const entry **sorted = malloc((L->n ? L->n : 1) * sizeof *sorted);
    if (!sorted)
        return bk_error(BK_ERR_NOMEM, "out of memory building the index");
    uint64_t total = 0;
    for (size_t i = 0; i < L->n; i++) {
        sorted[i] = &L->e[i];
        total += L->e[i].nbytes;
    }
    qsort(sorted, L->n, sizeof *sorted, cmp_entry_ptr_name);
    bk_sb_printf(b, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
                 (unsigned long long)total);
    for (size_t i = 0; i < L->n; i++) {
        bk_sb_puts(b, i ? ",\n    " : "\n    ");
        bk_sb_json_string(b, sorted[i]->name);
        bk_sb_puts(b, ": ");
        bk_sb_json_string(b, names[sorted[i]->shard]);
    }
    bk_sb_puts(b, "\n  }\n}\n");
    free(sorted);
    if (b->oom) {
        bk_sb_free(b);
        return bk_error(BK_ERR_NOMEM, "out of memory building the index");
    }
    return BK_OK;
}

static bk_status check_base(const char *who, const char *dir, const char *basename)
{
    if (!dir || !basename || !basename[0] || strchr(basename, '/'))
        return bk_error(BK_ERR_INVALID_ARG, "%s: basename must be a non-empty file name (got '%s')",
                        who, basename ? basename : "(null)");
    if (!bk_is_dir(dir))
        return bk_error(BK_ERR_WRITE, "%s: output folder does not exist", dir);
    return BK_OK;
}

/* --------------------------------------------------- in-memory writer */

struct bk_st_writer {
    entry_list L;
};

bk_status bk_st_writer_create(bk_st_writer **out)
{
    if (!out)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_writer_create: NULL output");
    *out = calloc(1, sizeof **out);
    if (!*out)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

void bk_st_writer_free(bk_st_writer *w)
{
    if (!w)
        return;
    list_free(&w->L);
    free(w);
}

bk_status bk_st_writer_add(bk_st_writer *w, const char *name, bk_dtype dt, int ndim,
                           const int64_t *shape, const void *data, int copy)
{
    static const char who[] = "safetensors writer";
    if (!w)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_writer_add: NULL writer");
    uint64_t nbytes = 0;
    bk_status st = list_check(&w->L, who, name, dt, ndim, shape, &nbytes);
    if (st != BK_OK)
        return st;
    if (nbytes > 0 && !data)
        return bk_error(BK_ERR_INVALID_ARG, "%s: tensor '%s': NULL data for %llu bytes", who,
                        name, (unsigned long long)nbytes);
    void *owned = NULL;
    if (copy && nbytes > 0) {
        if (nbytes > SIZE_MAX || !(owned = malloc((size_t)nbytes)))
            return bk_error(BK_ERR_NOMEM, "%s: tensor '%s': out of memory copying %llu bytes",
                            who, name, (unsigned long long)nbytes);
        memcpy(owned, data, (size_t)nbytes);
    }
    entry *e;
    st = list_append(&w->L, who, name, dt, ndim, shape, nbytes, &e);
    if (st != BK_OK) {
        free(owned);
        return st;
    }
    e->owned = owned;
    e->data = owned ? owned : data;
    return BK_OK;
}

bk_status bk_st_writer_set_meta(bk_st_writer *w, const char *key, const char *value)
{
    if (!w)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_writer_set_meta: NULL writer");
    return list_set_meta(&w->L, "safetensors writer", key, value);
}

/* Write shard s (header + data) to o. */
static bk_status write_shard_plain(const entry_list *L, size_t s, outfile *o)
{
    bk_strbuf h;
    uint64_t data_bytes;
    bk_status st = build_header(L, s, &h, &data_bytes);
    if (st != BK_OK)
        return bk_error_prefix(st, o->final_path);
    st = write_all(o, h.p, h.len);
    bk_sb_free(&h);
    for (size_t i = 0; st == BK_OK && i < L->n; i++) {
        const entry *e = &L->e[i];
        if (e->shard == s && e->nbytes)
            st = write_all(o, e->data, (size_t)e->nbytes);
    }
    return st;
}

bk_status bk_st_writer_save(bk_st_writer *w, const char *path)
{
    if (!w || !path)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_writer_save: NULL argument");
    plan_shards(&w->L, 0);
    outfile o;
    bk_status st = out_create(&o, path);
    if (st == BK_OK)
        st = write_shard_plain(&w->L, 0, &o);
    st = out_commit(&o, st);
    out_discard(&o, 0);
    return st;
}

/* zstd sink: compress chunks to o. */
typedef struct zsink {
    ZSTD_CCtx *cctx;
    void *obuf;
    size_t osize;
    outfile *o;
} zsink;

static bk_status zs_feed(zsink *z, const void *src, size_t len, ZSTD_EndDirective mode)
{
    ZSTD_inBuffer in = {src, len, 0};
    for (;;) {
        ZSTD_outBuffer ob = {z->obuf, z->osize, 0};
        size_t r = ZSTD_compressStream2(z->cctx, &ob, &in, mode);
        if (ZSTD_isError(r))
            return bk_error(BK_ERR_ZSTD, "%s: zstd compression failed: %s", z->o->final_path,
                            ZSTD_getErrorName(r));
        if (ob.pos) {
            bk_status st = write_all(z->o, z->obuf, ob.pos);
            if (st != BK_OK)
                return st;
        }
        if (mode == ZSTD_e_end ? r == 0 : in.pos == in.size)
            return BK_OK;
    }
}

bk_status bk_st_writer_save_zst(bk_st_writer *w, const char *path, int level)
{
    if (!w || !path)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_writer_save_zst: NULL argument");
    if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel())
        return bk_error(BK_ERR_INVALID_ARG, "%s: zstd level out of range (got %d, expected %d..%d)",
                        path, level, ZSTD_minCLevel(), ZSTD_maxCLevel());
    plan_shards(&w->L, 0);
    bk_strbuf h = {0};
    uint64_t data_bytes = 0;
    zsink z = {0};
    outfile o;
    bk_status st = out_create(&o, path);
    if (st == BK_OK)
        st = build_header(&w->L, 0, &h, &data_bytes);
    if (st == BK_OK) {
        z.cctx = ZSTD_createCCtx();
        z.osize = ZSTD_CStreamOutSize();
        z.obuf = malloc(z.osize);
        z.o = &o;
        if (!z.cctx || !z.obuf)
            st = bk_error(BK_ERR_NOMEM, "%s: out of memory for zstd", path);
    }
    if (st == BK_OK) {
        size_t r = ZSTD_CCtx_setParameter(z.cctx, ZSTD_c_compressionLevel,
                                          level ? level : ZSTD_CLEVEL_DEFAULT);
        if (!ZSTD_isError(r))
            r = ZSTD_CCtx_setParameter(z.cctx, ZSTD_c_checksumFlag, 1);
        if (!ZSTD_isError(r))
            r = ZSTD_CCtx_setPledgedSrcSize(z.cctx, (unsigned long long)h.len + data_bytes);
        if (ZSTD_isError(r))
            st = bk_error(BK_ERR_ZSTD, "%s: zstd setup failed: %s", path, ZSTD_getErrorName(r));
    }
    if (st == BK_OK)
        st = zs_feed(&z, h.p, h.len, ZSTD_e_continue);
    for (size_t i = 0; st == BK_OK && i < w->L.n; i++)
        if (w->L.e[i].nbytes)
            st = zs_feed(&z, w->L.e[i].data, (size_t)w->L.e[i].nbytes, ZSTD_e_continue);
    if (st == BK_OK)
        st = zs_feed(&z, NULL, 0, ZSTD_e_end);
    st = out_commit(&o, st);
    ZSTD_freeCCtx(z.cctx);
    free(z.obuf);
    bk_sb_free(&h);
    out_discard(&o, 0);
    return st;
}

bk_status bk_st_writer_save_sharded(bk_st_writer *w, const char *dir, const char *basename,
                                    uint64_t max_shard_bytes)
{
    if (!w)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_writer_save_sharded: NULL writer");
    bk_status st = check_base("safetensors writer", dir, basename);
    if (st != BK_OK)
        return st;
    size_t nsh = plan_shards(&w->L, max_shard_bytes);
    char **names = calloc(nsh, sizeof *names);
    outfile *outs = calloc(nsh + 1, sizeof *outs);
    if (!names || !outs) {
        free(names);
        free(outs);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i <= nsh; i++)
        outs[i].fd = -1;
    size_t ncreated = 0;
    for (size_t i = 0; st == BK_OK && i < nsh; i++) {
        char p[4096];
        names[i] = shard_name(basename, i, nsh);
        if (!names[i])
            st = bk_error(BK_ERR_INVALID_ARG, "%s: basename too long", basename);
        if (st == BK_OK)
            st = bk_path_join(p, sizeof p, dir, names[i]);
        if (st == BK_OK) {
            st = out_create(&outs[i], p);
            ncreated = i + 1;
        }
        if (st == BK_OK)
            st = write_shard_plain(&w->L, i, &outs[i]);
        if (st == BK_OK)
            st = out_close(&outs[i]);
    }
    if (st == BK_OK && nsh > 1) {
        char p[4096], fname[4096];
        bk_strbuf ib;
        int k = snprintf(fname, sizeof fname, "%s.safetensors.index.json", basename);
        if (k < 0 || (size_t)k >= sizeof fname)
            st = bk_error(BK_ERR_INVALID_ARG, "%s: basename too long", basename);
        if (st == BK_OK)
            st = bk_path_join(p, sizeof p, dir, fname);
        if (st == BK_OK)
            st = out_create(&outs[nsh], p);
        ncreated = nsh + 1;
        if (st == BK_OK && (st = build_index(&w->L, names, &ib)) == BK_OK) {
            st = write_all(&outs[nsh], ib.p, ib.len);
            bk_sb_free(&ib);
        }
        if (st == BK_OK)
            st = out_close(&outs[nsh]);
    }
    /* everything is on disk under temporary names: rename shards, then the index */
    size_t nfiles = nsh > 1 ? nsh + 1 : nsh;
    for (size_t i = 0; st == BK_OK && i < nfiles; i++)
        st = out_rename(&outs[i]);
    if (st == BK_OK)
        fsync_dir_of(outs[0].final_path);
    for (size_t i = 0; i < ncreated; i++)
        out_discard(&outs[i], st != BK_OK);
    for (size_t i = 0; i < nsh; i++)
        free(names[i]);
    free(names);
    free(outs);
    return st;
}

/* --------------------------------------------------- streaming writer */

struct bk_st_stream {
    entry_list L;
    char *dir, *basename;
    uint64_t max_shard_bytes;
    int frozen;       /* layout fixed, temporary files exist */
    int failed;       /* a write failed: only abort/finish (which cleans up) remain */
    size_t nsh;
    char **names;     /* shard file names */
    outfile *outs;    /* one per shard */
    uint64_t *hdr_len; /* 8 + N per shard */
    int fixed;         /* resumable: shards built as NAME.partial */
    int reused;        /* every shard's .partial file was reused */
};

static void stream_free(bk_st_stream *s, int remove_final)
{
    if (!s)
        return;
    if (s->outs)
        for (size_t i = 0; i < s->nsh; i++) {
            if (remove_final < 0 && s->outs[i].tmp_path) /* keep: forget the temporary */
                s->outs[i].renamed = 1;
            out_discard(&s->outs[i], remove_final > 0);
        }
    if (s->names)
        for (size_t i = 0; i < s->nsh; i++)
            free(s->names[i]);
    free(s->names);
    free(s->outs);
    free(s->hdr_len);
    list_free(&s->L);
    free(s->dir);
    free(s->basename);
    free(s);
}

bk_status bk_st_stream_begin(const char *dir, const char *basename, uint64_t max_shard_bytes,
                             bk_st_stream **out)
{
    if (!out)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_begin: NULL output");
    *out = NULL;
    bk_status st = check_base("safetensors stream", dir, basename);
    if (st != BK_OK)
        return st;
    bk_st_stream *s = calloc(1, sizeof *s);
    if (!s)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    s->dir = strdup(dir);
    s->basename = strdup(basename);
    s->max_shard_bytes = max_shard_bytes;
    if (!s->dir || !s->basename) {
        stream_free(s, 0);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    *out = s;
    return BK_OK;
}

bk_status bk_st_stream_declare(bk_st_stream *s, const char *name, bk_dtype dt, int ndim,
                               const int64_t *shape)
{
    static const char who[] = "safetensors stream";
    if (!s)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_declare: NULL stream");
    if (s->frozen)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: tensor '%s': declared after the first write (declare every tensor "
                        "first)",
                        who, name ? name : "?");
    uint64_t nbytes = 0;
    bk_status st = list_check(&s->L, who, name, dt, ndim, shape, &nbytes);
    if (st != BK_OK)
        return st;
    entry *e;
    return list_append(&s->L, who, name, dt, ndim, shape, nbytes, &e);
}

bk_status bk_st_stream_set_meta(bk_st_stream *s, const char *key, const char *value)
{
    if (!s)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_set_meta: NULL stream");
    if (s->frozen)
        return bk_error(BK_ERR_INVALID_ARG,
                        "safetensors stream: metadata '%s' set after the first write",
                        key ? key : "?");
    return list_set_meta(&s->L, "safetensors stream", key, value);
}

/* Fix the layout: plan shards, create each temporary file at its full size
 * (space reserved up front, so a full disk shows up here) and write its header. */
static bk_status stream_freeze(bk_st_stream *s)
{
    if (s->frozen)
        return BK_OK;
    size_t nsh = plan_shards(&s->L, s->max_shard_bytes);
    s->names = calloc(nsh, sizeof *s->names);
    s->outs = calloc(nsh, sizeof *s->outs);
    s->hdr_len = calloc(nsh, sizeof *s->hdr_len);
    if (!s->names || !s->outs || !s->hdr_len)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < nsh; i++)
        s->outs[i].fd = -1;
    s->nsh = nsh;
    s->frozen = 1;
    s->reused = s->fixed;
    for (size_t i = 0; i < nsh; i++) {
        char p[4096];
        bk_strbuf h;
        uint64_t data_bytes, total;
        s->names[i] = shard_name(s->basename, i, nsh);
        if (!s->names[i])
            return bk_error(BK_ERR_INVALID_ARG, "%s: basename too long", s->basename);
        bk_status st = bk_path_join(p, sizeof p, s->dir, s->names[i]);
        if (st != BK_OK)
            return st;
        int existing = 0;
        if ((st = s->fixed ? out_open_fixed(&s->outs[i], p, &existing)
                           : out_create(&s->outs[i], p)) != BK_OK)
            return st;
        if ((st = build_header(&s->L, i, &h, &data_bytes)) != BK_OK)
            return bk_error_prefix(st, p);
        s->hdr_len[i] = h.len;
        total = h.len + data_bytes;
        if (total > (uint64_t)INT64_MAX) {
            bk_sb_free(&h);
            return bk_error(BK_ERR_INVALID_ARG, "%s: shard too large", p);
        }
        if (existing) {
            /* a killed run's shard: kept when its size and header are ours */
            struct stat sb;
            int same = fstat(s->outs[i].fd, &sb) == 0 && (uint64_t)sb.st_size == total;
            char *old = same ? malloc(h.len) : NULL;
            same = old && pread(s->outs[i].fd, old, h.len, 0) == (ssize_t)h.len &&
                   !memcmp(old, h.p, h.len);
            free(old);
            if (same) {
                bk_sb_free(&h);
                continue;
            }
            s->reused = 0;
            if (ftruncate(s->outs[i].fd, 0) != 0) {
                int e = errno;
                bk_sb_free(&h);
                return bk_error(BK_ERR_WRITE, "%s: cannot truncate: %s", s->outs[i].tmp_path,
                                strerror(e));
            }
        } else {
            s->reused = 0;
        }
        int e = posix_fallocate(s->outs[i].fd, 0, (off_t)total);
        if (e == EOPNOTSUPP || e == EINVAL || e == ENOSYS)
            e = ftruncate(s->outs[i].fd, (off_t)total) == 0 ? 0 : errno;
        if (e != 0) {
            bk_sb_free(&h);
            return bk_error(BK_ERR_WRITE, "%s: cannot reserve %llu bytes: %s", p,
                            (unsigned long long)total, strerror(e));
        }
        st = pwrite_all(&s->outs[i], h.p, h.len, 0);
        bk_sb_free(&h);
        if (st != BK_OK)
            return st;
    }
    return BK_OK;
}

bk_status bk_st_stream_write(bk_st_stream *s, const char *name, const void *data)
{
    if (!s || !name)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_write: NULL argument");
    size_t k = list_find(&s->L, name);
    if (k == SIZE_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "safetensors stream: tensor '%s': was never declared",
                        name);
    entry *e = &s->L.e[k];
    if (e->written)
        return bk_error(BK_ERR_INVALID_ARG, "safetensors stream: tensor '%s': written twice",
                        name);
    if (e->nbytes && !data)
        return bk_error(BK_ERR_INVALID_ARG, "safetensors stream: tensor '%s': NULL data", name);
    if (s->failed)
        return bk_error(BK_ERR_WRITE,
                        "safetensors stream: tensor '%s': an earlier write failed (abort the "
                        "stream)",
                        name);
    bk_status st = stream_freeze(s);
    if (st != BK_OK) {
        s->failed = 1;
        return st;
    }
    outfile *o = &s->outs[e->shard];
    if (e->nbytes &&
        (st = pwrite_all(o, data, e->nbytes, s->hdr_len[e->shard] + e->offset)) != BK_OK) {
        s->failed = 1;
        return st;
    }
    e->written = 1;
    return BK_OK;
}

void bk_st_stream_abort(bk_st_stream *s)
{
    stream_free(s, 0);
}

bk_status bk_st_stream_finish(bk_st_stream *s)
{
    if (!s)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_finish: NULL stream");
    bk_status st = BK_OK;
    if (s->failed)
        st = bk_error(BK_ERR_WRITE, "safetensors stream %s/%s: an earlier write failed; nothing "
                      "was saved",
                      s->dir, s->basename);
    for (size_t i = 0; st == BK_OK && i < s->L.n; i++) {
        if (!s->L.e[i].written && s->L.e[i].nbytes) {
            st = bk_error(BK_ERR_INVALID_ARG,
                          "safetensors stream: tensor '%s': declared but never written",
                          s->L.e[i].name);
            break;
        }
    }
    if (st == BK_OK)
        st = stream_freeze(s);
    for (size_t i = 0; st == BK_OK && i < s->nsh; i++)
        st = out_close(&s->outs[i]);
    outfile idx;
    memset(&idx, 0, sizeof idx);
    idx.fd = -1;
    if (st == BK_OK && s->nsh > 1) {
        char p[4096], fname[4096];
        bk_strbuf ib;
        int k = snprintf(fname, sizeof fname, "%s.safetensors.index.json", s->basename);
        if (k < 0 || (size_t)k >= sizeof fname)
            st = bk_error(BK_ERR_INVALID_ARG, "%s: basename too long", s->basename);
        if (st == BK_OK)
            st = bk_path_join(p, sizeof p, s->dir, fname);
        if (st == BK_OK)
            st = out_create(&idx, p);
        if (st == BK_OK && (st = build_index(&s->L, s->names, &ib)) == BK_OK) {
            st = write_all(&idx, ib.p, ib.len);
            bk_sb_free(&ib);
        }
        if (st == BK_OK)
            st = out_close(&idx);
    }
    for (size_t i = 0; st == BK_OK && i < s->nsh; i++)
        st = out_rename(&s->outs[i]);
    if (st == BK_OK && s->nsh > 1)
        st = out_rename(&idx);
    if (st == BK_OK)
        fsync_dir_of(s->outs[0].final_path);
    out_discard(&idx, st != BK_OK);
    stream_free(s, st != BK_OK);
    return st;
}

/* ------------------------------------------------ resumable streams */

uint64_t bk_digest64(const void *p, size_t n, uint64_t seed)
{
    /* four lanes of multiply-rotate over 8-byte words, then a final mix */
    const uint64_t K1 = 0x9e3779b185ebca87ull, K2 = 0xc2b2ae3d27d4eb4full;
    const unsigned char *b = p;
    uint64_t v[4] = {seed ^ K1, seed ^ K2, seed + (uint64_t)n, ~seed};
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int k = 0; k < 4; k++) {
            uint64_t w;
            memcpy(&w, b + i + 8 * k, 8);
            v[k] += w * K2;
            v[k] = (v[k] << 31) | (v[k] >> 33);
            v[k] *= K1;
        }
    }
    uint64_t h = v[0] ^ ((v[1] << 7) | (v[1] >> 57)) ^ ((v[2] << 12) | (v[2] >> 52)) ^
                 ((v[3] << 18) | (v[3] >> 46));
    for (; i < n; i++) {
        h ^= b[i] * K1;
        h = ((h << 11) | (h >> 53)) * K2;
    }
    return bk_mix64(h ^ (uint64_t)n);
}

bk_status bk_st_stream_begin_resumable(const char *dir, const char *basename,
                                       uint64_t max_shard_bytes, bk_st_stream **out)
{
    bk_status st = bk_st_stream_begin(dir, basename, max_shard_bytes, out);
    if (st == BK_OK)
        (*out)->fixed = 1;
    return st;
}

bk_status bk_st_stream_open_files(bk_st_stream *s, int *reused)
{
    if (!s)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_open_files: NULL stream");
    int was = s->frozen;
    bk_status st = stream_freeze(s);
    if (st != BK_OK) {
        s->failed = 1;
        return st;
    }
    if (reused)
        *reused = !was && s->fixed && s->reused;
    return BK_OK;
}

bk_status bk_st_stream_sync(bk_st_stream *s)
{
    if (!s || !s->frozen)
        return BK_OK;
    for (size_t i = 0; i < s->nsh; i++)
        if (s->outs[i].fd >= 0 && fsync(s->outs[i].fd) != 0)
            return bk_error(BK_ERR_WRITE, "%s: fsync failed: %s", s->outs[i].final_path,
                            strerror(errno));
    return BK_OK;
}

bk_status bk_st_stream_digest(bk_st_stream *s, const char *prefix, uint64_t *digest)
{
    if (!s || !prefix || !digest)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_digest: NULL argument");
    if (!s->frozen)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_digest: no files yet");
    const size_t lp = strlen(prefix);
    const size_t cap = (size_t)1 << 22;
    unsigned char *buf = malloc(cap);
    if (!buf)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    uint64_t h = 0x62616b726f6eull; /* "bakron" */
    for (size_t i = 0; i < s->L.n; i++) {
        const entry *e = &s->L.e[i];
        if (strncmp(e->name, prefix, lp) != 0)
            continue;
        h = bk_digest64(e->name, strlen(e->name) + 1, h);
        const outfile *o = &s->outs[e->shard];
        uint64_t off = s->hdr_len[e->shard] + e->offset, left = e->nbytes;
        while (left > 0) {
            size_t chunk = left < cap ? (size_t)left : cap;
            ssize_t r = pread(o->fd, buf, chunk, (off_t)off);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                int er = r < 0 ? errno : EIO;
                free(buf);
                return bk_error(BK_ERR_IO, "%s: cannot read tensor '%s' back: %s",
                                o->final_path, e->name, r < 0 ? strerror(er) : "short file");
            }
            h = bk_digest64(buf, (size_t)r, h);
            off += (uint64_t)r;
            left -= (uint64_t)r;
        }
    }
    free(buf);
    *digest = h;
    return BK_OK;
}

bk_status bk_st_stream_read(bk_st_stream *s, const char *name, bk_dtype dt, void *dst,
                            uint64_t nbytes)
{
    if (!s || !name || (nbytes && !dst))
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_read: NULL argument");
    if (!s->frozen)
        return bk_error(BK_ERR_INVALID_ARG, "bk_st_stream_read: no files yet");
    const size_t k = list_find(&s->L, name);
    if (k == SIZE_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "safetensors stream: tensor '%s': was never declared",
                        name);
    const entry *e = &s->L.e[k];
    const outfile *o = &s->outs[e->shard];
    const char *path = o->tmp_path ? o->tmp_path : o->final_path;
    if (e->dtype != dt || e->nbytes != nbytes)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s: tensor '%s' is %s, %llu bytes; expected %s, %llu bytes", path,
                        name, bk_dtype_name(e->dtype), (unsigned long long)e->nbytes,
                        bk_dtype_name(dt), (unsigned long long)nbytes);
    uint64_t off = s->hdr_len[e->shard] + e->offset, left = nbytes;
    char *p = dst;
    while (left > 0) {
        const size_t chunk = left > ((uint64_t)1 << 30) ? ((size_t)1 << 30) : (size_t)left;
        ssize_t r = pread(o->fd, p, chunk, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return bk_error(BK_ERR_IO, "%s: cannot read tensor '%s' back: %s", path, name,
                            r < 0 ? strerror(errno) : "short file");
        p += r;
        off += (uint64_t)r;
        left -= (uint64_t)r;
    }
    return BK_OK;
}

void bk_st_stream_mark_written(bk_st_stream *s, const char *prefix)
{
    if (!s || !prefix)
        return;
    const size_t lp = strlen(prefix);
    for (size_t i = 0; i < s->L.n; i++)
        if (!strncmp(s->L.e[i].name, prefix, lp))
            s->L.e[i].written = 1;
}

void bk_st_stream_keep(bk_st_stream *s)
{
    stream_free(s, -1);
}
