/* libFuzzer target: a calibration / evaluation token file through
 * bk_load_tokens (a .safetensors, or a .safetensors.zst when the input starts
 * with the zstd magic). Accepted tokens must be in the vocabulary and the
 * sizes what was asked for. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/pipeline.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void one(const char *path, int64_t vocab, int64_t samples, int64_t seqlen)
{
    int32_t *tok = NULL;
    int64_t S = -1, T = -1;
    bk_status st = bk_load_tokens(path, vocab, samples, seqlen, &tok, &S, &T);
    if (st != BK_OK) {
        if (tok)
            abort();
        fz_check_message();
        return;
    }
    if (S < 1 || T < 2 || (samples > 0 && S != samples) || (seqlen > 0 && T != seqlen))
        abort();
    for (int64_t i = 0; i < S * T; i++)
        if (tok[i] < 0 || tok[i] >= vocab)
            abort();
    free(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const int zst = size >= 4 && !memcmp(data, "\x28\xb5\x2f\xfd", 4);
    char path[560];
    fz_write(zst ? "t.safetensors.zst" : "t.safetensors", data, size, path, sizeof path);
    one(path, 16, 0, 0);
    one(path, 100000, 1, 2);
    return 0;
}
