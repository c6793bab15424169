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
#include <unistd.h>

#include "bakron/bakron.h"
#include "bakron/safetensors.h"
#include "sha256.h"
#include "st_internal.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sha256_vectors),
        cmocka_unit_test(test_zst_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
