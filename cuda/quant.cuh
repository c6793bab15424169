/* CUDA backend — rounding one entry on the device, the same arithmetic as
 * the CPU rule (src/quant.h, BK_Q_DEFINE_APPLY): scales and zeros are the
 * fitted F32 values converted to the solve's type, the division is an IEEE
 * division in that type, ties go to even, out-of-range codes are clamped,
 * and the products are not contracted into FMAs. */
#ifndef BK_CUDA_QUANT_CUH
#define BK_CUDA_QUANT_CUH

#include "cuda_internal.cuh"

/* Products that the compiler must not contract into an FMA (the CPU
 * reference computes them as a separate rounding step). */
__device__ __forceinline__ float bk_mul_rn(float a, float b)
{
    return __fmul_rn(a, b);
}
__device__ __forceinline__ double bk_mul_rn(double a, double b)
{
    return __dmul_rn(a, b);
}

template <typename R> struct bk_dq {
    int kind;
    R qmin, qmax;
    int64_t group, groups;
    const R *scale;
    const R *zero;

    __host__ static bk_dq make(const bk_dquant &q)
    {
        bk_dq d;
        d.kind = q.kind;
        d.qmin = (R)q.qmin;
        d.qmax = (R)q.qmax;
        d.group = q.group > 0 ? q.group : 1;
        d.groups = q.groups > 0 ? q.groups : 1;
        d.scale = static_cast<const R *>(q.scale);
        d.zero = static_cast<const R *>(q.zero);
        return d;
    }

    /* Round w at (p, q) exactly as bk_q_apply_f / bk_q_apply_d (src/quant.h):
     * the code, the value it stands for; cnt[0] clamped, cnt[1] integer
     * overflow, cnt[2] non-finite inputs are counted by the caller. */
    __device__ __forceinline__ R round(R x, int64_t p, int64_t q, int16_t *code, int *cnt) const
    {
        if (!(x - x == R(0)))
            cnt[2]++;
        if (kind == BK_Q_INTEGER) {
            const R c = rint(x);
            if (!(c >= R(-32767) && c <= R(32767))) {
                cnt[1]++;
                *code = 0;
                return c;
            }
            *code = (int16_t)c;
            return c;
        }
        const int64_t gi = p * groups + q / group;
        const R s = scale[gi];
        R c = rint(x / s);
        if (kind == BK_Q_UNIFORM) {
            const R z = zero[gi];
            c += z;
            if (!(c >= R(0))) {
                c = R(0);
                cnt[0]++;
            } else if (c > qmax) {
                c = qmax;
                cnt[0]++;
            }
            *code = (int16_t)c;
            return bk_mul_rn(s, c - z);
        }
        if (!(c >= qmin)) {
            c = qmin;
            cnt[0]++;
        } else if (c > qmax) {
            c = qmax;
            cnt[0]++;
        }
        *code = (int16_t)c;
        return bk_mul_rn(c, s);
    }

    /* The same rule with the entry's scale s and zero z already at hand. */
    __device__ __forceinline__ R round_sz(R x, R s, R z, int16_t *code, int *cnt) const
    {
        if (!(x - x == R(0)))
            cnt[2]++;
        if (kind == BK_Q_INTEGER) {
            const R c = rint(x);
            if (!(c >= R(-32767) && c <= R(32767))) {
                cnt[1]++;
                *code = 0;
                return c;
            }
            *code = (int16_t)c;
            return c;
        }
        R c = rint(x / s);
        if (kind == BK_Q_UNIFORM) {
            c += z;
            if (!(c >= R(0))) {
                c = R(0);
                cnt[0]++;
            } else if (c > qmax) {
                c = qmax;
                cnt[0]++;
            }
            *code = (int16_t)c;
            return bk_mul_rn(s, c - z);
        }
        if (!(c >= qmin)) {
            c = qmin;
            cnt[0]++;
        } else if (c > qmax) {
            c = qmax;
            cnt[0]++;
        }
        *code = (int16_t)c;
        return bk_mul_rn(c, s);
    }
};

/* The rounding rule of bk_dq::round_sz with the quantizer kind fixed at
 * compile time and no branches but the division's own: the clamps are
 * selects, and the counter increments come back as bits (1 clamped, 2
 * integer overflow, 4 non-finite) for the caller to add where the entry is
 * real. The same values, codes and counts as round_sz. */
template <int KIND, typename R>
__device__ __forceinline__ R bk_round_bf(R x, R s, R z, R qmin, R qmax, int *code, int *flags)
{
    int f = !(x - x == R(0)) ? 4 : 0;
    if constexpr (KIND == BK_Q_INTEGER) {
        const R c = rint(x);
        const bool bad = !(c >= R(-32767) && c <= R(32767));
        *code = bad ? 0 : (int)c;
        *flags = f | (bad ? 2 : 0);
        return c;
    } else {
        R c = rint(x / s);
        if constexpr (KIND == BK_Q_UNIFORM) {
            c += z;
            const bool lo = !(c >= R(0)), hi = c > qmax; /* NaN: lo */
            c = lo ? R(0) : (hi ? qmax : c);
            *code = (int)c;
            *flags = f | (lo || hi ? 1 : 0);
            return bk_mul_rn(s, c - z);
        } else {
            const bool lo = !(c >= qmin), hi = c > qmax;
            c = lo ? qmin : (hi ? qmax : c);
            *code = (int)c;
            *flags = f | (lo || hi ? 1 : 0);
            return bk_mul_rn(c, s);
        }
    }
}

/* Add a thread's counters to the device counters. The warp form must be
 * reached by all 32 lanes of the warp. */
__device__ __forceinline__ void bk_counts_add(unsigned long long *dst, const int *cnt)
{
    for (int t = 0; t < 3; t++)
        if (cnt[t])
            atomicAdd(&dst[t], (unsigned long long)cnt[t]);
}

__device__ __forceinline__ void bk_counts_add_warp(unsigned long long *dst, const int *cnt)
{
    for (int t = 0; t < 3; t++) {
        int v = cnt[t];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, off);
        if ((threadIdx.x & 31) == 0 && v)
            atomicAdd(&dst[t], (unsigned long long)v);
    }
}

#endif /* BK_CUDA_QUANT_CUH */
