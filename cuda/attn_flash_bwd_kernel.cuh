/* CUDA backend — the kernels of the fused attention backward (design and
 * layouts: attn_flash_bwd.cu). Included by attn_flash_bwd.cu, and by the host
 * emulation test (tests/test_attn_bwd_emu.cu) with FA_EMU defined (the
 * emulation then also provides FB_KERNEL). Uses the forward's primitives
 * (attn_flash_kernel.cuh: cp.async, ldmatrix, mma, load_tile). */
#ifndef BK_ATTN_FLASH_BWD_KERNEL_CUH
#define BK_ATTN_FLASH_BWD_KERNEL_CUH

#include "attn_flash_kernel.cuh"

#ifndef FA_EMU
#define FB_KERNEL(threads, minb) __global__ void __launch_bounds__(threads, minb)
#endif

/* ------------------------------------------------------------- dK, dV */

/* NW warps of 16 keys each (16 NW keys per CTA), query blocks of BMQ rows
 * (rows of q's group-major layout: the rep heads of a position in a row);
 * MINB CTAs per SM for the register limit */
template <int HD> struct fb_kv_default {
    static constexpr int NW = 8, BMQ = 32, MINB = HD >= 128 ? 1 : 2;
};

template <int HD, int NW, int BMQ> struct fb_kv_shape {
    static constexpr int KEYS = 16 * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int LD = HD + 8;
    static constexpr int KV_ELEMS = KEYS * LD;
    static constexpr int QT_ELEMS = BMQ * LD;
    /* K, V; Q and dO double-buffered (BF16); L and D double-buffered (F32) */
    static constexpr size_t SMEM =
        (size_t)(2 * KV_ELEMS + 4 * QT_ELEMS) * sizeof(__nv_bfloat16) + 4 * BMQ * sizeof(float);
};

/* The rows of query block R0 .. R0 + BMQ of a pair into buffer b: Q and dO by
 * cp.async (rows past RP zero-filled), L and D by plain stores (rows past RP:
 * L = +inf, so that their probabilities are 0 whatever the mask says, D = 0) */
template <int HD, int NW, int BMQ>
FA_DEV void fb_load_q(uint32_t sQ_a, uint32_t sO_a, float *sL, float *sD,
                      const __nv_bfloat16 *qb, const __nv_bfloat16 *dob, const float *lse,
                      const float *dsum, int64_t rb, int R0, int RP, int b, int row_t, int col_t,
                      int tid)
{
    using sh = fb_kv_shape<HD, NW, BMQ>;
    const uint32_t bo = (uint32_t)(b * sh::QT_ELEMS * 2);
    const int64_t r0 = rb + R0; /* the block's first row of all pairs */
    load_tile<HD, BMQ, sh::THREADS>(sQ_a + bo, qb + r0 * HD, RP - R0, row_t, col_t);
    load_tile<HD, BMQ, sh::THREADS>(sO_a + bo, dob + r0 * HD, RP - R0, row_t, col_t);
    if (tid < BMQ) {
        const bool ok = R0 + tid < RP;
        sL[b * BMQ + tid] = ok ? lse[r0 + tid] : INFINITY;
        sD[b * BMQ + tid] = ok ? dsum[r0 + tid] : 0.0f;
    }
}

/* One CTA: the 16 NW keys key0 .. of one (sequence, kv group) pair against
 * every query row that sees them (rows from key0 · rep on), in query blocks of
 * BMQ rows double-buffered; warp w owns keys key0 + 16 w .. + 15 and keeps
 * their dK and dV (16 x HD each, F32) in registers:
 *   Sᵀ = K_w Qᵀ (16 x BMQ), Pᵀ = exp2(Sᵀ·scale_log2 - L) (causal mask),
 *   dV += Pᵀ dO, dPᵀ = V_w dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - D), dK += dSᵀ Q;
 * Pᵀ and dSᵀ are re-packed from C to A fragments in BF16 (as the forward's
 * P). dK is multiplied by scale at the store. */
template <int HD, int NW, int BMQ, int MINB>
FB_KERNEL(NW * 32, MINB)
k_attn_bwd_dkdv(const __nv_bfloat16 *__restrict__ qb, const __nv_bfloat16 *__restrict__ kb,
                const __nv_bfloat16 *__restrict__ vb, const __nv_bfloat16 *__restrict__ dob,
                const float *__restrict__ lse, const float *__restrict__ dsum,
                float *__restrict__ dk, float *__restrict__ dv, int64_t npairs, int T, int nkv,
                int rep, int nkb, float scale_log2, float scale)
{
    using sh = fb_kv_shape<HD, NW, BMQ>;
    constexpr int LD = sh::LD, KEYS = sh::KEYS, NT = sh::THREADS;
    FA_SHARED(fb_smem);
    __nv_bfloat16 *sK = reinterpret_cast<__nv_bfloat16 *>(fb_smem);
    __nv_bfloat16 *sV = sK + sh::KV_ELEMS;
    __nv_bfloat16 *sQ = sV + sh::KV_ELEMS;     /* two buffers */
    __nv_bfloat16 *sO = sQ + 2 * sh::QT_ELEMS; /* two buffers */
    float *sL = reinterpret_cast<float *>(sO + 2 * sh::QT_ELEMS);
    float *sD = sL + 2 * BMQ;

    /* pairs in groups of FA_PAIR_GROUP, within a group the first (longest:
     * every query row from their position on) key blocks of every pair first */
    const int64_t per_grp = (int64_t)FA_PAIR_GROUP * nkb;
    const int64_t grp = FA_BID / per_grp, idx = FA_BID % per_grp;
    const int64_t np =
        npairs - grp * FA_PAIR_GROUP < FA_PAIR_GROUP ? npairs - grp * FA_PAIR_GROUP : FA_PAIR_GROUP;
    const int64_t pair = grp * FA_PAIR_GROUP + idx % np;
    const int blk = (int)(idx / np);
    const int RP = T * rep;
    const int key0 = blk * KEYS;
    const int tid = FA_TID, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;

    const int64_t rb = pair * RP; /* the pair's first row */
    const __nv_bfloat16 *kp = kb + ((size_t)pair * T + key0) * HD;
    const __nv_bfloat16 *vp = vb + ((size_t)pair * T + key0) * HD;

    const int row_t = tid / (HD / 8), col_t = (tid % (HD / 8)) * 8;
    const uint32_t sQ_a = smem_addr(sQ), sO_a = smem_addr(sO);
    load_tile<HD, KEYS, NT>(smem_addr(sK), kp, T - key0, row_t, col_t);
    load_tile<HD, KEYS, NT>(smem_addr(sV), vp, T - key0, row_t, col_t);
    const int qb0 = key0 * rep / BMQ, nqb = (RP + BMQ - 1) / BMQ;
    fb_load_q<HD, NW, BMQ>(sQ_a, sO_a, sL, sD, qb, dob, lse, dsum, rb, qb0 * BMQ, RP, 0, row_t,
                           col_t, tid);
    cp_async_commit();

    /* this warp's keys kw .. kw + 15; this thread's rows of the C fragments:
     * keys kw + g and kw + g + 8 */
    const int kw = key0 + warp * 16;
    const int key_lo = kw + g, key_hi = kw + g + 8;
    const bool active = kw < T;

    float adv[HD / 8][4], adk[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            adv[j][e] = adk[j][e] = 0.0f;

    /* ldmatrix row addresses: A fragments (the warp's K / V rows; also the
     * B fragments of a .trans load), B fragments without .trans */
    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
    const int b_off = ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
    const uint32_t k_addr = smem_addr(sK + warp * 16 * LD + a_off);
    const uint32_t v_addr = smem_addr(sV + warp * 16 * LD + a_off);

    for (int qi = qb0; qi < nqb; qi++) {
        const int buf = (qi - qb0) & 1;
        if (qi + 1 < nqb) {
            fb_load_q<HD, NW, BMQ>(sQ_a, sO_a, sL, sD, qb, dob, lse, dsum, rb, (qi + 1) * BMQ, RP,
                                   buf ^ 1, row_t, col_t, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fa_sync();

        const int R0 = qi * BMQ;
        const int last = (R0 + BMQ < RP ? R0 + BMQ : RP) - 1;
        const int pos_lo = R0 / rep, pos_hi = last / rep;
        if (active && kw <= pos_hi) {
            const uint32_t qn = smem_addr(sQ + buf * sh::QT_ELEMS + b_off);
            const uint32_t qt = smem_addr(sQ + buf * sh::QT_ELEMS + a_off);
            const uint32_t on = smem_addr(sO + buf * sh::QT_ELEMS + b_off);
            const uint32_t ot = smem_addr(sO + buf * sh::QT_ELEMS + a_off);
            const float *Lb = sL + buf * BMQ, *Db = sD + buf * BMQ;
            /* Sᵀ = K_w Qᵀ: 16 keys x BMQ rows */
            float s[BMQ / 8][4];
#pragma unroll
            for (int j = 0; j < BMQ / 8; j++)
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t a0, a1, a2, a3;
                ldsm_x4(k_addr + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
                for (int n2 = 0; n2 < BMQ / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(qn + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * n2], a0, a1, a2, a3, b0, b1);
                    mma_bf16(s[2 * n2 + 1], a0, a1, a2, a3, b2, b3);
                }
            }
            /* Pᵀ: column c of tile j is row R0 + 8 j + 2 tq + e */
            const bool mask = kw + 15 > pos_lo;
#pragma unroll
            for (int j = 0; j < BMQ / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int c = j * 8 + 2 * tq + e;
                    const float Lc = Lb[c];
                    float p0 = exp2f(s[j][e] * scale_log2 - Lc);
                    float p1 = exp2f(s[j][2 + e] * scale_log2 - Lc);
                    if (mask) {
                        const int pos = (R0 + c) / rep;
                        p0 = key_lo > pos ? 0.0f : p0;
                        p1 = key_hi > pos ? 0.0f : p1;
                    }
                    s[j][e] = p0;
                    s[j][2 + e] = p1;
                }
            /* dV += Pᵀ dO (A: Pᵀ in BF16, one k-step of 16 rows at a time;
             * B: dO rows by ldmatrix.trans) */
#pragma unroll
            for (int k2 = 0; k2 < BMQ / 16; k2++) {
                uint32_t pa[4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * k2 + h;
                    pa[2 * h] = bf2_bits(__floats2bfloat162_rn(s[j][0], s[j][1]));
                    pa[2 * h + 1] = bf2_bits(__floats2bfloat162_rn(s[j][2], s[j][3]));
                }
#pragma unroll
                for (int n2 = 0; n2 < HD / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(ot + (k2 * 16 * LD + n2 * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(adv[2 * n2], pa[0], pa[1], pa[2], pa[3], b0, b1);
                    mma_bf16(adv[2 * n2 + 1], pa[0], pa[1], pa[2], pa[3], b2, b3);
                }
            }
            /* dPᵀ = V_w dOᵀ */
            float d[BMQ / 8][4];
#pragma unroll
            for (int j = 0; j < BMQ / 8; j++)
                d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t a0, a1, a2, a3;
                ldsm_x4(v_addr + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
                for (int n2 = 0; n2 < BMQ / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(on + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(d[2 * n2], a0, a1, a2, a3, b0, b1);
                    mma_bf16(d[2 * n2 + 1], a0, a1, a2, a3, b2, b3);
                }
            }
            /* dSᵀ = Pᵀ ∘ (dPᵀ - D) in BF16, a k-step at a time; dK += dSᵀ Q */
#pragma unroll
            for (int k2 = 0; k2 < BMQ / 16; k2++) {
                uint32_t da[4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * k2 + h;
                    const int c = j * 8 + 2 * tq;
                    const float D0 = Db[c], D1 = Db[c + 1];
                    da[2 * h] = bf2_bits(__floats2bfloat162_rn(s[j][0] * (d[j][0] - D0),
                                                               s[j][1] * (d[j][1] - D1)));
                    da[2 * h + 1] = bf2_bits(__floats2bfloat162_rn(s[j][2] * (d[j][2] - D0),
                                                                   s[j][3] * (d[j][3] - D1)));
                }
#pragma unroll
                for (int n2 = 0; n2 < HD / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(qt + (k2 * 16 * LD + n2 * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(adk[2 * n2], da[0], da[1], da[2], da[3], b0, b1);
                    mma_bf16(adk[2 * n2 + 1], da[0], da[1], da[2], da[3], b2, b3);
                }
            }
        }
        fa_sync(); /* buffer buf is refilled by the next iteration's prefetch */
    }

    if (!active)
        return;
    /* token-major [S*T, nkv*hd]: key kk of pair (s, gk) is row s T + kk,
     * columns gk hd .. */
    const int64_t s_ = pair / nkv, gk = pair % nkv, kd = (int64_t)nkv * HD;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int key = h ? key_hi : key_lo;
        if (key >= T)
            continue;
        const int64_t base = (s_ * T + key) * kd + gk * HD;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            const int col = j * 8 + 2 * tq;
            *reinterpret_cast<float2 *>(dk + base + col) =
                make_float2(adk[j][2 * h] * scale, adk[j][2 * h + 1] * scale);
            *reinterpret_cast<float2 *>(dv + base + col) =
                make_float2(adv[j][2 * h], adv[j][2 * h + 1]);
        }
    }
}

/* ----------------------------------------------------------------- dQ */

/* keys per block of the dQ kernel: 32 (S and dP of a warp's 16 rows, 16
 * registers each, next to the 16 x HD accumulators; 64 at head_dim 64
 * spills 4 bytes at 128 registers, ptxas sm_90) */
template <int HD> struct fb_q_default {
    static constexpr int BN = 32;
};

template <int HD, int BN> struct fb_q_shape {
    static constexpr int WARPS = FA_BM / 16;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int LD = HD + 8;
    static constexpr int Q_ELEMS = FA_BM * LD;
    static constexpr int KV_ELEMS = BN * LD;
    /* Q, dO; K and V double-buffered */
    static constexpr size_t SMEM = (size_t)(2 * Q_ELEMS + 4 * KV_ELEMS) * sizeof(__nv_bfloat16);
};

/* One CTA: FA_BM query rows of a pair (8 warps of 16 rows, as the forward),
 * the key blocks of BN keys up to its last position double-buffered:
 *   S = Q Kᵀ, P = exp2(S·scale_log2 - L) (causal mask), dP = dO Vᵀ,
 *   dS = P ∘ (dP - D) (BF16 A fragments), dQ += dS K (K by ldmatrix.trans);
 * dQ (F32, multiplied by scale) token-major as the forward's output. */
template <int HD, int BN>
FB_KERNEL(FA_BM / 16 * 32, 2)
k_attn_bwd_dq(const __nv_bfloat16 *__restrict__ qb, const __nv_bfloat16 *__restrict__ kb,
              const __nv_bfloat16 *__restrict__ vb, const __nv_bfloat16 *__restrict__ dob,
              const float *__restrict__ lse, const float *__restrict__ dsum,
              float *__restrict__ dq, int64_t npairs, int T, int nkv, int rep, int nblk,
              float scale_log2, float scale)
{
    using sh = fb_q_shape<HD, BN>;
    constexpr int LD = sh::LD, NT = sh::THREADS;
    FA_SHARED(fb_smem);
    __nv_bfloat16 *sQ = reinterpret_cast<__nv_bfloat16 *>(fb_smem);
    __nv_bfloat16 *sO = sQ + sh::Q_ELEMS;
    __nv_bfloat16 *sK = sO + sh::Q_ELEMS;      /* two buffers */
    __nv_bfloat16 *sV = sK + 2 * sh::KV_ELEMS; /* two buffers */

    const int64_t per_grp = (int64_t)FA_PAIR_GROUP * nblk;
    const int64_t grp = FA_BID / per_grp, idx = FA_BID % per_grp;
    const int64_t np =
        npairs - grp * FA_PAIR_GROUP < FA_PAIR_GROUP ? npairs - grp * FA_PAIR_GROUP : FA_PAIR_GROUP;
    const int64_t pair = grp * FA_PAIR_GROUP + idx % np;
    const int blk = nblk - 1 - (int)(idx / np);
    const int RP = T * rep;
    const int R0 = blk * FA_BM;
    const int tid = FA_TID, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;

    const int last_row = (R0 + FA_BM < RP ? R0 + FA_BM : RP) - 1;
    const int nkb = (last_row / rep) / BN + 1;

    const __nv_bfloat16 *qp = qb + ((size_t)pair * RP + R0) * HD;
    const __nv_bfloat16 *op = dob + ((size_t)pair * RP + R0) * HD;
    const __nv_bfloat16 *kp = kb + (size_t)pair * T * HD;
    const __nv_bfloat16 *vp = vb + (size_t)pair * T * HD;

    const int row_t = tid / (HD / 8), col_t = (tid % (HD / 8)) * 8;
    const uint32_t sK_a = smem_addr(sK), sV_a = smem_addr(sV);
    load_tile<HD, FA_BM, NT>(smem_addr(sQ), qp, RP - R0, row_t, col_t);
    load_tile<HD, FA_BM, NT>(smem_addr(sO), op, RP - R0, row_t, col_t);
    load_tile<HD, BN, NT>(sK_a, kp, T, row_t, col_t);
    load_tile<HD, BN, NT>(sV_a, vp, T, row_t, col_t);
    cp_async_commit();

    const int wrow = R0 + warp * 16;
    const bool active = wrow < RP;
    int pos[2];
    float Lr[2], Dr[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = wrow + g + 8 * h;
        pos[h] = row / rep;
        Lr[h] = row < RP ? lse[(size_t)pair * RP + row] : INFINITY;
        Dr[h] = row < RP ? dsum[(size_t)pair * RP + row] : 0.0f;
    }
    const int wpos_lo = wrow / rep, wpos_hi = (wrow + 15) / rep;

    float acc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
    const int b_off = ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
    const uint32_t q_addr = smem_addr(sQ + warp * 16 * LD + a_off);
    const uint32_t o_addr = smem_addr(sO + warp * 16 * LD + a_off);

    for (int kbi = 0; kbi < nkb; kbi++) {
        const int buf = kbi & 1;
        if (kbi + 1 < nkb) {
            const int k0 = (kbi + 1) * BN;
            const uint32_t bo = (uint32_t)((buf ^ 1) * sh::KV_ELEMS * 2);
            load_tile<HD, BN, NT>(sK_a + bo, kp + (size_t)k0 * HD, T - k0, row_t, col_t);
            load_tile<HD, BN, NT>(sV_a + bo, vp + (size_t)k0 * HD, T - k0, row_t, col_t);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fa_sync();

        const int key0 = kbi * BN;
        if (active && key0 <= wpos_hi) {
            const uint32_t kn = smem_addr(sK + buf * sh::KV_ELEMS + b_off);
            const uint32_t kt = smem_addr(sK + buf * sh::KV_ELEMS + a_off);
            const uint32_t vn = smem_addr(sV + buf * sh::KV_ELEMS + b_off);
            /* S = Q Kᵀ and dP = dO Vᵀ: 16 rows x BN keys */
            float s[BN / 8][4], d[BN / 8][4];
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[j][e] = d[j][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t a0, a1, a2, a3;
                ldsm_x4(q_addr + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
                for (int n2 = 0; n2 < BN / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(kn + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * n2], a0, a1, a2, a3, b0, b1);
                    mma_bf16(s[2 * n2 + 1], a0, a1, a2, a3, b2, b3);
                }
            }
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t a0, a1, a2, a3;
                ldsm_x4(o_addr + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
                for (int n2 = 0; n2 < BN / 16; n2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(vn + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(d[2 * n2], a0, a1, a2, a3, b0, b1);
                    mma_bf16(d[2 * n2 + 1], a0, a1, a2, a3, b2, b3);
                }
            }
            /* P, dS = P ∘ (dP - D) as BF16 A fragments */
            const bool mask = key0 + BN - 1 > wpos_lo;
            uint32_t da[BN / 16][4];
#pragma unroll
            for (int k2 = 0; k2 < BN / 16; k2++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int j = 2 * k2 + hh;
                    float x[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1, key = key0 + j * 8 + 2 * tq + (e & 1);
                        float p = exp2f(s[j][e] * scale_log2 - Lr[h]);
                        if (mask)
                            p = key > pos[h] ? 0.0f : p;
                        x[e] = p * (d[j][e] - Dr[h]);
                    }
                    da[k2][2 * hh] = bf2_bits(__floats2bfloat162_rn(x[0], x[1]));
                    da[k2][2 * hh + 1] = bf2_bits(__floats2bfloat162_rn(x[2], x[3]));
                }
            /* dQ += dS K (B: K rows by ldmatrix.trans) */
#pragma unroll
            for (int n2 = 0; n2 < HD / 16; n2++)
#pragma unroll
                for (int k2 = 0; k2 < BN / 16; k2++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(kt + (k2 * 16 * LD + n2 * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(acc[2 * n2], da[k2][0], da[k2][1], da[k2][2], da[k2][3], b0, b1);
                    mma_bf16(acc[2 * n2 + 1], da[k2][0], da[k2][1], da[k2][2], da[k2][3], b2, b3);
                }
        }
        fa_sync(); /* buffer buf is refilled by the next iteration's prefetch */
    }

    if (!active)
        return;
    const int64_t s_ = pair / nkv, gk = pair % nkv;
    const int64_t qd = (int64_t)nkv * rep * HD;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = wrow + g + 8 * h;
        if (row >= RP)
            continue;
        const int64_t base = (s_ * T + pos[h]) * qd + (gk * rep + row % rep) * HD;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            const int col = j * 8 + 2 * tq;
            *reinterpret_cast<float2 *>(dq + base + col) =
                make_float2(acc[j][2 * h] * scale, acc[j][2 * h + 1] * scale);
        }
    }
}

/* ------------------------------------------------------------ D, dO */

/* One warp per row of q's group-major layout (rows of all pairs, nrows in
 * all): dob[row] = dout's row in BF16, dsum[row] = Σ dout ∘ o (F32, a fixed
 * order: each lane's columns, then the xor-shuffle tree). dout and o are
 * token-major [S*T, nkv*rep*HD]. 8 warps per CTA. */
template <int HD>
FB_KERNEL(256, 4)
k_attn_bwd_prep(const float *__restrict__ o, const float *__restrict__ dout,
                __nv_bfloat16 *__restrict__ dob, float *__restrict__ dsum, int64_t nrows, int T,
                int nkv, int rep)
{
    const int lane = FA_TID & 31;
    const int64_t row = FA_BID * 8 + (FA_TID >> 5);
    if (row >= nrows) /* whole warps */
        return;
    const int64_t RP = (int64_t)T * rep, pair = row / RP, r = row % RP;
    const int64_t s_ = pair / nkv, gk = pair % nkv, pos = r / rep;
    const int64_t src = (s_ * T + pos) * nkv * rep * HD + (gk * rep + r % rep) * HD;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < HD / 64; i++) {
        const int col = i * 64 + 2 * lane;
        const float2 a = *reinterpret_cast<const float2 *>(dout + src + col);
        const float2 b = *reinterpret_cast<const float2 *>(o + src + col);
        sum += a.x * b.x;
        sum += a.y * b.y;
        *reinterpret_cast<__nv_bfloat162 *>(dob + row * HD + col) = __floats2bfloat162_rn(a.x, a.y);
    }
#pragma unroll
    for (int m = 16; m; m >>= 1)
        sum += fa_shfl_xor(sum, m);
    if (lane == 0)
        dsum[row] = sum;
}

#endif /* BK_ATTN_FLASH_BWD_KERNEL_CUH */
