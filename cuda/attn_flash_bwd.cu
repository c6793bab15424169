/* CUDA backend — fused causal attention backward (FlashAttention-2 style),
 * the adjoint of attn_flash.cu's forward. Written without a GPU (session 12),
 * checked on the host by tests/test_attn_bwd_emu.cu and on the H200 by
 * bk-cuda-dev attn-bwd (session 13). Used by cuda/backward.cu's layer
 * backward in bf16 mode with head_dim 64 / 128 (attn_back_fused, in place of
 * the unfused attn_back_bf; cuda/dev/NOTES.md "Session 13").
 *
 * Inputs: the forward's BF16 q [S, nkv, T, rep, hd] and k, v [S, nkv, T, hd]
 * (group-major, what attn_flash.cu reads), its F32 output o and the output
 * gradient dout token-major [S*T, nkv*rep*hd], and the forward's per-row
 * log-sum-exp L (bk_attn_flash with lse != NULL; log2 domain: the row's
 * probabilities are exp2(scale·log2(e)·s - L)). Outputs dq [S*T, nkv*rep*hd],
 * dk and dv [S*T, nkv*hd], F32 token-major (backward.cu's dq/dk/dv layouts),
 * written (not accumulated), dq and dk including the score scale.
 *
 * Three kernels (attn_flash_bwd_kernel.cuh):
 *   1. k_attn_bwd_prep: a warp per query row: dob = dout as BF16 group-major
 *      (q's layout) and D = rowsum(dout ∘ o) (F32);
 *   2. k_attn_bwd_dkdv: a CTA per 128 keys of a pair (8 warps x 16 keys),
 *      walking the query rows that see them (from key0·rep on) in blocks of
 *      32 rows, Q / dO / L / D double-buffered (cp.async): Sᵀ = K Qᵀ,
 *      Pᵀ = exp2(Sᵀ·c - L), dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - D),
 *      dK += dSᵀ Q, dK, dV in registers (F32) over the whole walk; the rep
 *      query heads of a kv group are rows of the same walk, so dK/dV sum
 *      them in row order (fixed);
 *   3. k_attn_bwd_dq: a CTA per 128 query rows (8 warps x 16 rows, the
 *      forward's arrangement), the key blocks up to its last position
 *      double-buffered: S = Q Kᵀ, P, dP = dO Vᵀ, dS, dQ += dS K.
 * dQ is not accumulated by atomics across the key CTAs (FA2's way) but
 * recomputed in its own kernel (S and dP once more: 7 instead of 5 matrix
 * products), so every output is one thread's register sum in a fixed
 * order: reruns give the same bytes.
 * Math: Q, K, V, dO, P and dS in BF16 for the products, F32 accumulation,
 * exponentials and D — as the unfused BF16 path (attn_back_bf: BF16 P and dS,
 * F32 dP) except that P is recomputed from the forward's L instead of a
 * softmax in double, and D from dout ∘ o instead of P ∘ dP. */
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "fwd_internal.cuh"

namespace {

#include "attn_flash_bwd_kernel.cuh"

template <int HD>
bk_status launch_bwd(const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                     const float *o, const float *dout, const float *lse, float *dq, float *dk,
                     float *dv, __nv_bfloat16 *dob, float *dsum, int64_t S, int64_t nkv,
                     int64_t T, int64_t rep, float scale, cudaStream_t stream)
{
    using kv = fb_kv_default<HD>;
    using shk = fb_kv_shape<HD, kv::NW, kv::BMQ>;
    constexpr int BN = fb_q_default<HD>::BN;
    using shq = fb_q_shape<HD, BN>;
    const int64_t pairs = S * nkv, RP = T * rep, nrows = pairs * RP;
    const int64_t nkb = (T + shk::KEYS - 1) / shk::KEYS, nblk = (RP + FA_BM - 1) / FA_BM;
    if (pairs * nblk > INT32_MAX || RP > INT32_MAX || (nrows + 7) / 8 > INT32_MAX)
        return bk_error(BK_ERR_INVALID_ARG,
                        "fused attention backward: %lld x %lld rows are too many",
                        (long long)pairs, (long long)RP);
    const float scale_log2 = (float)((double)scale * 1.4426950408889634);

    k_attn_bwd_prep<HD><<<(unsigned)((nrows + 7) / 8), 256, 0, stream>>>(o, dout, dob, dsum, nrows,
                                                                       (int)T, (int)nkv, (int)rep);
    bk_status st = BK_LAUNCHED("k_attn_bwd_prep");
    if (st != BK_OK)
        return st;

    auto kk = k_attn_bwd_dkdv<HD, kv::NW, kv::BMQ, kv::MINB>;
    cudaError_t e =
        cudaFuncSetAttribute(kk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shk::SMEM);
    if (e != cudaSuccess)
        return bk_cuda_status(e, "fused attention backward: shared memory", __FILE__, __LINE__);
    kk<<<(unsigned)(pairs * nkb), shk::THREADS, shk::SMEM, stream>>>(
        q, k, v, dob, lse, dsum, dk, dv, pairs, (int)T, (int)nkv, (int)rep, (int)nkb, scale_log2,
        scale);
    if ((st = BK_LAUNCHED("k_attn_bwd_dkdv")) != BK_OK)
        return st;

    auto kq = k_attn_bwd_dq<HD, BN>;
    e = cudaFuncSetAttribute(kq, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shq::SMEM);
    if (e != cudaSuccess)
        return bk_cuda_status(e, "fused attention backward: shared memory", __FILE__, __LINE__);
    kq<<<(unsigned)(pairs * nblk), shq::THREADS, shq::SMEM, stream>>>(
        q, k, v, dob, lse, dsum, dq, pairs, (int)T, (int)nkv, (int)rep, (int)nblk, scale_log2,
        scale);
    return BK_LAUNCHED("k_attn_bwd_dq");
}

} // namespace

bk_status bk_attn_flash_bwd(const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                            const __nv_bfloat16 *v, const float *o, const float *dout,
                            const float *lse, float *dq, float *dk, float *dv, __nv_bfloat16 *dob,
                            float *dsum, int64_t S, int64_t nkv, int64_t T, int64_t rep,
                            int64_t hd, float scale, cudaStream_t stream)
{
    if (S <= 0 || T <= 0)
        return BK_OK;
    if (hd == 128)
        return launch_bwd<128>(q, k, v, o, dout, lse, dq, dk, dv, dob, dsum, S, nkv, T, rep, scale,
                               stream);
    if (hd == 64)
        return launch_bwd<64>(q, k, v, o, dout, lse, dq, dk, dv, dob, dsum, S, nkv, T, rep, scale,
                              stream);
    return bk_error(BK_ERR_INTERNAL, "fused attention backward: head_dim %lld is not supported",
                    (long long)hd);
}
