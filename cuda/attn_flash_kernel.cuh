/* CUDA backend — the fused attention kernel of attn_flash.cu (design and
 * layouts there). Included by attn_flash.cu, and by the host emulation test
 * (tests/test_attn_flash_emu.cu) with FA_EMU defined: the emulation provides
 * FA_DEV, FA_KERNEL, FA_TID, FA_BID, FA_SHARED and the warp operations
 * (ldmatrix, mma, cp.async, shuffles, barriers, bk_nf_note) from the PTX
 * definitions of their fragment layouts. */
#ifndef BK_ATTN_FLASH_KERNEL_CUH
#define BK_ATTN_FLASH_KERNEL_CUH

#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>

constexpr int FA_BM = 128; /* query rows per CTA */
constexpr int FA_PAIR_GROUP = 16;

/* keys per block: 64, or 32 at head_dim 128 (registers: the 16 x hd output
 * accumulators and the 16 x BN scores of a warp stay within 128 per thread
 * without spills; 64 at head_dim 128 spills a few bytes, kept as a variant
 * for the dev harness) */
template <int HD> struct fa_default_bn {
    static constexpr int value = HD >= 128 ? 32 : 64;
};

/* MT: 16-row m-tiles per warp (1: 8 warps of 16 rows, two CTAs of 128
 * registers per SM — the product's; 2: 4 warps of 32 rows sharing each K/V
 * fragment between two MMAs, up to 255 registers — a dev-harness variant) */
template <int HD, int BN, int MT = 1> struct fa_shape {
    static constexpr int FA_BN = BN;
    static constexpr int WARPS = FA_BM / (16 * MT);
    static constexpr int THREADS = WARPS * 32;
    static constexpr int LD = HD + 8; /* padded row, BF16 elements */
    static constexpr int Q_ELEMS = FA_BM * LD;
    static constexpr int KV_ELEMS = FA_BN * LD;
    static constexpr size_t SMEM = (size_t)(Q_ELEMS + 4 * KV_ELEMS) * sizeof(__nv_bfloat16);
    static constexpr int CHUNKS = HD / 8; /* 16-byte chunks per row */
};

#ifndef FA_EMU
#define FA_DEV __device__ __forceinline__
#define FA_KERNEL(threads) __global__ void __launch_bounds__(threads, 2)
#define FA_TID threadIdx.x
#define FA_BID blockIdx.x
#define FA_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

FA_DEV uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; zero-filled when !valid (src is not read) */
FA_DEV void cp_async16(uint32_t dst, const void *src, bool valid)
{
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}
FA_DEV void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> FA_DEV void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

FA_DEV void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
FA_DEV void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

/* d += a b: m16n8k16, A row-major BF16, B column-major BF16, F32 accumulators */
FA_DEV void mma_bf16(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                     uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fa_shfl_xor(float v, int m)
{
    return __shfl_xor_sync(0xffffffffu, v, m);
}
__device__ __forceinline__ void fa_sync()
{
    __syncthreads();
}
#endif /* !FA_EMU */

/* the bits of a BF16 pair (the first in the low half) */
FA_DEV uint32_t bf2_bits(__nv_bfloat162 v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* ROWS rows of HD BF16 from global src (row stride HD) to shared dst (row
 * stride LD, a shared-window address), 16-byte chunks; rows r >= valid are
 * zero-filled. This thread copies the chunks (row_t + j * (threads / chunks
 * per row), col_t). */
template <int HD, int ROWS, int NT>
FA_DEV void load_tile(uint32_t dst, const __nv_bfloat16 *src, int valid, int row_t, int col_t)
{
    constexpr int C = HD / 8, LD = HD + 8, RPP = NT / C;
    static_assert(ROWS % RPP == 0, "tile rows");
#pragma unroll
    for (int j = 0; j < ROWS / RPP; j++) {
        const int r = row_t + j * RPP;
        const bool ok = r < valid;
        cp_async16(dst + (uint32_t)(r * LD + col_t) * 2, ok ? src + (size_t)r * HD + col_t : src,
                   ok);
    }
}

template <int HD, int BN, int MT>
FA_KERNEL(FA_BM / (16 * MT) * 32) /* fa_shape<HD, BN, MT>::THREADS */
k_attn_flash(const __nv_bfloat16 *__restrict__ qb, const __nv_bfloat16 *__restrict__ kb,
             const __nv_bfloat16 *__restrict__ vb, float *__restrict__ out, int64_t npairs, int T,
             int nkv, int rep, int nblk, float scale_log2, unsigned long long *nf,
             float *__restrict__ lse)
{
    using sh = fa_shape<HD, BN, MT>;
    constexpr int LD = sh::LD, FA_BN = sh::FA_BN, NT = sh::THREADS;
    FA_SHARED(fa_smem);
    __nv_bfloat16 *sQ = reinterpret_cast<__nv_bfloat16 *>(fa_smem);
    __nv_bfloat16 *sK = sQ + sh::Q_ELEMS;      /* two buffers */
    __nv_bfloat16 *sV = sK + 2 * sh::KV_ELEMS; /* two buffers */

    /* pairs in groups of FA_PAIR_GROUP (their keys and values stay in L2),
     * within a group the last (longest) row blocks of every pair first */
    const int64_t per_grp = (int64_t)FA_PAIR_GROUP * nblk;
    const int64_t grp = FA_BID / per_grp, idx = FA_BID % per_grp;
    const int64_t np =
        npairs - grp * FA_PAIR_GROUP < FA_PAIR_GROUP ? npairs - grp * FA_PAIR_GROUP : FA_PAIR_GROUP;
    const int64_t pair = grp * FA_PAIR_GROUP + idx % np;
    const int blk = nblk - 1 - (int)(idx / np);
    const int RP = T * rep;
    const int R0 = blk * FA_BM;
    const int warp = FA_TID >> 5, lane = FA_TID & 31;
    const int g = lane >> 2, tq = lane & 3;

    const int last_row = (R0 + FA_BM < RP ? R0 + FA_BM : RP) - 1;
    const int nkb = (last_row / rep) / FA_BN + 1; /* key blocks up to the last position */

    const __nv_bfloat16 *qp = qb + ((size_t)pair * RP + R0) * HD;
    const __nv_bfloat16 *kp = kb + (size_t)pair * T * HD;
    const __nv_bfloat16 *vp = vb + (size_t)pair * T * HD;

    const int row_t = FA_TID / sh::CHUNKS, col_t = (FA_TID % sh::CHUNKS) * 8;
    const uint32_t sK_a = smem_addr(sK), sV_a = smem_addr(sV);
    load_tile<HD, FA_BM, NT>(smem_addr(sQ), qp, RP - R0, row_t, col_t);
    load_tile<HD, FA_BN, NT>(sK_a, kp, T, row_t, col_t);
    load_tile<HD, FA_BN, NT>(sV_a, vp, T, row_t, col_t);
    cp_async_commit();

    /* this warp's 16 MT rows from wrow; m-tile t: this thread's rows
     * wrow + 16 t + g and + 8, positions pos[t][0..1] */
    const int wrow = R0 + warp * 16 * MT;
    const bool active = wrow < RP;
    int pos[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        pos[t][0] = (wrow + 16 * t + g) / rep;
        pos[t][1] = (wrow + 16 * t + g + 8) / rep;
    }
    const int wpos_lo = wrow / rep, wpos_hi = (wrow + 16 * MT - 1) / rep;

    float o[MT][HD / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) {
#pragma unroll
        for (int j = 0; j < HD / 8; j++)
            o[t][j][0] = o[t][j][1] = o[t][j][2] = o[t][j][3] = 0.0f;
        m[t][0] = m[t][1] = -INFINITY;
        l[t][0] = l[t][1] = 0.0f;
    }

    /* ldmatrix row addresses of this lane (bytes, shared window) */
    const uint32_t q_addr = smem_addr(
        sQ + (warp * 16 * MT + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8);
    const int k_off = ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
    const int v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;

    for (int kbi = 0; kbi < nkb; kbi++) {
        const int buf = kbi & 1;
        if (kbi + 1 < nkb) {
            const int k0 = (kbi + 1) * FA_BN;
            const uint32_t bo = (uint32_t)((buf ^ 1) * sh::KV_ELEMS * 2);
            load_tile<HD, FA_BN, NT>(sK_a + bo, kp + (size_t)k0 * HD, T - k0, row_t, col_t);
            load_tile<HD, FA_BN, NT>(sV_a + bo, vp + (size_t)k0 * HD, T - k0, row_t, col_t);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fa_sync();

        const int key0 = kbi * FA_BN;
        if (active && key0 <= wpos_hi) {
            const uint32_t k_base = smem_addr(sK + buf * sh::KV_ELEMS + k_off);
            const uint32_t v_base = smem_addr(sV + buf * sh::KV_ELEMS + v_off);
            /* S = Q Kᵀ for 16 MT rows x FA_BN keys */
            float s[MT][FA_BN / 8][4];
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int j = 0; j < FA_BN / 8; j++)
                    s[t][j][0] = s[t][j][1] = s[t][j][2] = s[t][j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++)
                    ldsm_x4(q_addr + (t * 16 * LD + kk * 16) * 2, a[t][0], a[t][1], a[t][2],
                            a[t][3]);
#pragma unroll
                for (int n2 = 0; n2 < FA_BN / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(k_base + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        mma_bf16(s[t][2 * n2], a[t][0], a[t][1], a[t][2], a[t][3], b0, b1);
                        mma_bf16(s[t][2 * n2 + 1], a[t][0], a[t][1], a[t][2], a[t][3], b2, b3);
                    }
                }
            }
            /* scale (log2 domain), causal mask, block row maxima, rescale,
             * probabilities as BF16 A fragments of P V: key tiles 2 k2 and
             * 2 k2 + 1 (C fragments of S) make the 16 keys of k-step k2 */
            const bool mask = key0 + FA_BN - 1 > wpos_lo;
            uint32_t pa[MT][FA_BN / 16][4];
#pragma unroll
            for (int t = 0; t < MT; t++) {
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int j = 0; j < FA_BN / 8; j++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int key = key0 + j * 8 + 2 * tq + e;
                        float x0 = s[t][j][e] * scale_log2, x1 = s[t][j][2 + e] * scale_log2;
                        if (mask) {
                            x0 = key > pos[t][0] ? -INFINITY : x0;
                            x1 = key > pos[t][1] ? -INFINITY : x1;
                        }
                        s[t][j][e] = x0;
                        s[t][j][2 + e] = x1;
                        mx0 = fmaxf(mx0, x0);
                        mx1 = fmaxf(mx1, x1);
                    }
                }
                mx0 = fmaxf(mx0, fa_shfl_xor(mx0, 1));
                mx0 = fmaxf(mx0, fa_shfl_xor(mx0, 2));
                mx1 = fmaxf(mx1, fa_shfl_xor(mx1, 1));
                mx1 = fmaxf(mx1, fa_shfl_xor(mx1, 2));
                const float mn0 = fmaxf(m[t][0], mx0), mn1 = fmaxf(m[t][1], mx1);
                /* a row with no key yet: base 0, so exp2(-inf - 0) = 0 and no NaN */
                const float b0 = mn0 == -INFINITY ? 0.0f : mn0;
                const float b1 = mn1 == -INFINITY ? 0.0f : mn1;
                const float al0 = exp2f(m[t][0] - b0), al1 = exp2f(m[t][1] - b1);
                m[t][0] = mn0;
                m[t][1] = mn1;
                float l0 = l[t][0] * al0, l1 = l[t][1] * al1;
#pragma unroll
                for (int j = 0; j < HD / 8; j++) {
                    o[t][j][0] *= al0;
                    o[t][j][1] *= al0;
                    o[t][j][2] *= al1;
                    o[t][j][3] *= al1;
                }
#pragma unroll
                for (int k2 = 0; k2 < FA_BN / 16; k2++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int j = 2 * k2 + h;
                        const __nv_bfloat162 p0 =
                            __floats2bfloat162_rn(exp2f(s[t][j][0] - b0), exp2f(s[t][j][1] - b0));
                        const __nv_bfloat162 p1 =
                            __floats2bfloat162_rn(exp2f(s[t][j][2] - b1), exp2f(s[t][j][3] - b1));
                        const float2 f0 = __bfloat1622float2(p0), f1 = __bfloat1622float2(p1);
                        l0 += f0.x + f0.y;
                        l1 += f1.x + f1.y;
                        pa[t][k2][2 * h] = bf2_bits(p0);
                        pa[t][k2][2 * h + 1] = bf2_bits(p1);
                    }
                }
                l[t][0] = l0;
                l[t][1] = l1;
            }
            /* O += P V */
#pragma unroll
            for (int n2 = 0; n2 < HD / 16; n2++) {
#pragma unroll
                for (int k2 = 0; k2 < FA_BN / 16; k2++) {
                    uint32_t v0, v1, v2, v3;
                    ldsm_x4_t(v_base + (k2 * 16 * LD + n2 * 16) * 2, v0, v1, v2, v3);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        mma_bf16(o[t][2 * n2], pa[t][k2][0], pa[t][k2][1], pa[t][k2][2],
                                 pa[t][k2][3], v0, v1);
                        mma_bf16(o[t][2 * n2 + 1], pa[t][k2][0], pa[t][k2][1], pa[t][k2][2],
                                 pa[t][k2][3], v2, v3);
                    }
                }
            }
        }
        fa_sync(); /* buffer buf is refilled by the next iteration's prefetch */
    }

    if (!active)
        return;
    /* token-major [S*T, nh*hd]: row r of pair (s, gk) is position r / rep of
     * sequence s, head gk*rep + r % rep */
    const int64_t s_ = pair / nkv, gk = pair % nkv;
    const int64_t qd = (int64_t)nkv * rep * HD;
#pragma unroll
    for (int t = 0; t < MT; t++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float lt = l[t][h];
            lt += fa_shfl_xor(lt, 1);
            lt += fa_shfl_xor(lt, 2);
            const int row = wrow + 16 * t + g + 8 * h;
            if (row >= RP)
                continue;
            const float inv = 1.0f / lt;
            /* the log2-domain log-sum-exp of the row (scale_log2 · s), for
             * the backward (attn_flash_bwd_kernel.cuh): P = exp2(s·scale_log2 - L) */
            if (lse && tq == 0)
                lse[pair * RP + row] = m[t][h] + log2f(lt);
            const int64_t base = (s_ * T + pos[t][h]) * qd + (gk * rep + row % rep) * HD;
#pragma unroll
            for (int j = 0; j < HD / 8; j++) {
                const int col = j * 8 + 2 * tq;
                const float x = o[t][j][2 * h] * inv, y = o[t][j][2 * h + 1] * inv;
                bk_nf_note(nf, x, base + col);
                bk_nf_note(nf, y, base + col + 1);
                *reinterpret_cast<float2 *>(out + base + col) = make_float2(x, y);
            }
        }
    }
}

#endif /* BK_ATTN_FLASH_KERNEL_CUH */
