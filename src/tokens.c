/* Calibration / evaluation token files: safetensors with `input_ids`
 * [sequences, seqlen] of I32 or I64. */
#include <stdlib.h>
#include <string.h>

#include "bakron/pipeline.h"
#include "bakron/safetensors.h"
#include "util.h"

bk_status bk_load_tokens(const char *path, int64_t vocab, int64_t samples, int64_t seqlen,
                         int32_t **tokens, int64_t *S, int64_t *T)
{
    *tokens = NULL;
    *S = *T = 0;
    bk_st_file *f = NULL;
    bk_status st = bk_st_open_any(path, &f);
    if (st != BK_OK)
        return st;
    const bk_tensor_info *t = bk_st_find(f, "input_ids");
    if (!t) {
        bk_st_close(f);
        return bk_error(BK_ERR_CALIB, "%s: no tensor 'input_ids' (expected I32/I64 [sequences, seqlen])",
                        path);
    }
    if (t->ndim != 2 || (t->dtype != BK_DT_I32 && t->dtype != BK_DT_I64)) {
        st = bk_error(BK_ERR_CALIB, "%s: 'input_ids' must be I32 or I64 of rank 2 [sequences, seqlen], got %s rank %d",
                      path, bk_dtype_name(t->dtype), t->ndim);
        bk_st_close(f);
        return st;
    }
    int64_t fs = t->shape[0], ft = t->shape[1];
    int64_t s = samples > 0 ? samples : fs;
    int64_t tt = seqlen > 0 ? seqlen : ft;
    if (s > fs || tt > ft) {
        st = bk_error(BK_ERR_CALIB, "%s: asked for %lld sequences of %lld tokens, file has [%lld, %lld]",
                      path, (long long)s, (long long)tt, (long long)fs, (long long)ft);
        bk_st_close(f);
        return st;
    }
    if (s < 1 || tt < 2) {
        st = bk_error(BK_ERR_CALIB, "%s: need at least 1 sequence of at least 2 tokens, got [%lld, %lld]",
                      path, (long long)s, (long long)tt);
        bk_st_close(f);
        return st;
    }
    int32_t *out = bk_alloc((size_t)(s * tt), sizeof(int32_t));
    if (!out) {
        bk_st_close(f);
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for %lld tokens", path, (long long)(s * tt));
    }
    const unsigned char *base = t->data;
    for (int64_t i = 0; i < s; i++) {
        for (int64_t j = 0; j < tt; j++) {
            int64_t v;
            if (t->dtype == BK_DT_I32) {
                int32_t x;
                memcpy(&x, base + ((size_t)(i * ft + j)) * 4, 4);
                v = x;
            } else {
                memcpy(&v, base + ((size_t)(i * ft + j)) * 8, 8);
            }
            if (v < 0 || (vocab > 0 && v >= vocab)) {
                free(out);
                bk_st_close(f);
                return bk_error(BK_ERR_CALIB,
                                "%s: input_ids[%lld][%lld] = %lld is outside the vocabulary [0, %lld)",
                                path, (long long)i, (long long)j, (long long)v, (long long)vocab);
            }
            out[i * tt + j] = (int32_t)v;
        }
    }
    bk_st_close(f);
    *tokens = out;
    *S = s;
    *T = tt;
    return BK_OK;
}
