/* The C tokenizer (src/tokenizer.c) against reference ids made by the
 * Hugging Face `tokenizers` library (and checked equal with transformers) by
 * scripts/tokenizer_reference.py: tests/data/tokenizer/NAME.ids.json holds,
 * for every text of texts.json, the ids with add_special_tokens False and
 * True. Every id must be identical.
 *
 * By hand, on any tokenizer.json and a reference file made by
 * `scripts/tokenizer_reference.py ids TOKENIZER.json OUT.json`:
 *     build/tests/test_tokenizer TOKENIZER.json OUT.json [TEXTS.json]
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bakron/pipeline.h"
#include "bakron/tokenizer.h"

static const char *data_dir(void)
{
    const char *d = getenv("BK_TEST_DATA");
    return d ? d : "tests/data";
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = '\0';
        if (len)
            *len = (size_t)n;
    }
    return b;
}

static cJSON *load_json(const char *path)
{
    char *s = slurp(path, NULL);
    if (!s) {
        fprintf(stderr, "cannot read %s\n", path);
        return NULL;
    }
    cJSON *j = cJSON_Parse(s);
    free(s);
    return j;
}

/* Compare every text; returns the number of mismatching encodings. */
static int check_file(const char *tok_path, const char *ids_path, const char *texts_path)
{
    cJSON *tj = load_json(texts_path), *rj = load_json(ids_path);
    if (!tj || !rj) {
        cJSON_Delete(tj);
        cJSON_Delete(rj);
        return -1;
    }
    bk_tokenizer *t = NULL;
    bk_status st = bk_tokenizer_load(tok_path, &t);
    if (st != BK_OK) {
        fprintf(stderr, "%s: %s\n", tok_path, bk_last_error());
        cJSON_Delete(tj);
        cJSON_Delete(rj);
        return -1;
    }
    const cJSON *texts = cJSON_GetObjectItem(tj, "texts");
    int bad = 0, n = cJSON_GetArraySize(texts);
    long total = 0;
    for (int special = 0; special <= 1; special++) {
        const cJSON *ref = cJSON_GetObjectItem(rj, special ? "ids_special" : "ids");
        if (cJSON_GetArraySize(ref) != n) {
            fprintf(stderr, "%s: %d reference lists for %d texts\n", ids_path, cJSON_GetArraySize(ref), n);
            bad++;
            continue;
        }
        for (int i = 0; i < n; i++) {
            const char *text = cJSON_GetArrayItem(texts, i)->valuestring;
            const cJSON *want = cJSON_GetArrayItem(ref, i);
            bk_token_ids got = {0};
            st = bk_tokenizer_encode(t, text, strlen(text), special, &got);
            if (st != BK_OK) {
                fprintf(stderr, "text %d: %s\n", i, bk_last_error());
                bad++;
                continue;
            }
            int nw = cJSON_GetArraySize(want), first = -1;
            for (int k = 0; k < nw && k < (int)got.n; k++)
                if (got.ids[k] != (int32_t)cJSON_GetArrayItem(want, k)->valuedouble) {
                    first = k;
                    break;
                }
            if (first < 0 && nw != (int)got.n)
                first = nw < (int)got.n ? nw : (int)got.n;
            if (first >= 0) {
                bad++;
                fprintf(stderr, "%s: text %d (add_special %d, \"%.40s\"): %zu ids, reference %d; first "
                        "difference at %d:",
                        tok_path, i, special, text, got.n, nw, first);
                for (int k = first; k < first + 6 && k < (int)got.n; k++)
                    fprintf(stderr, " %d", got.ids[k]);
                fprintf(stderr, " vs");
                for (int k = first; k < first + 6 && k < nw; k++)
                    fprintf(stderr, " %d", (int)cJSON_GetArrayItem(want, k)->valuedouble);
                fprintf(stderr, "\n");
            }
            total += nw;
            bk_token_ids_free(&got);
        }
    }
    printf("%s: %d texts x 2, %ld reference ids, %d mismatches\n", tok_path, n, total, bad);
    bk_tokenizer_free(t);
    cJSON_Delete(tj);
    cJSON_Delete(rj);
    return bad;
}

static void check_named(const char *tok, const char *ids)
{
    char tp[1024], ip[1024], xp[1024];
    if (strchr(tok, '/'))
        snprintf(tp, sizeof tp, "%s", tok);
    else
        snprintf(tp, sizeof tp, "%s/tokenizer/%s", data_dir(), tok);
    snprintf(ip, sizeof ip, "%s/tokenizer/%s", data_dir(), ids);
    snprintf(xp, sizeof xp, "%s/tokenizer/texts.json", data_dir());
    assert_int_equal(check_file(tp, ip, xp), 0);
}

static void test_llama3(void **state)
{
    (void)state;
    check_named("llama3.json", "llama3.ids.json");
}

static void test_llama3_ignore_merges(void **state)
{
    (void)state;
    check_named("llama3-ignore-merges.json", "llama3-ignore-merges.ids.json");
}

static void test_qwen(void **state)
{
    (void)state;
    check_named("qwen.json", "qwen.ids.json");
}

static void test_gpt2_style(void **state)
{
    (void)state;
    check_named("gpt2-style.json", "gpt2-style.ids.json");
}

static void test_kerneldocs(void **state)
{
    (void)state;
    char tp[1024];
    const char *root = getenv("BK_SOURCE_ROOT");
    snprintf(tp, sizeof tp, "%s/examples/kerneldocs-1.6m/tokenizer.json", root ? root : ".");
    check_named(tp, "kerneldocs.ids.json");
    /* and the definition: token id = byte value, BOS = 1 with add_special */
    bk_tokenizer *t = NULL;
    assert_int_equal(bk_tokenizer_load(tp, &t), BK_OK);
    assert_int_equal(bk_tokenizer_vocab_size(t), 256);
    char all[255];
    for (int i = 0; i < 127; i++)
        all[i] = (char)(i + 1);
    memcpy(all + 127, "\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x91\x8D", 9); /* é 中 👍 */
    size_t n = 136;
    bk_token_ids ids = {0};
    assert_int_equal(bk_tokenizer_encode(t, all, n, 1, &ids), BK_OK);
    assert_int_equal(ids.n, n + 1);
    assert_int_equal(ids.ids[0], 1);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(ids.ids[i + 1], (unsigned char)all[i]);
    bk_token_ids_free(&ids);
    bk_tokenizer_free(t);
}

/* Write text to a temporary file; returns its path (static buffer). */
static const char *tmp_file(const char *name, const char *text)
{
    static char path[512];
    snprintf(path, sizeof path, "/tmp/bk-tok-%d-%s", (int)getpid(), name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

static void expect_refusal(const char *json, bk_status want, const char *words)
{
    const char *p = tmp_file("bad.json", json);
    bk_tokenizer *t = NULL;
    bk_status st = bk_tokenizer_load(p, &t);
    if (st != want || !strstr(bk_last_error(), words) || !strstr(bk_last_error(), p)) {
        fprintf(stderr, "got status %d, message '%s'; wanted %d with '%s'\n", st, bk_last_error(), want, words);
        fail();
    }
    assert_null(t);
    unlink(p);
}

#define BPE_MODEL "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}"

static void test_refusals(void **state)
{
    (void)state;
    expect_refusal("{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}", BK_ERR_UNSUPPORTED,
                   "Unigram");
    expect_refusal("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}", BK_ERR_UNSUPPORTED,
                   "WordPiece");
    expect_refusal("{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {}, \"merges\": []}}",
                   BK_ERR_UNSUPPORTED, "byte_fallback");
    expect_refusal("{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"_\"}, " BPE_MODEL "}",
                   BK_ERR_UNSUPPORTED, "Metaspace");
    expect_refusal("{\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", "
                   "\"prepend\": \"_\"}]}, " BPE_MODEL "}",
                   BK_ERR_UNSUPPORTED, "Prepend");
    expect_refusal("{\"post_processor\": {\"type\": \"Weird\"}, " BPE_MODEL "}", BK_ERR_UNSUPPORTED, "Weird");
    expect_refusal("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}",
                   BK_ERR_CONFIG, "not in the vocabulary");
    expect_refusal("{\"model\": ", BK_ERR_CONFIG, "not a JSON object");
}

/* A tiny hand-made BPE whose ids are worked out by hand. */
static void test_tiny_bpe(void **state)
{
    (void)state;
    /* ranks: "a a" 0 -> aa, "aa a" 1 -> aaa, "b c" 2 -> bc, "a bc" 3 -> abc, "ab c" 4 -> abc */
    const char *json =
        "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, \"behavior\": \"Removed\"},"
        " \"added_tokens\": [{\"id\": 9, \"content\": \"<x>\", \"special\": true}],"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"aa\": 3, \"aaa\": 4,"
        " \"bc\": 5, \"abc\": 6, \"ab\": 7}, \"merges\": [\"a a\", \"aa a\", \"b c\", \"a bc\", \"ab c\"]}}";
    const char *p = tmp_file("tiny.json", json);
    bk_tokenizer *t = NULL;
    assert_int_equal(bk_tokenizer_load(p, &t), BK_OK);
    unlink(p);
    /* the added token's id: 8 vocabulary entries -> 8 (not the file's 9, as `tokenizers` does) */
    assert_int_equal(bk_tokenizer_token_id(t, "<x>"), 8);
    struct {
        const char *text;
        int n;
        int32_t ids[8];
    } cases[] = {
        {"aaa", 1, {4}},          /* a a -> aa (leftmost of equal ranks), aa a -> aaa */
        {"aaaa", 2, {3, 3}},      /* aa aa: no merge for that pair */
        {"aaaaa", 2, {3, 4}},     /* (aa)(aa)a -> aa then aa+a */
        {"abc", 1, {6}},          /* b c (2) before a bc (3) */
        {"a  b<x>c", 4, {0, 1, 8, 2}},
        {"", 0, {0}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bk_token_ids ids = {0};
        assert_int_equal(bk_tokenizer_encode(t, cases[i].text, strlen(cases[i].text), 1, &ids), BK_OK);
        if ((int)ids.n != cases[i].n)
            fprintf(stderr, "case '%s': %zu ids\n", cases[i].text, ids.n);
        assert_int_equal(ids.n, cases[i].n);
        for (int k = 0; k < cases[i].n; k++)
            assert_int_equal(ids.ids[k], cases[i].ids[k]);
        bk_token_ids_free(&ids);
    }
    /* not UTF-8 */
    bk_token_ids ids = {0};
    assert_int_equal(bk_tokenizer_encode(t, "a\xC3(", 3, 0, &ids), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_tokenizer_encode(t, "\xED\xA0\x80", 3, 0, &ids), BK_ERR_INVALID_ARG); /* surrogate */
    bk_token_ids_free(&ids);
    bk_tokenizer_free(t);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* No quadratic work: a 300 KB word without spaces, and 2 MB of mixed text. */
static void test_speed(void **state)
{
    (void)state;
    char tp[1024];
    snprintf(tp, sizeof tp, "%s/tokenizer/llama3.json", data_dir());
    bk_tokenizer *t = NULL;
    double t0 = now_s();
    assert_int_equal(bk_tokenizer_load(tp, &t), BK_OK);
    double t_load = now_s() - t0;
    size_t n = 300000;
    char *s = malloc(2000001);
    assert_non_null(s);
    for (size_t i = 0; i < n; i++)
        s[i] = "abcdefghij"[(i * 7 + i / 13) % 10];
    bk_token_ids ids = {0};
    t0 = now_s();
    assert_int_equal(bk_tokenizer_encode(t, s, n, 0, &ids), BK_OK);
    double t_word = now_s() - t0;
    assert_true(ids.n > 0 && ids.n < n);
    size_t n_word = ids.n;
    ids.n = 0;
    const char *words[] = {"The ", "quick ", "brown ", "fox ", "jumps ", "über ", "den ", "faulen ",
                           "Hund. ", "12345 ", "中文 ", "\n\n", "isn't ", "  ", "👍 ", "tokenization "};
    size_t k = 0, w = 0;
    while (k < 2000000 - 32) {
        const char *x = words[(w * 2654435761u >> 7) % 16];
        size_t l = strlen(x);
        memcpy(s + k, x, l);
        k += l;
        w++;
    }
    t0 = now_s();
    assert_int_equal(bk_tokenizer_encode(t, s, k, 0, &ids), BK_OK);
    double t_text = now_s() - t0;
    printf("load %.3f s, 300 KB word %.3f s (%zu ids), %.1f MB text %.3f s\n", t_load, t_word,
           n_word, k / 1e6, t_text);
    /* generous bounds (sanitizer builds run these too); quadratic BPE on the
     * long word would take minutes */
    assert_true(t_word < 10.0);
    assert_true(t_text < 30.0);
    bk_token_ids_free(&ids);
    free(s);
    bk_tokenizer_free(t);
}

/* --calib-text's windows equal those of scripts/tokenize.py (made by
 * scripts/tokenizer_reference.py from tests/data/tokenizer/textcalib/: CRLF and
 * lone CR line ends, invalid UTF-8, a special token, a subfolder). */
static void check_textcalib(const char *tok, const char *bos_token, int64_t seqlen, int64_t samples,
                            const char *ref)
{
    char dir[256], link[512], tp[1024], text[1024], rp[1024];
    const char *root = getenv("BK_SOURCE_ROOT");
    if (tok)
        snprintf(tp, sizeof tp, "%s/tokenizer/%s", data_dir(), tok);
    else
        snprintf(tp, sizeof tp, "%s/examples/kerneldocs-1.6m/tokenizer.json", root ? root : ".");
    char *abs = realpath(tp, NULL);
    assert_non_null(abs);
    snprintf(dir, sizeof dir, "/tmp/bk-tok-model-%d", (int)getpid());
    assert_int_equal(mkdir(dir, 0700), 0);
    snprintf(link, sizeof link, "%s/tokenizer.json", dir);
    assert_int_equal(symlink(abs, link), 0);
    bk_tokenizer *t = NULL;
    assert_int_equal(bk_tokenizer_load(abs, &t), BK_OK);
    int64_t bos = bos_token ? bk_tokenizer_token_id(t, bos_token) : 1;
    assert_true(bos >= 0);
    bk_tokenizer_free(t);
    free(abs);
    snprintf(text, sizeof text, "%s/tokenizer/textcalib", data_dir());
    snprintf(rp, sizeof rp, "%s/tokenizer/%s", data_dir(), ref);
    int32_t *got = NULL, *want = NULL;
    int64_t S = 0, T = 0, S2 = 0, T2 = 0;
    bk_status st = bk_load_text_tokens(dir, text, 0, bos, samples, seqlen, &got, &S, &T);
    if (st != BK_OK)
        fprintf(stderr, "%s\n", bk_last_error());
    assert_int_equal(st, BK_OK);
    assert_int_equal(bk_load_tokens(rp, 0, 0, 0, &want, &S2, &T2), BK_OK);
    printf("%s: [%lld, %lld] windows, reference [%lld, %lld]\n", ref, (long long)S, (long long)T,
           (long long)S2, (long long)T2);
    assert_int_equal(S, S2);
    assert_int_equal(T, T2);
    for (int64_t i = 0; i < S * T; i++)
        if (got[i] != want[i]) {
            fprintf(stderr, "%s: token %lld: %d, reference %d\n", ref, (long long)i, got[i], want[i]);
            fail();
        }
    free(got);
    free(want);
    /* a window longer than the text gives / more windows than it gives: refused */
    assert_int_equal(bk_load_text_tokens(dir, text, 0, bos, 0, 100000, &got, &S, &T), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "not enough for one window"));
    assert_int_equal(bk_load_text_tokens(dir, text, 0, bos, 1000, seqlen, &got, &S, &T), BK_ERR_CALIB);
    /* an id outside the model's vocabulary */
    assert_int_equal(bk_load_text_tokens(dir, text, 8, bos, 0, seqlen, &got, &S, &T), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "outside the model's vocabulary"));
    unlink(link);
    /* no tokenizer.json: one line naming it and pointing at --calib */
    assert_int_equal(bk_load_text_tokens(dir, text, 0, bos, 0, seqlen, &got, &S, &T), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "tokenizer.json"));
    assert_non_null(strstr(bk_last_error(), "--calib"));
    rmdir(dir);
}

static void test_textcalib(void **state)
{
    (void)state;
    check_textcalib(NULL, NULL, 64, 0, "textcalib-kerneldocs.safetensors");
    check_textcalib("qwen.json", "<|endoftext|>", 32, 0, "textcalib-qwen.safetensors");
    check_textcalib("llama3.json", "<|begin_of_text|>", 32, 5, "textcalib-llama3.safetensors");
}

int main(int argc, char **argv)
{
    if (argc >= 3) {
        char xp[1024];
        snprintf(xp, sizeof xp, "%s/tokenizer/texts.json", data_dir());
        int bad = check_file(argv[1], argv[2], argc >= 4 ? argv[3] : xp);
        return bad == 0 ? 0 : 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_llama3_ignore_merges),
        cmocka_unit_test(test_qwen),
        cmocka_unit_test(test_gpt2_style),
        cmocka_unit_test(test_kerneldocs),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_tiny_bpe),
        cmocka_unit_test(test_speed),
        cmocka_unit_test(test_textcalib),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
