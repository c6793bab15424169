/* CUDA backend — BaKron (paper Alg. 6) as a tile wavefront.
 *
 * The matrix is cut into T x T tiles (T = 64 or 32). Any order of the
 * entries that respects (i,j) <= (p,q) gives the same codes (Theorem 3.2),
 * so the tiles are processed along TILE anti-diagonals K = I + J; the tiles
 * of one K are independent. The rounding value of entry (p, q) is
 *
 *   W~[p,q] = W0[p,q] + sum_{i<=p, j<=q, (i,j)!=(p,q)} L_B[p,i] E[i,j] L_A[q,j]
 *           = W0[p,q] + sum_{i<p} L_B[p,i] R[i,q] + (R[p,q] without E[p,q]),
 *   R[i,q]  = sum_{j<=q} E[i,j] L_A[q,j]                       (R = E L_A^T)
 *
 * Two accumulators carry what crosses tile borders:
 *   W  ("down"):  W[I', J] += L_B[I', I] R^[I, J]   for I' > I
 *   Rp ("right"): Rp[I, J'] += E[I, J] L_A[J', J]^T   for J' > J
 * where R^[I,J] = Rp[I,J] + E[I,J] L_A[J,J]^T is the completed R tile. A
 * contribution from tile (I',J') reaches (I,J) exactly once: through Rp when
 * I' = I, through R^[I',J] (which already holds every J' <= J) when I' < I.
 *
 * Per tile anti-diagonal K, two launches:
 *  1. k_tile_solve, one CTA per tile: the 2T-1 entry anti-diagonals of the
 *     tile in sequence. Each thread keeps, for the entries it owns, X (the
 *     in-row part of R) and Y (W plus the in-tile down part) in registers;
 *     after an entry anti-diagonal is rounded, every owner adds its one new
 *     term to X and to Y (one barrier per entry anti-diagonal). The tile's E
 *     replaces its W tile and R^ (stored transposed) its Rp tile.
 *  2. k_push, one CTA per (tile, target tile): C += A Bt^T with T x T x T
 *     operands in shared memory (right: A = E, Bt = L_A block, C = Rp;
 *     down: A = L_B block, Bt = R^ stored transposed, C = W). Targets of
 *     different tiles of one K are disjoint, so there are no races.
 * Push work is about m n (m + n) / 2 FMA in total (the paper's cubic bound).
 */
#include <algorithm>
#include <cstdio>

#include "cuda_internal.cuh"
#include "quant.cuh"

namespace {

template <typename R> struct TileArgs {
    int64_t m, n;
    R *W;
    int64_t ldw;
    R *Rp;
    int64_t ldr;
    const R *LA;
    int64_t ldla;
    const R *LB; /* NULL: identity */
    int64_t ldlb;
    bk_dq<R> q;
    int16_t *codes;
    float *weight;
    unsigned long long *counts;
};

constexpr unsigned FULL = 0xffffffffu;

/* ------------------------------------------------------------ tile solve */

template <typename R, int T> struct SolveCfg {
    static constexpr int NW = T == 64 ? 16 : 8; /* warps */
    static constexpr int RPT = T / NW;          /* rows per thread (4) */
    static constexpr int CPT = T / 32;          /* columns per thread */
    static constexpr int LS = T + 1;            /* padded stride (row access by lane) */
    static constexpr size_t smem = sizeof(R) * (size_t)(3 * T * LS + T * T);
};

template <typename R, int T>
__global__ void __launch_bounds__(SolveCfg<R, T>::NW * 32)
    k_tile_solve(TileArgs<R> a, int K, int i_lo)
{
    using C = SolveCfg<R, T>;
    constexpr int NW = C::NW, RPT = C::RPT, CPT = C::CPT, LS = C::LS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *LAs = reinterpret_cast<R *>(smem_raw); /* [T][LS] diagonal block of L_A */
    R *LBs = LAs + T * LS;                    /* [T][LS] diagonal block of L_B */
    R *Es = LBs + T * LS;                     /* [T][LS] errors */
    R *Rs = Es + T * LS;                      /* [T][T] completed R (stride T: the
                                                 anti-diagonal reads hit distinct banks) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int I = i_lo + (int)blockIdx.x, J = K - I;
    const int64_t r0 = (int64_t)I * T, c0 = (int64_t)J * T;

    for (int idx = tid; idx < T * T; idx += NW * 32) {
        const int r = idx / T, cc = idx % T;
        LAs[r * LS + cc] = a.LA[(c0 + r) * a.ldla + c0 + cc];
        LBs[r * LS + cc] = a.LB ? a.LB[(r0 + r) * a.ldlb + r0 + cc] : (r == cc ? R(1) : R(0));
    }
    /* entry (p, q) of this thread: p = warp + NW * i, q = lane + 32 * j */
    R x[RPT][CPT], y[RPT][CPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        const int64_t gp = r0 + warp + NW * i;
#pragma unroll
        for (int j = 0; j < CPT; j++) {
            const int64_t gq = c0 + lane + 32 * j;
            y[i][j] = a.W[gp * a.ldw + gq];
            x[i][j] = a.Rp[gp * a.ldr + gq];
        }
    }
    int cnt[3] = {0, 0, 0};
    __syncthreads();

    for (int k = 0; k < 2 * T - 1; k++) {
        /* 1. Round the entries of anti-diagonal k. Each warp owns RPT rows,
         *    hence at most RPT active entries: gather their values into
         *    lanes 0..RPT-1, round there in one pass, scatter back. */
        R wt = R(0);
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            const int q = k - (warp + NW * i);
            if (q >= 0 && q < T) { /* warp-uniform */
                /* selects, not a run-time index: keeps x, y in registers */
                const int js = q >> 5;
                R cand = y[i][0] + x[i][0];
#pragma unroll
                for (int j = 1; j < CPT; j++)
                    cand = js == j ? y[i][j] + x[i][j] : cand;
                const R v = __shfl_sync(FULL, cand, q & 31);
                if (lane == i)
                    wt = v;
            }
        }
        R e = R(0);
        if (lane < RPT) {
            const int p = warp + NW * lane, q = k - p;
            const int64_t gp = r0 + p, gq = c0 + q;
            if (q >= 0 && q < T && gp < a.m && gq < a.n) {
                int16_t code;
                const R v = a.q.round(wt, gp, gq, &code, cnt);
                e = v - wt;
                a.codes[gp * a.n + gq] = code;
                a.weight[gp * a.n + gq] = (float)v;
            }
        }
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            const int p = warp + NW * i, q = k - p;
            if (q >= 0 && q < T) {
                const R ei = __shfl_sync(FULL, e, i);
                if (lane == (q & 31)) {
                    const int js = q >> 5;
                    R xr = R(0);
#pragma unroll
                    for (int j = 0; j < CPT; j++) {
                        const R nx = x[i][j] + ei; /* L_A[q,q] = 1: R[p,q] */
                        x[i][j] = js == j ? nx : x[i][j];
                        xr = js == j ? nx : xr;
                    }
                    Rs[p * T + q] = xr;
                    Es[p * LS + q] = ei;
                }
            }
        }
        __syncthreads();
        /* 2. Every later entry takes its terms from anti-diagonal k:
         *    X[p,q] += E[p,k-p] L_A[q,k-p]  (k-p < q),
         *    Y[p,q] += L_B[p,k-q] R[k-q,q]  (k-q < p).
         *    Anti-diagonal k+1 is written next, so no second barrier. */
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            const int p = warp + NW * i, jj = k - p;
            if (jj >= 0 && jj < T - 1) {
                const R ep = Es[p * LS + jj];
#pragma unroll
                for (int j = 0; j < CPT; j++) {
                    const int q = lane + 32 * j;
                    if (jj < q)
                        x[i][j] += ep * LAs[q * LS + jj];
                }
            }
        }
        if (a.LB) {
#pragma unroll
            for (int j = 0; j < CPT; j++) {
                const int q = lane + 32 * j, ii = k - q;
                if (ii >= 0 && ii < T - 1) {
                    const R rq = Rs[ii * T + q];
#pragma unroll
                    for (int i = 0; i < RPT; i++) {
                        const int p = warp + NW * i;
                        if (ii < p)
                            y[i][j] += LBs[p * LS + ii] * rq;
                    }
                }
            }
        }
    }
    __syncthreads();
    /* E replaces the W tile; R^ (transposed) replaces the Rp tile. */
    for (int idx = tid; idx < T * T; idx += NW * 32) {
        const int r = idx / T, cc = idx % T;
        a.W[(r0 + r) * a.ldw + c0 + cc] = Es[r * LS + cc];
        a.Rp[(r0 + r) * a.ldr + c0 + cc] = Rs[cc * T + r];
    }
    bk_counts_add_warp(a.counts, cnt);
}

/* ------------------------------------------------------------------ push */

template <typename R> struct Vec16;
template <> struct Vec16<float> {
    using type = float4;
};
template <> struct Vec16<double> {
    using type = double2;
};

template <typename R, int T> struct PushCfg {
    static constexpr int TM = T / 16;                  /* outputs per thread per dim */
    static constexpr int VE = 16 / (int)sizeof(R);     /* elements per 16-byte vector */
    static constexpr int S = T + VE;                   /* stride: 16-byte aligned rows,
                                                          rows 16 B apart in banks */
    static constexpr size_t smem = sizeof(R) * (size_t)(2 * T * S);
};

/* C[r][a] += sum_c A[r][c] Bt[a][c] for one (tile, target) pair. Thread
 * (ty, tx) owns rows ty + 16 i and columns tx + 16 j. The eager ("near")
 * pushes of the tiles of diagonal K: right targets J < Jt <= Kf - I, down
 * targets I < It <= Kf - J, i.e. the tiles solved up to the next flush Kf
 * (every target when the pushes are eager). */
template <typename R, int T>
__global__ void __launch_bounds__(256)
    k_push(TileArgs<R> a, int K, int i_lo, int MT, int NT, int Kf)
{
    using P = PushCfg<R, T>;
    constexpr int TM = P::TM, VE = P::VE, S = P::S;
    using V = typename Vec16<R>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *As = reinterpret_cast<R *>(smem_raw);
    R *Bs = As + T * S;
    const int I = i_lo + (int)blockIdx.y, J = K - I;
    const int nright = min(NT - 1, Kf - I) - J;
    const int ndown = min(MT - 1, Kf - J) - I;
    const int t = (int)blockIdx.x;
    const R *Ap, *Bp;
    int64_t lda, ldb, ldc;
    R *Cp;
    if (t < nright) {
        const int Jt = J + 1 + t;
        Ap = a.W + (int64_t)I * T * a.ldw + (int64_t)J * T; /* E tile */
        lda = a.ldw;
        Bp = a.LA + (int64_t)Jt * T * a.ldla + (int64_t)J * T;
        ldb = a.ldla;
        Cp = a.Rp + (int64_t)I * T * a.ldr + (int64_t)Jt * T;
        ldc = a.ldr;
    } else {
        const int It = I + 1 + (t - nright);
        if (!a.LB || t - nright >= ndown)
            return; /* whole block */
        Ap = a.LB + (int64_t)It * T * a.ldlb + (int64_t)I * T;
        lda = a.ldlb;
        Bp = a.Rp + (int64_t)I * T * a.ldr + (int64_t)J * T; /* R^ transposed */
        ldb = a.ldr;
        Cp = a.W + (int64_t)It * T * a.ldw + (int64_t)J * T;
        ldc = a.ldw;
    }
    const int tid = threadIdx.x;
    constexpr int VPR = T / VE; /* vectors per row */
    for (int idx = tid; idx < T * VPR; idx += 256) {
        const int r = idx / VPR, cv = (idx % VPR) * VE;
        *reinterpret_cast<V *>(&As[r * S + cv]) =
            *reinterpret_cast<const V *>(&Ap[(int64_t)r * lda + cv]);
        *reinterpret_cast<V *>(&Bs[r * S + cv]) =
            *reinterpret_cast<const V *>(&Bp[(int64_t)r * ldb + cv]);
    }
    __syncthreads();
    const int tx = tid & 15, ty = tid >> 4;
    R acc[TM][TM];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TM; j++)
            acc[i][j] = R(0);
#pragma unroll 4
    for (int c = 0; c < T; c += VE) {
        R av[TM][VE], bv[TM][VE];
#pragma unroll
        for (int i = 0; i < TM; i++)
            *reinterpret_cast<V *>(av[i]) = *reinterpret_cast<const V *>(&As[(ty + 16 * i) * S + c]);
#pragma unroll
        for (int j = 0; j < TM; j++)
            *reinterpret_cast<V *>(bv[j]) = *reinterpret_cast<const V *>(&Bs[(tx + 16 * j) * S + c]);
#pragma unroll
        for (int u = 0; u < VE; u++)
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TM; j++)
                    acc[i][j] += av[i][u] * bv[j][u];
    }
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TM; j++) {
            R *cp = &Cp[(int64_t)(ty + 16 * i) * ldc + tx + 16 * j];
            *cp += acc[i][j];
        }
}

/* ------------------------------------------------------- tile solve, v2 */

/* The default tile solve. Warp (ab, bb) owns the 32 rows 32 ab + lane and
 * the WC = 16 columns 16 bb .. 16 bb + 15 of the tile; lane p keeps its row's
 * 16 accumulators skewed: register slot s holds column q with
 * (p + q) mod 16 = s. On entry anti-diagonal k every active entry of every
 * lane is therefore in the same slot, k mod 16 (a compile-time index once the
 * k loop is unrolled by 16): one rounding pass per warp, no gathers. The
 * newest error of each row and the newest completed R of each column go
 * through double-buffered shared arrays (one barrier per anti-diagonal).
 * E and R^ (transposed) are written to global memory as they are produced. */
template <typename R, int T> struct Solve2Cfg {
    static constexpr int WC = 16;
    static constexpr int NWC = T / WC;
    static constexpr int NW = (T / 32) * NWC; /* 8 warps for T = 64, 2 for T = 32 */
    static constexpr int LS = T + 1;
    static constexpr size_t smem = sizeof(R) * (size_t)(2 * T * LS + 2 * T * T + 4 * T);
};

template <typename R, int T>
__global__ void __launch_bounds__(Solve2Cfg<R, T>::NW * 32)
    k_tile_solve2(TileArgs<R> a, int K, int i_lo)
{
    using C = Solve2Cfg<R, T>;
    constexpr int WC = C::WC, NWC = C::NWC, NW = C::NW, LS = C::LS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *LAs = reinterpret_cast<R *>(smem_raw); /* [T][LS] */
    R *LBs = LAs + T * LS;                    /* [T][LS] */
    R *Sc = LBs + T * LS;                     /* [T][T] scale of each entry */
    R *Zc = Sc + T * T;                       /* [T][T] zero point of each entry */
    R *Erow = Zc + T * T;                     /* [2][T] newest error of each row */
    R *Rcol = Erow + 2 * T;                   /* [2][T] newest completed R of each column */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ab = warp / NWC, bb = warp % NWC;
    const int I = i_lo + (int)blockIdx.x, J = K - I;
    const int64_t r0 = (int64_t)I * T, c0 = (int64_t)J * T;
    const int p = 32 * ab + lane, qlo = WC * bb;
    const int64_t gp = r0 + p;
    const bool rowin = gp < a.m;

    for (int idx = tid; idx < T * T; idx += NW * 32) {
        const int r = idx / T, cc = idx % T;
        LAs[r * LS + cc] = a.LA[(c0 + r) * a.ldla + c0 + cc];
        LBs[r * LS + cc] = a.LB ? a.LB[(r0 + r) * a.ldlb + r0 + cc] : (r == cc ? R(1) : R(0));
        R sc = R(1), z = R(0);
        const int64_t gr = r0 + r, gc = c0 + cc;
        if (a.q.kind != BK_Q_INTEGER && gr < a.m && gc < a.n) {
            const int64_t gi = gr * a.q.groups + gc / a.q.group;
            sc = a.q.scale[gi];
            if (a.q.zero)
                z = a.q.zero[gi];
        }
        Sc[idx] = sc;
        Zc[idx] = z;
    }
    int qs[WC];
    R x[WC], y[WC];
#pragma unroll
    for (int s = 0; s < WC; s++) {
        qs[s] = qlo + ((s - lane) & (WC - 1));
        x[s] = a.Rp[gp * a.ldr + c0 + qs[s]];
        y[s] = a.W[gp * a.ldw + c0 + qs[s]];
    }
    int cnt[3] = {0, 0, 0};
    __syncthreads();

    for (int k0 = 0; k0 < 2 * T - 1; k0 += WC) {
#pragma unroll
        for (int u = 0; u < WC; u++) {
            const int k = k0 + u;
            if (k >= 2 * T - 1)
                break;
            R *Er = Erow + (u & 1) * T;
            R *Rc = Rcol + (u & 1) * T;
            /* A. the active entry (p, k - p), when this warp owns its column:
             *    it sits in slot u */
            const int q = k - p;
            if (q >= qlo && q < qlo + WC) {
                const R wt = y[u] + x[u];
                R e = R(0);
                const int64_t gq = c0 + q;
                if (rowin && gq < a.n) {
                    int16_t code;
                    const R v = a.q.round_sz(wt, Sc[p * T + q], Zc[p * T + q], &code, cnt);
                    e = v - wt;
                    a.codes[gp * a.n + gq] = code;
                    a.weight[gp * a.n + gq] = (float)v;
                }
                x[u] += e; /* L_A[q,q] = 1: now R[p,q] */
                Er[p] = e;
                Rc[q] = x[u];
                a.W[gp * a.ldw + gq] = e;
                a.Rp[(r0 + q) * a.ldr + c0 + p] = x[u];
            }
            __syncthreads();
            /* B. the terms of anti-diagonal k for every later entry:
             *    X[p,q] += E[p,k-p] L_A[q,k-p] (k-p < q),
             *    Y[p,q] += L_B[p,k-q] R[k-q,q] (k-q < p). */
            const int jj = k - p;
            if (jj >= 0 && jj < T - 1) {
                const R er = Er[p];
#pragma unroll
                for (int s = 0; s < WC; s++)
                    if (jj < qs[s])
                        x[s] += er * LAs[qs[s] * LS + jj];
            }
            if (a.LB) {
#pragma unroll
                for (int s = 0; s < WC; s++) {
                    const int ii = k - qs[s];
                    if (ii >= 0 && ii < p)
                        y[s] += LBs[p * LS + ii] * Rc[qs[s]];
                }
            }
        }
    }
    bk_counts_add_warp(a.counts, cnt);
}

/* ------------------------------------------------------------- far push */

/* The lazy half of the pushes (push_group G > 0): at a flush diagonal Kf the
 * errors of the last G tile anti-diagonals reach every tile beyond them in
 * one product with inner dimension up to G T:
 *   line x < MT (row I):      Rp[I, Jt] += sum_{J in run} E[I,J] L_A[Jt,J]^T
 *   line x >= MT (column J):  W[It, J]  += sum_{I in run} L_B[It,I] R^[I,J]
 * with the run = the tiles of the line on diagonals Kf-G+1 .. Kf and the
 * targets those after it (solved after Kf). blockIdx.y is the absolute
 * target index, so neighbouring CTAs share L_A / L_B blocks in L2. */
template <typename R, int T>
__global__ void __launch_bounds__(256) k_push_far(TileArgs<R> a, int Kf, int G, int MT, int NT)
{
    using P = PushCfg<R, T>;
    constexpr int TM = P::TM, VE = P::VE, S = P::S, VPR = T / VE;
    using V = typename Vec16<R>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *As = reinterpret_cast<R *>(smem_raw);
    R *Bs = As + T * S;
    const int line = (int)blockIdx.x, tgt = (int)blockIdx.y;
    int lo, hi;
    R *Cp;
    int64_t ldc;
    const bool right = line < MT;
    if (right) {
        const int I = line;
        hi = min(NT - 1, Kf - I);
        lo = max(0, Kf - G + 1 - I);
        if (hi < lo || tgt <= hi || tgt >= NT)
            return;
        Cp = a.Rp + (int64_t)I * T * a.ldr + (int64_t)tgt * T;
        ldc = a.ldr;
    } else {
        const int J = line - MT;
        hi = min(MT - 1, Kf - J);
        lo = max(0, Kf - G + 1 - J);
        if (!a.LB || hi < lo || tgt <= hi || tgt >= MT)
            return;
        Cp = a.W + (int64_t)tgt * T * a.ldw + (int64_t)J * T;
        ldc = a.ldw;
    }
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    R acc[TM][TM];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TM; j++)
            acc[i][j] = R(0);
    for (int src = lo; src <= hi; src++) {
        const R *Ap, *Bp;
        int64_t lda, ldb;
        if (right) { /* A = E[I, src], Bt = L_A[tgt, src] */
            Ap = a.W + (int64_t)line * T * a.ldw + (int64_t)src * T;
            lda = a.ldw;
            Bp = a.LA + (int64_t)tgt * T * a.ldla + (int64_t)src * T;
            ldb = a.ldla;
        } else { /* A = L_B[tgt, src], Bt = R^[src, J] (stored transposed) */
            Ap = a.LB + (int64_t)tgt * T * a.ldlb + (int64_t)src * T;
            lda = a.ldlb;
            Bp = a.Rp + (int64_t)src * T * a.ldr + (int64_t)(line - MT) * T;
            ldb = a.ldr;
        }
        for (int idx = tid; idx < T * VPR; idx += 256) {
            const int r = idx / VPR, cv = (idx % VPR) * VE;
            *reinterpret_cast<V *>(&As[r * S + cv]) =
                *reinterpret_cast<const V *>(&Ap[(int64_t)r * lda + cv]);
            *reinterpret_cast<V *>(&Bs[r * S + cv]) =
                *reinterpret_cast<const V *>(&Bp[(int64_t)r * ldb + cv]);
        }
        __syncthreads();
#pragma unroll 4
        for (int c = 0; c < T; c += VE) {
            R av[TM][VE], bv[TM][VE];
#pragma unroll
            for (int i = 0; i < TM; i++)
                *reinterpret_cast<V *>(av[i]) =
                    *reinterpret_cast<const V *>(&As[(ty + 16 * i) * S + c]);
#pragma unroll
            for (int j = 0; j < TM; j++)
                *reinterpret_cast<V *>(bv[j]) =
                    *reinterpret_cast<const V *>(&Bs[(tx + 16 * j) * S + c]);
#pragma unroll
            for (int uu = 0; uu < VE; uu++)
#pragma unroll
                for (int i = 0; i < TM; i++)
#pragma unroll
                    for (int j = 0; j < TM; j++)
                        acc[i][j] += av[i][uu] * bv[j][uu];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TM; j++)
            Cp[(int64_t)(ty + 16 * i) * ldc + tx + 16 * j] += acc[i][j];
}

template <typename R, int T> bk_status run_tiles(bk_cuda_ctx *c, const bk_core_args *a, R *Rp)
{
    using SC = SolveCfg<R, T>;
    using S2 = Solve2Cfg<R, T>;
    using PC = PushCfg<R, T>;
    if (a->mpad % T || a->npad % T)
        return bk_error(BK_ERR_INTERNAL, "bakron: padded size %lldx%lld is not a multiple of %d",
                        (long long)a->mpad, (long long)a->npad, T);
    TileArgs<R> ta;
    ta.m = a->m;
    ta.n = a->n;
    ta.W = static_cast<R *>(a->W);
    ta.ldw = a->ldw;
    ta.Rp = Rp;
    ta.ldr = a->npad;
    ta.LA = static_cast<const R *>(a->LA);
    ta.ldla = a->ldla;
    ta.LB = static_cast<const R *>(a->LB);
    ta.ldlb = a->ldlb;
    ta.q = bk_dq<R>::make(a->q);
    ta.codes = a->codes;
    ta.weight = a->weight;
    ta.counts = a->counts;
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve<R, T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve2<R, T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S2::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push<R, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)PC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push_far<R, T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem));
    const int MT = (int)(a->mpad / T), NT = (int)(a->npad / T);
    const int G = c->push_group > 0 ? c->push_group : 0;
    const int never = MT + NT + 1; /* eager: no flush, every target is near */
    BK_CUDA_CHECK(cudaEventRecord(c->ev_start, c->stream));
    for (int K = 0; K <= MT + NT - 2; K++) {
        const int i_lo = std::max(0, K - (NT - 1)), i_hi = std::min(K, MT - 1);
        const int ntiles = i_hi - i_lo + 1;
        if (c->solve_v1)
            k_tile_solve<R, T><<<ntiles, SC::NW * 32, SC::smem, c->stream>>>(ta, K, i_lo);
        else
            k_tile_solve2<R, T><<<ntiles, S2::NW * 32, S2::smem, c->stream>>>(ta, K, i_lo);
        BK_CUDA_CHECK(cudaGetLastError());
        if (c->skip_push)
            continue;
        const int Kf = G ? (K / G) * G + G - 1 : never;
        int nx = 0;
        for (int I = i_lo; I <= i_hi; I++) {
            const int J = K - I;
            int t = std::min(NT - 1, Kf - I) - J;
            if (ta.LB)
                t += std::min(MT - 1, Kf - J) - I;
            nx = std::max(nx, t);
        }
        if (nx > 0) {
            k_push<R, T><<<dim3(nx, ntiles), 256, PC::smem, c->stream>>>(ta, K, i_lo, MT, NT, Kf);
            BK_CUDA_CHECK(cudaGetLastError());
        }
        if (G && K == Kf && K < MT + NT - 2) {
            const int lines = MT + (ta.LB ? NT : 0), targets = std::max(MT, NT);
            k_push_far<R, T><<<dim3(lines, targets), 256, PC::smem, c->stream>>>(ta, Kf, G, MT,
                                                                                 NT);
            BK_CUDA_CHECK(cudaGetLastError());
        }
    }
    BK_CUDA_CHECK(cudaEventRecord(c->ev_stop, c->stream));
    return BK_OK;
}

template <typename R> bk_status bakron(bk_cuda_ctx *c, const bk_core_args *a)
{
    R *Rp = NULL;
    size_t bytes = sizeof(R) * (size_t)a->mpad * (size_t)a->npad;
    bk_status st = bk_dev_alloc(c, (void **)&Rp, bytes, "bakron: the right accumulator");
    if (st != BK_OK)
        return st;
    if (c->tile == 32)
        st = run_tiles<R, 32>(c, a, Rp);
    else
        st = run_tiles<R, 64>(c, a, Rp);
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "bakron", __FILE__, __LINE__);
    bk_dev_free(c, Rp);
    return st;
}

} // namespace

bk_status bk_cuda_bakron_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return bakron<float>(c, a);
}

bk_status bk_cuda_bakron_f64(bk_cuda_ctx *c, const bk_core_args *a)
{
    return bakron<double>(c, a);
}
