/* What the dev harness's commands (the .cu files of cuda/dev, bk-cuda-dev) share: the
 * exit-on-error checks and the counter-based random numbers. Not part of
 * the product. */
#ifndef BK_DEV_COMMON_CUH
#define BK_DEV_COMMON_CUH

#include <cstdint>
#include <cstdio>
#include <cstdlib>

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

#endif
