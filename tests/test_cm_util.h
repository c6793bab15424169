/* Helpers of the cmocka tests (include after <cmocka.h>): a call that must
 * succeed, the test models, host buffers, random token ids, and for the GPU
 * tests (after pipeline_gpu.h) their start and device buffers. */
#ifndef BK_TEST_CM_UTIL_H
#define BK_TEST_CM_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/backend.h"
#include "bakron/model.h"
#include "test_util.h"
#include "util.h"

/* call returns BK_OK, else the test fails with the error */
#define OKS(call)                                                                                  \
    do {                                                                                           \
        bk_status s_ = (call);                                                                     \
        if (s_ != BK_OK)                                                                           \
            fail_msg("%s: %s", #call, bk_last_error());                                            \
    } while (0)

/* The folder of test model `name`: the bundled kerneldocs-1.6m, a model of
 * tests/data/bad/models ("bad/NAME"), else of tests/data/models
 * (BK_SOURCE_ROOT, BK_TEST_DATA from meson). */
static inline void tu_model_path(char *buf, size_t cap, const char *name)
{
    const char *data = getenv("BK_TEST_DATA");
    const char *root = getenv("BK_SOURCE_ROOT");
    assert_non_null(data);
    assert_non_null(root);
    if (!strcmp(name, "kerneldocs-1.6m"))
        snprintf(buf, cap, "%s/examples/kerneldocs-1.6m", root);
    else if (!strncmp(name, "bad/", 4))
        snprintf(buf, cap, "%s/bad/models/%s", data, name + 4);
    else
        snprintf(buf, cap, "%s/models/%s", data, name);
}

static inline bk_model *tu_open_model(const char *name)
{
    char dir[4096];
    tu_model_path(dir, sizeof dir, name);
    bk_model *m = NULL;
    if (bk_model_open(dir, &m) != BK_OK)
        fail_msg("%s: %s", dir, bk_last_error());
    return m;
}

/* fn(name, folder) for each of the n test models named (tu_model_path's
 * names), in order */
static inline void tu_each_model(const char *const *names, size_t n,
                                 void (*fn)(const char *name, const char *dir))
{
    for (size_t i = 0; i < n; i++) {
        char dir[4096];
        tu_model_path(dir, sizeof dir, names[i]);
        fn(names[i], dir);
    }
}

/* The bundled model's folder and its golden forward (tests/data/golden). */
static inline void tu_kerneldocs_paths(char *dir, size_t dcap, char *golden, size_t gcap)
{
    snprintf(dir, dcap, "%s/examples/kerneldocs-1.6m", tu_env_or("BK_SOURCE_ROOT", "."));
    snprintf(golden, gcap, "%s/golden/kerneldocs-1.6m/golden.safetensors",
             tu_env_or("BK_TEST_DATA", "tests/data"));
}

/* n zeroed floats */
static inline float *tu_hbuf(int64_t n)
{
    float *p = calloc((size_t)n, sizeof(float));
    assert_non_null(p);
    return p;
}

/* n token ids in [0, vocab) from seed */
static inline int32_t *tu_random_tokens(uint64_t seed, int64_t n, int64_t vocab)
{
    bk_rng rg;
    bk_rng_seed(&rg, seed);
    int32_t *t = malloc((size_t)n * sizeof(int32_t));
    assert_non_null(t);
    for (int64_t i = 0; i < n; i++)
        t[i] = (int32_t)(bk_rng_next(&rg) % (uint64_t)vocab);
    return t;
}

/* The start of a GPU test's main: 77 (skipped) without a CUDA device, 1 when
 * the CUDA backend cannot be created, else 0 with the backend in *gpu. */
static inline int tu_gpu_begin(bk_backend **gpu)
{
    if (bk_cuda_device_count() == 0) {
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    if (bk_backend_create(BK_BACKEND_CUDA, gpu) != BK_OK) {
        fprintf(stderr, "cannot create the CUDA backend: %s\n", bk_last_error());
        return 1;
    }
    return 0;
}

#ifdef BK_PIPELINE_GPU_H
/* n floats of device memory of the GPU forward f */
static inline float *tu_dbuf(bk_gfwd *f, int64_t n)
{
    void *p = NULL;
    if (bk_gpu_alloc(f, &p, (size_t)n * sizeof(float), "test buffer") != BK_OK)
        fail_msg("device allocation: %s", bk_last_error());
    return (float *)p;
}

/* n floats from the host h to the device d */
static inline void tu_up(bk_gfwd *f, float *d, const float *h, int64_t n)
{
    if (bk_gpu_upload(f, d, h, (size_t)n * sizeof(float)) != BK_OK)
        fail_msg("upload: %s", bk_last_error());
}
#endif

#endif
