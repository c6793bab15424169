/* Helpers shared by the C tests: the environment and relative errors of a
 * result against a reference. Nothing here calls the code under test. */
#ifndef BK_TEST_UTIL_H
#define BK_TEST_UTIL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The environment variable name, or dflt when it is unset or empty. */
static inline const char *tu_env_or(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return v && v[0] ? v : dflt;
}

/* Removes a test's model folder: its model.safetensors, config.json and the
 * (then empty) folder. */
static inline void tu_rm_model_dir(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    remove(p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    remove(p);
    remove(dir); /* (POSIX remove: an empty folder too) */
}

/* max |a - b| / max |b| over n elements (max |a - b| when b is all zero); a
 * NaN difference counts as infinite. _f: float against float, _fd: float
 * against double, _d: double against double. */
#define TU_REL_ERR_BODY(A, B)                                                                      \
    double md = 0.0, mb = 0.0;                                                                     \
    for (int64_t i = 0; i < (int64_t)n; i++) {                                                     \
        double d = fabs((double)(A)[i] - (double)(B)[i]);                                          \
        if (!(d <= md))                                                                            \
            md = isnan(d) ? INFINITY : d;                                                          \
        if (fabs((double)(B)[i]) > mb)                                                             \
            mb = fabs((double)(B)[i]);                                                             \
    }                                                                                              \
    return mb > 0 ? md / mb : md

static inline double tu_rel_err_f(const float *a, const float *b, int64_t n)
{
    TU_REL_ERR_BODY(a, b);
}

static inline double tu_rel_err_fd(const float *a, const double *b, int64_t n)
{
    TU_REL_ERR_BODY(a, b);
}

static inline double tu_rel_err_d(const double *a, const double *b, int64_t n)
{
    TU_REL_ERR_BODY(a, b);
}

#endif
