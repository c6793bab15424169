/* CUDA backend — the small-size algorithms, for completeness:
 *   naive (paper Alg. 2): entries in row-major order, each followed by its
 *     rank-one update, in one CTA (m * n sequential steps); refused above
 *     BK_CUDA_NAIVE_MAX_MN entries;
 *   recursive (Alg. 5): split the longer side in half (n1 = floor(n/2)),
 *     solve the first half, push its errors with two GEMMs, solve the second
 *     half; blocks of at most 32 x 32 entries are finished by the naive
 *     kernel restricted to the block (the same order Alg. 5 would take);
 *   rtn: every entry rounded on its own.
 */
#include <algorithm>
#include <cstdio>

#include "cuda_internal.cuh"
#include "quant.cuh"

namespace {

template <typename R> struct NArgs {
    int64_t m, n;
    R *W;
    int64_t ldw;
    R *E; /* [m, lde] or NULL */
    int64_t lde;
    const R *LA;
    int64_t ldla;
    const R *LB; /* NULL: identity */
    int64_t ldlb;
    bk_dq<R> q;
    int16_t *codes;
    float *weight;
    unsigned long long *counts;
};

/* Alg. 2 on the block rows [r0, r1) x columns [c0, c1), updates kept inside
 * the block. One CTA. */
template <typename R>
__global__ void __launch_bounds__(1024)
    k_naive_block(NArgs<R> a, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
    __shared__ R e_sh;
    const int tid = threadIdx.x, nt = blockDim.x;
    int cnt[3] = {0, 0, 0};
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = c0; j < c1; j++) {
            if (tid == 0) {
                const R wt = a.W[i * a.ldw + j];
                int16_t code;
                const R v = a.q.round(wt, i, j, &code, cnt);
                const R e = v - wt;
                a.codes[i * a.n + j] = code;
                a.weight[i * a.n + j] = (float)v;
                if (a.E)
                    a.E[i * a.lde + j] = e;
                e_sh = e;
            }
            __syncthreads();
            const R e = e_sh;
            const int64_t rows = a.LB ? r1 - i : 1, cols = c1 - j;
            for (int64_t idx = tid; idx < rows * cols; idx += nt) {
                const int64_t p = i + idx / cols, q = j + idx % cols;
                const R lb = a.LB ? a.LB[p * a.ldlb + i] : R(1);
                a.W[p * a.ldw + q] += lb * e * a.LA[q * a.ldla + j];
            }
            __syncthreads();
        }
    if (tid == 0)
        bk_counts_add(a.counts, cnt);
}

template <typename R> __global__ void k_rtn(NArgs<R> a)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= a.m * a.n)
        return;
    const int64_t i = idx / a.n, j = idx % a.n;
    int16_t code;
    int cnt[3] = {0, 0, 0};
    const R v = a.q.round(a.W[i * a.ldw + j], i, j, &code, cnt);
    a.codes[idx] = code;
    a.weight[idx] = (float)v;
    bk_counts_add(a.counts, cnt);
}

template <typename R> NArgs<R> make_args(const bk_core_args *a)
{
    NArgs<R> g;
    g.m = a->m;
    g.n = a->n;
    g.W = static_cast<R *>(a->W);
    g.ldw = a->ldw;
    g.E = NULL;
    g.lde = 0;
    g.LA = static_cast<const R *>(a->LA);
    g.ldla = a->ldla;
    g.LB = static_cast<const R *>(a->LB);
    g.ldlb = a->ldlb;
    g.q = bk_dq<R>::make(a->q);
    g.codes = a->codes;
    g.weight = a->weight;
    g.counts = a->counts;
    return g;
}

template <typename R> bk_status naive(bk_cuda_ctx *c, const bk_core_args *a)
{
    if (a->m * a->n > BK_CUDA_NAIVE_MAX_MN)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "backend cuda: algorithm naive runs one entry at a time and is limited to "
                        "m*n <= %lld on the GPU (got %lldx%lld); use bakron (the same codes) or "
                        "--backend cpu",
                        (long long)BK_CUDA_NAIVE_MAX_MN, (long long)a->m, (long long)a->n);
    NArgs<R> g = make_args<R>(a);
    BK_CUDA_CHECK(cudaEventRecord(c->ev_start, c->stream));
    k_naive_block<R><<<1, 1024, 0, c->stream>>>(g, 0, a->m, 0, a->n);
    BK_CUDA_CHECK(cudaGetLastError());
    BK_CUDA_CHECK(cudaEventRecord(c->ev_stop, c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return BK_OK;
}

template <typename R> struct Rec {
    bk_cuda_ctx *c;
    NArgs<R> g;
    R *T1; /* [mpad, npad] */
    int64_t ldt;

    bk_status run(int64_t r0, int64_t r1, int64_t c0, int64_t c1)
    {
        const int64_t mm = r1 - r0, nn = c1 - c0;
        if (mm <= 0 || nn <= 0)
            return BK_OK;
        if (mm * nn <= 1024 && mm <= 32 && nn <= 32) {
            k_naive_block<R><<<1, 256, 0, c->stream>>>(g, r0, r1, c0, c1);
            BK_CUDA_CHECK(cudaGetLastError());
            return BK_OK;
        }
        bk_status st;
        if (mm < nn) {
            const int64_t cm = c0 + nn / 2;
            if ((st = run(r0, r1, c0, cm)) != BK_OK)
                return st;
            /* W[r0:r1, cm:c1] += L_B[r0:r1, r0:r1] E[r0:r1, c0:cm] L_A[cm:c1, c0:cm]^T */
            const R *Eb = g.E + r0 * g.lde + c0;
            const R *left = Eb;
            int64_t ldl = g.lde;
            if (g.LB) {
                st = bk_rm_gemm(c->cublas, 0, 0, mm, cm - c0, mm, 1.0, g.LB + r0 * g.ldlb + r0,
                                g.ldlb, Eb, g.lde, 0.0, T1, ldt);
                if (st != BK_OK)
                    return st;
                left = T1;
                ldl = ldt;
            }
            st = bk_rm_gemm(c->cublas, 0, 1, mm, c1 - cm, cm - c0, 1.0, left, ldl,
                            g.LA + cm * g.ldla + c0, g.ldla, 1.0, g.W + r0 * g.ldw + cm, g.ldw);
            if (st != BK_OK)
                return st;
            return run(r0, r1, cm, c1);
        }
        const int64_t rm = r0 + mm / 2;
        if ((st = run(r0, rm, c0, c1)) != BK_OK)
            return st;
        if (g.LB) {
            /* W[rm:r1, c0:c1] += L_B[rm:r1, r0:rm] E[r0:rm, c0:c1] L_A[c0:c1, c0:c1]^T */
            st = bk_rm_gemm(c->cublas, 0, 1, rm - r0, nn, nn, 1.0, g.E + r0 * g.lde + c0, g.lde,
                            g.LA + c0 * g.ldla + c0, g.ldla, 0.0, T1, ldt);
            if (st != BK_OK)
                return st;
            st = bk_rm_gemm(c->cublas, 0, 0, r1 - rm, nn, rm - r0, 1.0, g.LB + rm * g.ldlb + r0,
                            g.ldlb, T1, ldt, 1.0, g.W + rm * g.ldw + c0, g.ldw);
            if (st != BK_OK)
                return st;
        }
        return run(rm, r1, c0, c1);
    }
};

template <typename R> bk_status recursive(bk_cuda_ctx *c, const bk_core_args *a)
{
    Rec<R> rec;
    rec.c = c;
    rec.g = make_args<R>(a);
    rec.T1 = NULL;
    rec.ldt = a->npad;
    const size_t bytes = sizeof(R) * (size_t)a->mpad * (size_t)a->npad;
    bk_status st = bk_dev_alloc(c, (void **)&rec.g.E, bytes, "recursive: errors");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&rec.T1, bytes, "recursive: workspace");
    rec.g.lde = a->npad;
    if (st != BK_OK)
        goto done;
    BK_CUDA_GOTO(cudaEventRecord(c->ev_start, c->stream), st, done);
    st = rec.run(0, a->m, 0, a->n);
    if (st != BK_OK)
        goto done;
    BK_CUDA_GOTO(cudaEventRecord(c->ev_stop, c->stream), st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
done:
    bk_dev_free(c, rec.T1);
    bk_dev_free(c, rec.g.E);
    return st;
}

template <typename R> bk_status rtn(bk_cuda_ctx *c, const bk_core_args *a)
{
    NArgs<R> g = make_args<R>(a);
    const int64_t tot = a->m * a->n;
    BK_CUDA_CHECK(cudaEventRecord(c->ev_start, c->stream));
    if (tot > 0) {
        k_rtn<R><<<(unsigned)((tot + 255) / 256), 256, 0, c->stream>>>(g);
        BK_CUDA_CHECK(cudaGetLastError());
    }
    BK_CUDA_CHECK(cudaEventRecord(c->ev_stop, c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return BK_OK;
}

} // namespace

bk_status bk_cuda_naive_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return naive<float>(c, a);
}
bk_status bk_cuda_naive_f64(bk_cuda_ctx *c, const bk_core_args *a)
{
    return naive<double>(c, a);
}
bk_status bk_cuda_recursive_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return recursive<float>(c, a);
}
bk_status bk_cuda_recursive_f64(bk_cuda_ctx *c, const bk_core_args *a)
{
    return recursive<double>(c, a);
}
bk_status bk_cuda_rtn_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return rtn<float>(c, a);
}
bk_status bk_cuda_rtn_f64(bk_cuda_ctx *c, const bk_core_args *a)
{
    return rtn<double>(c, a);
}
