/* safetensors writers: in-memory (single, sharded + index, zstd) and streaming.
 *
 * Independent checks: the written bytes are parsed here with cJSON and compared
 * with layouts computed by hand; .zst files are decompressed with libzstd
 * directly; when the Python `safetensors` package is installed, it reads what we
 * wrote (scripts/st_python_check.py) and its description must match the inputs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zstd.h>

#include "bakron/safetensors.h"

/* ---------------------------------------------------------- helpers */

static unsigned char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(n > 0 ? (size_t)n + 1 : 1);
    if (b && n > 0 && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    if (b)
        b[n > 0 ? n : 0] = 0;
    fclose(f);
    *len = (size_t)(n > 0 ? n : 0);
    return b;
}

static void make_dir(char *out, size_t cap)
{
    snprintf(out, cap, "/tmp/bk_test_stw_XXXXXX");
    assert_non_null(mkdtemp(out));
}

static void clear_dir(const char *dir, int remove)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
    if (remove)
        rmdir(dir);
}

/* Sorted, '|'-joined names of the files in dir. */
static void list_dir(const char *dir, char *out, size_t cap)
{
    char *names[64];
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL && n < 64)
        if (e->d_name[0] != '.')
            names[n++] = strdup(e->d_name);
    if (d)
        closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (i)
            strncat(out, "|", cap - strlen(out) - 1);
        strncat(out, names[i], cap - strlen(out) - 1);
        free(names[i]);
    }
}

static void fill_pattern(unsigned char *p, size_t n, int seed)
{
    for (size_t k = 0; k < n; k++)
        p[k] = (unsigned char)((seed * 37 + (int)k * 11 + 5) & 0xff);
}

/* One tensor of every dtype, with scalars and zero-sized ones. */
typedef struct spec {
    char name[32];
    bk_dtype dt;
    int ndim;
    int64_t shape[BK_MAX_DIMS];
    size_t nbytes;
    unsigned char *data;
} spec;

static int make_specs(spec *s)
{
    int n = 0;
    for (int dt = 0; dt < BK_DT_COUNT; dt++) {
        spec *x = &s[n];
        snprintf(x->name, sizeof x->name, "t%02d.%s", n, bk_dtype_name((bk_dtype)dt));
        x->dt = (bk_dtype)dt;
        x->ndim = 1 + dt % 3;
        uint64_t numel = 1;
        for (int d = 0; d < x->ndim; d++) {
            x->shape[d] = 2 + (dt + d) % 3;
            numel *= (uint64_t)x->shape[d];
        }
        if (dt == BK_DT_F4 || dt == BK_DT_F6_E2M3 || dt == BK_DT_F6_E3M2) {
            x->ndim = 1;
            x->shape[0] = 8; /* 8 x 4 or 8 x 6 bits: whole bytes */
            numel = 8;
        }
        x->nbytes = (size_t)(numel * bk_dtype_bits((bk_dtype)dt) / 8);
        n++;
    }
    spec *sc = &s[n++];
    snprintf(sc->name, sizeof sc->name, "scalar");
    sc->dt = BK_DT_F32;
    sc->ndim = 0;
    sc->nbytes = 4;
    spec *z = &s[n++];
    snprintf(z->name, sizeof z->name, "zero");
    z->dt = BK_DT_BF16;
    z->ndim = 2;
    z->shape[0] = 3;
    z->shape[1] = 0;
    z->nbytes = 0;
    spec *z2 = &s[n++];
    snprintf(z2->name, sizeof z2->name, "zero1d.F64");
    z2->dt = BK_DT_F64;
    z2->ndim = 1;
    z2->shape[0] = 0;
    z2->nbytes = 0;
    for (int i = 0; i < n; i++) {
        s[i].data = malloc(s[i].nbytes ? s[i].nbytes : 1);
        fill_pattern(s[i].data, s[i].nbytes, i);
        if (s[i].dt == BK_DT_BOOL)
            for (size_t k = 0; k < s[i].nbytes; k++)
                s[i].data[k] &= 1;
    }
    return n;
}

static void free_specs(spec *s, int n)
{
    for (int i = 0; i < n; i++)
        free(s[i].data);
}

/* Check a written file against the specs, reading its bytes and header by hand. */
static void check_file_layout(const char *path, const spec *s, const int *which, int n,
                              const char *meta_key, const char *meta_val)
{
    size_t len;
    unsigned char *b = slurp(path, &len);
    assert_non_null(b);
    assert_true(len >= 8);
    uint64_t hn = 0;
    for (int i = 7; i >= 0; i--)
        hn = (hn << 8) | b[i];
    assert_int_equal((8 + hn) % 8, 0);
    assert_true(8 + hn <= len);
    /* padding: spaces after the closing brace */
    size_t last = 8 + hn - 1;
    while (b[last] == ' ')
        last--;
    assert_int_equal(b[last], '}');
    assert_true(8 + hn - 1 - last < 8);
    cJSON *h = cJSON_ParseWithLength((const char *)b + 8, hn);
    assert_non_null(h);
    /* __metadata__ first, with format pt */
    assert_non_null(h->child);
    assert_string_equal(h->child->string, "__metadata__");
    assert_string_equal(cJSON_GetObjectItem(h->child, "format")->valuestring, "pt");
    if (meta_key)
        assert_string_equal(cJSON_GetObjectItem(h->child, meta_key)->valuestring, meta_val);
    /* then the tensors in the order given, contiguous from 0 */
    cJSON *e = h->child->next;
    uint64_t off = 0;
    for (int i = 0; i < n; i++, e = e->next) {
        const spec *x = &s[which ? which[i] : i];
        assert_non_null(e);
        assert_string_equal(e->string, x->name);
        assert_string_equal(cJSON_GetObjectItem(e, "dtype")->valuestring, bk_dtype_name(x->dt));
        cJSON *sh = cJSON_GetObjectItem(e, "shape");
        assert_int_equal(cJSON_GetArraySize(sh), x->ndim);
        for (int d = 0; d < x->ndim; d++)
            assert_true(cJSON_GetArrayItem(sh, d)->valuedouble == (double)x->shape[d]);
        cJSON *of = cJSON_GetObjectItem(e, "data_offsets");
        assert_true(cJSON_GetArrayItem(of, 0)->valuedouble == (double)off);
        assert_true(cJSON_GetArrayItem(of, 1)->valuedouble == (double)(off + x->nbytes));
        if (x->nbytes)
            assert_memory_equal(b + 8 + hn + off, x->data, x->nbytes);
        off += x->nbytes;
    }
    assert_null(e);
    assert_int_equal(len, 8 + hn + off);
    cJSON_Delete(h);
    free(b);
}

static bk_st_writer *writer_of(const spec *s, int n, int copy)
{
    bk_st_writer *w;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    for (int i = 0; i < n; i++)
        if (bk_st_writer_add(w, s[i].name, s[i].dt, s[i].ndim, s[i].shape, s[i].data, copy) !=
            BK_OK)
            fail_msg("%s", bk_last_error());
    return w;
}

static void check_read_back(const bk_st_file *f, const spec *s, int n)
{
    assert_int_equal(bk_st_count(f), n);
    for (int i = 0; i < n; i++) {
        const bk_tensor_info *t = bk_st_find(f, s[i].name);
        assert_non_null(t);
        assert_int_equal(t->dtype, s[i].dt);
        assert_int_equal(t->ndim, s[i].ndim);
        for (int d = 0; d < s[i].ndim; d++)
            assert_int_equal(t->shape[d], s[i].shape[d]);
        assert_int_equal(t->nbytes, s[i].nbytes);
        if (s[i].nbytes)
            assert_memory_equal(t->data, s[i].data, s[i].nbytes);
    }
}

/* Run scripts/st_python_check.py; returns its stdout (caller frees) or NULL to skip. */
static char *python_describe(const char *path, const char *base)
{
    const char *src = getenv("BK_SOURCE_ROOT");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "python3 '%s/scripts/st_python_check.py' '%s' '%s' 2>&1",
             src ? src : ".", path, base ? base : "");
    FILE *p = popen(cmd, "r");
    if (!p)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    size_t r;
    while ((r = fread(out + n, 1, cap - n - 1, p)) > 0) {
        n += r;
        if (n + 1 == cap)
            out = realloc(out, cap *= 2);
    }
    out[n] = '\0';
    int rc = pclose(p);
    if (WIFEXITED(rc) && (WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127)) {
        free(out);
        return NULL;
    }
    if (!WIFEXITED(rc) || WEXITSTATUS(rc) != 0)
        fail_msg("st_python_check.py failed: %s", out);
    return out;
}

static int cmp_line(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* What the Python description of the specs must be (sorted lines). */
static char *expected_description(const spec *s, int n, const char *extra_meta)
{
    char **lines = calloc((size_t)n + 4, sizeof *lines);
    int k = 0;
    lines[k++] = strdup("meta \"format\" \"pt\"");
    if (extra_meta)
        lines[k++] = strdup(extra_meta);
    for (int i = 0; i < n; i++) {
        size_t cap = 256 + 2 * s[i].nbytes;
        char *l = malloc(cap);
        int o = snprintf(l, cap, "tensor %s %s ", s[i].name, bk_dtype_name(s[i].dt));
        if (s[i].ndim == 0)
            o += snprintf(l + o, cap - (size_t)o, "-");
        for (int d = 0; d < s[i].ndim; d++)
            o += snprintf(l + o, cap - (size_t)o, d ? ",%lld" : "%lld", (long long)s[i].shape[d]);
        o += snprintf(l + o, cap - (size_t)o, " ");
        if (!s[i].nbytes)
            o += snprintf(l + o, cap - (size_t)o, "-");
        for (size_t b = 0; b < s[i].nbytes; b++)
            o += snprintf(l + o, cap - (size_t)o, "%02x", s[i].data[b]);
        lines[k++] = l;
    }
    qsort(lines, (size_t)k, sizeof *lines, cmp_line);
    size_t total = 2;
    for (int i = 0; i < k; i++)
        total += strlen(lines[i]) + 1;
    char *out = malloc(total);
    out[0] = '\0';
    for (int i = 0; i < k; i++) {
        strcat(out, lines[i]);
        strcat(out, "\n");
        free(lines[i]);
    }
    free(lines);
    return out;
}

/* ------------------------------------------------------------ tests */

static void test_roundtrip_every_dtype(void **state)
{
    (void)state;
    spec s[BK_DT_COUNT + 4];
    int n = make_specs(s);
    char dir[64], path[256];
    make_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/all.safetensors", dir);
    for (int copy = 0; copy < 2; copy++) {
        bk_st_writer *w = writer_of(s, n, copy);
        assert_int_equal(bk_st_writer_set_meta(w, "source", "bakron \"test\""), BK_OK);
        assert_int_equal(bk_st_writer_set_meta(w, "format", "pt"), BK_OK);
        if (bk_st_writer_save(w, path) != BK_OK)
            fail_msg("%s", bk_last_error());
        bk_st_writer_free(w);
        check_file_layout(path, s, NULL, n, "source", "bakron \"test\"");
        bk_st_file *f;
        if (bk_st_open(path, &f) != BK_OK)
            fail_msg("%s", bk_last_error());
        check_read_back(f, s, n);
        assert_int_equal(bk_st_meta_count(f), 2);
        assert_string_equal(bk_st_meta_find(f, "source"), "bakron \"test\"");
        /* file order is the order of addition */
        for (int i = 0; i < n; i++)
            assert_string_equal(bk_st_tensor(f, (size_t)i)->name, s[i].name);
        bk_st_close(f);
    }
    /* the reference implementation reads it back the same */
    char *got = python_describe(path, NULL);
    if (got) {
        char *want = expected_description(s, n, "meta \"source\" \"bakron \\\"test\\\"\"");
        assert_string_equal(got, want);
        free(want);
        free(got);
    } else {
        print_message("python safetensors not available: cross-check skipped\n");
    }
    char names[512];
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "all.safetensors"); /* no temporary left behind */
    clear_dir(dir, 1);
    free_specs(s, n);
}

static void test_roundtrip_values(void **state)
{
    (void)state;
    /* values whose bytes are written out by hand, read back through bk_tensor_to_f64 */
    static const uint8_t bools[3] = {0, 1, 1};
    static const int8_t i8[3] = {-128, 0, 127};
    static const uint8_t u8[3] = {0, 1, 255};
    static const int16_t i16[3] = {-32768, -1, 32767};
    static const uint16_t u16[3] = {0, 1000, 65535};
    static const int32_t i32[3] = {INT32_MIN, 0, INT32_MAX};
    static const uint32_t u32[3] = {0, 7, UINT32_MAX};
    static const int64_t i64[3] = {-(1LL << 53), 0, 1LL << 53};
    static const uint64_t u64[3] = {0, 1, 1ULL << 53};
    static const uint16_t f16[3] = {0x3c00, 0xc000, 0x0001};  /* 1, -2, 2^-24 */
    static const uint16_t bf16[3] = {0x3f80, 0xc040, 0x0001}; /* 1, -3, 2^-133 */
    static const float f32[3] = {1.5f, -0.0f, 0x1p-149f};
    static const double f64[3] = {-2.75, 0x1p-1074, 1e300};
    static const struct {
        const char *name;
        bk_dtype dt;
        const void *p;
        double v[3];
    } cases[] = {
        {"bool", BK_DT_BOOL, bools, {0, 1, 1}},
        {"i8", BK_DT_I8, i8, {-128, 0, 127}},
        {"u8", BK_DT_U8, u8, {0, 1, 255}},
        {"i16", BK_DT_I16, i16, {-32768, -1, 32767}},
        {"u16", BK_DT_U16, u16, {0, 1000, 65535}},
        {"i32", BK_DT_I32, i32, {-2147483648.0, 0, 2147483647.0}},
        {"u32", BK_DT_U32, u32, {0, 7, 4294967295.0}},
        {"i64", BK_DT_I64, i64, {-9007199254740992.0, 0, 9007199254740992.0}},
        {"u64", BK_DT_U64, u64, {0, 1, 9007199254740992.0}},
        {"f16", BK_DT_F16, f16, {1, -2, 0x1p-24}},
        {"bf16", BK_DT_BF16, bf16, {1, -3, 0x1p-133}},
        {"f32", BK_DT_F32, f32, {1.5, -0.0, 0x1p-149}},
        {"f64", BK_DT_F64, f64, {-2.75, 0x1p-1074, 1e300}},
    };
    char dir[64], path[256];
    make_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/v.safetensors", dir);
    bk_st_writer *w;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    int64_t three = 3;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        assert_int_equal(bk_st_writer_add(w, cases[i].name, cases[i].dt, 1, &three, cases[i].p, 0),
                         BK_OK);
    assert_int_equal(bk_st_writer_save(w, path), BK_OK);
    bk_st_writer_free(w);
    bk_st_file *f;
    assert_int_equal(bk_st_open(path, &f), BK_OK);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bk_tensor_info *t = bk_st_find(f, cases[i].name);
        double got[3];
        assert_int_equal(bk_tensor_to_f64(t, got), BK_OK);
        for (int k = 0; k < 3; k++) {
            if (got[k] != cases[i].v[k] || signbit(got[k]) != signbit(cases[i].v[k]))
                fail_msg("%s[%d]: got %a, expected %a", cases[i].name, k, got[k], cases[i].v[k]);
        }
        assert_memory_equal(t->data, cases[i].p, t->nbytes);
    }
    bk_st_close(f);
    clear_dir(dir, 1);
}

static void test_writer_errors(void **state)
{
    (void)state;
    bk_st_writer *w;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    float x[4] = {1, 2, 3, 4};
    int64_t sh[9] = {4, 1, 1, 1, 1, 1, 1, 1, 1};
    assert_int_equal(bk_st_writer_add(w, "a", BK_DT_F32, 1, sh, x, 0), BK_OK);
    assert_int_equal(bk_st_writer_add(w, "a", BK_DT_F32, 1, sh, x, 0), BK_ERR_ST_DUPLICATE);
    assert_non_null(strstr(bk_last_error(), "'a'"));
    assert_int_equal(bk_st_writer_add(w, "", BK_DT_F32, 1, sh, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, NULL, BK_DT_F32, 1, sh, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "__metadata__", BK_DT_F32, 1, sh, x, 0),
                     BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "bad\xff", BK_DT_F32, 1, sh, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F32, 9, sh, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F32, -1, sh, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F32, 1, NULL, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_COUNT, 1, sh, x, 0), BK_ERR_INVALID_ARG);
    int64_t neg = -1, odd = 3, huge[3] = {1LL << 32, 1LL << 32, 4};
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F32, 1, &neg, x, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F4, 1, &odd, x, 0), BK_ERR_ST_SUBBYTE);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F32, 3, huge, x, 0), BK_ERR_ST_OVERFLOW);
    assert_int_equal(bk_st_writer_add(w, "b", BK_DT_F32, 1, sh, NULL, 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_set_meta(w, "format", "np"), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_set_meta(w, NULL, "x"), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_set_meta(w, "k", "v1"), BK_OK);
    assert_int_equal(bk_st_writer_set_meta(w, "k", "v2"), BK_OK); /* replaces */
    /* a zero-sized tensor needs no data */
    int64_t zero = 0;
    assert_int_equal(bk_st_writer_add(w, "z", BK_DT_F32, 1, &zero, NULL, 0), BK_OK);
    /* the failed calls left the writer intact */
    char dir[64], path[256];
    make_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/e.safetensors", dir);
    assert_int_equal(bk_st_writer_save(w, path), BK_OK);
    assert_int_equal(bk_st_writer_save_zst(w, path, 99), BK_ERR_INVALID_ARG);
    bk_st_file *f;
    assert_int_equal(bk_st_open(path, &f), BK_OK);
    assert_int_equal(bk_st_count(f), 2);
    assert_string_equal(bk_st_meta_find(f, "k"), "v2");
    assert_int_equal(bk_st_meta_count(f), 2);
    bk_st_close(f);
    /* missing folder */
    assert_int_equal(bk_st_writer_save(w, "/nonexistent-dir/x.safetensors"), BK_ERR_WRITE);
    assert_non_null(strstr(bk_last_error(), "/nonexistent-dir/x.safetensors"));
    assert_int_equal(bk_st_writer_save_sharded(w, "/nonexistent-dir", "model", 0), BK_ERR_WRITE);
    assert_int_equal(bk_st_writer_save_sharded(w, dir, "a/b", 0), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_st_writer_save_sharded(w, dir, "", 0), BK_ERR_INVALID_ARG);
    bk_st_writer_free(w);
    bk_st_writer_free(NULL);
    clear_dir(dir, 1);
}

/* Tensors of the given byte sizes (U8 vectors), named w0, w1, ... */
static bk_st_writer *sized_writer(const size_t *sizes, int n, unsigned char **bufs)
{
    bk_st_writer *w;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "w%d", i);
        bufs[i] = malloc(sizes[i] ? sizes[i] : 1);
        fill_pattern(bufs[i], sizes[i], i);
        int64_t sh = (int64_t)sizes[i];
        assert_int_equal(bk_st_writer_add(w, name, BK_DT_U8, 1, &sh, bufs[i], 0), BK_OK);
    }
    return w;
}

static void test_sharded(void **state)
{
    (void)state;
    /* sizes 40, 40, 40, 100, 10, 0 with at most 100 bytes a shard:
     *   shard 1: w0 w1 (80; w2 would make 120)
     *   shard 2: w2 (40; w3 would make 140)
     *   shard 3: w3 (100, alone)
     *   shard 4: w4 w5 (10) */
    const size_t sizes[6] = {40, 40, 40, 100, 10, 0};
    const int shard_of[6] = {1, 1, 2, 3, 4, 4};
    unsigned char *bufs[6];
    bk_st_writer *w = sized_writer(sizes, 6, bufs);
    assert_int_equal(bk_st_writer_set_meta(w, "producer", "test"), BK_OK);
    char dir[64];
    make_dir(dir, sizeof dir);
    if (bk_st_writer_save_sharded(w, dir, "model", 100) != BK_OK)
        fail_msg("%s", bk_last_error());
    char names[1024];
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "model-00001-of-00004.safetensors|model-00002-of-00004.safetensors|"
                               "model-00003-of-00004.safetensors|model-00004-of-00004.safetensors|"
                               "model.safetensors.index.json");
    /* the index, byte for byte as transformers writes it (json.dumps indent=2, sort_keys) */
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    size_t n;
    char *idx = (char *)slurp(p, &n);
    const char *want_idx = "{\n"
                           "  \"metadata\": {\n"
                           "    \"total_size\": 230\n"
                           "  },\n"
                           "  \"weight_map\": {\n"
                           "    \"w0\": \"model-00001-of-00004.safetensors\",\n"
                           "    \"w1\": \"model-00001-of-00004.safetensors\",\n"
                           "    \"w2\": \"model-00002-of-00004.safetensors\",\n"
                           "    \"w3\": \"model-00003-of-00004.safetensors\",\n"
                           "    \"w4\": \"model-00004-of-00004.safetensors\",\n"
                           "    \"w5\": \"model-00004-of-00004.safetensors\"\n"
                           "  }\n"
                           "}\n";
    assert_string_equal(idx, want_idx);
    free(idx);
    /* each shard holds its tensors, laid out from 0 */
    bk_st_set *s;
    if (bk_st_set_open(dir, &s) != BK_OK)
        fail_msg("%s", bk_last_error());
    assert_int_equal(bk_st_set_count(s), 6);
    assert_int_equal(bk_st_set_file_count(s), 4);
    assert_int_equal(bk_st_set_total_bytes(s), 230);
    for (int i = 0; i < 6; i++) {
        char name[16], shard[64];
        snprintf(name, sizeof name, "w%d", i);
        snprintf(shard, sizeof shard, "model-%05d-of-00004.safetensors", shard_of[i]);
        const bk_tensor_info *t = bk_st_set_find(s, name);
        assert_non_null(t);
        assert_non_null(strstr(t->file, shard));
        assert_int_equal(t->nbytes, sizes[i]);
        if (sizes[i])
            assert_memory_equal(t->data, bufs[i], sizes[i]);
    }
    for (size_t i = 0; i < 4; i++)
        assert_string_equal(bk_st_meta_find(bk_st_set_file(s, i), "producer"), "test");
    bk_st_set_close(s);
    /* the Python package reads the shards back the same */
    char *got = python_describe(dir, "model");
    if (got) {
        spec sp[6];
        for (int i = 0; i < 6; i++) {
            memset(&sp[i], 0, sizeof sp[i]);
            snprintf(sp[i].name, sizeof sp[i].name, "w%d", i);
            sp[i].dt = BK_DT_U8;
            sp[i].ndim = 1;
            sp[i].shape[0] = (int64_t)sizes[i];
            sp[i].nbytes = sizes[i];
            sp[i].data = bufs[i];
        }
        char *want = expected_description(sp, 6, "meta \"producer\" \"test\"");
        char *want2 = malloc(strlen(want) + 32);
        sprintf(want2, "%stotal_size 230\n", want);
        assert_string_equal(got, want2);
        free(want);
        free(want2);
        free(got);
    }
    clear_dir(dir, 0);
    /* everything fits: one file, no index */
    assert_int_equal(bk_st_writer_save_sharded(w, dir, "model", 1000), BK_OK);
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "model.safetensors");
    clear_dir(dir, 0);
    /* no limit */
    assert_int_equal(bk_st_writer_save_sharded(w, dir, "out", 0), BK_OK);
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "out.safetensors");
    clear_dir(dir, 0);
    /* a limit below every tensor: one shard each (the zero-sized one joins the last) */
    assert_int_equal(bk_st_writer_save_sharded(w, dir, "m", 1), BK_OK);
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "m-00001-of-00005.safetensors|m-00002-of-00005.safetensors|"
                               "m-00003-of-00005.safetensors|m-00004-of-00005.safetensors|"
                               "m-00005-of-00005.safetensors|m.safetensors.index.json");
    snprintf(p, sizeof p, "%s/m.safetensors.index.json", dir);
    assert_int_equal(bk_st_set_open(p, &s), BK_OK);
    assert_int_equal(bk_st_set_count(s), 6);
    bk_st_set_close(s);
    clear_dir(dir, 1);
    bk_st_writer_free(w);
    for (int i = 0; i < 6; i++)
        free(bufs[i]);
}

static void test_zst_roundtrip(void **state)
{
    (void)state;
    spec s[BK_DT_COUNT + 4];
    int n = make_specs(s);
    char dir[64], plain[256], zp[256];
    make_dir(dir, sizeof dir);
    snprintf(plain, sizeof plain, "%s/a.safetensors", dir);
    snprintf(zp, sizeof zp, "%s/a.safetensors.zst", dir);
    bk_st_writer *w = writer_of(s, n, 0);
    assert_int_equal(bk_st_writer_set_meta(w, "kind", "activations"), BK_OK);
    assert_int_equal(bk_st_writer_save(w, plain), BK_OK);
    for (int level = 0; level <= 19; level += 19) {
        if (bk_st_writer_save_zst(w, zp, level) != BK_OK)
            fail_msg("%s", bk_last_error());
        /* libzstd itself decompresses it to the plain file's bytes */
        size_t pn, zn;
        unsigned char *pb = slurp(plain, &pn), *zb = slurp(zp, &zn);
        unsigned long long declared = ZSTD_getFrameContentSize(zb, zn);
        assert_true(declared == pn);
        unsigned char *db = malloc(pn);
        size_t dn = ZSTD_decompress(db, pn, zb, zn);
        assert_false(ZSTD_isError(dn));
        assert_int_equal(dn, pn);
        assert_memory_equal(db, pb, pn);
        free(pb);
        free(zb);
        free(db);
        bk_st_file *f;
        if (bk_st_open_any(zp, &f) != BK_OK)
            fail_msg("%s", bk_last_error());
        check_read_back(f, s, n);
        assert_string_equal(bk_st_meta_find(f, "kind"), "activations");
        bk_st_close(f);
    }
    /* a large, compressible image */
    size_t big = 3u << 20;
    float *v = calloc(big / 4, 4);
    for (size_t i = 0; i < big / 4; i++)
        v[i] = (float)(i % 1000);
    int64_t sh = (int64_t)(big / 4);
    bk_st_writer *w2;
    assert_int_equal(bk_st_writer_create(&w2), BK_OK);
    assert_int_equal(bk_st_writer_add(w2, "acts", BK_DT_F32, 1, &sh, v, 0), BK_OK);
    assert_int_equal(bk_st_writer_save_zst(w2, zp, 3), BK_OK);
    struct stat stt;
    assert_int_equal(stat(zp, &stt), 0);
    assert_true((size_t)stt.st_size < big / 4);
    bk_st_file *f;
    assert_int_equal(bk_st_open_zst(zp, &f), BK_OK);
    assert_memory_equal(bk_st_find(f, "acts")->data, v, big);
    bk_st_close(f);
    bk_st_writer_free(w2);
    free(v);
    char names[256];
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "a.safetensors|a.safetensors.zst");
    bk_st_writer_free(w);
    clear_dir(dir, 1);
    free_specs(s, n);
}

static void test_stream_matches_writer(void **state)
{
    (void)state;
    spec s[BK_DT_COUNT + 4];
    int n = make_specs(s);
    char dir[64];
    make_dir(dir, sizeof dir);
    for (int sharded = 0; sharded < 2; sharded++) {
        uint64_t max = sharded ? 64 : 0;
        /* reference output from the in-memory writer */
        bk_st_writer *w = writer_of(s, n, 0);
        assert_int_equal(bk_st_writer_set_meta(w, "m", "1"), BK_OK);
        assert_int_equal(bk_st_writer_save_sharded(w, dir, "ref", max), BK_OK);
        bk_st_writer_free(w);
        /* the same through the stream, data written in reverse order */
        bk_st_stream *st;
        assert_int_equal(bk_st_stream_begin(dir, "str", max, &st), BK_OK);
        for (int i = 0; i < n; i++)
            assert_int_equal(bk_st_stream_declare(st, s[i].name, s[i].dt, s[i].ndim, s[i].shape),
                             BK_OK);
        assert_int_equal(bk_st_stream_set_meta(st, "m", "1"), BK_OK);
        for (int i = n - 1; i >= 0; i--)
            if (bk_st_stream_write(st, s[i].name, s[i].data) != BK_OK)
                fail_msg("%s", bk_last_error());
        if (bk_st_stream_finish(st) != BK_OK)
            fail_msg("%s", bk_last_error());
        /* same files, same bytes */
        char names[4096];
        list_dir(dir, names, sizeof names);
        int files = 0;
        for (char *tok = strtok(names, "|"); tok; tok = strtok(NULL, "|")) {
            if (strncmp(tok, "ref", 3))
                continue;
            char a[512], b[512];
            snprintf(a, sizeof a, "%s/%s", dir, tok);
            snprintf(b, sizeof b, "%s/str%s", dir, tok + 3);
            size_t an, bn;
            unsigned char *ab = slurp(a, &an), *bb = slurp(b, &bn);
            assert_non_null(ab);
            if (!bb)
                fail_msg("stream did not write %s", b);
            if (strstr(tok, ".index.json")) {
                /* shard names differ by the basename */
                assert_int_equal(bn, an);
            } else {
                assert_int_equal(an, bn);
                assert_memory_equal(ab, bb, an);
            }
            free(ab);
            free(bb);
            files++;
        }
        assert_true(sharded ? files > 3 : files == 1);
        if (!sharded) {
            char p[512];
            snprintf(p, sizeof p, "%s/str.safetensors", dir);
            check_file_layout(p, s, NULL, n, "m", "1");
        }
        bk_st_set *set;
        assert_int_equal(bk_st_set_open(dir, &set), BK_ERR_INVALID_ARG); /* two checkpoints */
        char p[512];
        snprintf(p, sizeof p, sharded ? "%s/str.safetensors.index.json" : "%s/str.safetensors",
                 dir);
        if (bk_st_set_open(p, &set) != BK_OK)
            fail_msg("%s", bk_last_error());
        assert_int_equal(bk_st_set_count(set), n);
        for (int i = 0; i < n; i++) {
            const bk_tensor_info *t = bk_st_set_find(set, s[i].name);
            assert_non_null(t);
            if (s[i].nbytes)
                assert_memory_equal(t->data, s[i].data, s[i].nbytes);
        }
        bk_st_set_close(set);
        clear_dir(dir, 0);
    }
    clear_dir(dir, 1);
    free_specs(s, n);
}

static void test_stream_misuse_and_abort(void **state)
{
    (void)state;
    char dir[64], names[1024];
    make_dir(dir, sizeof dir);
    float x[4] = {1, 2, 3, 4};
    int64_t four = 4;
    bk_st_stream *s;
    assert_int_equal(bk_st_stream_begin("/nonexistent-dir", "m", 0, &s), BK_ERR_WRITE);
    assert_null(s);
    assert_int_equal(bk_st_stream_begin(dir, "", 0, &s), BK_ERR_INVALID_ARG);
    /* abort before and after writing: nothing remains */
    for (int wrote = 0; wrote < 2; wrote++) {
        assert_int_equal(bk_st_stream_begin(dir, "m", 8, &s), BK_OK);
        assert_int_equal(bk_st_stream_declare(s, "a", BK_DT_F32, 1, &four), BK_OK);
        assert_int_equal(bk_st_stream_declare(s, "b", BK_DT_F32, 1, &four), BK_OK);
        assert_int_equal(bk_st_stream_declare(s, "a", BK_DT_F32, 1, &four), BK_ERR_ST_DUPLICATE);
        if (wrote) {
            assert_int_equal(bk_st_stream_write(s, "b", x), BK_OK);
            list_dir(dir, names, sizeof names); /* only temporaries exist meanwhile */
            int tmps = 0;
            for (char *tok = strtok(names, "|"); tok; tok = strtok(NULL, "|"), tmps++)
                assert_non_null(strstr(tok, ".safetensors.tmp."));
            assert_int_equal(tmps, 2);
            assert_int_equal(bk_st_stream_write(s, "b", x), BK_ERR_INVALID_ARG);
            assert_non_null(strstr(bk_last_error(), "twice"));
            assert_int_equal(bk_st_stream_write(s, "c", x), BK_ERR_INVALID_ARG);
            assert_int_equal(bk_st_stream_declare(s, "c", BK_DT_F32, 1, &four),
                             BK_ERR_INVALID_ARG);
            assert_int_equal(bk_st_stream_set_meta(s, "k", "v"), BK_ERR_INVALID_ARG);
        }
        bk_st_stream_abort(s);
        list_dir(dir, names, sizeof names);
        assert_string_equal(names, "");
    }
    /* finish with a tensor never written: error, nothing remains */
    assert_int_equal(bk_st_stream_begin(dir, "m", 8, &s), BK_OK);
    assert_int_equal(bk_st_stream_declare(s, "a", BK_DT_F32, 1, &four), BK_OK);
    assert_int_equal(bk_st_stream_declare(s, "b", BK_DT_F32, 1, &four), BK_OK);
    assert_int_equal(bk_st_stream_write(s, "a", x), BK_OK);
    assert_int_equal(bk_st_stream_finish(s), BK_ERR_INVALID_ARG);
    assert_non_null(strstr(bk_last_error(), "'b'"));
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "");
    /* no tensors at all: a valid empty file */
    assert_int_equal(bk_st_stream_begin(dir, "empty", 0, &s), BK_OK);
    assert_int_equal(bk_st_stream_finish(s), BK_OK);
    list_dir(dir, names, sizeof names);
    assert_string_equal(names, "empty.safetensors");
    bk_st_stream_abort(NULL);
    clear_dir(dir, 1);
}

/* Every failed save leaves nothing behind: the file-size limit makes writes fail
 * part-way (EFBIG), as a full disk would. Run in a child process so the limit
 * cannot leak into other tests. */
static void failing_saves(const char *dir)
{
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {64 * 1024, 64 * 1024};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        _exit(3);
    size_t big = 256 * 1024;
    unsigned char *buf = malloc(big);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < big; i++) { /* xorshift bytes: incompressible */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (unsigned char)(x >> 32);
    }
    int64_t sh = (int64_t)big, small = 1000;
    bk_st_writer *w;
    bk_st_writer_create(&w);
    bk_st_writer_add(w, "small", BK_DT_U8, 1, &small, buf, 0);
    bk_st_writer_add(w, "big", BK_DT_U8, 1, &sh, buf, 0);
    char p[512], names[1024];
    int bad = 0;
    snprintf(p, sizeof p, "%s/out.safetensors", dir);
    bad |= bk_st_writer_save(w, p) != BK_ERR_WRITE;
    bad |= strstr(bk_last_error(), "out.safetensors") == NULL;
    snprintf(p, sizeof p, "%s/out.safetensors.zst", dir);
    bad |= (bk_st_writer_save_zst(w, p, 1) != BK_ERR_WRITE) << 1;
    /* shard 1 (small) is written completely before shard 2 fails: it must go too */
    bad |= (bk_st_writer_save_sharded(w, dir, "model", 2000) != BK_ERR_WRITE) << 2;
    bk_st_writer_free(w);
    /* stream: reserving the space fails at the first write */
    bk_st_stream *s;
    bk_st_stream_begin(dir, "stream", 2000, &s);
    bk_st_stream_declare(s, "small", BK_DT_U8, 1, &small);
    bk_st_stream_declare(s, "big", BK_DT_U8, 1, &sh);
    bad |= (bk_st_stream_write(s, "small", buf) != BK_ERR_WRITE) << 3;
    bad |= (bk_st_stream_write(s, "big", buf) != BK_ERR_WRITE) << 4;
    bad |= (bk_st_stream_finish(s) != BK_ERR_WRITE) << 5;
    free(buf);
    list_dir(dir, names, sizeof names);
    if (names[0]) {
        fprintf(stderr, "left behind: %s\n", names);
        bad |= 1 << 6;
    }
    _exit(bad);
}

static void test_failed_save_leaves_no_file(void **state)
{
    (void)state;
    char dir[64];
    make_dir(dir, sizeof dir);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        failing_saves(dir);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) != 0)
        fail_msg("failing-save checks: bit mask %d", WEXITSTATUS(status));
    clear_dir(dir, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_every_dtype),
        cmocka_unit_test(test_roundtrip_values),
        cmocka_unit_test(test_writer_errors),
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_zst_roundtrip),
        cmocka_unit_test(test_stream_matches_writer),
        cmocka_unit_test(test_stream_misuse_and_abort),
        cmocka_unit_test(test_failed_save_leaves_no_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
