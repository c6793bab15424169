/* CUDA backend — BaKron (paper Alg. 6) as a tile wavefront: the kernels and
 * their launch sequence, templated on the real type R. Included by
 * bakron_f32.cu and bakron_f64.cu, which instantiate one R each: two
 * translation units that nvcc compiles in parallel (the float and double
 * instantiations of every kernel in one file made it the build's critical
 * path, ~200 s; the kernels themselves are unchanged).
 *
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
 * With push groups (c->push_group = G > 0) the near pushes only reach the
 * tiles up to the next flush diagonal Kf; at Kf, k_push_far carries the last
 * G diagonals' errors to every later tile in one product per target. With
 * c->overlap, only the targets of the next G diagonals are done then; the
 * rest runs on a low-priority side stream while those G diagonals are
 * solved (events order it before the next flush, which writes the same
 * tiles, and before the end).
 */
#ifndef BK_CUDA_BAKRON_IMPL_CUH
#define BK_CUDA_BAKRON_IMPL_CUH

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


/* ------------------------------------------------------------------ push */

template <typename R> struct Vec16;
template <> struct Vec16<float> {
    using type = float4;
};
template <> struct Vec16<double> {
    using type = double2;
};

template <typename R, int T> struct PushCfg {
    static constexpr int TH = sizeof(R) == 4 ? 8 : 16; /* threads per dimension; each
                                                          owns (T / QD / TH)^2 outputs */
    static constexpr int NTH = TH * TH;                /* 64 (fp32) or 256 (fp64) */
    static constexpr int VE = 16 / (int)sizeof(R);     /* elements per 16-byte vector */
    static constexpr int S = T + VE;                   /* stride: 16-byte aligned rows,
                                                          rows 16 B apart in banks */
    static constexpr size_t smem = sizeof(R) * (size_t)(2 * T * S);
};

/* Copy the T x T operands A and Bt into shared memory (rows S apart) in
 * batches: all global loads of a batch are issued before its shared stores,
 * so that their latencies overlap (a loop alternating the two serializes
 * them). Used by the pushes on the critical path (near, and the flush's
 * next-run part); the overlapped far push keeps its plain loop (the batch
 * registers would cost it occupancy). */
/* 16-byte asynchronous copies global -> shared (sm_80+): every load of a
 * tile in flight at once with no registers held for it. */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all()
{
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

template <typename R, int T, int ROWS = T>
__device__ __forceinline__ void load_pair_batched(R *As, R *Bs, const R *Ap, int64_t lda,
                                                  const R *Bp, int64_t ldb, int tid)
{
    using P = PushCfg<R, T>;
    using V = typename Vec16<R>::type;
    constexpr int VE = P::VE, S = P::S, NTH = P::NTH, VPR = T / VE, IT = ROWS * VPR / NTH;
    static_assert(ROWS * VPR % NTH == 0, "load rows");
    constexpr int BT = IT < 8 ? IT : 8;
    static_assert(IT % BT == 0, "load batches");
#pragma unroll
    for (int b0 = 0; b0 < IT; b0 += BT) {
        V ra[BT], rb[BT];
#pragma unroll
        for (int t = 0; t < BT; t++) {
            const int idx = tid + NTH * (b0 + t), r = idx / VPR, cv = (idx % VPR) * VE;
            ra[t] = *reinterpret_cast<const V *>(&Ap[(int64_t)r * lda + cv]);
            rb[t] = *reinterpret_cast<const V *>(&Bp[(int64_t)r * ldb + cv]);
        }
#pragma unroll
        for (int t = 0; t < BT; t++) {
            const int idx = tid + NTH * (b0 + t), r = idx / VPR, cv = (idx % VPR) * VE;
            *reinterpret_cast<V *>(&As[r * S + cv]) = ra[t];
            *reinterpret_cast<V *>(&Bs[r * S + cv]) = rb[t];
        }
    }
}

/* acc[i][j] += sum over c < T of As[ty + TH i][c] Bs[tx + TH j][c]: the
 * register-tile product of the push kernels (As, Bs in shared memory, rows S
 * apart, read VE elements at a time as V). A macro, not a function: the
 * kernels compile to exactly the code they had with the loop written out
 * (an inlined function reorders the accumulators' registers). Uses R, V, T,
 * TM, VE, S, TH, As, Bs, tx, ty and acc of the kernel. */
#define BK_TILE_MAC()                                                                              \
    _Pragma("unroll 4") for (int c = 0; c < T; c += VE)                                            \
    {                                                                                              \
        R av[TM][VE], bv[TM][VE];                                                                  \
        _Pragma("unroll") for (int i = 0; i < TM; i++) *reinterpret_cast<V *>(av[i]) =             \
            *reinterpret_cast<const V *>(&As[(ty + TH * i) * S + c]);                              \
        _Pragma("unroll") for (int j = 0; j < TM; j++) *reinterpret_cast<V *>(bv[j]) =             \
            *reinterpret_cast<const V *>(&Bs[(tx + TH * j) * S + c]);                              \
        _Pragma("unroll") for (int u = 0; u < VE; u++)                                             \
            _Pragma("unroll") for (int i = 0; i < TM; i++)                                         \
                _Pragma("unroll") for (int j = 0; j < TM; j++) acc[i][j] += av[i][u] * bv[j][u];   \
    }

/* The same product on tensor cores for R = float (c->push_mma): 3xTF32
 * mma.sync.m16n8k8 with fp32 accumulation. Each operand x is split into
 * hi = tf32(x) and lo = tf32(x - hi) (x - hi is exact in fp32) and
 *   acc += a_lo b_hi + a_hi b_lo + a_hi b_hi
 * (the small terms first; a_lo b_lo, ~2^-22 relative, is dropped): close to,
 * not bit-equal with, the FFMA product, so fp32 codes may differ from the
 * FFMA path in a few entries. fp64 solves never take this path. The CTA's
 * two warps (PushCfg<float, T>::NTH = 64) own QR / 2 rows each of the
 * QR x QR output: QR / 32 m-tiles by QR / 8 n-tiles of 16 x 8. Fragments come
 * straight from the S-strided operands (S = T + 4: rows 4 banks apart, the
 * 8 x 4 lanes of a fragment load hit 32 distinct banks). */
template <int QR> struct MmaShape {
    static_assert(QR % 32 == 0, "mma pushes need parts of at least 32 rows");
    static constexpr int WM = QR / 2, MI = QR / 32, NJ = QR / 8;
};

__device__ __forceinline__ void tf32_split(float x, unsigned &hi, unsigned &lo)
{
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
    const float r = x - __uint_as_float(hi);
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(r));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2])
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* acc[i][j] (16 x 8 fragment: rows WM warp + 16 i + g (+ 8), columns 8 j +
 * 2 t (+ 1), g = lane / 4, t = lane % 4) += As Bs^T over c < T */
template <int T, int QR>
__device__ __forceinline__ void mma_mac(const float *As, const float *Bs,
                                        float (&acc)[MmaShape<QR>::MI][MmaShape<QR>::NJ][4],
                                        int warp, int lane)
{
    using M = MmaShape<QR>;
    constexpr int S = PushCfg<float, T>::S, MI = M::MI, NJ = M::NJ;
    const int g = lane >> 2, t = lane & 3;
    const float *Aw = As + (warp * M::WM + g) * S + t;
    const float *Bw = Bs + g * S + t;
#pragma unroll 2
    for (int kk = 0; kk < T; kk += 8) {
        unsigned ah[MI][4], al[MI][4];
#pragma unroll
        for (int i = 0; i < MI; i++) {
            const float *ap = Aw + 16 * i * S + kk;
            tf32_split(ap[0], ah[i][0], al[i][0]);
            tf32_split(ap[8 * S], ah[i][1], al[i][1]);
            tf32_split(ap[4], ah[i][2], al[i][2]);
            tf32_split(ap[8 * S + 4], ah[i][3], al[i][3]);
        }
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            unsigned bh[2], bl[2];
            const float *bp = Bw + 8 * j * S + kk;
            tf32_split(bp[0], bh[0], bl[0]);
            tf32_split(bp[4], bh[1], bl[1]);
#pragma unroll
            for (int i = 0; i < MI; i++) {
                mma_tf32(acc[i][j], al[i], bh);
                mma_tf32(acc[i][j], ah[i], bl);
                mma_tf32(acc[i][j], ah[i], bh);
            }
        }
    }
}

template <int QR>
__device__ __forceinline__ void mma_zero(float (&acc)[MmaShape<QR>::MI][MmaShape<QR>::NJ][4])
{
#pragma unroll
    for (int i = 0; i < MmaShape<QR>::MI; i++)
#pragma unroll
        for (int j = 0; j < MmaShape<QR>::NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[i][j][e] = 0.0f;
}

/* C += acc (Cp: the CTA's QR x QR part, rows ldc apart; 8-byte aligned) */
template <int QR>
__device__ __forceinline__ void mma_store(float *Cp, int64_t ldc,
                                          const float (&acc)[MmaShape<QR>::MI][MmaShape<QR>::NJ][4],
                                          int warp, int lane)
{
    using M = MmaShape<QR>;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < M::MI; i++)
#pragma unroll
        for (int j = 0; j < M::NJ; j++) {
            float2 *c0 = reinterpret_cast<float2 *>(
                Cp + (int64_t)(warp * M::WM + 16 * i + g) * ldc + 8 * j + 2 * t);
            float2 *c1 = reinterpret_cast<float2 *>(reinterpret_cast<float *>(c0) + 8 * ldc);
            float2 v0 = *c0, v1 = *c1;
            v0.x += acc[i][j][0];
            v0.y += acc[i][j][1];
            v1.x += acc[i][j][2];
            v1.y += acc[i][j][3];
            *c0 = v0;
            *c1 = v1;
        }
}

/* the mma path exists for fp32 and parts of >= 32 rows */
template <typename R, int QR> constexpr bool mma_ok()
{
    return sizeof(R) == 4 && QR % 32 == 0;
}

/* C[r][a] += sum_c A[r][c] Bt[a][c] for one (tile, target) pair. Thread
 * (ty, tx) owns rows ty + TH i and columns tx + TH j. The eager ("near")
 * pushes of the tiles of diagonal K: right targets J < Jt <= Kf - I, down
 * targets I < It <= Kf - J, i.e. the tiles solved up to the next flush Kf
 * (every target when the pushes are eager). QD = 2: the target tile in
 * QD x QD parts, one per CTA (blockIdx.z): a quarter of the latency on the
 * critical path, for more CTAs and loads. */
template <typename R, int T, int QD = 1, bool MMA = false>
__global__ void __launch_bounds__(PushCfg<R, T>::NTH)
    k_push(TileArgs<R> a, int K, int i_lo, int MT, int NT, int Kf)
{
    using P = PushCfg<R, T>;
    constexpr int QR = T / QD, TM = QR / P::TH, VE = P::VE, S = P::S, TH = P::TH;
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
    if (QD > 1) { /* this CTA's part: rows of A, rows of Bt (columns of C) */
        const int qr = (int)blockIdx.z / QD, qc = (int)blockIdx.z % QD;
        Ap += (int64_t)qr * QR * lda;
        Bp += (int64_t)qc * QR * ldb;
        Cp += (int64_t)qr * QR * ldc + qc * QR;
    }
    const int tid = threadIdx.x;
    load_pair_batched<R, T, QR>(As, Bs, Ap, lda, Bp, ldb, tid);
    __syncthreads();
    if constexpr (MMA) {
        static_assert(mma_ok<R, QR>(), "mma pushes: fp32, parts of >= 32 rows");
        float macc[MmaShape<QR>::MI][MmaShape<QR>::NJ][4];
        mma_zero<QR>(macc);
        mma_mac<T, QR>(As, Bs, macc, tid >> 5, tid & 31);
        mma_store<QR>(Cp, ldc, macc, tid >> 5, tid & 31);
        return;
    }
    const int tx = tid % TH, ty = tid / TH;
    R acc[TM][TM];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TM; j++)
            acc[i][j] = R(0);
    BK_TILE_MAC();
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TM; j++) {
            R *cp = &Cp[(int64_t)(ty + TH * i) * ldc + tx + TH * j];
            *cp += acc[i][j];
        }
}

/* ------------------------------------------------------- tile solve, v3 */

/* Warp (ab, bb) owns the 32 rows 32 ab + lane and the WC columns WC bb ..
 * WC bb + WC - 1 of the tile; lane p keeps its row's WC accumulators skewed:
 * register slot s holds column q with (p + q) mod WC = s. On entry
 * anti-diagonal k every active entry of every lane is therefore in the same
 * slot (a compile-time index once the k loop is unrolled): one rounding pass
 * per warp, no gathers. The newest error of each row and the newest completed
 * R of each column go through double-buffered shared arrays (one barrier per
 * anti-diagonal).
 *
 * Compared with the previous version (v2, removed; in git history and
 * cuda/dev/NOTES.md), a shorter path per entry anti-diagonal: the scale and zero of
 * each slot in registers; the diagonals of the L_A / L_B blocks zeroed in
 * shared memory and L_B's rows padded with zeros on both sides, so that the
 * terms need no predicates (a zero factor stands for "not yet" or "not this
 * one"); the factors of a step are loaded before its barrier. Above all,
 * every global access is a coalesced tile copy: the accumulators come in and
 * the codes, weights, E and R^ go out through shared memory (v2 stored four
 * scattered words per active lane and step, ~1000 L1 transactions per step
 * and SM: that, not the arithmetic, bounded it). */
template <typename R, int T, int WC_, int V = 0> struct Solve3Cfg {
    static constexpr int WC = WC_; /* columns (register slots) per warp: 8 or 16 */
    static constexpr int NWC = T / WC;
    static constexpr int NW = (T / 32) * NWC;
    /* V = 0: L_A rows T + 1 apart, L_B rows 3T + 1 apart. With the skew, both
     * factor loads of a step are 2-way bank conflicted (fp32: the 32 lanes hit
     * 16 banks; fp64: 4 wavefronts instead of 2). V >= 1 (session 14, branch
     * chain): L_A rows T + 2 apart, L_B rows 3T apart plus 16 more for rows
     * with bit 4 set: conflict-free for WC = 16 (T = 32 and 64, fp32 and fp64;
     * checked by enumerating every lane, slot and step) */
    static constexpr int LS = V ? T + 2 : T + 1; /* L_A rows */
    static constexpr int LBS = V ? 3 * T : 3 * T + 1; /* L_B rows: T zeros | T values | T zeros */
    static constexpr int LBX = V ? 16 : 0;            /* L_B: extra elements at the end */
    __host__ __device__ static constexpr int lb_row(int p)
    {
        return p * LBS + (V && (p & 16) ? 16 : 0);
    }
    /* LA, LB, E [p][q], R^T [q][p], weight (F32) [p][q], codes (int16) [p][q],
     * the two newest-value buffers */
    static constexpr size_t smem = sizeof(R) * (size_t)(T * LS + T * LBS + LBX + 2 * T * T + 4 * T) +
                                   sizeof(float) * T * T + sizeof(int16_t) * T * T +
                                   sizeof(int) * T;
};

/* KIND: the quantizer kind (compile-time: the rounding is branch-free, see
 * bk_round_bf). The loads are batched: every global load of a batch is
 * issued before its shared stores, so their latencies overlap.
 *
 * V (c->solve_chain): the layout and schedule of the step chain, never its
 * arithmetic:
 *   0  as described above (the session-14 default);
 *   1  (default since session 19) conflict-free factor layouts (Solve3Cfg,
 *      session 14: the 2 x 16 factor loads of a step take 32 shared wavefronts
 *      per warp instead of 64 in fp32) and the critical slot first (session
 *      18): after the barrier of step k a lane first adds step k's terms to
 *      the one slot whose entry is active at step k + 1, rounds that entry and
 *      publishes its E and R (the other buffer), and only then adds step k's
 *      terms to its other WC - 1 slots; one barrier per step as in 0. The
 *      rounding of step k + 1 no longer waits behind the other slots' loads
 *      and FMAs (H200, session 19: 5% off 8192^2, 3% off 4096^2).
 * Each register gets the same terms in the same order in both (the critical
 * slot's step-k term is added before its step-k+1 rounding, the others'
 * before their own), so the codes are the same bit for bit. With WC = 8 (16
 * warps a 64-tile: twice the warps to hide the step's dependent chain, which
 * the session-19 stall profile of WC = 16 points at) V = 1 is a dev variant,
 * not yet measured; the layout was made conflict-free for WC = 16. (Removed in
 * session 19 after their measurements: the factors a step ahead, and a
 * straight-line rounding in the critical-slot schedule; both slower.) */
template <typename R, int T, int WC_, int KIND, int V = 0>
__global__ void __launch_bounds__(Solve3Cfg<R, T, WC_, V>::NW * 32)
    k_tile_solve3(TileArgs<R> a, int K, int i_lo)
{
    using C = Solve3Cfg<R, T, WC_, V>;
    constexpr int WC = C::WC, NWC = C::NWC, NW = C::NW, LS = C::LS, LBS = C::LBS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *LAs = reinterpret_cast<R *>(smem_raw); /* [T][LS], strict lower part only */
    R *LBs = LAs + T * LS;                    /* [T][LBS], strict lower part at offset T */
    R *Erow = LBs + T * LBS + C::LBX;         /* [2][T] */
    R *Rcol = Erow + 2 * T;                   /* [2][T] */
    R *Es = Rcol + 2 * T;                     /* [T][T] E by rows; first W in */
    R *Rt = Es + T * T;                       /* [T][T] R^ by columns; first Rp in */
    float *Ws = reinterpret_cast<float *>(Rt + T * T);  /* [T][T] weights */
    int16_t *Cs = reinterpret_cast<int16_t *>(Ws + T * T); /* [T][T] codes */
    int *Grp = reinterpret_cast<int *>(Cs + T * T);        /* [T] group of each column */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ab = warp / NWC, bb = warp % NWC;
    const int I = i_lo + (int)blockIdx.x, J = K - I;
    const int64_t r0 = (int64_t)I * T, c0 = (int64_t)J * T;
    const int p = 32 * ab + lane, qlo = WC * bb;
    const int64_t gp = r0 + p;
    const bool rowin = gp < a.m;
    const bool hasb = a.LB != nullptr;

    constexpr int NTH = NW * 32;
    if (hasb) /* the zero padding of L_B's rows (the loads below fill the middle) */
        for (int idx = tid; idx < T * 2 * T; idx += NTH) {
            const int r = idx / (2 * T), cz = idx % (2 * T);
            LBs[C::lb_row(r) + (cz < T ? cz : cz + T)] = R(0);
        }
    for (int idx = tid; idx < 4 * T; idx += NTH)
        Erow[idx] = R(0);
    if (tid < T)
        Grp[tid] = (int)((c0 + tid) / a.q.group);
    {   /* coalesced tile loads: a fixed column per thread, batches of rows */
        static_assert(NTH % T == 0 && (T / (NTH / T)) % 8 == 0, "load batches");
        constexpr int RSTEP = NTH / T, NR = T / RSTEP, RB = 8;
        const int cc = tid % T, rbase = tid / T;
#pragma unroll 1
        for (int t0 = 0; t0 < NR; t0 += RB) {
            R wv[RB], rv[RB], lav[RB], lbv[RB];
#pragma unroll
            for (int t = 0; t < RB; t++) {
                const int r = rbase + RSTEP * (t0 + t);
                wv[t] = a.W[(r0 + r) * a.ldw + c0 + cc];
                rv[t] = a.Rp[(r0 + r) * a.ldr + c0 + cc];
                lav[t] = cc < r ? a.LA[(c0 + r) * a.ldla + c0 + cc] : R(0);
                lbv[t] = hasb && cc < r ? a.LB[(r0 + r) * a.ldlb + r0 + cc] : R(0);
            }
#pragma unroll
            for (int t = 0; t < RB; t++) {
                const int r = rbase + RSTEP * (t0 + t);
                Es[r * T + cc] = wv[t];
                Rt[r * T + cc] = rv[t];
                LAs[r * LS + cc] = lav[t];
                if (hasb)
                    LBs[C::lb_row(r) + T + cc] = lbv[t];
            }
        }
    }
    __syncthreads();
    int qs[WC], qa[WC];
    R x[WC], y[WC], sc[WC], zc[WC];
#pragma unroll
    for (int s = 0; s < WC; s++) {
        qs[s] = qlo + ((s - lane) & (WC - 1));
        qa[s] = qs[s] * LS;
        x[s] = Rt[p * T + qs[s]];
        y[s] = Es[p * T + qs[s]];
        const int64_t gq = c0 + qs[s];
        sc[s] = R(1);
        zc[s] = R(0);
        if (KIND != BK_Q_INTEGER && rowin && gq < a.n) {
            const int64_t gi = gp * a.q.groups + Grp[qs[s]];
            sc[s] = a.q.scale[gi];
            if (a.q.zero)
                zc[s] = a.q.zero[gi];
        }
    }
    int cnt[3] = {0, 0, 0};
    __syncthreads();

    /* The step loop is unrolled by WC so that the active slot u is a
     * compile-time register index (a rolled loop with a select chain was
     * 1.5-2x slower on the H200). */
    const R *lbrow = LBs + C::lb_row(p) + T; /* L_B[p, i] at lbrow[i] */
    /* the factors of step k: la[s] = L_A[q_s, k - p] (where that is a real
     * term), lb[s] = L_B[p, k - q_s] (zero padding elsewhere) */
    auto load_factors = [&](int k, R(&fa)[WC], R(&fb)[WC]) {
        const int j = k - p;
        if (j >= 0 && j < T - 1) {
#pragma unroll
            for (int s = 0; s < WC; s++)
                fa[s] = LAs[qa[s] + j];
        }
        if (hasb) {
            const R *lbr = lbrow + k;
#pragma unroll
            for (int s = 0; s < WC; s++)
                fb[s] = lbr[-qs[s]];
        }
    };
    /* the active entry (p, k - p) of step k, in slot u (when this lane's
     * columns hold it): rounded, its error and R value into the buffers Er /
     * Rc of step k and the tile */
    auto active = [&](int k, int u, R *Er, R *Rc) {
        const int q = k - p;
        if (q < qlo || q >= qlo + WC)
            return;
        const R wt = y[u] + x[u];
        int ci = 0, fl = 0;
        R v = bk_round_bf<KIND, R>(wt, sc[u], zc[u], R(a.q.qmin), R(a.q.qmax), &ci, &fl);
        const bool real = rowin && c0 + q < a.n;
        if (real) {
            cnt[0] += fl & 1;
            cnt[1] += (fl >> 1) & 1;
            cnt[2] += (fl >> 2) & 1;
        }
        v = real ? v : R(0);
        const int16_t code = real ? (int16_t)ci : (int16_t)0;
        const R e = real ? v - wt : R(0);
        x[u] += e;
        Er[p] = e;
        Rc[q] = x[u];
        Es[p * T + q] = e;    /* stride T-1 along the lanes: no conflicts */
        Rt[q * T + p] = x[u]; /* stride 1-T */
        Ws[p * T + q] = (float)v;
        Cs[p * T + q] = code;
    };
    if constexpr (V == 1) {
        active(0, 0, Erow, Rcol);
        __syncthreads();
        for (int k0 = 0; k0 < 2 * T - 1; k0 += WC) {
#pragma unroll
            for (int u = 0; u < WC; u++) {
                const int k = k0 + u;
                if (k >= 2 * T - 1)
                    break;
                const int un = (u + 1) & (WC - 1); /* the slot active at step k + 1 */
                const R *Er = Erow + (u & 1) * T;
                const R *Rc = Rcol + (u & 1) * T;
                const int jj = k - p;
                const bool xon = jj >= 0 && jj < T - 1;
                const R *lbr = lbrow + k;
                const R er = xon ? Er[p] : R(0);
                /* step k's terms of slot un, then the rounding of step k + 1 */
                if (xon)
                    x[un] += er * LAs[qa[un] + jj];
                if (hasb)
                    y[un] += lbr[-qs[un]] * Rc[qs[un]];
                if (k + 1 < 2 * T - 1)
                    active(k + 1, un, Erow + ((u + 1) & 1) * T, Rcol + ((u + 1) & 1) * T);
                /* step k's terms of the other slots */
                if (xon) {
#pragma unroll
                    for (int s = 0; s < WC; s++)
                        if (s != un)
                            x[s] += er * LAs[qa[s] + jj];
                }
                if (hasb) {
#pragma unroll
                    for (int s = 0; s < WC; s++)
                        if (s != un)
                            y[s] += lbr[-qs[s]] * Rc[qs[s]];
                }
                __syncthreads();
            }
        }
    } else {
        for (int k0 = 0; k0 < 2 * T - 1; k0 += WC) {
#pragma unroll
            for (int u = 0; u < WC; u++) {
                const int k = k0 + u;
                if (k >= 2 * T - 1)
                    break;
                R *Er = Erow + (u & 1) * T;
                R *Rc = Rcol + (u & 1) * T;
                const int jj = k - p;
                const bool xon = jj >= 0 && jj < T - 1;
                /* factors of this step, loaded ahead of the barrier */
                R la[WC], lb[WC];
                load_factors(k, la, lb);
                /* A. the active entry (p, k - p) sits in slot u */
                active(k, u, Er, Rc);
                __syncthreads();
                /* B. X[p,q] += E[p,k-p] L_A[q,k-p], Y[p,q] += L_B[p,k-q] R[k-q,q] */
                if (xon) {
                    const R er = Er[p];
#pragma unroll
                    for (int s = 0; s < WC; s++)
                        x[s] += er * la[s];
                }
                if (hasb) {
#pragma unroll
                    for (int s = 0; s < WC; s++)
                        y[s] += lb[s] * Rc[qs[s]];
                }
            }
        }
    }
    __syncthreads();
    /* coalesced tile stores: E over the W tile, R^ transposed over the Rp
     * tile (what the pushes read), codes and weights inside the matrix */
    for (int idx = tid; idx < T * T; idx += NW * 32) {
        const int r = idx / T, cc = idx % T;
        a.W[(r0 + r) * a.ldw + c0 + cc] = Es[idx];
        a.Rp[(r0 + r) * a.ldr + c0 + cc] = Rt[idx];
        if (r0 + r < a.m && c0 + cc < a.n) {
            a.codes[(r0 + r) * a.n + c0 + cc] = Cs[idx];
            a.weight[(r0 + r) * a.n + c0 + cc] = Ws[idx];
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
template <typename R, int T, bool BATCH = false, int QD = 1, bool ASYNC = false, bool MMA = false>
__global__ void __launch_bounds__(PushCfg<R, T>::NTH)
    k_push_far(TileArgs<R> a, int Kf, int G, int MT, int NT, int mode)
{
    using P = PushCfg<R, T>;
    constexpr int QR = T / QD, TM = QR / P::TH, VE = P::VE, S = P::S, VPR = T / VE, TH = P::TH,
                  NTH = P::NTH;
    static_assert(QD == 1 || BATCH, "parts need the batched loads");
    using V = typename Vec16<R>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *As = reinterpret_cast<R *>(smem_raw);
    R *Bs = As + T * S;
    /* mode 0: every target after the run (blockIdx.y = target); 1: the
     * targets on diagonals Kf+1 .. Kf+G (blockIdx.y = diagonal - Kf - 1);
     * 2: the targets beyond diagonal Kf+G (the overlapped part) */
    const int line = (int)blockIdx.x;
    const int lidx = line < MT ? line : line - MT;
    /* mode 3: the targets on diagonals Kf+G+1 .. Kf+2G (blockIdx.y = diagonal
     * - Kf - G - 1); 4: those beyond Kf+2G (c->side_band: the overlapped part
     * in two launches, the nearer band first) */
    const int tgt = mode == 1   ? Kf + 1 - lidx + (int)blockIdx.y
                    : mode == 3 ? Kf + G + 1 - lidx + (int)blockIdx.y
                                : (int)blockIdx.y;
    if ((mode == 2 && lidx + tgt <= Kf + G) || (mode == 4 && lidx + tgt <= Kf + 2 * G))
        return;
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
    const int tid = threadIdx.x, tx = tid % TH, ty = tid / TH;
    const int qr = QD > 1 ? (int)blockIdx.z / QD : 0, qc = QD > 1 ? (int)blockIdx.z % QD : 0;
    if (QD > 1)
        Cp += (int64_t)qr * QR * ldc + qc * QR;
    static_assert(!MMA || mma_ok<R, QR>(), "mma pushes: fp32, parts of >= 32 rows");
    constexpr int MQ = MMA ? QR : 32; /* the mma accumulators (unused without MMA) */
    float macc[MmaShape<MQ>::MI][MmaShape<MQ>::NJ][4];
    R acc[TM][TM];
    if constexpr (MMA)
        mma_zero<MQ>(macc);
    else {
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < TM; j++)
                acc[i][j] = R(0);
    }
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
        if constexpr (BATCH) /* the next run's part: on the critical path */
            load_pair_batched<R, T, QR>(As, Bs, Ap + (int64_t)qr * QR * lda, lda,
                                        Bp + (int64_t)qc * QR * ldb, ldb, tid);
        else if constexpr (ASYNC) {
            for (int idx = tid; idx < T * VPR; idx += NTH) {
                const int r = idx / VPR, cv = (idx % VPR) * VE;
                cp_async16(&As[r * S + cv], &Ap[(int64_t)r * lda + cv]);
                cp_async16(&Bs[r * S + cv], &Bp[(int64_t)r * ldb + cv]);
            }
            cp_async_wait_all();
        } else
            for (int idx = tid; idx < T * VPR; idx += NTH) {
                const int r = idx / VPR, cv = (idx % VPR) * VE;
                *reinterpret_cast<V *>(&As[r * S + cv]) =
                    *reinterpret_cast<const V *>(&Ap[(int64_t)r * lda + cv]);
                *reinterpret_cast<V *>(&Bs[r * S + cv]) =
                    *reinterpret_cast<const V *>(&Bp[(int64_t)r * ldb + cv]);
            }
        __syncthreads();
        if constexpr (MMA)
            mma_mac<T, MQ>(As, Bs, macc, tid >> 5, tid & 31);
        else
            BK_TILE_MAC();
        __syncthreads();
    }
    if constexpr (MMA)
        mma_store<MQ>(Cp, ldc, macc, tid >> 5, tid & 31);
    else {
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < TM; j++)
                Cp[(int64_t)(ty + TH * i) * ldc + tx + TH * j] += acc[i][j];
    }
}

template <typename R, int T, int WC, int V = 0>
void launch_solve3(const TileArgs<R> &ta, int K, int i_lo, int ntiles, cudaStream_t st)
{
    using S = Solve3Cfg<R, T, WC, V>;
    if (ta.q.kind == BK_Q_LEVELS)
        k_tile_solve3<R, T, WC, BK_Q_LEVELS, V><<<ntiles, S::NW * 32, S::smem, st>>>(ta, K, i_lo);
    else if (ta.q.kind == BK_Q_UNIFORM)
        k_tile_solve3<R, T, WC, BK_Q_UNIFORM, V><<<ntiles, S::NW * 32, S::smem, st>>>(ta, K, i_lo);
    else
        k_tile_solve3<R, T, WC, BK_Q_INTEGER, V><<<ntiles, S::NW * 32, S::smem, st>>>(ta, K, i_lo);
}

/* the shared-memory limit of the tile solves of one (WC, V) */
template <typename R, int T, int WC, int V = 0> cudaError_t solve3_attrs()
{
    const int sm = (int)Solve3Cfg<R, T, WC, V>::smem;
    cudaError_t e = cudaFuncSetAttribute(k_tile_solve3<R, T, WC, BK_Q_LEVELS, V>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_tile_solve3<R, T, WC, BK_Q_UNIFORM, V>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_tile_solve3<R, T, WC, BK_Q_INTEGER, V>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
    return e;
}

/* the far push off the critical path (modes 0, 2, 3, 4); on tensor cores
 * with c->push_mma >= 1 (fp32) */
template <typename R, int T>
void launch_far(const bk_cuda_ctx *c, const TileArgs<R> &ta, dim3 grid, cudaStream_t st, int Kf,
                int G, int MT, int NT, int mode)
{
    using PC = PushCfg<R, T>;
    if constexpr (mma_ok<R, T>())
        if (c->push_mma >= 1) {
            if (c->far_async)
                k_push_far<R, T, false, 1, true, true><<<grid, PC::NTH, PC::smem, st>>>(
                    ta, Kf, G, MT, NT, mode);
            else
                k_push_far<R, T, false, 1, false, true><<<grid, PC::NTH, PC::smem, st>>>(
                    ta, Kf, G, MT, NT, mode);
            return;
        }
    if (c->far_async)
        k_push_far<R, T, false, 1, true><<<grid, PC::NTH, PC::smem, st>>>(ta, Kf, G, MT, NT, mode);
    else
        k_push_far<R, T><<<grid, PC::NTH, PC::smem, st>>>(ta, Kf, G, MT, NT, mode);
}

/* the critical-path pushes (near: k_push; the flush's next-run part:
 * k_push_far mode 1), split QD x QD; on tensor cores with c->push_mma == 2
 * where a part has >= 32 rows (fp32; else the FFMA kernels) */
template <typename R, int T, int QD>
void launch_near(const bk_cuda_ctx *c, const TileArgs<R> &ta, dim3 grid, cudaStream_t st, int K,
                 int i_lo, int MT, int NT, int Kf)
{
    using PC = PushCfg<R, T>;
    if constexpr (mma_ok<R, T / QD>())
        if (c->push_mma == 2) {
            k_push<R, T, QD, true><<<grid, PC::NTH, PC::smem, st>>>(ta, K, i_lo, MT, NT, Kf);
            return;
        }
    k_push<R, T, QD><<<grid, PC::NTH, PC::smem, st>>>(ta, K, i_lo, MT, NT, Kf);
}

template <typename R, int T, int QD>
void launch_next(const bk_cuda_ctx *c, const TileArgs<R> &ta, dim3 grid, cudaStream_t st, int Kf,
                 int G, int MT, int NT)
{
    using PC = PushCfg<R, T>;
    if constexpr (mma_ok<R, T / QD>())
        if (c->push_mma == 2) {
            k_push_far<R, T, true, QD, false, true><<<grid, PC::NTH, PC::smem, st>>>(ta, Kf, G, MT,
                                                                                     NT, 1);
            return;
        }
    k_push_far<R, T, true, QD><<<grid, PC::NTH, PC::smem, st>>>(ta, Kf, G, MT, NT, 1);
}

/* the shared-memory limit of the mma push kernels (fp32: below the default
 * 48 KiB, set like the others for uniformity) */
template <typename R, int T> cudaError_t mma_attrs()
{
    cudaError_t e = cudaSuccess;
    if constexpr (mma_ok<R, T>()) {
        const int sm = (int)PushCfg<R, T>::smem;
        e = cudaFuncSetAttribute(k_push_far<R, T, false, 1, false, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(k_push_far<R, T, false, 1, true, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(k_push_far<R, T, true, 1, false, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(k_push<R, T, 1, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
        if constexpr (mma_ok<R, T / 2>()) {
            if (e == cudaSuccess)
                e = cudaFuncSetAttribute(k_push_far<R, T, true, 2, false, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
            if (e == cudaSuccess)
                e = cudaFuncSetAttribute(k_push<R, T, 2, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
        }
    }
    return e;
}

template <typename R, int T>
bk_status run_tiles(bk_cuda_ctx *c, const bk_core_args *a, R *Rp)
{
    using S3 = Solve3Cfg<R, T, 16>;
    using S8 = Solve3Cfg<R, T, 8>;
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
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve3<R, T, 16, BK_Q_LEVELS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S3::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve3<R, T, 16, BK_Q_UNIFORM>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S3::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve3<R, T, 16, BK_Q_INTEGER>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S3::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve3<R, T, 8, BK_Q_LEVELS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S8::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve3<R, T, 8, BK_Q_UNIFORM>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S8::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_tile_solve3<R, T, 8, BK_Q_INTEGER>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S8::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push<R, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)PC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push<R, T, 2>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push_far<R, T, true, 2>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push_far<R, T, true>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push_far<R, T, false, 1, true>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem));
    BK_CUDA_CHECK(cudaFuncSetAttribute(k_push_far<R, T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem));
    BK_CUDA_CHECK((mma_attrs<R, T>()));
    if (c->solve_wc == 16 && c->solve_chain == 1)
        BK_CUDA_CHECK((solve3_attrs<R, T, 16, 1>()));
    else if (c->solve_chain == 1)
        BK_CUDA_CHECK((solve3_attrs<R, T, 8, 1>()));
    const int MT = (int)(a->mpad / T), NT = (int)(a->npad / T);
    const int G = c->push_group > 0 ? c->push_group : 0;
    const int never = MT + NT + 1; /* eager: no flush, every target is near */
    const bool ovl = G > 0 && c->overlap && c->side;
    /* the overlapped pushes' stream: confined to an SM partition that leaves
     * `keep` SMs to the solves (auto: when an anti-diagonal has at most 40
     * tiles, its tile count rounded up to 8), else the ordinary side stream */
    cudaStream_t side = c->side;
    cudaEvent_t side_done = c->ev_side_done;
    bool band = c->side_band == 1; /* auto (-1): with the SM partition */
    c->part_used = 0;
    if (ovl && c->partition != 0) {
        const int per = std::min(MT, NT);
        const int keep = c->partition > 0 ? c->partition : per <= 40 ? (per + 7) / 8 * 8 : 0;
        cudaStream_t ps = NULL;
        cudaEvent_t pe = NULL;
        if (keep > 0) {
            bk_status pst = bk_cuda_partition_side(c, keep, &ps, &pe);
            if (pst != BK_OK)
                return pst;
        }
        if (ps) {
            /* the far push's shared-memory limit, also in that context */
            if (!bk_cuda_partition_enter(c))
                return bk_error(BK_ERR_DEVICE, "bakron: entering the SM partition's context");
            cudaError_t e = cudaFuncSetAttribute(
                k_push_far<R, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PC::smem);
            if (e == cudaSuccess)
                e = cudaFuncSetAttribute(k_push_far<R, T, false, 1, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)PC::smem);
            if (e == cudaSuccess)
                e = mma_attrs<R, T>();
            bk_cuda_partition_leave(c);
            BK_CUDA_CHECK(e);
            side = ps;
            side_done = pe;
            band = c->side_band != 0;
            c->part_used = 1;
        }
    }
    BK_CUDA_CHECK(cudaEventRecord(c->ev_start, c->stream));
    if (ovl) { /* nothing pending on the side stream yet */
        BK_CUDA_CHECK(cudaEventRecord(c->ev_main_ready, c->stream));
        BK_CUDA_CHECK(cudaStreamWaitEvent(side, c->ev_main_ready, 0));
        BK_CUDA_CHECK(cudaEventRecord(side_done, side));
    }
    for (int K = 0; K <= MT + NT - 2; K++) {
        const int i_lo = std::max(0, K - (NT - 1)), i_hi = std::min(K, MT - 1);
        const int ntiles = i_hi - i_lo + 1;
        if (c->solve_wc == 16 && c->solve_chain == 1)
            launch_solve3<R, T, 16, 1>(ta, K, i_lo, ntiles, c->stream);
        else if (c->solve_chain == 1)
            launch_solve3<R, T, 8, 1>(ta, K, i_lo, ntiles, c->stream);
        else if (c->solve_wc == 16)
            launch_solve3<R, T, 16>(ta, K, i_lo, ntiles, c->stream);
        else
            launch_solve3<R, T, 8>(ta, K, i_lo, ntiles, c->stream);
        BK_CUDA_CHECK(cudaGetLastError());
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
            if (c->push_split == 2)
                launch_near<R, T, 2>(c, ta, dim3(nx, ntiles, 4), c->stream, K, i_lo, MT, NT, Kf);
            else
                launch_near<R, T, 1>(c, ta, dim3(nx, ntiles), c->stream, K, i_lo, MT, NT, Kf);
            BK_CUDA_CHECK(cudaGetLastError());
        }
        if (G && K == Kf && K < MT + NT - 2) {
            const int lines = MT + (ta.LB ? NT : 0), targets = std::max(MT, NT);
            if (!ovl) {
                launch_far<R, T>(c, ta, dim3(lines, targets), c->stream, Kf, G, MT, NT, 0);
                BK_CUDA_CHECK(cudaGetLastError());
            } else {
                /* the targets of the next run now (the previous overlapped
                 * push wrote some of them: wait for it), the rest on the side
                 * stream while the next G diagonals are solved */
                BK_CUDA_CHECK(cudaStreamWaitEvent(c->stream, side_done, 0));
                if (c->push_split == 2)
                    launch_next<R, T, 2>(c, ta, dim3(lines, G, 4), c->stream, Kf, G, MT, NT);
                else
                    launch_next<R, T, 1>(c, ta, dim3(lines, G), c->stream, Kf, G, MT, NT);
                BK_CUDA_CHECK(cudaGetLastError());
                if (Kf + G < MT + NT - 2) {
                    BK_CUDA_CHECK(cudaEventRecord(c->ev_main_ready, c->stream));
                    BK_CUDA_CHECK(cudaStreamWaitEvent(side, c->ev_main_ready, 0));
                    if (band) {
                        /* the band needed by the next flush, then the rest: the
                         * next flush waits for the band only (the rest of the
                         * previous flush is before it on the stream) */
                        launch_far<R, T>(c, ta, dim3(lines, G), side, Kf, G, MT, NT, 3);
                        BK_CUDA_CHECK(cudaGetLastError());
                        BK_CUDA_CHECK(cudaEventRecord(side_done, side));
                        if (Kf + 2 * G < MT + NT - 2)
                            launch_far<R, T>(c, ta, dim3(lines, targets), side, Kf, G, MT, NT, 4);
                    } else {
                        launch_far<R, T>(c, ta, dim3(lines, targets), side, Kf, G, MT, NT, 2);
                        BK_CUDA_CHECK(cudaGetLastError());
                        BK_CUDA_CHECK(cudaEventRecord(side_done, side));
                    }
                    BK_CUDA_CHECK(cudaGetLastError());
                }
            }
        }
    }
    if (ovl) { /* everything on the side stream */
        BK_CUDA_CHECK(cudaEventRecord(side_done, side));
        BK_CUDA_CHECK(cudaStreamWaitEvent(c->stream, side_done, 0));
    }
    BK_CUDA_CHECK(cudaEventRecord(c->ev_stop, c->stream));
    return BK_OK;
}

template <typename R> bk_status bakron(bk_cuda_ctx *c, const bk_core_args *a)
{
    R *Rp = NULL;
    size_t bytes = sizeof(R) * (size_t)a->mpad * (size_t)a->npad;
    bk_status st = bk_dev_alloc(c, (void **)&Rp, bytes, "bakron: the right accumulator");
    if (st == BK_OK) {
        if (c->tile == 32)
            st = run_tiles<R, 32>(c, a, Rp);
        else
            st = run_tiles<R, 64>(c, a, Rp);
    }
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "bakron", __FILE__, __LINE__);
    /* after a failed launch sequence the side stream may still hold pushes
     * that read the accumulator: let them finish before it is freed */
    cudaStreamSynchronize(c->side);
    if (c->part_stream)
        cudaStreamSynchronize(c->part_stream);
    bk_dev_free(c, Rp);
    return st;
}

} // namespace

#endif /* BK_CUDA_BAKRON_IMPL_CUH */
