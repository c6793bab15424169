/* The causal softmax of the backward flow's unfused attention and its
 * backward, one warp per row, sums in double (cuda/backward.cu; the dev
 * harness's attn-bwd compares the fused backward against the same kernels).
 * Internal to the CUDA backend. */
#ifndef BK_ATTN_SOFTMAX_CUH
#define BK_ATTN_SOFTMAX_CUH

#include <cstdint>

#include <cuda_bf16.h>

namespace {

__device__ inline double warp_sum(double v)
{
    for (int o = 16; o; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ inline double warp_max(double v)
{
    for (int o = 16; o; o >>= 1)
        v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* an element as double, and a double stored in the element type (BF16:
 * rounded to F32 first, then to nearest BF16) */
__device__ inline double sm_get(float x)
{
    return (double)x;
}
__device__ inline double sm_get(double x)
{
    return x;
}
__device__ inline double sm_get(__nv_bfloat16 x)
{
    return (double)__bfloat162float(x);
}
__device__ inline void sm_put(float *p, double x)
{
    *p = (float)x;
}
__device__ inline void sm_put(double *p, double x)
{
    *p = x;
}
__device__ inline void sm_put(__nv_bfloat16 *p, double x)
{
    *p = __float2bfloat16_rn((float)x);
}

/* P = softmax of the scores S over the causal keys of each row, 0 above the
 * diagonal (S and P may be the same array). Rows: `rows` = sequences x rc
 * query rows starting at r0, the matrices [T, T] per sequence; columns below
 * kc written (the others are not read); the whole matrix: r0 = 0,
 * rc = kc = T. */
template <typename Ti, typename To>
__global__ void k_softmax(const Ti *S, To *P, int64_t rows, int64_t T, int64_t r0, int64_t rc,
                          int64_t kc)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows)
        return;
    const int64_t t = r0 + row % rc;
    const int64_t at = ((row / rc) * T + t) * T;
    const Ti *sr = S + at;
    To *pr = P + at;
    double mx = -INFINITY;
    for (int64_t u = lane; u <= t; u += 32)
        mx = fmax(mx, sm_get(sr[u]));
    mx = warp_max(mx);
    double sum = 0;
    for (int64_t u = lane; u <= t; u += 32)
        sum += exp(sm_get(sr[u]) - mx);
    sum = warp_sum(sum);
    for (int64_t u = lane; u < kc; u += 32)
        sm_put(pr + u, u <= t ? exp(sm_get(sr[u]) - mx) / sum : 0.0);
}

/* dS = P ⊙ (dP - rowsum(P ⊙ dP)), zero above the diagonal (rows and columns
 * as k_softmax; dP and dS may be the same array) */
template <typename Tp, typename Td, typename To>
__global__ void k_dsoftmax(const Tp *P, const Td *dP, To *dS, int64_t rows, int64_t T, int64_t r0,
                           int64_t rc, int64_t kc)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows)
        return;
    const int64_t t = r0 + row % rc;
    const int64_t at = ((row / rc) * T + t) * T;
    const Tp *pr = P + at;
    const Td *dr = dP + at;
    To *sr = dS + at;
    double dot = 0;
    for (int64_t u = lane; u <= t; u += 32)
        dot += sm_get(pr[u]) * sm_get(dr[u]);
    dot = warp_sum(dot);
    for (int64_t u = lane; u < kc; u += 32)
        sm_put(sr + u, u <= t ? sm_get(pr[u]) * (sm_get(dr[u]) - dot) : 0.0);
}

} // namespace

#endif
