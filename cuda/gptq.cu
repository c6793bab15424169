/* CUDA backend — GPTQ (paper Alg. 1 with lazy batches; B is ignored).
 *
 * Columns are taken in blocks of 128. Inside a block the rows are
 * independent: one warp owns RW rows and each lane four columns of the
 * block in registers. Column j is rounded by broadcasting its value from the
 * owning lane (a shuffle, no barrier) and every lane adds e * L_A[q, j] to
 * its columns q; L_A's diagonal block sits transposed in shared memory so
 * that the lanes read consecutive words. The block's errors then update the
 * columns after the block with one GEMM (cuBLAS):
 *   W[:, after] += E[:, block] L_A[after, block]^T.
 * With refit_groups the blocks also end at group boundaries and each group
 * is refitted on the host (the CPU fitting code, for identical scales) from
 * its fully updated columns when it starts, as the CPU solver does.
 */
#include <algorithm>

#include "cuda_internal.cuh"
#include "quant.cuh"

namespace {

constexpr int GB = 128;    /* block width */
constexpr int GRW = 2;     /* rows per warp */
constexpr int GWARPS = 8;  /* warps per CTA */
constexpr unsigned FULL = 0xffffffffu;

template <typename R> struct GArgs {
    int64_t m, n;
    R *W;
    int64_t ldw;
    const R *LA;
    int64_t ldla;
    R *Eb; /* [mpad, GB] errors of the current block */
    bk_dq<R> q;
    int16_t *codes;
    float *weight;
    unsigned long long *counts;
};

template <typename R> __host__ __device__ constexpr int gstride()
{
    return GB + 16 / (int)sizeof(R);
}

template <typename R>
__global__ void __launch_bounds__(GWARPS * 32) k_gptq_block(GArgs<R> a, int64_t b0, int bw)
{
    constexpr int LST = gstride<R>();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    R *Ls = reinterpret_cast<R *>(smem_raw); /* Ls[j * LST + q] = L_A[b0+q][b0+j] */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int idx = tid; idx < GB * GB; idx += GWARPS * 32) {
        const int q = idx / GB, j = idx % GB;
        Ls[j * LST + q] = (q < bw && j < bw) ? a.LA[(b0 + q) * a.ldla + b0 + j] : R(0);
    }
    const int64_t p0 = ((int64_t)blockIdx.x * GWARPS + warp) * GRW;
    R w[GRW][4];
#pragma unroll
    for (int r = 0; r < GRW; r++)
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int q = 4 * lane + u;
            w[r][u] = (p0 + r < a.m && q < bw) ? a.W[(p0 + r) * a.ldw + b0 + q] : R(0);
        }
    __syncthreads();
    int cnt[3] = {0, 0, 0};
    for (int j0 = 0; j0 < 32; j0++) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = 4 * j0 + u;
            if (j >= bw)
                break;
            R lt[4];
#pragma unroll
            for (int v = 0; v < 4; v++)
                lt[v] = Ls[j * LST + 4 * lane + v];
#pragma unroll
            for (int r = 0; r < GRW; r++) {
                const R wt = __shfl_sync(FULL, w[r][u], j0);
                R e = R(0);
                const int64_t p = p0 + r;
                if (p < a.m) {
                    int16_t code;
                    int lc[3] = {0, 0, 0};
                    const R v = a.q.round(wt, p, b0 + j, &code, lc);
                    e = v - wt;
                    if (lane == j0) {
                        a.codes[p * a.n + b0 + j] = code;
                        a.weight[p * a.n + b0 + j] = (float)v;
                        a.Eb[p * GB + j] = e;
                        cnt[0] += lc[0];
                        cnt[1] += lc[1];
                        cnt[2] += lc[2];
                    }
                }
#pragma unroll
                for (int v = 0; v < 4; v++)
                    w[r][v] += e * lt[v];
            }
        }
    }
    bk_counts_add_warp(a.counts, cnt);
}

template <typename R> bk_status gptq(bk_cuda_ctx *c, const bk_core_args *a)
{
    R *Eb = NULL;
    bk_status st = bk_dev_alloc(c, (void **)&Eb, sizeof(R) * (size_t)a->mpad * GB,
                                "gptq: block errors");
    if (st != BK_OK)
        return st;
    GArgs<R> g;
    g.m = a->m;
    g.n = a->n;
    g.W = static_cast<R *>(a->W);
    g.ldw = a->ldw;
    g.LA = static_cast<const R *>(a->LA);
    g.ldla = a->ldla;
    g.Eb = Eb;
    g.q = bk_dq<R>::make(a->q);
    g.codes = a->codes;
    g.weight = a->weight;
    g.counts = a->counts;
    const size_t smem = sizeof(R) * (size_t)GB * gstride<R>();
    const int rows_per_cta = GWARPS * GRW;
    const unsigned grid = (unsigned)((a->m + rows_per_cta - 1) / rows_per_cta);
    BK_CUDA_GOTO(cudaFuncSetAttribute(k_gptq_block<R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)smem),
                 st, done);
    BK_CUDA_GOTO(cudaEventRecord(c->ev_start, c->stream), st, done);
    for (int64_t b0 = 0, b1; b0 < a->n; b0 = b1) {
        b1 = std::min<int64_t>(b0 + GB, a->n);
        if (a->refit) {
            /* as the CPU: batches end at group boundaries, and a group is
             * refitted from its fully updated columns when it starts */
            const int64_t grp = a->q.group, g0 = b0 / grp;
            b1 = std::min<int64_t>(b1, (g0 + 1) * grp);
            if (b0 % grp == 0) {
                st = a->refit(a->refit_ctx, g0, g.W + b0, a->ldw);
                if (st != BK_OK)
                    goto done;
            }
        }
        const int bw = (int)(b1 - b0);
        k_gptq_block<R><<<grid, GWARPS * 32, smem, c->stream>>>(g, b0, bw);
        BK_CUDA_GOTO(cudaGetLastError(), st, done);
        const int64_t after = b0 + bw;
        if (after < a->n) {
            st = bk_rm_gemm(c->cublas, 0, 1, a->m, a->n - after, bw, 1.0, Eb, GB,
                            g.LA + after * a->ldla + b0, a->ldla, 1.0, g.W + after, a->ldw);
            if (st != BK_OK)
                goto done;
        }
    }
    BK_CUDA_GOTO(cudaEventRecord(c->ev_stop, c->stream), st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
done:
    bk_dev_free(c, Eb);
    return st;
}

} // namespace

bk_status bk_cuda_gptq_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return gptq<float>(c, a);
}

bk_status bk_cuda_gptq_f64(bk_cuda_ctx *c, const bk_core_args *a)
{
    return gptq<double>(c, a);
}
