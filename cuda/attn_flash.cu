/* CUDA backend — fused causal attention of the GPU forward pass in BF16 mode
 * (issue 20; the unfused path and the layouts: forward.cu, bk_gfwd_attention).
 *
 * One kernel per micro-batch: softmax(scale Q Kᵀ, causal) V for every
 * (sequence, kv group) pair, the scores and probabilities never leaving the
 * chip. Inputs are the rotated queries, keys and values as BF16, group-major
 * as forward.cu's head-major buffers ([S, nkv, T, rep, hd] for the queries:
 * a pair's rows are its rep query heads per position, position-major;
 * [S, nkv, T, hd] for keys and values). The output is written token-major
 * [S*T, nh*hd] in F32 (what k_heads_to_tok writes on the unfused path), its
 * non-finite entries flagged as there.
 *
 * A CTA takes FA_BM = 128 consecutive query rows of one pair (128 / rep
 * positions: the rep heads of a group share the K/V loads), 8 warps of 16
 * rows each, and walks the key blocks of BN keys (32 at head_dim 128, 64 at
 * 64: fa_default_bn) up to its last position:
 *   - the Q tile and the key/value blocks go to shared memory with cp.async
 *     (16-byte chunks, rows padded by 8 BF16 against bank conflicts); key
 *     block kb+1 is loaded while kb is computed (two buffers);
 *   - S = Q Kᵀ with mma.sync m16n8k16 (BF16 inputs, F32 accumulation), the A
 *     fragments of Q and the B fragments of K from ldmatrix;
 *   - one online-softmax pass (log2 domain: exp2(s·scale·log2 e − m)), the
 *     row maxima and the rescaling of the row sums and of the output
 *     accumulators in registers; the probabilities are rounded to BF16 and
 *     the C fragments of S re-packed as the A fragments of P V (the B
 *     fragments of V from ldmatrix.trans); the row sums add the rounded
 *     probabilities, so the result is a weighted mean of V rows;
 *   - the causal mask only on the key blocks that reach past a warp's first
 *     position; a warp skips the blocks that lie wholly after its last one;
 *   - at the end the rows are divided by their sums (every row sees key 0,
 *     so the sums are positive); with lse != NULL each row's log2-domain
 *     log-sum-exp m + log2 l is stored too, for the fused backward
 *     (attn_flash_bwd.cu; the output does not change).
 * Keys and query rows past the end are zero-filled by cp.async (their rows
 * are masked or never stored; zeros keep 0·V finite).
 * (Dev-harness variants from the same source, not used by the product: the
 * other key-block size, and two 16-row m-tiles per warp — 4 warps of 32 rows,
 * each K/V fragment feeding two MMAs, up to 255 registers.)
 * Math: Q, K, V and P in BF16, the scores, sums and output in F32 — a change
 * from the unfused BF16-mode path (TF32 score GEMMs, F32 softmax); used in
 * BF16 mode only (forward.cu: bk_g_attn_flash_ok). */
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "fwd_internal.cuh"

namespace {

#include "attn_flash_kernel.cuh"

template <int HD, int BN, int MT>
bk_status launch(const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v, float *out,
                 int64_t S, int64_t nkv, int64_t T, int64_t rep, float scale,
                 unsigned long long *nf, cudaStream_t stream, float *lse)
{
    using sh = fa_shape<HD, BN, MT>;
    const int64_t nblk = (T * rep + FA_BM - 1) / FA_BM, grid = S * nkv * nblk;
    if (grid > INT32_MAX || T * rep > INT32_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "fused attention: %lld x %lld rows are too many",
                        (long long)(S * nkv), (long long)(T * rep));
    cudaError_t e = cudaFuncSetAttribute(
        k_attn_flash<HD, BN, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh::SMEM);
    if (e != cudaSuccess)
        return bk_cuda_status(e, "fused attention: shared memory", __FILE__, __LINE__);
    const float scale_log2 = (float)((double)scale * 1.4426950408889634);
    k_attn_flash<HD, BN, MT><<<(unsigned)grid, sh::THREADS, sh::SMEM, stream>>>(
        q, k, v, out, S * nkv, (int)T, (int)nkv, (int)rep, (int)nblk, scale_log2, nf, lse);
    return BK_LAUNCHED("k_attn_flash");
}

} // namespace

int bk_attn_flash_supported(int64_t hd)
{
    return hd == 64 || hd == 128;
}

bk_status bk_attn_flash(const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                        float *out, int64_t S, int64_t nkv, int64_t T, int64_t rep, int64_t hd,
                        float scale, unsigned long long *nf, cudaStream_t stream, int bn, int mt,
                        float *lse)
{
    if (S <= 0 || T <= 0)
        return BK_OK;
    constexpr int B128 = fa_default_bn<128>::value, B64 = fa_default_bn<64>::value;
    if (bn == 0)
        bn = hd == 128 ? B128 : B64;
    if (mt == 0)
        mt = 1;
    if (hd == 128 && bn == B128 && mt == 1)
        return launch<128, B128, 1>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    if (hd == 64 && bn == B64 && mt == 1)
        return launch<64, B64, 1>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    /* dev-harness variants: the other key-block size; two m-tiles per warp */
    if (hd == 128 && bn == 64 && mt == 1)
        return launch<128, 64, 1>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    if (hd == 64 && bn == 32 && mt == 1)
        return launch<64, 32, 1>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    if (hd == 128 && bn == 32 && mt == 2)
        return launch<128, 32, 2>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    if (hd == 128 && bn == 64 && mt == 2)
        return launch<128, 64, 2>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    if (hd == 64 && bn == 64 && mt == 2)
        return launch<64, 64, 2>(q, k, v, out, S, nkv, T, rep, scale, nf, stream, lse);
    return bk_error(BK_ERR_INTERNAL,
                    "fused attention: head_dim %lld with key blocks of %d and %d m-tiles per warp "
                    "is not supported",
                    (long long)hd, bn, mt);
}
