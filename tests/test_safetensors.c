/* safetensors reader: files written by the Python package, the malformed corpus
 * (one file per rule), the index checks, and the .zst variant.
 *
 * Independent expectations:
 *   - tests/data/st_python/reference.txt was produced by the Python `safetensors`
 *     package (scripts/st_python_reference.py), not by bakron;
 *   - the malformed files are built byte by byte by scripts/make_bad_corpus.py and
 *     the status each must produce is written in the tables below, from the rule
 *     each file breaks (docs/formats.md);
 *   - .zst inputs are made here with libzstd directly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "bakron/safetensors.h"

static const char *data_dir(void)
{
    const char *d = getenv("BK_TEST_DATA");
    return d ? d : "tests/data";
}

static void data_path(char *out, size_t cap, const char *rel)
{
    snprintf(out, cap, "%s/%s", data_dir(), rel);
}

static unsigned char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(n > 0 ? (size_t)n : 1);
    if (b && n > 0 && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *len = (size_t)(n > 0 ? n : 0);
    return b;
}

static void spit(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n)
        assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static char tmpdir[256];

static int make_tmpdir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/bk_test_st_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_tmpdir(void **state)
{
    (void)state;
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(tmpdir);
    return 0;
}

/* ------------------------------------------- the Python package's view */

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static void test_python_reference(void **state)
{
    (void)state;
    char path[1024];
    data_path(path, sizeof path, "st_python/reference.txt");
    FILE *in = fopen(path, "r");
    assert_non_null(in);
    char line[1 << 16];
    bk_st_file *f = NULL;
    const bk_tensor_info *t = NULL;
    const unsigned char *data0 = NULL;
    int files = 0, tensors = 0, values = 0, metas = 0;
    while (fgets(line, sizeof line, in)) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] == '#' || !line[0])
            continue;
        if (!strncmp(line, "file ", 5)) {
            char rel[512];
            unsigned long long n;
            size_t nt, nm;
            assert_int_equal(sscanf(line, "file %511s %llu %zu %zu", rel, &n, &nt, &nm), 4);
            bk_st_close(f);
            data_path(path, sizeof path, rel);
            if (bk_st_open(path, &f) != BK_OK)
                fail_msg("%s", bk_last_error());
            assert_int_equal(bk_st_header_size(f), n);
            assert_int_equal(bk_st_count(f), nt);
            assert_int_equal(bk_st_meta_count(f), nm);
            assert_string_equal(bk_st_path(f), path);
            /* the data buffer starts at the tensor with offset 0 (file order) */
            data0 = nt ? bk_st_tensor(f, 0)->data : NULL;
            for (size_t i = 1; i < nt; i++) /* ascending offsets */
                assert_true((const char *)bk_st_tensor(f, i)->data >=
                            (const char *)bk_st_tensor(f, i - 1)->data);
            files++;
        } else if (!strncmp(line, "meta ", 5)) {
            /* two JSON strings: key and value */
            const char *end = NULL;
            cJSON *k = cJSON_ParseWithOpts(line + 5, &end, 0);
            assert_non_null(k);
            cJSON *v = cJSON_Parse(end);
            assert_non_null(v);
            const char *got = bk_st_meta_find(f, k->valuestring);
            assert_non_null(got);
            assert_string_equal(got, v->valuestring);
            cJSON_Delete(k);
            cJSON_Delete(v);
            metas++;
        } else if (!strncmp(line, "tensor ", 7)) {
            char name[256], dt[32], shape[256];
            unsigned long long b, e;
            assert_int_equal(sscanf(line, "tensor %255s %31s %255s %llu %llu", name, dt, shape,
                                    &b, &e),
                             5);
            t = bk_st_find(f, name);
            if (!t)
                fail_msg("tensor %s missing", name);
            assert_string_equal(t->name, name);
            assert_string_equal(bk_dtype_name(t->dtype), dt);
            assert_string_equal(t->file, bk_st_path(f));
            int nd = 0;
            uint64_t numel = 1;
            if (strcmp(shape, "-")) {
                for (char *p = strtok(shape, ","); p; p = strtok(NULL, ",")) {
                    long long d = atoll(p);
                    assert_true(nd < t->ndim);
                    assert_int_equal(t->shape[nd], d);
                    numel *= (uint64_t)d;
                    nd++;
                }
            }
            assert_int_equal(t->ndim, nd);
            assert_int_equal(t->numel, numel);
            assert_int_equal(t->nbytes, e - b);
            assert_int_equal((const unsigned char *)t->data - data0, b);
            tensors++;
        } else if (!strncmp(line, "bytes ", 6)) {
            const char *hx = line + 6;
            size_t n = strcmp(hx, "-") ? strlen(hx) / 2 : 0;
            assert_int_equal(t->nbytes, n);
            const unsigned char *p = t->data;
            for (size_t i = 0; i < n; i++)
                assert_int_equal(p[i], hexval(hx[2 * i]) * 16 + hexval(hx[2 * i + 1]));
        } else if (!strncmp(line, "f32 ", 4) || !strncmp(line, "bf16 ", 5)) {
            int is32 = line[1] == '3';
            unsigned long long idx;
            unsigned bits;
            assert_int_equal(sscanf(line + (is32 ? 4 : 5), "%llu %x", &idx, &bits), 2);
            assert_true(idx < t->numel);
            float *all = malloc(t->numel * sizeof *all);
            assert_non_null(all);
            assert_int_equal(bk_tensor_to_f32(t, all), BK_OK);
            uint32_t got;
            memcpy(&got, &all[idx], 4);
            assert_int_equal(got, is32 ? bits : (uint32_t)bits << 16);
            free(all);
            values++;
        } else {
            fail_msg("bad reference line: %s", line);
        }
    }
    fclose(in);
    bk_st_close(f);
    assert_int_equal(files, 6);
    assert_true(tensors > 100 && values > 300 && metas == 8);
}

/* ------------------------------------------------- malformed files */

typedef struct bad_case {
    const char *file;
    bk_status want;
} bad_case;

static const bad_case bad_files[] = {
    {"r01_empty.safetensors", BK_ERR_ST_TOO_SHORT},
    {"r01_seven_bytes.safetensors", BK_ERR_ST_TOO_SHORT},
    {"r02_header_too_large.safetensors", BK_ERR_ST_HEADER_TOO_LARGE},
    {"r02_header_u64_max.safetensors", BK_ERR_ST_HEADER_TOO_LARGE},
    {"r03_header_past_eof.safetensors", BK_ERR_ST_HEADER_BOUNDS},
    {"r03_header_one_past.safetensors", BK_ERR_ST_HEADER_BOUNDS},
    {"r04_invalid_byte.safetensors", BK_ERR_ST_UTF8},
    {"r04_overlong.safetensors", BK_ERR_ST_UTF8},
    {"r04_surrogate.safetensors", BK_ERR_ST_UTF8},
    {"r04_cut_sequence.safetensors", BK_ERR_ST_UTF8},
    {"r05_json_unclosed.safetensors", BK_ERR_ST_JSON},
    {"r05_json_trailing_garbage.safetensors", BK_ERR_ST_JSON},
    {"r05_json_control_char.safetensors", BK_ERR_ST_JSON},
    {"r05_json_nul_byte.safetensors", BK_ERR_ST_JSON},
    {"r05_json_single_quotes.safetensors", BK_ERR_ST_JSON},
    {"r05_json_deep_nesting.safetensors", BK_ERR_ST_JSON},
    {"r05_json_empty_header.safetensors", BK_ERR_ST_JSON},
    {"r05_json_nan_literal.safetensors", BK_ERR_ST_JSON},
    {"r05_schema_top_array.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_entry_not_object.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_missing_dtype.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_missing_shape.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_missing_offsets.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_dtype_not_string.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_duplicate_field.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_shape_negative.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_shape_fraction.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_shape_huge.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_shape_2p53_plus_2.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_shape_string.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_shape_not_array.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offset_negative.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offset_fraction.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offset_huge.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offset_string.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offsets_three.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offsets_one.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_offsets_object.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_metadata_int.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_metadata_nested.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_metadata_string.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_schema_metadata_null_value.safetensors", BK_ERR_ST_SCHEMA},
    {"r05_dtype_unknown.safetensors", BK_ERR_ST_DTYPE},
    {"r05_dtype_lowercase.safetensors", BK_ERR_ST_DTYPE},
    {"r05_dtype_torch_name.safetensors", BK_ERR_ST_DTYPE},
    {"limit_nine_dims.safetensors", BK_ERR_UNSUPPORTED},
    {"limit_nul_in_name.safetensors", BK_ERR_UNSUPPORTED},
    {"r07_overlap.safetensors", BK_ERR_ST_LAYOUT},
    {"r07_hole.safetensors", BK_ERR_ST_LAYOUT},
    {"r07_first_not_zero.safetensors", BK_ERR_ST_LAYOUT},
    {"r07_alias.safetensors", BK_ERR_ST_LAYOUT},
    {"r07_end_before_begin.safetensors", BK_ERR_ST_LAYOUT},
    {"r08_numel_overflow.safetensors", BK_ERR_ST_OVERFLOW},
    {"r08_bits_overflow.safetensors", BK_ERR_ST_OVERFLOW},
    {"r09_f4_odd_count.safetensors", BK_ERR_ST_SUBBYTE},
    {"r09_f6_three.safetensors", BK_ERR_ST_SUBBYTE},
    {"r10_size_mismatch.safetensors", BK_ERR_ST_SIZE_MISMATCH},
    {"r10_zero_shape_with_bytes.safetensors", BK_ERR_ST_SIZE_MISMATCH},
    {"r10_f4_bytes.safetensors", BK_ERR_ST_SIZE_MISMATCH},
    {"r11_truncated.safetensors", BK_ERR_ST_FILE_SIZE},
    {"r11_trailing_bytes.safetensors", BK_ERR_ST_FILE_SIZE},
    {"r11_no_data.safetensors", BK_ERR_ST_FILE_SIZE},
    {"dup_tensor_name.safetensors", BK_ERR_ST_DUPLICATE},
    {"dup_metadata_block.safetensors", BK_ERR_ST_DUPLICATE},
    {"dup_metadata_key.safetensors", BK_ERR_ST_DUPLICATE},
};

static int in_table(const char *name)
{
    for (size_t i = 0; i < sizeof bad_files / sizeof bad_files[0]; i++)
        if (!strcmp(bad_files[i].file, name))
            return 1;
    return 0;
}

static void check_rejected(const char *path, const char *mention, bk_status want, bk_status got,
                           const void *handle)
{
    if (got != want)
        fail_msg("%s: got %s, expected %s (%s)", path, bk_status_name(got), bk_status_name(want),
                 bk_last_error());
    assert_null(handle);
    const char *msg = bk_last_error();
    if (!strstr(msg, mention))
        fail_msg("%s: message does not name the file: %s", path, msg);
    assert_null(strchr(msg, '\n'));
}

static void test_bad_corpus(void **state)
{
    (void)state;
    char dir[1024], path[2048];
    data_path(dir, sizeof dir, "bad/safetensors");
    int seen = 0;
    for (size_t i = 0; i < sizeof bad_files / sizeof bad_files[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, bad_files[i].file);
        bk_st_file *f = (bk_st_file *)&seen; /* must be reset to NULL */
        bk_clear_error();
        bk_status st = bk_st_open(path, &f);
        check_rejected(path, bad_files[i].file, bad_files[i].want, st, f);
        /* the same bytes from memory, and through bk_st_set_open */
        size_t n;
        unsigned char *b = slurp(path, &n);
        assert_non_null(b);
        f = (bk_st_file *)&seen;
        st = bk_st_open_memory(b, n, 0, bad_files[i].file, &f);
        check_rejected(path, bad_files[i].file, bad_files[i].want, st, f);
        free(b);
        bk_st_set *s = (bk_st_set *)&seen;
        st = bk_st_set_open(path, &s);
        check_rejected(path, bad_files[i].file, bad_files[i].want, st, s);
        seen++;
    }
    /* every file of the corpus is in the table */
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *e;
    int count = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        if (!in_table(e->d_name))
            fail_msg("%s/%s is not in the test table", dir, e->d_name);
        count++;
    }
    closedir(d);
    assert_int_equal(count, seen);
}

static const bad_case bad_index[] = {
    {"bad_json", BK_ERR_ST_INDEX},          {"not_object", BK_ERR_ST_INDEX},
    {"no_weight_map", BK_ERR_ST_INDEX},     {"weight_map_array", BK_ERR_ST_INDEX},
    {"weight_map_empty", BK_ERR_ST_INDEX},  {"value_not_string", BK_ERR_ST_INDEX},
    {"missing_shard", BK_ERR_ST_INDEX},     {"wrong_shard", BK_ERR_ST_INDEX},
    {"listed_twice", BK_ERR_ST_INDEX},      {"unlisted_tensor", BK_ERR_ST_INDEX},
    {"in_two_shards", BK_ERR_ST_INDEX},     {"absent_tensor", BK_ERR_ST_INDEX},
    {"path_escape", BK_ERR_ST_INDEX},       {"absolute_path", BK_ERR_ST_INDEX},
    {"truncated_shard", BK_ERR_ST_FILE_SIZE}, {"shard_bad_header", BK_ERR_ST_UTF8},
    {"name_with_nul", BK_ERR_ST_INDEX},     {"shard_name_with_nul", BK_ERR_ST_INDEX},
};

static void test_bad_index(void **state)
{
    (void)state;
    char dir[1024], path[2048];
    data_path(dir, sizeof dir, "bad/index");
    int seen = 0;
    for (size_t i = 0; i < sizeof bad_index / sizeof bad_index[0]; i++) {
        /* through the folder and through the index file itself */
        for (int via_file = 0; via_file < 2; via_file++) {
            snprintf(path, sizeof path, "%s/%s%s", dir, bad_index[i].file,
                     via_file ? "/model.safetensors.index.json" : "");
            bk_st_set *s = (bk_st_set *)&seen;
            bk_status st = bk_st_set_open(path, &s);
            check_rejected(path, bad_index[i].file, bad_index[i].want, st, s);
        }
        seen++;
    }
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *e;
    int count = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        int found = 0;
        for (size_t i = 0; i < sizeof bad_index / sizeof bad_index[0]; i++)
            found |= !strcmp(bad_index[i].file, e->d_name);
        if (!found)
            fail_msg("%s/%s is not in the test table", dir, e->d_name);
        count++;
    }
    closedir(d);
    assert_int_equal(count, seen);
    /* the index messages say what is wrong */
    snprintf(path, sizeof path, "%s/missing_shard", dir);
    bk_st_set *s;
    assert_int_equal(bk_st_set_open(path, &s), BK_ERR_ST_INDEX);
    assert_non_null(strstr(bk_last_error(), "model-00002-of-00002.safetensors"));
    assert_non_null(strstr(bk_last_error(), "does not exist"));
    snprintf(path, sizeof path, "%s/unlisted_tensor", dir);
    assert_int_equal(bk_st_set_open(path, &s), BK_ERR_ST_INDEX);
    assert_non_null(strstr(bk_last_error(), "'b.weight'"));
    snprintf(path, sizeof path, "%s/listed_twice", dir);
    assert_int_equal(bk_st_set_open(path, &s), BK_ERR_ST_INDEX);
    assert_non_null(strstr(bk_last_error(), "'a.weight'"));
    /* a NUL in a name is refused, not cut at */
    snprintf(path, sizeof path, "%s/name_with_nul", dir);
    assert_int_equal(bk_st_set_open(path, &s), BK_ERR_ST_INDEX);
    assert_non_null(strstr(bk_last_error(), "\\u0000"));
    assert_non_null(strstr(bk_last_error(), "model.safetensors.index.json"));
    snprintf(path, sizeof path, "%s/truncated_shard", dir);
    assert_int_equal(bk_st_set_open(path, &s), BK_ERR_ST_FILE_SIZE);
    assert_non_null(strstr(bk_last_error(), "model-00001-of-00002.safetensors"));
}

/* Messages follow "PATH: tensor 'NAME': rule (got X, expected Y)". */
static void test_message_shapes(void **state)
{
    (void)state;
    char path[2048];
    bk_st_file *f;
    data_path(path, sizeof path, "bad/safetensors/r10_size_mismatch.safetensors");
    assert_int_equal(bk_st_open(path, &f), BK_ERR_ST_SIZE_MISMATCH);
    char want[2200];
    snprintf(want, sizeof want, "%s: tensor 'a': ", path);
    assert_memory_equal(bk_last_error(), want, strlen(want));
    assert_non_null(strstr(bk_last_error(), "(got end - begin = 4 bytes, expected 2 elements"));
    data_path(path, sizeof path, "bad/safetensors/r11_truncated.safetensors");
    assert_int_equal(bk_st_open(path, &f), BK_ERR_ST_FILE_SIZE);
    assert_non_null(strstr(bk_last_error(), "truncated"));
    data_path(path, sizeof path, "bad/safetensors/r05_dtype_unknown.safetensors");
    assert_int_equal(bk_st_open(path, &f), BK_ERR_ST_DTYPE);
    assert_non_null(strstr(bk_last_error(), "tensor 'a': unknown dtype 'F33'"));
    data_path(path, sizeof path, "bad/safetensors/r07_overlap.safetensors");
    assert_int_equal(bk_st_open(path, &f), BK_ERR_ST_LAYOUT);
    assert_non_null(strstr(bk_last_error(), "tensor 'b': overlaps tensor 'a'"));
    data_path(path, sizeof path, "bad/safetensors/r05_schema_metadata_int.safetensors");
    assert_int_equal(bk_st_open(path, &f), BK_ERR_ST_SCHEMA);
    assert_non_null(strstr(bk_last_error(), "'step'"));
    data_path(path, sizeof path, "bad/safetensors/r05_schema_shape_fraction.safetensors");
    assert_int_equal(bk_st_open(path, &f), BK_ERR_ST_SCHEMA);
    assert_non_null(strstr(bk_last_error(), "(got 1.5)"));
}

/* Status names of every rule are distinct (the contract other code relies on). */
static void test_status_codes_distinct(void **state)
{
    (void)state;
    const bk_status rules[] = {BK_ERR_ST_TOO_SHORT,   BK_ERR_ST_HEADER_TOO_LARGE,
                               BK_ERR_ST_HEADER_BOUNDS, BK_ERR_ST_UTF8,
                               BK_ERR_ST_JSON,        BK_ERR_ST_SCHEMA,
                               BK_ERR_ST_DTYPE,       BK_ERR_ST_LAYOUT,
                               BK_ERR_ST_OVERFLOW,    BK_ERR_ST_SUBBYTE,
                               BK_ERR_ST_SIZE_MISMATCH, BK_ERR_ST_FILE_SIZE,
                               BK_ERR_ST_DUPLICATE};
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++) {
        assert_int_equal(bk_status_exit_code(rules[i]), 2);
        for (size_t j = 0; j < i; j++)
            assert_int_not_equal(rules[i], rules[j]);
    }
}

/* ------------------------------------------------ valid edge cases */

static bk_st_file *open_seed(const char *name)
{
    char path[2048];
    const char *src = getenv("BK_SOURCE_ROOT");
    snprintf(path, sizeof path, "%s/tests/fuzz/corpus/%s", src ? src : ".", name);
    bk_st_file *f = NULL;
    if (bk_st_open(path, &f) != BK_OK)
        fail_msg("%s", bk_last_error());
    return f;
}

static void test_valid_edge_cases(void **state)
{
    (void)state;
    char dir[2048];
    const char *src = getenv("BK_SOURCE_ROOT");
    snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus", src ? src : ".");
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "ok_", 3))
            continue;
        bk_st_close(open_seed(e->d_name));
        n++;
    }
    closedir(d);
    assert_true(n >= 15);

    bk_st_file *f = open_seed("ok_empty_header.safetensors");
    assert_int_equal(bk_st_count(f), 0);
    assert_int_equal(bk_st_meta_count(f), 0);
    assert_null(bk_st_tensor(f, 0));
    assert_null(bk_st_find(f, "x"));
    bk_st_close(f);

    f = open_seed("ok_scalar.safetensors");
    const bk_tensor_info *t = bk_st_find(f, "s");
    assert_non_null(t);
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->numel, 1);
    assert_int_equal(t->nbytes, 8);
    double v;
    assert_int_equal(bk_tensor_to_f64(t, &v), BK_OK);
    assert_true(v == 3.25);
    assert_string_equal(bk_st_meta_find(f, "format"), "pt");
    bk_st_close(f);

    f = open_seed("ok_zero_sized.safetensors");
    t = bk_st_find(f, "z1");
    assert_int_equal(t->ndim, 3);
    assert_int_equal(t->numel, 0);
    assert_int_equal(t->nbytes, 0);
    float dummy;
    assert_int_equal(bk_tensor_to_f32(t, &dummy), BK_OK);
    assert_int_equal(*(const unsigned char *)bk_st_find(f, "x")->data, 7);
    bk_st_close(f);

    f = open_seed("ok_zero_sized_shared_offset.safetensors");
    assert_int_equal(bk_st_count(f), 3);
    assert_string_equal(bk_st_tensor(f, 2)->name, "c");
    bk_st_close(f);

    f = open_seed("ok_offsets_out_of_order.safetensors");
    assert_string_equal(bk_st_tensor(f, 0)->name, "a"); /* file order = offset order */
    assert_string_equal(bk_st_tensor(f, 1)->name, "b");
    bk_st_close(f);

    f = open_seed("ok_escaped_names.safetensors");
    assert_non_null(bk_st_find(f, "a\"b\\c\xc3\xa9"));
    bk_st_close(f);

    f = open_seed("ok_escaped_backslash_u0000.safetensors");
    assert_non_null(bk_st_find(f, "a\\u0000"));
    bk_st_close(f);

    f = open_seed("ok_unicode_names.safetensors");
    assert_non_null(bk_st_find(f, "\xe5\x90\x8d\xe5\x89\x8d"));
    assert_string_equal(bk_st_meta_find(f, "note"), "\xc3\xbc" "n\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9 \xe2\x9c\x93");
    bk_st_close(f);

    f = open_seed("ok_shape_2p53_zero.safetensors");
    assert_true(bk_st_tensor(f, 0)->shape[0] == 9007199254740992LL);
    assert_int_equal(bk_st_tensor(f, 0)->numel, 0);
    bk_st_close(f);

    f = open_seed("ok_eight_dims.safetensors");
    assert_int_equal(bk_st_tensor(f, 0)->ndim, 8);
    assert_int_equal(bk_st_tensor(f, 0)->numel, 4);
    bk_st_close(f);

    f = open_seed("ok_null_metadata.safetensors");
    assert_int_equal(bk_st_meta_count(f), 0);
    assert_null(bk_st_meta_find(f, "format"));
    const char *k = "x", *vv = "y";
    bk_st_meta_get(f, 0, &k, &vv);
    assert_null(k);
    assert_null(vv);
    bk_st_close(f);

    /* opaque dtypes load as bytes; arithmetic on them is refused, naming the tensor */
    f = open_seed("ok_opaque_dtypes.safetensors");
    t = bk_st_find(f, "f8");
    assert_int_equal(t->dtype, BK_DT_F8_E4M3);
    assert_int_equal(((const unsigned char *)t->data)[1], 0x40);
    float out[4];
    assert_int_equal(bk_tensor_to_f32(t, out), BK_ERR_DTYPE);
    assert_non_null(strstr(bk_last_error(), "tensor 'f8'"));
    assert_non_null(strstr(bk_last_error(), "ok_opaque_dtypes.safetensors"));
    t = bk_st_find(f, "f4");
    assert_int_equal(t->numel, 4);
    assert_int_equal(t->nbytes, 2);
    t = bk_st_find(f, "f6");
    assert_int_equal(t->nbytes, 3);
    bk_st_close(f);

    f = open_seed("ok_all_numeric.safetensors");
    static const struct {
        const char *name;
        double v0;
    } want[] = {{"bool", 0},  {"u8", 1},   {"i8", -1},  {"i16", -3},    {"u16", 65535},
                {"f16", 1.0}, {"bf16", 1.0}, {"i32", -7}, {"u32", 7},   {"f32", 0.5},
                {"f64", -0.25}, {"i64", -1099511627776.0}, {"u64", 9223372036854775808.0}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        double o[2];
        t = bk_st_find(f, want[i].name);
        assert_non_null(t);
        assert_int_equal(bk_tensor_to_f64(t, o), BK_OK);
        if (o[0] != want[i].v0)
            fail_msg("%s: got %g, expected %g", want[i].name, o[0], want[i].v0);
    }
    bk_st_close(f);
}

/* ----------------------------------------------------- open paths */

static void test_open_memory_and_errors(void **state)
{
    (void)state;
    char path[2048];
    data_path(path, sizeof path, "st_python/all_dtypes.safetensors");
    size_t n;
    unsigned char *b = slurp(path, &n);
    assert_non_null(b);
    bk_st_file *f;
    /* copy = 1: the handle survives the caller's buffer */
    assert_int_equal(bk_st_open_memory(b, n, 1, "copied", &f), BK_OK);
    memset(b, 0, n);
    free(b);
    assert_string_equal(bk_st_path(f), "copied");
    const bk_tensor_info *t = bk_st_find(f, "t_bool");
    assert_non_null(t);
    assert_string_equal(t->file, "copied");
    assert_memory_equal(t->data, "\1\0\1\0\1", 5);
    bk_st_close(f);
    /* NULL label */
    assert_int_equal(bk_st_open_memory("\0\0\0\0\0\0\0", 7, 0, NULL, &f), BK_ERR_ST_TOO_SHORT);
    assert_non_null(strstr(bk_last_error(), "<memory>"));
    assert_int_equal(bk_st_open_memory(NULL, 10, 0, "x", &f), BK_ERR_INVALID_ARG);
    /* missing files and folders */
    assert_int_equal(bk_st_open("/nonexistent/x.safetensors", &f), BK_ERR_IO);
    assert_null(f);
    assert_non_null(strstr(bk_last_error(), "/nonexistent/x.safetensors"));
    assert_int_equal(bk_st_open(data_dir(), &f), BK_ERR_IO);
    bk_st_set *s;
    assert_int_equal(bk_st_set_open("/nonexistent/dir/", &s), BK_ERR_IO);
    assert_null(s);
    /* a folder with no checkpoint */
    assert_int_equal(bk_st_set_open(tmpdir, &s), BK_ERR_IO);
    assert_non_null(strstr(bk_last_error(), tmpdir));
    /* NULL-safe accessors */
    assert_int_equal(bk_st_count(NULL), 0);
    assert_null(bk_st_find(NULL, "x"));
    assert_int_equal(bk_st_set_count(NULL), 0);
    bk_st_close(NULL);
    bk_st_set_close(NULL);
}

static int cmp_cstr(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void test_set_sharded_model(void **state)
{
    (void)state;
    char dir[2048], idx[2100];
    data_path(dir, sizeof dir, "models/tiny-llama3");
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    /* the expected content, read from the index with cJSON */
    size_t n;
    char *text = (char *)slurp(idx, &n);
    assert_non_null(text);
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    assert_non_null(root);
    cJSON *wm = cJSON_GetObjectItem(root, "weight_map");
    int count = cJSON_GetArraySize(wm);
    double total = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "metadata"), "total_size")
                       ->valuedouble;
    char **names = calloc((size_t)count, sizeof *names);
    int i = 0;
    for (cJSON *c = wm->child; c; c = c->next)
        names[i++] = c->string;
    qsort(names, (size_t)count, sizeof *names, cmp_cstr);

    for (int via = 0; via < 2; via++) {
        bk_st_set *s;
        if (bk_st_set_open(via ? idx : dir, &s) != BK_OK)
            fail_msg("%s", bk_last_error());
        assert_int_equal(bk_st_set_count(s), count);
        assert_int_equal(bk_st_set_file_count(s), 10);
        assert_true((double)bk_st_set_total_bytes(s) == total);
        for (int k = 0; k < count; k++) {
            const bk_tensor_info *t = bk_st_set_tensor(s, (size_t)k);
            assert_string_equal(t->name, names[k]); /* sorted by name */
            assert_ptr_equal(bk_st_set_find(s, names[k]), t);
            /* in the file the map names */
            const char *file = cJSON_GetObjectItem(wm, names[k])->valuestring;
            assert_true(strlen(t->file) > strlen(file));
            assert_string_equal(t->file + strlen(t->file) - strlen(file), file);
        }
        assert_null(bk_st_set_find(s, "nope"));
        assert_null(bk_st_set_tensor(s, (size_t)count));
        size_t sum = 0;
        for (size_t k = 0; k < bk_st_set_file_count(s); k++)
            sum += bk_st_count(bk_st_set_file(s, k));
        assert_int_equal(sum, count);
        bk_st_set_close(s);
    }
    free(names);
    cJSON_Delete(root);
}

static void test_set_single_and_folder(void **state)
{
    (void)state;
    char dir[2048], file[2100];
    /* the folder holds golden.safetensors too: model.safetensors must win */
    data_path(dir, sizeof dir, "models/tiny-qwen2");
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    bk_st_set *a, *b;
    assert_int_equal(bk_st_set_open(dir, &a), BK_OK);
    assert_int_equal(bk_st_set_open(file, &b), BK_OK);
    assert_int_equal(bk_st_set_file_count(a), 1);
    assert_int_equal(bk_st_set_count(a), bk_st_set_count(b));
    assert_int_equal(bk_st_set_count(a), 26);
    assert_string_equal(bk_st_path(bk_st_set_file(a, 0)), file);
    for (size_t i = 1; i < bk_st_set_count(a); i++)
        assert_true(strcmp(bk_st_set_tensor(a, i - 1)->name, bk_st_set_tensor(a, i)->name) < 0);
    uint64_t sum = 0;
    for (size_t i = 0; i < bk_st_set_count(b); i++)
        sum += bk_st_set_tensor(b, i)->nbytes;
    assert_int_equal(bk_st_set_total_bytes(b), sum);
    bk_st_set_close(a);
    bk_st_set_close(b);
    /* a folder with exactly one other *.safetensors file */
    char p[512];
    snprintf(p, sizeof p, "%s/weights.safetensors", tmpdir);
    spit(p, "\x08\0\0\0\0\0\0\0{}      ", 16);
    assert_int_equal(bk_st_set_open(tmpdir, &a), BK_OK);
    assert_int_equal(bk_st_set_count(a), 0);
    bk_st_set_close(a);
    /* two of them: ambiguous */
    snprintf(p, sizeof p, "%s/other.safetensors", tmpdir);
    spit(p, "\x08\0\0\0\0\0\0\0{}      ", 16);
    assert_int_equal(bk_st_set_open(tmpdir, &a), BK_ERR_INVALID_ARG);
    assert_non_null(strstr(bk_last_error(), "2 *.safetensors"));
    unlink(p);
    snprintf(p, sizeof p, "%s/weights.safetensors", tmpdir);
    unlink(p);
}

/* ----------------------------------------------------------- zstd */

static unsigned char *zcompress(const void *src, size_t n, int with_size, int checksum,
                                size_t *out_n)
{
    ZSTD_CCtx *c = ZSTD_createCCtx();
    size_t cap = ZSTD_compressBound(n);
    unsigned char *dst = malloc(cap);
    ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, checksum);
    if (with_size) {
        *out_n = ZSTD_compress2(c, dst, cap, src, n);
    } else {
        /* streamed without a pledged size: the frame does not record its size */
        ZSTD_inBuffer in = {src, n, 0};
        ZSTD_outBuffer ob = {dst, cap, 0};
        size_t r;
        do {
            r = ZSTD_compressStream2(c, &ob, &in, ZSTD_e_end);
        } while (r != 0 && !ZSTD_isError(r));
        *out_n = ob.pos;
    }
    assert_false(ZSTD_isError(*out_n));
    ZSTD_freeCCtx(c);
    return dst;
}

static void expect_same_tensors(const bk_st_file *a, const bk_st_file *b)
{
    assert_int_equal(bk_st_count(a), bk_st_count(b));
    assert_int_equal(bk_st_meta_count(a), bk_st_meta_count(b));
    for (size_t i = 0; i < bk_st_count(a); i++) {
        const bk_tensor_info *x = bk_st_tensor(a, i), *y = bk_st_tensor(b, i);
        assert_string_equal(x->name, y->name);
        assert_int_equal(x->dtype, y->dtype);
        assert_int_equal(x->nbytes, y->nbytes);
        assert_memory_equal(x->shape, y->shape, sizeof x->shape);
        if (x->nbytes)
            assert_memory_equal(x->data, y->data, x->nbytes);
    }
}

static void test_zst_reader(void **state)
{
    (void)state;
    char path[2048], zp[512];
    data_path(path, sizeof path, "st_python/all_dtypes.safetensors");
    size_t n, zn;
    unsigned char *img = slurp(path, &n);
    bk_st_file *plain, *z;
    assert_int_equal(bk_st_open(path, &plain), BK_OK);
    snprintf(zp, sizeof zp, "%s/x.safetensors.zst", tmpdir);

    for (int with_size = 0; with_size < 2; with_size++) {
        unsigned char *c = zcompress(img, n, with_size, 1, &zn);
        spit(zp, c, zn);
        if (bk_st_open_any(zp, &z) != BK_OK)
            fail_msg("%s", bk_last_error());
        assert_string_equal(bk_st_path(z), zp);
        expect_same_tensors(plain, z);
        bk_st_close(z);
        /* truncated */
        spit(zp, c, zn - 5);
        assert_int_equal(bk_st_open_zst(zp, &z), BK_ERR_ZSTD);
        assert_null(z);
        assert_non_null(strstr(bk_last_error(), zp));
        /* a flipped byte in the middle (the frame checksum catches what decoding misses) */
        c[zn / 2] ^= 0x5a;
        spit(zp, c, zn);
        assert_int_equal(bk_st_open_zst(zp, &z), BK_ERR_ZSTD);
        c[zn / 2] ^= 0x5a;
        /* trailing garbage after the frame */
        unsigned char *g = malloc(zn + 7);
        memcpy(g, c, zn);
        memcpy(g + zn, "garbage", 7);
        spit(zp, g, zn + 7);
        assert_int_equal(bk_st_open_zst(zp, &z), BK_ERR_ZSTD);
        free(g);
        free(c);
    }
    /* two frames, one after the other, are one image */
    size_t h = n / 2, n1, n2;
    unsigned char *c1 = zcompress(img, h, 1, 0, &n1), *c2 = zcompress(img + h, n - h, 1, 0, &n2);
    unsigned char *cc = malloc(n1 + n2);
    memcpy(cc, c1, n1);
    memcpy(cc + n1, c2, n2);
    spit(zp, cc, n1 + n2);
    assert_int_equal(bk_st_open_zst(zp, &z), BK_OK);
    expect_same_tensors(plain, z);
    bk_st_close(z);
    free(c1);
    free(c2);
    free(cc);
    /* not zstd at all; empty; a valid stream holding a malformed image */
    spit(zp, img, n);
    assert_int_equal(bk_st_open_zst(zp, &z), BK_ERR_ZSTD);
    spit(zp, "", 0);
    assert_int_equal(bk_st_open_zst(zp, &z), BK_ERR_ZSTD);
    unsigned char *bad = zcompress(img, n - 1, 1, 0, &zn);
    spit(zp, bad, zn);
    assert_int_equal(bk_st_open_zst(zp, &z), BK_ERR_ST_FILE_SIZE);
    assert_non_null(strstr(bk_last_error(), zp));
    free(bad);
    /* an image larger than the first guess of the buffer (8 MiB of zeros, no size recorded) */
    size_t big = 8u << 20;
    char hdr[] = "{\"z\":{\"dtype\":\"U8\",\"shape\":[8388608],\"data_offsets\":[0,8388608]}}";
    uint64_t hn = strlen(hdr);
    unsigned char *bi = calloc(1, 8 + hn + big);
    memcpy(bi, &hn, 8);
    memcpy(bi + 8, hdr, hn);
    unsigned char *bc = zcompress(bi, 8 + hn + big, 0, 0, &zn);
    spit(zp, bc, zn);
    assert_int_equal(bk_st_open_any(zp, &z), BK_OK);
    assert_int_equal(bk_st_find(z, "z")->nbytes, big);
    bk_st_close(z);
    free(bc);
    free(bi);
    unlink(zp);
    bk_st_close(plain);
    free(img);
}

/* The threaded scan of a whole set reports what the tensor-by-tensor scan
 * reports: the first tensor by name with a NaN/Inf and its first such
 * element, also when the hits lie in different chunks (2^24 elements) of a
 * big tensor and a later tensor has an earlier hit. */
static void test_set_check_finite(void **state)
{
    (void)state;
    const int64_t big = ((int64_t)1 << 24) * 2 + 77; /* three chunks */
    uint16_t *a = calloc((size_t)big, sizeof *a);     /* BF16 zeros */
    float b[64] = {0};
    double c[8] = {0};
    assert_non_null(a);
    char path[400];
    snprintf(path, sizeof path, "%s/finite.safetensors", tmpdir);
    for (int round = 0; round < 4; round++) {
        /* round 0: all finite; 1: NaN in b only; 2: also hits in chunks 3
         * and 2 of "a" (chunk 2's comes first); 3: also an Inf in c */
        if (round == 1)
            memcpy(&b[0], &(float){NAN}, sizeof(float));
        if (round == 2) {
            a[big - 5] = 0x7f80;                      /* +Inf, chunk 3 */
            a[((int64_t)1 << 24) + 12345] = 0xffc0; /* NaN, chunk 2 */
        }
        if (round == 3)
            c[3] = -INFINITY;
        bk_st_writer *w;
        assert_int_equal(bk_st_writer_create(&w), BK_OK);
        int64_t sa[1] = {big}, sb[2] = {8, 8}, sc[1] = {8};
        assert_int_equal(bk_st_writer_add(w, "b.weight", BK_DT_F32, 2, sb, b, 0), BK_OK);
        assert_int_equal(bk_st_writer_add(w, "a.weight", BK_DT_BF16, 1, sa, a, 0), BK_OK);
        assert_int_equal(bk_st_writer_add(w, "c.weight", BK_DT_F64, 1, sc, c, 0), BK_OK);
        if (bk_st_writer_save(w, path) != BK_OK)
            fail_msg("%s", bk_last_error());
        bk_st_writer_free(w);
        bk_st_set *s;
        if (bk_st_set_open(path, &s) != BK_OK)
            fail_msg("%s", bk_last_error());
        /* the sequential answer */
        bk_status want = BK_OK;
        char want_msg[1024] = "";
        for (size_t i = 0; i < bk_st_set_count(s) && want == BK_OK; i++)
            if ((want = bk_tensor_check_finite(bk_st_set_tensor(s, i))) != BK_OK)
                snprintf(want_msg, sizeof want_msg, "%s", bk_last_error());
        bk_clear_error();
        const bk_status got = bk_st_set_check_finite(s);
        assert_int_equal(got, want);
        assert_int_equal(got, round == 0 ? BK_OK : BK_ERR_NONFINITE);
        if (got != BK_OK)
            assert_string_equal(bk_last_error(), want_msg);
        if (round == 1)
            assert_non_null(strstr(want_msg, "tensor b.weight: element 0 "));
        if (round >= 2)
            assert_non_null(strstr(want_msg, "tensor a.weight: element 16789561 "));
        bk_st_set_close(s);
    }
    unlink(path);
    free(a);
}

/* The threaded scan of a checkpoint of several files (an index): a NaN in
 * the last chunk of the last tensor of the last file is reported with that
 * tensor and that file; once an earlier file's tensor (by name) also has an
 * Inf, that one is reported instead, with its own file. */
static void test_set_check_finite_shards(void **state)
{
    (void)state;
    const int64_t big = ((int64_t)1 << 24) + 300; /* two chunks */
    uint16_t *z = calloc((size_t)big, sizeof *z);  /* BF16 zeros */
    float a[16] = {0}, m[32] = {0};
    assert_non_null(z);
    char shard[3][400], idx[400];
    const char *names[3] = {"a.weight", "m.weight", "z.weight"};
    for (int k = 0; k < 3; k++)
        snprintf(shard[k], sizeof shard[k], "%s/fin-%d-of-3.safetensors", tmpdir, k + 1);
    snprintf(idx, sizeof idx, "%s/fin.safetensors.index.json", tmpdir);
    char json[1024];
    snprintf(json, sizeof json,
             "{\"metadata\": {}, \"weight_map\": {\"a.weight\": \"fin-1-of-3.safetensors\", "
             "\"m.weight\": \"fin-2-of-3.safetensors\", \"z.weight\": "
             "\"fin-3-of-3.safetensors\"}}");
    spit(idx, json, strlen(json));
    z[big - 1] = 0xffc1; /* NaN, last element of the last chunk */
    for (int round = 0; round < 3; round++) {
        /* 0: only z's NaN; 1: also an Inf in m (file 2); 2: also z[0] NaN */
        if (round == 1)
            memcpy(&m[31], &(float){-INFINITY}, sizeof(float));
        if (round == 2)
            z[0] = 0x7fc0;
        for (int k = 0; k < 3; k++) {
            bk_st_writer *w;
            assert_int_equal(bk_st_writer_create(&w), BK_OK);
            int64_t sa[1] = {16}, sm[2] = {4, 8}, sz[1] = {big};
            if (k == 0)
                assert_int_equal(bk_st_writer_add(w, names[0], BK_DT_F32, 1, sa, a, 0), BK_OK);
            if (k == 1)
                assert_int_equal(bk_st_writer_add(w, names[1], BK_DT_F32, 2, sm, m, 0), BK_OK);
            if (k == 2)
                assert_int_equal(bk_st_writer_add(w, names[2], BK_DT_BF16, 1, sz, z, 0), BK_OK);
            if (bk_st_writer_save(w, shard[k]) != BK_OK)
                fail_msg("%s", bk_last_error());
            bk_st_writer_free(w);
        }
        bk_st_set *s;
        if (bk_st_set_open(idx, &s) != BK_OK)
            fail_msg("%s", bk_last_error());
        assert_int_equal(bk_st_set_file_count(s), 3);
        assert_int_equal(bk_st_set_check_finite(s), BK_ERR_NONFINITE);
        const char *msg = bk_last_error();
        char want[600];
        if (round == 0)
            snprintf(want, sizeof want, "%s: tensor z.weight: element %lld is NaN or Inf",
                     shard[2], (long long)(big - 1));
        else
            snprintf(want, sizeof want, "%s: tensor m.weight: element 31 is NaN or Inf",
                     shard[1]);
        if (!strstr(msg, want))
            fail_msg("got '%s', want '%s'", msg, want);
        bk_st_set_close(s);
    }
    for (int k = 0; k < 3; k++)
        unlink(shard[k]);
    unlink(idx);
    free(z);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_python_reference),
        cmocka_unit_test(test_bad_corpus),
        cmocka_unit_test(test_bad_index),
        cmocka_unit_test(test_message_shapes),
        cmocka_unit_test(test_status_codes_distinct),
        cmocka_unit_test(test_valid_edge_cases),
        cmocka_unit_test(test_open_memory_and_errors),
        cmocka_unit_test(test_set_sharded_model),
        cmocka_unit_test(test_set_single_and_folder),
        cmocka_unit_test(test_zst_reader),
        cmocka_unit_test(test_set_check_finite),
        cmocka_unit_test(test_set_check_finite_shards),
    };
    return cmocka_run_group_tests(tests, make_tmpdir, remove_tmpdir);
}
