/* CUDA backend — alphabet fitting on the device (cuda/qfit.cuh).
 *
 * One thread block per (row, group) cell. The CPU rule (src/quant.c) is
 * followed expression by expression in double; products and sums go through
 * __dmul_rn / __dadd_rn / __dsub_rn so that nvcc cannot contract them into
 * fused multiply-adds (the CPU build does not contract either), hence every
 * error term equals the CPU's and only the summation order differs. */
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "qfit.cuh"

namespace {

constexpr int FIT_THREADS = 256;

struct FitArgs {
    const float *W;
    int64_t ldw, m, n, group, groups, cells;
    int kind, levels, bits, asym, mse;
    const unsigned char *dead;
    float *scale, *zero;
    unsigned long long *bad; /* the first cell whose scale leaves F32 (atomicMin) */
};

__device__ inline double xval(const FitArgs &a, const float *row, int64_t j0, int64_t j)
{
    if (a.dead && a.dead[j0 + j])
        return 0.0;
    return (double)row[j];
}

/* Block-wide reductions (every thread gets the result). */
__device__ double block_sum(double v, double *sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v = __dadd_rn(v, __shfl_down_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0)
        sh[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < FIT_THREADS / 32; w++)
            t = __dadd_rn(t, sh[w]);
        sh[FIT_THREADS / 32] = t;
    }
    __syncthreads();
    return sh[FIT_THREADS / 32];
}

__device__ double block_min(double v, double *sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmin(v, __shfl_down_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0)
        sh[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = sh[0];
        for (int w = 1; w < FIT_THREADS / 32; w++)
            t = fmin(t, sh[w]);
        sh[FIT_THREADS / 32] = t;
    }
    __syncthreads();
    return sh[FIT_THREADS / 32];
}

__device__ double block_max(double v, double *sh)
{
    return -block_min(-v, sh);
}

__global__ void __launch_bounds__(FIT_THREADS) k_fit(FitArgs a)
{
    __shared__ double sh[FIT_THREADS / 32 + 1];
    for (int64_t cell = blockIdx.x; cell < a.cells; cell += gridDim.x) {
        const int64_t i = cell / a.groups, g = cell % a.groups;
        const int64_t j0 = g * a.group;
        const int64_t len = a.n - j0 < a.group ? a.n - j0 : a.group;
        const float *row = a.W + i * a.ldw + j0;
        double lo = 0.0, hi = 0.0, amax = 0.0;
        for (int64_t j = threadIdx.x; j < len; j += FIT_THREADS) {
            const double v = xval(a, row, j0, j);
            lo = fmin(lo, v);
            hi = fmax(hi, v);
            amax = fmax(amax, fabs(v));
        }
        lo = block_min(lo, sh);
        hi = block_max(hi, sh);
        amax = block_max(amax, sh);
        if (a.kind == BK_Q_LEVELS) {
            const int L = a.levels;
            if (amax == 0.0 || (float)(amax / L) == 0.0f)
                amax = 1.0;
            if (!((float)(amax / L) <= FLT_MAX)) {
                if (threadIdx.x == 0)
                    atomicMin(a.bad, (unsigned long long)cell);
                continue;
            }
            float best_s = (float)(amax / L);
            if (a.mse) {
                double best = INFINITY;
                for (int st = 0; st < BK_Q_LEVELS_STEPS; st++) {
                    const double p = 1.0 - (double)st / BK_Q_LEVELS_GRID;
                    const float s = (float)(__dmul_rn(p, amax) / L);
                    if (!(s > 0.0f))
                        continue;
                    const double sd = (double)s;
                    double e = 0.0;
                    for (int64_t j = threadIdx.x; j < len; j += FIT_THREADS) {
                        const double x = xval(a, row, j0, j);
                        double c = rint(x / sd);
                        if (c < -L)
                            c = -L;
                        else if (c > L)
                            c = L;
                        const double d = __dsub_rn(__dmul_rn(c, sd), x);
                        e = __dadd_rn(e, __dmul_rn(d, d));
                    }
                    e = block_sum(e, sh);
                    if (e < best) {
                        best = e;
                        best_s = s;
                    }
                }
            }
            if (threadIdx.x == 0)
                a.scale[cell] = best_s;
        } else {
            const int maxq = (1 << a.bits) - 1;
            const int sym = !a.asym;
            double xmin = lo, xmax = hi;
            if (sym) {
                xmax = fmax(fabs(xmin), xmax);
                if (xmin < 0)
                    xmin = -xmax;
            }
            if ((xmin == 0.0 && xmax == 0.0) || (float)(__dsub_rn(xmax, xmin) / maxq) == 0.0f) {
                xmin = -1.0;
                xmax = 1.0;
            }
            if (!((float)(__dsub_rn(xmax, xmin) / maxq) <= FLT_MAX)) {
                if (threadIdx.x == 0)
                    atomicMin(a.bad, (unsigned long long)cell);
                continue;
            }
            float s = (float)(__dsub_rn(xmax, xmin) / maxq);
            double z = sym ? (maxq + 1) / 2.0 : rint(-xmin / (double)s);
            if (a.mse) {
                double best = INFINITY;
                for (int st = 0; st < BK_Q_UNIFORM_MAXSHRINK_STEPS; st++) {
                    const double p = 1.0 - (double)st / BK_Q_UNIFORM_GRID;
                    const double xmin1 = __dmul_rn(p, xmin), xmax1 = __dmul_rn(p, xmax);
                    const float s1 = (float)(__dsub_rn(xmax1, xmin1) / maxq);
                    if (!(s1 > 0.0f))
                        continue;
                    const double sd = (double)s1;
                    const double z1 = sym ? z : rint(-xmin1 / sd);
                    double e = 0.0;
                    for (int64_t j = threadIdx.x; j < len; j += FIT_THREADS) {
                        const double x = xval(a, row, j0, j);
                        double q = __dadd_rn(rint(x / sd), z1);
                        if (q < 0)
                            q = 0;
                        else if (q > maxq)
                            q = maxq;
                        e = __dadd_rn(e, pow(fabs(__dsub_rn(__dmul_rn(sd, __dsub_rn(q, z1)), x)),
                                             BK_Q_UNIFORM_NORM));
                    }
                    e = block_sum(e, sh);
                    if (e < best) {
                        best = e;
                        s = s1;
                        z = z1;
                    }
                }
            }
            if (threadIdx.x == 0) {
                a.scale[cell] = s;
                a.zero[cell] = (float)z;
            }
        }
    }
}

} // namespace

bk_status bk_cuda_alphabet_fit(bk_cuda_ctx *c, bk_alphabet *a, const float *dW, int64_t ldw,
                               const unsigned char *dead)
{
    const int64_t cells = a->m * a->groups;
    if (a->spec.kind == BK_Q_INTEGER) {
        for (int64_t t = 0; t < cells; t++)
            a->scale[t] = 1.0f;
        return BK_OK;
    }
    if (cells <= 0)
        return BK_OK;
    const int uni = a->spec.kind == BK_Q_UNIFORM;
    float *dscale = NULL, *dzero = NULL;
    unsigned long long *dbad = NULL, bad = ~0ull;
    bk_status st = bk_dev_alloc(c, (void **)&dscale, sizeof(float) * (size_t)cells, "fit: scales");
    if (st == BK_OK && uni)
        st = bk_dev_alloc(c, (void **)&dzero, sizeof(float) * (size_t)cells, "fit: zero points");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dbad, sizeof bad, "fit: flag");
    if (st != BK_OK)
        goto done;
    BK_CUDA_GOTO(cudaMemcpyAsync(dbad, &bad, sizeof bad, cudaMemcpyHostToDevice, c->stream), st,
                 done);
    {
        FitArgs fa;
        memset(&fa, 0, sizeof fa);
        fa.W = dW;
        fa.ldw = ldw;
        fa.m = a->m;
        fa.n = a->n;
        fa.group = a->group;
        fa.groups = a->groups;
        fa.cells = cells;
        fa.kind = (int)a->spec.kind;
        fa.levels = a->spec.levels;
        fa.bits = a->spec.bits;
        fa.asym = a->spec.asym;
        fa.mse = a->spec.mse;
        fa.dead = dead;
        fa.scale = dscale;
        fa.zero = dzero;
        fa.bad = dbad;
        const int64_t grid = cells < 65535 * 4 ? cells : 65535 * 4;
        k_fit<<<(unsigned)grid, FIT_THREADS, 0, c->stream>>>(fa);
        BK_CUDA_GOTO(cudaGetLastError(), st, done);
    }
    BK_CUDA_GOTO(cudaMemcpyAsync(&bad, dbad, sizeof bad, cudaMemcpyDeviceToHost, c->stream), st,
                 done);
    BK_CUDA_GOTO(cudaMemcpyAsync(a->scale, dscale, sizeof(float) * (size_t)cells,
                                 cudaMemcpyDeviceToHost, c->stream),
                 st, done);
    if (uni)
        BK_CUDA_GOTO(cudaMemcpyAsync(a->zero, dzero, sizeof(float) * (size_t)cells,
                                     cudaMemcpyDeviceToHost, c->stream),
                     st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
    if (bad != ~0ull) {
        /* regenerate the CPU's message from the host fit of that cell */
        const int64_t i = (int64_t)(bad / (unsigned long long)a->groups);
        const int64_t g = (int64_t)(bad % (unsigned long long)a->groups);
        const int64_t j0 = g * a->group;
        const int64_t len = a->n - j0 < a->group ? a->n - j0 : a->group;
        float *xf = static_cast<float *>(malloc(sizeof(float) * (size_t)len));
        double *xd = static_cast<double *>(malloc(sizeof(double) * (size_t)len));
        unsigned char *dh = static_cast<unsigned char *>(malloc((size_t)len));
        if (!xf || !xd || !dh) {
            st = bk_error(BK_ERR_NOMEM, "fit: out of host memory");
        } else {
            st = bk_cuda_status(cudaMemcpy(xf, dW + i * ldw + j0, sizeof(float) * (size_t)len,
                                           cudaMemcpyDeviceToHost),
                                "fit: row download", __FILE__, __LINE__);
            if (st == BK_OK && dead)
                st = bk_cuda_status(cudaMemcpy(dh, dead + j0, (size_t)len,
                                               cudaMemcpyDeviceToHost),
                                    "fit: dead columns", __FILE__, __LINE__);
            if (st == BK_OK) {
                for (int64_t j = 0; j < len; j++)
                    xd[j] = dead && dh[j] ? 0.0 : (double)xf[j];
                float sc = 0.0f, zr = 0.0f;
                st = uni ? bk_q_fit_uniform(xd, len, a->spec.bits, a->spec.asym, a->spec.mse, &sc,
                                            &zr)
                         : bk_q_fit_levels(xd, len, a->spec.levels, a->spec.mse, &sc);
                if (st == BK_OK)
                    st = bk_error(BK_ERR_INTERNAL,
                                  "fit: row %lld, group %lld: the device and host fits disagree "
                                  "on the scale's range",
                                  (long long)i, (long long)g);
                else {
                    char ctx[96];
                    snprintf(ctx, sizeof ctx, "row %lld, group %lld", (long long)i, (long long)g);
                    bk_error_prefix(st, ctx);
                }
            }
        }
        free(xf);
        free(xd);
        free(dh);
    }
done:
    bk_dev_free(c, dscale);
    bk_dev_free(c, dzero);
    bk_dev_free(c, dbad);
    return st;
}
