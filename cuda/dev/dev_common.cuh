/* What the dev harness's commands (the .cu files of cuda/dev, bk-cuda-dev) share: the
 * exit-on-error checks, the counter-based random numbers, the error summary of
 * a result against a reference and the parsing of number lists. Not part of
 * the product. */
#ifndef BK_DEV_COMMON_CUH
#define BK_DEV_COMMON_CUH

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../cuda_internal.cuh"

/* A failed bakron call or CUDA call ends the harness with its message. */
#define CK(x)                                                                                  \
    do {                                                                                       \
        bk_status s_ = (x);                                                                    \
        if (s_ != BK_OK) {                                                                     \
            fprintf(stderr, "FAILED %s: %s (%s)\n", #x, bk_last_error(), bk_status_name(s_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define CU(x) CK(bk_cuda_status((x), #x, __FILE__, __LINE__))

/* splitmix64's finaliser: a well-mixed 64-bit value of a counter */
static __host__ __device__ __forceinline__ uint64_t dev_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* a result against a reference, rows x n: the largest absolute error, that
 * over the reference's largest magnitude, the largest per-row relative error,
 * and the non-finite entries of the result (left out of the errors) */
struct errs {
    double max_abs, rel, row_rel;
    int64_t nonfinite;
};

template <typename A, typename B> errs compare(const A *x, const B *ref, int64_t rows, int64_t n)
{
    errs e = {0, 0, 0, 0};
    double mref = 0;
    for (int64_t r = 0; r < rows; r++) {
        double er = 0, mr = 0;
        for (int64_t c = 0; c < n; c++) {
            const double a = (double)x[r * n + c], b = (double)ref[r * n + c];
            if (!std::isfinite(a)) {
                e.nonfinite++;
                continue;
            }
            er = std::max(er, fabs(a - b));
            mr = std::max(mr, fabs(b));
        }
        e.max_abs = std::max(e.max_abs, er);
        mref = std::max(mref, mr);
        e.row_rel = std::max(e.row_rel, mr > 0 ? er / mr : er);
    }
    e.rel = mref > 0 ? e.max_abs / mref : e.max_abs;
    return e;
}

/* "a,b,c" -> {a, b, c} (conv: atoll or atof) */
template <typename T, typename F> std::vector<T> num_list(const char *s, F conv)
{
    std::vector<T> v;
    for (const char *p = s; *p;) {
        v.push_back((T)conv(p));
        const char *c = strchr(p, ',');
        if (!c)
            break;
        p = c + 1;
    }
    return v;
}

#endif
