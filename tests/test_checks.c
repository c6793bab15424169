/* Input checks of issue 14 (points 5, 9, 11, 12): the SHA-256 behind the
 * activation dumps' identity digests (FIPS 180-4 examples), the bound on a
 * .zst's decompressed size, message escaping. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bakron/bakron.h"
#include "bakron/safetensors.h"
#include "sha256.h"
#include "st_internal.h"
#include "util.h"

static void test_sha256_vectors(void **state)
{
    (void)state;
    char hex[65];
    /* FIPS 180-4 / NIST CSRC examples */
    bk_sha256_buf_hex("abc", 3, hex);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    bk_sha256_buf_hex("", 0, hex);
    assert_string_equal(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    bk_sha256_buf_hex(two, strlen(two), hex);
    assert_string_equal(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* one million 'a', fed in uneven pieces */
    bk_sha256 s;
    bk_sha256_init(&s);
    char a[997];
    memset(a, 'a', sizeof a);
    size_t left = 1000000;
    for (size_t k = 1; left; k = k % 997 + 1) {
        size_t n = k < left ? k : left;
        bk_sha256_update(&s, a, n);
        left -= n;
    }
    bk_sha256_hex(&s, hex);
    assert_string_equal(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

/* A tiny zstd frame that declares `declared` bytes and holds `body` raw. */
static void write_frame(const char *path, uint64_t declared, const void *body, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    unsigned char h[4 + 1 + 1 + 8 + 3] = {0x28, 0xb5, 0x2f, 0xfd, 0xC0, 10 << 3};
    for (int i = 0; i < 8; i++)
        h[6 + i] = (unsigned char)(declared >> (8 * i));
    uint32_t bh = 1u | ((uint32_t)n << 3);
    h[14] = (unsigned char)bh;
    h[15] = (unsigned char)(bh >> 8);
    h[16] = (unsigned char)(bh >> 16);
    assert_int_equal(fwrite(h, 1, sizeof h, f), sizeof h);
    assert_int_equal(fwrite(body, 1, n, f), n);
    fclose(f);
}

static void test_zst_bound(void **state)
{
    (void)state;
    char path[] = "/tmp/bk-zst-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    const char body[] = "\x10\0\0\0\0\0\0\0{}              ";
    write_frame(path, 60ull << 30, body, sizeof body - 1);
    bk_st_file *f = NULL;
    /* refused from the declared size, before any buffer of it exists */
    assert_int_equal(bk_st_open_zst_max(path, 1 << 20, "the test's bound", &f), BK_ERR_ZSTD);
    assert_null(f);
    assert_non_null(strstr(bk_last_error(), "declares 64424509440 decompressed bytes"));
    assert_non_null(strstr(bk_last_error(), "the test's bound"));
    char *json = NULL;
    uint64_t declared = 0;
    assert_int_equal(bk_st_zst_header(path, 4096, 1 << 20, "the test's bound", &json, &declared),
                     BK_ERR_ZSTD);
    assert_null(json);
    assert_non_null(strstr(bk_last_error(), "declares 64424509440"));
    /* an honest frame of the same bytes reads (header only) */
    write_frame(path, sizeof body - 1, body, sizeof body - 1);
    assert_int_equal(bk_st_zst_header(path, 4096, 1 << 20, "b", &json, &declared), BK_OK);
    assert_int_equal(declared, sizeof body - 1);
    assert_string_equal(json, "{}              ");
    free(json);
    assert_int_equal(bk_st_open_zst_max(path, 1 << 20, "b", &f), BK_OK);
    bk_st_close(f);
    /* declared exactly at the bound + 1 */
    assert_int_equal(bk_st_open_zst_max(path, sizeof body - 2, "b", &f), BK_ERR_ZSTD);
    unlink(path);
}

/* A zstd frame declaring `declared` bytes: body as a raw block, then `rle`
 * RLE blocks of 128 KiB zeros (a small file whose frame is decoded block by
 * block: the lie, if any, shows only at its end). */
static void write_frame_rle(const char *path, uint64_t declared, const void *body, size_t n,
                            int rle)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    unsigned char h[4 + 1 + 1 + 8] = {0x28, 0xb5, 0x2f, 0xfd, 0xC0, 10 << 3};
    for (int i = 0; i < 8; i++)
        h[6 + i] = (unsigned char)(declared >> (8 * i));
    assert_int_equal(fwrite(h, 1, sizeof h, f), sizeof h);
    for (int b = 0; b <= rle; b++) {
        const int last = b == rle;
        uint32_t bh = b == 0 ? (uint32_t)last | ((uint32_t)n << 3)
                             : (uint32_t)last | (1u << 1) | ((uint32_t)(128u << 10) << 3);
        unsigned char bb[3] = {(unsigned char)bh, (unsigned char)(bh >> 8),
                               (unsigned char)(bh >> 16)};
        assert_int_equal(fwrite(bb, 1, 3, f), 3);
        if (b == 0)
            assert_int_equal(fwrite(body, 1, n, f), n);
        else
            assert_int_equal(fputc(0, f), 0);
    }
    fclose(f);
}

/* bk_st_open_zst (token files, bakron inspect/solve on a .zst): the bound is
 * the image size the safetensors header inside declares, checked against the
 * frame's declared size before the image's buffer exists. */
static void test_zst_header_bound(void **state)
{
    (void)state;
    char path[] = "/tmp/bk-zsth-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    /* input_ids I32 [2, 4]: 8 + 72 + 32 bytes */
    const char hdr[] = "{\"input_ids\":{\"dtype\":\"I32\",\"shape\":[2,4],\"data_offsets\":[0,32]}}";
    const size_t hn = sizeof hdr - 1, n = 8 + hn + 32;
    unsigned char img[256];
    assert_true(n <= sizeof img);
    for (int i = 0; i < 8; i++)
        img[i] = (unsigned char)((uint64_t)hn >> (8 * i));
    memcpy(img + 8, hdr, hn);
    for (int i = 0; i < 8; i++) {
        int32_t v = i + 1;
        memcpy(img + 8 + hn + 4 * i, &v, 4);
    }
    bk_st_file *f = NULL;
    char want[160];
    snprintf(want, sizeof want, "more than the %zu bytes allowed by the safetensors header's shapes",
             n);
    /* the frame declares 60 GiB in ~130 bytes: more than any zstd stream of
     * that size holds (a block is >= 4 bytes and decodes to <= 128 KiB) */
    write_frame(path, 60ull << 30, img, n);
    assert_int_equal(bk_st_open_zst(path, &f), BK_ERR_ZSTD);
    assert_null(f);
    assert_int_equal(bk_status_exit_code(BK_ERR_ZSTD), 2);
    assert_non_null(strstr(bk_last_error(), "truncated or corrupt zstd stream (the frame declares "
                                            "64424509440 decompressed bytes"));
    /* an honest frame of 1 MiB + 112 bytes in ~160 bytes (the header, then
     * RLE zeros): possible for the stream's size, not for the header's
     * shapes; refused before its buffer exists */
    write_frame_rle(path, n + (8u << 17), img, n, 8);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_true(sb.st_size < 200);
    assert_int_equal(bk_st_open_zst(path, &f), BK_ERR_ZSTD);
    assert_null(f);
    char dec[64];
    snprintf(dec, sizeof dec, "declares %zu decompressed bytes", n + (8u << 17));
    assert_non_null(strstr(bk_last_error(), dec));
    assert_non_null(strstr(bk_last_error(), want));
    /* one byte more than the block holds: the decoder's own check */
    write_frame(path, n + 1, img, n);
    assert_int_equal(bk_st_open_zst(path, &f), BK_ERR_ZSTD);
    assert_null(f);
    /* the honest frame reads */
    write_frame(path, n, img, n);
    assert_int_equal(bk_st_open_zst(path, &f), BK_OK);
    const bk_tensor_info *t = bk_st_find(f, "input_ids");
    assert_non_null(t);
    assert_int_equal(t->shape[0], 2);
    bk_st_close(f);
    /* a header and a frame that agree on 32 GiB in a frame of a few hundred
     * bytes */
    const char big[] =
        "{\"input_ids\":{\"dtype\":\"I32\",\"shape\":[1073741824,8],\"data_offsets\":[0,"
        "34359738368]}}";
    const size_t bn = sizeof big - 1;
    unsigned char bimg[256];
    for (int i = 0; i < 8; i++)
        bimg[i] = (unsigned char)((uint64_t)bn >> (8 * i));
    memcpy(bimg + 8, big, bn);
    write_frame(path, 8 + bn + (32ull << 30), bimg, 8 + bn);
    assert_int_equal(bk_st_open_zst(path, &f), BK_ERR_ZSTD);
    assert_null(f);
    assert_non_null(strstr(bk_last_error(), "truncated or corrupt zstd stream"));
    /* a malformed header in a sound stream is named as such (rule 5) */
    bimg[8] = '!';
    write_frame(path, 8 + bn, bimg, 8 + bn);
    assert_int_equal(bk_st_open_zst(path, &f), BK_ERR_ST_JSON);
    assert_non_null(strstr(bk_last_error(), "header is not valid JSON"));
    unlink(path);
}

/* Messages are one line of valid UTF-8: control characters and invalid bytes
 * from input files are escaped (issue 14 point 12). */
static void test_escape(void **state)
{
    (void)state;
    char out[64];
    bk_escape_message("a\nb\tc\rd\x1b[31m\x7f", out, sizeof out);
    assert_string_equal(out, "a\\nb\\tc\\rd\\x1b[31m\\x7f");
    /* valid UTF-8 kept; invalid bytes, overlong forms and surrogates escaped byte by byte */
    bk_escape_message("\xc3\xa9 \xe2\x80\x94 \xff \xc0\xaf \xed\xa0\x80 \xe2\x80", out, sizeof out);
    assert_string_equal(out, "\xc3\xa9 \xe2\x80\x94 \\xff \\xc0\\xaf \\xed\\xa0\\x80 \\xe2\\x80");
    /* never an escape or a character cut in half at the end */
    char small[6];
    bk_escape_message("ab\x01" "cd", small, sizeof small);
    assert_string_equal(small, "ab");
    char five[5];
    bk_escape_message("abc\xc3\xa9", five, sizeof five);
    assert_string_equal(five, "abc");
    /* through bk_error and bk_error_prefix */
    bk_error(BK_ERR_CONFIG, "x '%s'", "bad\x1b\xfe");
    assert_string_equal(bk_last_error(), "x 'bad\\x1b\\xfe'");
    bk_error_prefix(BK_ERR_CONFIG, "p\n");
    assert_string_equal(bk_last_error(), "p\\n: x 'bad\\x1b\\xfe'");
    /* a config.json echoing a value with an escape character and a raw invalid byte */
    const char cfg[] = "{\"model_type\": \"gpt\\u001b[31m\xff\", \"hidden_size\": 8}";
    bk_model_config c;
    assert_int_equal(bk_model_config_parse(cfg, sizeof cfg - 1, "c.json", &c), BK_ERR_UNSUPPORTED);
    assert_non_null(strstr(bk_last_error(), "model_type 'gpt\\x1b[31m\\xff'"));
    for (const unsigned char *p = (const unsigned char *)bk_last_error(); *p; p++)
        assert_true(*p >= 0x20 && *p < 0x7f);
}

/* Write failures say why (issue 14 point 12: "README.md: write failed"). */
static void test_copy_reason(void **state)
{
    (void)state;
    if (access("/dev/full", W_OK) != 0)
        skip();
    char src[] = "/tmp/bk-copy-XXXXXX";
    int fd = mkstemp(src);
    assert_true(fd >= 0);
    char buf[4096];
    memset(buf, 'r', sizeof buf);
    assert_int_equal(write(fd, buf, sizeof buf), (ssize_t)sizeof buf);
    close(fd);
    assert_int_equal(bk_copy_file(src, "/dev/full"), BK_ERR_WRITE);
    assert_non_null(strstr(bk_last_error(), "/dev/full: write failed: No space left on device"));
    unlink(src);
}

/* A shard that is a folder is named as one, not "which does not exist". */
static void test_shard_is_folder(void **state)
{
    (void)state;
    char dir[] = "/tmp/bk-idx-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char p[256], sub[256];
    snprintf(sub, sizeof sub, "%s/model-00001-of-00001.safetensors", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs("{\"weight_map\": {\"a.weight\": \"model-00001-of-00001.safetensors\"}}", f);
    fclose(f);
    bk_st_set *s = NULL;
    assert_int_equal(bk_st_set_open(dir, &s), BK_ERR_ST_INDEX);
    assert_non_null(strstr(bk_last_error(), "which is a folder, not a file"));
    assert_null(strstr(bk_last_error(), "does not exist"));
    unlink(p);
    rmdir(sub);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sha256_vectors),
        cmocka_unit_test(test_zst_bound),
        cmocka_unit_test(test_zst_header_bound),
        cmocka_unit_test(test_escape),
        cmocka_unit_test(test_copy_reason),
        cmocka_unit_test(test_shard_is_folder),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
