/* libFuzzer target: model.safetensors.index.json text through bk_st_set_open,
 * next to two fixed, valid shards (a.weight + b.weight, c.bias). An accepted
 * set must list every tensor once and find each by name. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/safetensors.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void put_shards(void)
{
    /* 8-byte header length, JSON padded to 8, data (hand-made: not bakron's writer) */
    static const char h1[] = "{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                             "\"b.weight\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}";
    static const char h2[] = "{\"c.bias\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}}";
    const char *hs[2] = {h1, h2};
    const size_t dn[2] = {12, 4};
    const char *names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    for (int s = 0; s < 2; s++) {
        size_t hl = strlen(hs[s]), pad = (8 - hl % 8) % 8, n = 8 + hl + pad + dn[s];
        unsigned char buf[256];
        memset(buf, 0, sizeof buf);
        for (int i = 0; i < 8; i++)
            buf[i] = (unsigned char)((hl + pad) >> (8 * i));
        memcpy(buf + 8, hs[s], hl);
        memset(buf + 8 + hl, ' ', pad);
        char path[560];
        fz_write(names[s], buf, n, path, sizeof path);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        put_shards();
        ready = 1;
    }
    char path[560];
    fz_write("model.safetensors.index.json", data, size, path, sizeof path);
    bk_st_set *s = NULL;
    bk_status st = bk_st_set_open(fz_tmpdir(), &s);
    if (st != BK_OK) {
        if (s)
            abort();
        fz_check_message();
        return 0;
    }
    size_t n = bk_st_set_count(s);
    if (n < 1 || n > 3)
        abort();
    for (size_t i = 0; i < n; i++) {
        const bk_tensor_info *t = bk_st_set_tensor(s, i);
        if (!t || bk_st_set_find(s, t->name) != t || strlen(t->name) == 0)
            abort();
    }
    bk_st_set_close(s);
    return 0;
}
