/* Identity digests of a model and of calibration tokens (activation dumps,
 * docs/activations.md "Identity"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline_internal.h"
#include "sha256.h"
#include "util.h"

static void put_u64(bk_sha256 *s, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    bk_sha256_update(s, b, 8);
}

/* A tensor's bytes: all of them up to 64 KiB, else 16 blocks of 4 KiB spread
 * evenly from the first byte to the last (cheap on a large checkpoint, and
 * any retraining or fine-tune changes them). */
#define DG_BLOCK 4096u
#define DG_BLOCKS 16u

static void hash_tensor(bk_sha256 *s, const bk_tensor_info *t)
{
    bk_sha256_update(s, t->name, strlen(t->name) + 1);
    const char *dt = bk_dtype_name(t->dtype);
    bk_sha256_update(s, dt, strlen(dt) + 1);
    put_u64(s, (uint64_t)t->ndim);
    for (int d = 0; d < t->ndim; d++)
        put_u64(s, (uint64_t)t->shape[d]);
    put_u64(s, t->nbytes);
    const unsigned char *p = t->data;
    if (t->nbytes <= (uint64_t)DG_BLOCK * DG_BLOCKS) {
        bk_sha256_update(s, p, (size_t)t->nbytes);
        return;
    }
    uint64_t span = t->nbytes - DG_BLOCK;
    for (unsigned k = 0; k < DG_BLOCKS; k++)
        bk_sha256_update(s, p + span * k / (DG_BLOCKS - 1), DG_BLOCK);
}

bk_status bk__model_digest(const bk_model *m, char config_hex[65], char weights_hex[65])
{
    char path[4096];
    bk_status st = bk_path_join(path, sizeof path, bk_model_dir(m), "config.json");
    if (st != BK_OK)
        return st;
    char *text = NULL;
    size_t len = 0;
    st = bk_read_file(path, (size_t)64 << 20 /* config.json limit, src/model.c */, &text, &len);
    if (st != BK_OK)
        return st;
    bk_sha256_buf_hex(text, len, config_hex);
    free(text);
    const bk_st_set *set = bk_model_tensors(m);
    bk_sha256 s;
    bk_sha256_init(&s);
    static const char tag[] = "bakron weights digest 1";
    bk_sha256_update(&s, tag, sizeof tag);
    size_t n = bk_st_set_count(set);
    put_u64(&s, n);
    for (size_t i = 0; i < n; i++) /* sorted by name */
        hash_tensor(&s, bk_st_set_tensor(set, i));
    bk_sha256_hex(&s, weights_hex);
    return BK_OK;
}

void bk__calib_digest(const int32_t *tokens, int64_t S, int64_t T, char hex[65])
{
    bk_sha256 s;
    bk_sha256_init(&s);
    static const char tag[] = "bakron calibration digest 1";
    bk_sha256_update(&s, tag, sizeof tag);
    put_u64(&s, (uint64_t)S);
    put_u64(&s, (uint64_t)T);
    for (int64_t i = 0; i < S * T; i++) {
        uint32_t v = (uint32_t)tokens[i];
        unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                              (unsigned char)(v >> 24)};
        bk_sha256_update(&s, b, 4);
    }
    bk_sha256_hex(&s, hex);
}
