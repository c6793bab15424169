/* libFuzzer target: any byte string through the safetensors reader.
 *
 * The reader must either accept the input (and then every accessor must work
 * and every tensor must lie inside the buffer) or reject it with a message; it
 * must never crash, read out of bounds, or leak. Built with -Dfuzzing=true (see
 * docs/DEVELOPING.md); replayed over the corpus in normal test runs by
 * replay_main.c.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/safetensors.h"

/* Abort (a finding for the fuzzer) when an invariant of an accepted file fails. */
static void check(int ok)
{
    if (!ok)
        abort();
}

static void run_image(const uint8_t *data, size_t size)
{
    bk_st_file *f = NULL;
    bk_status st = bk_st_open_memory(data, size, 0, "fuzz-input", &f);
    if (st != BK_OK) {
        check(f == NULL);
        check(bk_last_error()[0] != '\0');
        check(strchr(bk_last_error(), '\n') == NULL);
        return;
    }
    const unsigned char *lo = data, *hi = data + size;
    uint64_t sum = 0;
    for (size_t i = 0; i < bk_st_count(f); i++) {
        const bk_tensor_info *t = bk_st_tensor(f, i);
        check(t != NULL && bk_st_find(f, t->name) == t);
        const unsigned char *p = t->data;
        check(p >= lo + 8 + bk_st_header_size(f) && p <= hi && t->nbytes <= (uint64_t)(hi - p));
        check(t->ndim >= 0 && t->ndim <= BK_MAX_DIMS);
        sum += t->nbytes;
        /* touch the first and last byte */
        if (t->nbytes) {
            volatile unsigned char a = p[0], b = p[t->nbytes - 1];
            (void)a;
            (void)b;
        }
        /* conversion of small numeric tensors */
        if (bk_dtype_is_numeric(t->dtype) && t->numel <= 4096) {
            double *buf = malloc((size_t)t->numel * sizeof *buf + 1);
            if (buf) {
                check(bk_tensor_to_f64(t, buf) == BK_OK);
                free(buf);
            }
        } else if (!bk_dtype_is_numeric(t->dtype)) {
            double one;
            check(t->numel == 0 || bk_tensor_to_f64(t, &one) == BK_ERR_DTYPE);
        }
    }
    check(8 + bk_st_header_size(f) + sum == size);
    for (size_t i = 0; i < bk_st_meta_count(f); i++) {
        const char *k, *v;
        bk_st_meta_get(f, i, &k, &v);
        check(k && v && bk_st_meta_find(f, k) == v);
    }
    bk_st_close(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* the input as a whole file */
    run_image(data, size);
    /* and as "HEADER \0 DATA" with a correct length prefix, so that mutations reach
     * the JSON and layout checks without having to guess the 8-byte length */
    const uint8_t *nul = memchr(data, 0, size);
    size_t hl = nul ? (size_t)(nul - data) : size;
    size_t dl = nul ? size - hl - 1 : 0;
    uint8_t *img = malloc(8 + hl + dl);
    if (!img)
        return 0;
    for (int i = 0; i < 8; i++)
        img[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(img + 8, data, hl);
    if (dl)
        memcpy(img + 8 + hl, nul + 1, dl);
    run_image(img, 8 + hl + dl);
    free(img);
    return 0;
}
