/* CUDA backend — causal attention of one layer in one kernel for the TF32
 * GEMM arithmetic (the TF32 and BF16 paths; docs/DEVICE.md): the scores of a
 * block of query rows stay in shared memory instead of passing through
 * device memory (cuBLAS scores, softmax, cuBLAS P V: five passes).
 *
 * Layout as bk_gfwd_attention's: per (sequence, kv group) pair, queries qh
 * [RP = rep*T rows, hd] with row r = position * rep + head in the group,
 * keys kh / values vh [T, hd], output oh like qh. Query row r sees the keys
 * 0 .. r / rep.
 *
 * A CTA takes BQ = 128 query rows of one pair, 8 warps of 16 rows; the keys
 * in blocks of 64 through shared memory. Two passes over the key blocks:
 * the first finds each row's maximum score m (exact: the same scores as the
 * second pass), the second forms e = expf(s - m) (as k_causal_softmax),
 * sums them (double per lane) and accumulates e V with WMMA TF32 (inputs
 * rounded to TF32, F32 accumulation); the output row is divided by the sum at
 * the end. The products are TF32 as cuBLAS's in TF32 mode; what differs from
 * the unfused path is the summation order and where the 1/sum is applied
 * (after the product instead of before it). */
#ifndef BK_ATTN_FUSED_CUH
#define BK_ATTN_FUSED_CUH

#include <cstdint>
#include <mma.h>

namespace bk_attn {

using namespace nvcuda;

constexpr int BQ = 128;   /* query rows per CTA */
constexpr int BK = 64;    /* keys per block */
constexpr int NW = BQ / 16;
constexpr int SLD = BK + 4; /* row stride of a warp's score tile (floats) */
static_assert(BQ <= 2 * BK, "the queries and the output are staged through Ks + Vs");

template <int HD> struct Cfg {
    static constexpr int KLD = HD + 4; /* row stride of the K / V blocks */
    static constexpr size_t smem =
        sizeof(float) * ((size_t)2 * BK * KLD + (size_t)NW * 16 * SLD);
};

/* Every operand is rounded to TF32 (cvt.rna, as the fragments would be) once,
 * when it is written to shared memory, so the fragments are loaded as they
 * are. */
__device__ inline float4 tf32x4(float4 v)
{
    return make_float4(wmma::__float_to_tf32(v.x), wmma::__float_to_tf32(v.y),
                       wmma::__float_to_tf32(v.z), wmma::__float_to_tf32(v.w));
}

/* rows [kb, kb + BK) of X [T, HD] into dst [BK, KLD] as TF32 (zeros past T) */
template <int HD>
__device__ inline void load_block(float *dst, const float *X, int64_t kb, int64_t T)
{
    constexpr int V4 = HD / 4;
    for (int t = threadIdx.x; t < BK * V4; t += blockDim.x) {
        const int r = t / V4, c = (t % V4) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (kb + r < T)
            v = tf32x4(*reinterpret_cast<const float4 *>(X + (kb + r) * HD + c));
        *reinterpret_cast<float4 *>(dst + r * Cfg<HD>::KLD + c) = v;
    }
}

/* grid (ceil(RP / BQ), pairs), NW * 32 threads, Cfg<HD>::smem bytes */
template <int HD>
__global__ void __launch_bounds__(NW * 32)
    k_attn_fused(const float *__restrict__ qh, const float *__restrict__ kh,
                 const float *__restrict__ vh, float *__restrict__ oh, int64_t T, int64_t rep,
                 float scale)
{
    constexpr int KLD = Cfg<HD>::KLD;
    extern __shared__ __align__(128) float sm[];
    float *Ks = sm, *Vs = sm + BK * KLD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *Sw = sm + 2 * BK * KLD + warp * 16 * SLD;
    const int64_t RP = rep * T, pair = blockIdx.y;
    const int64_t q0 = (int64_t)blockIdx.x * BQ, w0 = q0 + warp * 16;
    const float *Q = qh + pair * RP * HD, *K = kh + pair * T * HD, *Vg = vh + pair * T * HD;
    float *O = oh + pair * RP * HD;
    /* the last key any row of the CTA / of this warp sees */
    const int64_t cta_last = ((q0 + BQ - 1 < RP ? q0 + BQ - 1 : RP - 1)) / rep;
    const bool wlive = w0 < RP;
    const int64_t w_last = wlive ? (w0 + 15 < RP ? w0 + 15 : RP - 1) / rep : -1;
    /* lane's row of the warp's 16 (two lanes per row, 32 columns each) */
    const int row = lane >> 1, half = lane & 1;
    const int64_t grow = w0 + row;
    const bool rlive = grow < RP;
    const int64_t pos = rlive ? grow / rep : -1;

    /* the warp's queries as fragments, staged through its 16 rows of Ks / Vs
     * (zeros past RP) */
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> qf[HD / 8];
    {
        float *Qw = Ks + warp * 16 * KLD; /* NW * 16 = BQ rows of KLD: fits in Ks + Vs */
        constexpr int V4 = HD / 4;
        for (int t = lane; t < 16 * V4; t += 32) {
            const int r = t / V4, c = (t % V4) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (w0 + r < RP)
                v = tf32x4(*reinterpret_cast<const float4 *>(Q + (w0 + r) * HD + c));
            *reinterpret_cast<float4 *>(Qw + r * KLD + c) = v;
        }
        __syncwarp();
        for (int k = 0; k < HD / 8; k++) {
            wmma::load_matrix_sync(qf[k], Qw + k * 8, KLD);
        }
    }
    const int nblk = (int)(cta_last / BK) + 1;

    /* S [16, BK] = Q K^T of the block in Ks, into Sw */
    auto scores = [&]() {
        for (int n = 0; n < BK / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int k = 0; k < HD / 8; k++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32,
                               wmma::col_major> kf;
                wmma::load_matrix_sync(kf, Ks + n * 16 * KLD + k * 8, KLD);
                wmma::mma_sync(acc, qf[k], kf, acc);
            }
            wmma::store_matrix_sync(Sw + n * 16, acc, SLD, wmma::mem_row_major);
        }
        __syncwarp();
    };

    /* pass 1: the row maxima */
    float mx = -INFINITY;
    for (int b = 0; b < nblk; b++) {
        const int64_t kb = (int64_t)b * BK;
        __syncthreads();
        load_block<HD>(Ks, K, kb, T);
        __syncthreads();
        if (!wlive || kb > w_last)
            continue;
        scores();
        for (int j = half * 32; j < half * 32 + 32; j++)
            if (kb + j <= pos) {
                const float s = Sw[row * SLD + j] * scale;
                mx = s > mx ? s : mx;
            }
        __syncwarp();
    }
    {
        const float o = __shfl_xor_sync(0xffffffffu, mx, 1);
        mx = o > mx ? o : mx;
    }

    /* pass 2: e = expf(s - m), their sum, e V */
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> of[HD / 16];
    for (int n = 0; n < HD / 16; n++)
        wmma::fill_fragment(of[n], 0.0f);
    double sum = 0.0;
    for (int b = 0; b < nblk; b++) {
        const int64_t kb = (int64_t)b * BK;
        __syncthreads();
        load_block<HD>(Ks, K, kb, T);
        load_block<HD>(Vs, Vg, kb, T);
        __syncthreads();
        if (!wlive || kb > w_last)
            continue;
        scores();
        for (int j = half * 32; j < half * 32 + 32; j++) {
            float e = 0.0f;
            if (kb + j <= pos) {
                e = expf(__fsub_rn(Sw[row * SLD + j] * scale, mx));
                sum += (double)e;
            }
            Sw[row * SLD + j] = wmma::__float_to_tf32(e);
        }
        __syncwarp();
        for (int k = 0; k < BK / 8; k++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> ef;
            wmma::load_matrix_sync(ef, Sw + k * 8, SLD);
            for (int n = 0; n < HD / 16; n++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32,
                               wmma::row_major> vf;
                wmma::load_matrix_sync(vf, Vs + k * 8 * KLD + n * 16, KLD);
                wmma::mma_sync(of[n], ef, vf, of[n]);
            }
        }
        __syncwarp();
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);

    /* the output rows, divided by their sums, through the warp's slice of Ks */
    __syncthreads();
    if (!wlive)
        return;
    float *Ow = Ks + warp * 16 * KLD;
    for (int n = 0; n < HD / 16; n++)
        wmma::store_matrix_sync(Ow + n * 16, of[n], KLD, wmma::mem_row_major);
    __syncwarp();
    if (rlive) {
        const float fs = (float)sum;
        for (int c = half * (HD / 2); c < half * (HD / 2) + HD / 2; c++)
            O[grow * HD + c] = __fdiv_rn(Ow[row * KLD + c], fs);
    }
}

} // namespace bk_attn

#endif /* BK_ATTN_FUSED_CUH */
