/* bk-cuda-dev factor — the candidate: the fp32 Cholesky factorization and
 * triangular inverse with the O(n^3) work on tensor cores (3xTF32), timed by
 * factor_dev.cu against the product's cuSOLVER path (cuda/factor.cu). Dev
 * harness only: in the product behind the CUDA tuning factor_tc in session 16
 * (branch fac3xprod), removed from it in session 17 (branch prune: 1.67x end
 * to end at n = 14336 against a rule of 2x, errors 2.6x fp32's, and the fp32
 * parity bar failed at 2304x256); see cuda/dev/NOTES.md.
 *
 *   x = hi + lo, hi = TF32(x), lo = TF32(x - hi); a.b ~ hi.hi + hi.lo + lo.hi,
 *   one cuBLAS GEMM (CUBLAS_COMPUTE_32F_FAST_TF32, fp32 accumulation) with the
 *   three products interleaved along K (K' = 3K): the operands are split
 *   copies, so the tensor cores see exact TF32 numbers and round nothing.
 *
 *   Cholesky, column-major upper (A = U^T U), right-looking by block columns
 *   of width nb: cuSOLVER Spotrf of the diagonal block (fp32), cuBLAS Strsm of
 *   the panel (fp32), the trailing update C -= U12^T U12 on its upper
 *   trapezoid by column panels of width pw, in 3xTF32.
 *   Inverse, column-major upper, recursive: X = [[A, B], [0, C]] -> invert A
 *   and C, then B <- -(A^-1 B) C^-1 as two 3xTF32 GEMMs by panels that skip
 *   the zero triangles; leaves of order <= leaf by cuSOLVER trtri.
 *
 * The strict lower part of the diagonal blocks receives leftovers of the
 * trapezoid updates; nothing reads it (potrf / trtri read the upper
 * triangle, the split of a triangular operand zeroes it, the
 * anti-transpose of cuda/factor_kernels.cuh clears it).
 */
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fac3x.cuh"

namespace {

inline unsigned grid(int64_t n)
{
    return (unsigned)((n + 255) / 256);
}

__device__ __forceinline__ float tf32(float x)
{
    uint32_t u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
    return __uint_as_float(u);
}

/* The split copy of src [rows, cols] (column-major, lds) for a K' = t K GEMM
 * operand. krows: K is the row index, dst is [t rows, cols] (ld t rows),
 * dst[t r + p, c] = term p of src[r, c]; else K is the column index, dst is
 * [rows, t cols] (ld rows), dst[r, t c + p]. Term p is lo when bit p of pat is
 * set, else hi. tri: src is upper triangular, entries below its diagonal are
 * taken as zero (whatever the buffer holds there). */
__global__ void k_split(float *dst, const float *src, int64_t lds, int64_t rows, int64_t cols,
                        int krows, int t, unsigned pat, int tri)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * cols)
        return;
    const int64_t r = idx % rows, c = idx / rows;
    const float x = (tri && r > c) ? 0.f : src[c * lds + r];
    const float hi = tf32(x), lo = tf32(x - hi);
    for (int p = 0; p < t; p++) {
        const float v = (pat >> p) & 1u ? lo : hi;
        if (krows)
            dst[c * (t * rows) + t * r + p] = v;
        else
            dst[(t * c + p) * rows + r] = v;
    }
}

/* the patterns of the A and B operands: t = 3: (hi, hi, lo) . (hi, lo, hi) */
inline unsigned pat_a(int t)
{
    return t == 3 ? 4u : 0u;
}
inline unsigned pat_b(int t)
{
    return t == 3 ? 2u : 0u;
}

bk_status split(bk_cuda_ctx *c, float *dst, const float *src, int64_t lds, int64_t rows,
                int64_t cols, int krows, int t, unsigned pat, int tri)
{
    if (rows <= 0 || cols <= 0)
        return BK_OK;
    k_split<<<grid(rows * cols), 256, 0, c->stream>>>(dst, src, lds, rows, cols, krows, t, pat,
                                                      tri);
    BK_CUDA_CHECK(cudaGetLastError());
    return BK_OK;
}

/* C = alpha op(A) B + beta C in TF32 with fp32 accumulation; with kc > 0, K
 * in chunks of at most kc (a multiple of the terms) added in fp32 by the
 * epilogue (beta = 1 after the first): shorter accumulations inside the
 * tensor cores, whose rounding of partial sums may not be fp32's nearest */
bk_status gemm_tc(bk_cuda_ctx *c, cublasOperation_t ta, int64_t M, int64_t N, int64_t K,
                  float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                  float beta, float *C, int64_t ldc, int64_t kc)
{
    if (M <= 0 || N <= 0)
        return BK_OK;
    if (kc <= 0)
        kc = K;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kl = std::min(kc, K - k0);
        const float b = k0 ? 1.f : beta;
        const float *Ak = ta == CUBLAS_OP_T ? A + k0 : A + k0 * lda;
        BK_CUBLAS_CHECK(cublasGemmEx_64(c->cublas, ta, CUBLAS_OP_N, M, N, kl, &alpha, Ak,
                                        CUDA_R_32F, lda, B + k0, CUDA_R_32F, ldb, &b, C,
                                        CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F_FAST_TF32,
                                        CUBLAS_GEMM_DEFAULT));
    }
    return BK_OK;
}

/* the leaves of bk_fac3x_trtri's recursion on order k */
int64_t count_leaves(int64_t k, int64_t leaf)
{
    if (k <= leaf)
        return 1;
    const int64_t n1 = (k / 2 + 63) / 64 * 64;
    return count_leaves(n1, leaf) + count_leaves(k - n1, leaf);
}

bk_status next_info(bk_fac3x_ws *w, int **slot)
{
    if (w->used >= w->ninfo)
        return bk_error(BK_ERR_INTERNAL, "factor: out of info slots (%d)", w->ninfo);
    *slot = w->dinfo + w->used++;
    return BK_OK;
}

} // namespace

void bk_fac3x_ws_free(bk_cuda_ctx *c, bk_fac3x_ws *w)
{
    bk_dev_free(c, w->s1);
    bk_dev_free(c, w->s2);
    bk_dev_free(c, w->tmp);
    bk_dev_free(c, w->pw);
    bk_dev_free(c, w->tw);
    bk_dev_free(c, w->dinfo);
    free(w->th);
    memset(w, 0, sizeof *w);
}

bk_status bk_fac3x_ws_make(bk_cuda_ctx *c, bk_fac3x_ws *w, int64_t n, int64_t ld,
                           const bk_fac3x_cfg *g)
{
    memset(w, 0, sizeof *w);
    if (g->nb < 1 || g->pw < 1 || g->leaf < 1 || (g->terms != 1 && g->terms != 3) || g->kc < 0 ||
        g->nb > 2147483647 || ld > 2147483647)
        return bk_error(BK_ERR_INVALID_ARG, "factor: bad blocked-factorization settings");
    /* the largest halves of the inverse's recursion (its first split; n2 can
     * exceed n1) and the Cholesky's widest panel */
    const int64_t t = g->terms, h0 = (n / 2 + 63) / 64 * 64, h = std::max(h0, n - h0);
    const int64_t nb = std::min(g->nb, n), leaf = std::min(g->leaf, n);
    w->s1n = (size_t)std::max<int64_t>(t * nb * n, t * h * h);
    w->s2n = w->s1n;
    w->tmpn = (size_t)std::max<int64_t>(h * h, 1);
    w->ninfo = (int)((n + nb - 1) / nb + count_leaves(n, g->leaf));
    bk_status st = bk_dev_alloc(c, (void **)&w->s1, sizeof(float) * w->s1n, "factor: split A");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&w->s2, sizeof(float) * w->s2n, "factor: split B");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&w->tmp, sizeof(float) * w->tmpn, "factor: inverse panel");
    if (st == BK_OK)
        st = bk_cusolver_status(cusolverDnSpotrf_bufferSize(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                                            (int)nb, w->s1, (int)ld, &w->lw),
                                "cusolverDnSpotrf_bufferSize", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_dev_alloc(c, &w->pw, sizeof(float) * (size_t)std::max(w->lw, 1),
                          "factor: block potrf workspace");
    if (st == BK_OK)
        st = bk_cusolver_status(cusolverDnXtrtri_bufferSize(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                                            CUBLAS_DIAG_NON_UNIT, leaf,
                                                            CUDA_R_32F, w->s1, ld, &w->twd,
                                                            &w->twh),
                                "cusolverDnXtrtri_bufferSize", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_dev_alloc(c, &w->tw, std::max<size_t>(w->twd, 1), "factor: leaf trtri workspace");
    if (st == BK_OK && !(w->th = malloc(std::max<size_t>(w->twh, 1))))
        st = bk_error(BK_ERR_NOMEM, "factor: out of host memory");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&w->dinfo, sizeof(int) * (size_t)w->ninfo, "factor: infos");
    if (st != BK_OK)
        bk_fac3x_ws_free(c, w);
    return st;
}

bk_status bk_fac3x_potrf(bk_cuda_ctx *c, float *X, int64_t n, int64_t ld, const bk_fac3x_cfg *g,
                         bk_fac3x_ws *w)
{
    const int t = g->terms;
    const float one = 1.f;
    for (int64_t j0 = 0; j0 < n; j0 += g->nb) {
        const int64_t b = std::min(g->nb, n - j0), m = n - j0 - b;
        float *U11 = X + j0 * ld + j0;
        int *info = NULL;
        bk_status st = next_info(w, &info);
        if (st != BK_OK)
            return st;
        BK_CUSOLVER_CHECK(cusolverDnSpotrf(c->cusolver, CUBLAS_FILL_MODE_UPPER, (int)b, U11,
                                           (int)ld, (float *)w->pw, w->lw, info));
        if (m == 0)
            break;
        float *A12 = X + (j0 + b) * ld + j0;
        BK_CUBLAS_CHECK(cublasStrsm_64(c->cublas, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_UPPER,
                                       CUBLAS_OP_T, CUBLAS_DIAG_NON_UNIT, b, m, &one, U11, ld,
                                       A12, ld));
        /* C -= U12^T U12 on the upper trapezoid, by column panels */
        if ((st = split(c, w->s1, A12, ld, b, m, 1, t, pat_a(t), 0)) != BK_OK ||
            (st = split(c, w->s2, A12, ld, b, m, 1, t, pat_b(t), 0)) != BK_OK)
            return st;
        float *C = X + (j0 + b) * ld + (j0 + b);
        for (int64_t c0 = 0; c0 < m; c0 += g->pw) {
            const int64_t c1 = std::min(c0 + g->pw, m);
            if ((st = gemm_tc(c, CUBLAS_OP_T, c1, c1 - c0, t * b, -1.f, w->s1, t * b,
                              w->s2 + c0 * t * b, t * b, 1.f, C + c0 * ld, ld, g->kc)) != BK_OK)
                return st;
        }
    }
    return BK_OK;
}

bk_status bk_fac3x_trtri(bk_cuda_ctx *c, float *X, int64_t k, int64_t ld, const bk_fac3x_cfg *g,
                         bk_fac3x_ws *w)
{
    bk_status st;
    if (k <= g->leaf) {
        int *info = NULL;
        if ((st = next_info(w, &info)) != BK_OK)
            return st;
        BK_CUSOLVER_CHECK(cusolverDnXtrtri(c->cusolver, CUBLAS_FILL_MODE_UPPER,
                                           CUBLAS_DIAG_NON_UNIT, k, CUDA_R_32F, X, ld, w->tw,
                                           w->twd, w->th, w->twh, info));
        return BK_OK;
    }
    const int t = g->terms;
    const int64_t n1 = (k / 2 + 63) / 64 * 64, n2 = k - n1;
    float *A = X, *B = X + n1 * ld, *C = X + n1 * ld + n1;
    if ((st = bk_fac3x_trtri(c, A, n1, ld, g, w)) != BK_OK ||
        (st = bk_fac3x_trtri(c, C, n2, ld, g, w)) != BK_OK)
        return st;
    /* T = A^-1 B by row panels of A^-1 (columns from the panel's diagonal on) */
    if ((st = split(c, w->s1, A, ld, n1, n1, 0, t, pat_a(t), 1)) != BK_OK || /* [n1, t n1] */
        (st = split(c, w->s2, B, ld, n1, n2, 1, t, pat_b(t), 0)) != BK_OK)   /* [t n1, n2] */
        return st;
    for (int64_t r0 = 0; r0 < n1; r0 += g->pw) {
        const int64_t r1 = std::min(r0 + g->pw, n1);
        if ((st = gemm_tc(c, CUBLAS_OP_N, r1 - r0, n2, t * (n1 - r0), 1.f, w->s1 + r0 + t * r0 * n1,
                          n1, w->s2 + t * r0, t * n1, 0.f, w->tmp + r0, n1, g->kc)) != BK_OK)
            return st;
    }
    /* B = -T C^-1 by column panels of C^-1 (rows up to the panel's end) */
    if ((st = split(c, w->s1, w->tmp, n1, n1, n2, 0, t, pat_a(t), 0)) != BK_OK || /* [n1, t n2] */
        (st = split(c, w->s2, C, ld, n2, n2, 1, t, pat_b(t), 1)) != BK_OK)        /* [t n2, n2] */
        return st;
    for (int64_t c0 = 0; c0 < n2; c0 += g->pw) {
        const int64_t c1 = std::min(c0 + g->pw, n2);
        if ((st = gemm_tc(c, CUBLAS_OP_N, n1, c1 - c0, t * c1, -1.f, w->s1, n1,
                          w->s2 + c0 * t * n2, t * n2, 0.f, B + c0 * ld, ld, g->kc)) != BK_OK)
            return st;
    }
    return BK_OK;
}

bk_status bk_fac3x_info(bk_cuda_ctx *c, bk_fac3x_ws *w, int *info)
{
    *info = 0;
    std::vector<int> h((size_t)std::max(w->used, 1), 0);
    if (w->used)
        BK_CUDA_CHECK(cudaMemcpyAsync(h.data(), w->dinfo, sizeof(int) * (size_t)w->used,
                                      cudaMemcpyDeviceToHost, c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int i = 0; i < w->used; i++)
        if (h[(size_t)i]) {
            *info = h[(size_t)i];
            break;
        }
    w->used = 0;
    return BK_OK;
}
