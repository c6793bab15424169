/* CUDA backend — BaKron-antidiagonal (paper Alg. 3), the slow baseline.
 *
 * Anti-diagonal k holds the entries (i, k - i), i in [i_lo, i_hi]. They are
 * rounded together (k_ad_round), then the whole batch of updates
 *   W += L_B[:, I] diag(delta) L_A[:, J]^T
 * is one GEMM restricted to the lower-right region rows >= i_lo, columns
 * >= j_lo (nothing above or left of it can change). The rows I are
 * consecutive, so L_B[i_lo:, i_lo:i_hi+1] is used in place; the columns J
 * run backwards, so L_A's are gathered (and scaled by delta) into a buffer.
 */
#include <algorithm>

#include "cuda_internal.cuh"
#include "quant.cuh"

namespace {

template <typename R> struct AArgs {
    int64_t m, n;
    R *W;
    int64_t ldw;
    const R *LA;
    int64_t ldla;
    R *delta;  /* [min(m,n)] */
    R *G;      /* [npad, ldg] gathered, scaled L_A columns */
    int64_t ldg;
    bk_dq<R> q;
    int16_t *codes;
    float *weight;
    unsigned long long *counts;
};

template <typename R> __global__ void k_ad_round(AArgs<R> a, int64_t k, int64_t i_lo, int64_t d)
{
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= d)
        return;
    const int64_t i = i_lo + t, j = k - i;
    const R wt = a.W[i * a.ldw + j];
    int16_t code;
    int cnt[3] = {0, 0, 0};
    const R v = a.q.round(wt, i, j, &code, cnt);
    a.codes[i * a.n + j] = code;
    a.weight[i * a.n + j] = (float)v;
    a.delta[t] = v - wt;
    bk_counts_add(a.counts, cnt);
}

/* G[q - j_lo][t] = L_A[q][k - i_lo - t] * delta[t] for q in [j_lo, n). */
template <typename R>
__global__ void k_ad_gather(AArgs<R> a, int64_t k, int64_t i_lo, int64_t j_lo, int64_t d)
{
    const int64_t rows = a.n - j_lo;
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * d)
        return;
    const int64_t qq = idx / d, t = idx % d;
    const int64_t jt = k - i_lo - t;
    a.G[qq * a.ldg + t] = a.LA[(j_lo + qq) * a.ldla + jt] * a.delta[t];
}

template <typename R> __global__ void k_identity(R *M, int64_t n, int64_t ld)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        M[i * ld + i] = R(1);
}

template <typename R> bk_status antidiag(bk_cuda_ctx *c, const bk_core_args *a)
{
    const int64_t m = a->m, n = a->n, dmax = std::min(m, n);
    AArgs<R> g;
    R *LBid = NULL;
    const R *LB = static_cast<const R *>(a->LB);
    int64_t ldlb = a->ldlb;
    bk_status st;
    g.m = m;
    g.n = n;
    g.W = static_cast<R *>(a->W);
    g.ldw = a->ldw;
    g.LA = static_cast<const R *>(a->LA);
    g.ldla = a->ldla;
    g.delta = NULL;
    g.G = NULL;
    g.ldg = dmax;
    g.q = bk_dq<R>::make(a->q);
    g.codes = a->codes;
    g.weight = a->weight;
    g.counts = a->counts;
    st = bk_dev_alloc(c, (void **)&g.delta, sizeof(R) * (size_t)dmax, "antidiag: errors");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&g.G, sizeof(R) * (size_t)n * (size_t)dmax,
                          "antidiag: gathered columns");
    if (st == BK_OK && !LB) {
        st = bk_dev_alloc(c, (void **)&LBid, sizeof(R) * (size_t)m * (size_t)m,
                          "antidiag: identity L_B");
        if (st == BK_OK) {
            k_identity<R><<<(unsigned)((m + 255) / 256), 256, 0, c->stream>>>(LBid, m, m);
            st = bk_cuda_status(cudaGetLastError(), "k_identity", __FILE__, __LINE__);
        }
        LB = LBid;
        ldlb = m;
    }
    if (st != BK_OK)
        goto done;
    BK_CUDA_GOTO(cudaEventRecord(c->ev_start, c->stream), st, done);
    for (int64_t k = 0; k <= m + n - 2; k++) {
        const int64_t i_lo = std::max<int64_t>(0, k - (n - 1)), i_hi = std::min(k, m - 1);
        const int64_t d = i_hi - i_lo + 1, j_lo = k - i_hi;
        k_ad_round<R><<<(unsigned)((d + 255) / 256), 256, 0, c->stream>>>(g, k, i_lo, d);
        BK_CUDA_GOTO(cudaGetLastError(), st, done);
        if (k == m + n - 2)
            break; /* the last entry updates nothing */
        const int64_t tot = (n - j_lo) * d;
        k_ad_gather<R><<<(unsigned)((tot + 255) / 256), 256, 0, c->stream>>>(g, k, i_lo, j_lo, d);
        BK_CUDA_GOTO(cudaGetLastError(), st, done);
        st = bk_rm_gemm(c->cublas, 0, 1, m - i_lo, n - j_lo, d, 1.0, LB + i_lo * ldlb + i_lo, ldlb,
                        g.G, g.ldg, 1.0, g.W + i_lo * a->ldw + j_lo, a->ldw);
        if (st != BK_OK)
            goto done;
    }
    BK_CUDA_GOTO(cudaEventRecord(c->ev_stop, c->stream), st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
done:
    bk_dev_free(c, LBid);
    bk_dev_free(c, g.G);
    bk_dev_free(c, g.delta);
    return st;
}

} // namespace

bk_status bk_cuda_antidiag_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return antidiag<float>(c, a);
}

bk_status bk_cuda_antidiag_f64(bk_cuda_ctx *c, const bk_core_args *a)
{
    return antidiag<double>(c, a);
}
