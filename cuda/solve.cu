/* CUDA backend — bk_backend_solve for the GPU: the same contract and rules
 * as bk_solve (src/solver.c, docs/solver.md), step for step:
 *   validation (same checks, messages and statuses),
 *   the alphabet (src/quant.c: fitted on the host, the CPU code itself),
 *   damping + Cholesky of the inverse on the device (factor.cu), with the
 *   CPU's escalation, dead columns and precomputed-factor rules,
 *   the core algorithm on the device (timed with CUDA events: time_solve_s),
 *   the statistics in double on the device (stats.cu: on a stream of their
 *   own, overlapping the codes' download and the bound, collected before the
 *   solve returns) and the bound.
 *
 * Validation is solver.c's own (src/solver_check.h).
 *
 * bk_cuda_solve_dev is the same solve with the factors A/B already on the
 * device (F32, the GPU pipeline): finiteness, symmetry, diagonals and the
 * mirrored double matrix are done on the device (prepare_dmatrix, the same
 * rules and messages as prepare_matrix), the factorization starts from the
 * device matrix (bk_dside_from_dmatrix). Both entries share everything from
 * the alphabet fit on (solve_rest). Its input side can be kept for the next
 * solves of the same A (bk_dshare: q/k/v, gate/up in the GPU stages).
 */
#include <cfloat>
#include <cmath>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <pthread.h>

#include "cuda_internal.cuh"

extern "C" {
#include "quant.h"
#include "util.h"
}
#include "solver_check.h"
#include "qfit.cuh"

namespace {

inline double in_at(const void *p, bk_dtype dt, size_t idx)
{
    return dt == BK_DT_F64 ? static_cast<const double *>(p)[idx]
                           : (double)static_cast<const float *>(p)[idx];
}

/* side_from_matrix's host part (src/solver_check.c): symmetry check,
 * mirrored lower triangle, negative diagonal -> NOT_PD, zero diagonal -> 1
 * (input side: a dead column, zeroed in Wd), mean diagonal. */
bk_status prepare_matrix(const void *X, bk_dtype dt, int64_t n, const char *label, int input_side,
                         double *Wd, int64_t m, int64_t *dead, double **out, double *mean_out)
{
    const size_t nn = (size_t)n * (size_t)n;
    double *Xd = static_cast<double *>(bk_alloc(nn, sizeof(double)));
    if (!Xd)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                        (long long)n, (long long)n);
    bk_status st = bk_solve_mirror_matrix(X, dt, n, label, input_side, Wd, m, dead, Xd, mean_out);
    if (st != BK_OK) {
        free(Xd);
        return st;
    }
    *out = Xd;
    return BK_OK;
}

/* side_from_factor's checks (src/solver_check.c); the factor as host double. */
bk_status prepare_factor(const void *LX, bk_dtype dt, int64_t n, const char *label, double **out)
{
    bk_status st = bk_solve_check_factor(LX, dt, n, label);
    if (st != BK_OK)
        return st;
    const size_t nn = (size_t)n * (size_t)n;
    double *L = static_cast<double *>(bk_alloc(nn, sizeof(double)));
    if (!L)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                        (long long)n, (long long)n);
    for (size_t t = 0; t < nn; t++)
        L[t] = in_at(LX, dt, t);
    *out = L;
    return BK_OK;
}

int family_two_sided(bk_algorithm a)
{
    return a == BK_ALG_BAKRON || a == BK_ALG_RECURSIVE || a == BK_ALG_ANTIDIAG ||
           a == BK_ALG_NAIVE;
}

/* Upload a host double [rows, cols] into a device buffer of the solve type
 * with row stride ld (the buffer is already zeroed). */
bk_status upload_as(bk_cuda_ctx *c, void *dst, int64_t ld, const double *src, int64_t rows,
                    int64_t cols, bk_precision prec)
{
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *tmp = bk_alloc((size_t)rows * (size_t)cols, rsz);
    if (!tmp)
        return bk_error(BK_ERR_NOMEM, "out of host memory staging a [%lld, %lld] upload",
                        (long long)rows, (long long)cols);
    const size_t count = (size_t)rows * (size_t)cols;
    if (prec == BK_PREC_FP64)
        memcpy(tmp, src, count * sizeof(double));
    else
        for (size_t t = 0; t < count; t++)
            static_cast<float *>(tmp)[t] = (float)src[t];
    bk_status st = bk_cuda_status(cudaMemcpy2DAsync(dst, (size_t)ld * rsz, tmp, (size_t)cols * rsz,
                                                    (size_t)cols * rsz, (size_t)rows,
                                                    cudaMemcpyHostToDevice, c->stream),
                                  "upload", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "upload", __FILE__, __LINE__);
    free(tmp);
    return st;
}

/* scale/zero arrays (F32 on the host) into the solve type on the device */
bk_status upload_f32_as(bk_cuda_ctx *c, void *dst, const float *src, size_t count,
                        bk_precision prec)
{
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *tmp = bk_alloc(count, rsz);
    if (!tmp)
        return bk_error(BK_ERR_NOMEM, "out of host memory staging the scales");
    for (size_t t = 0; t < count; t++) {
        if (prec == BK_PREC_FP64)
            static_cast<double *>(tmp)[t] = (double)src[t];
        else
            static_cast<float *>(tmp)[t] = src[t];
    }
    bk_status st = bk_cuda_status(cudaMemcpyAsync(dst, tmp, count * rsz, cudaMemcpyHostToDevice,
                                                  c->stream),
                                  "upload scales", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "upload scales", __FILE__,
                            __LINE__);
    free(tmp);
    return st;
}

/* GPTQ's refit at a group start: download the group's columns, refit with
 * the CPU code, upload the group's new scales and zeros. */
typedef struct refit_ctx {
    bk_cuda_ctx *c;
    bk_alphabet *al;
    bk_precision prec;
    void *dscale, *dzero;
    const char *label;
} refit_ctx;

bk_status refit_group(void *vctx, int64_t g, const void *dW, int64_t ldw)
{
    refit_ctx *x = static_cast<refit_ctx *>(vctx);
    bk_alphabet *al = x->al;
    const int64_t m = al->m, j0 = g * al->group;
    const int64_t len = al->n - j0 < al->group ? al->n - j0 : al->group;
    const size_t rsz = x->prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    void *raw = bk_alloc((size_t)m * (size_t)len, rsz);
    double *G = static_cast<double *>(bk_alloc((size_t)m * (size_t)len, sizeof(double)));
    void *col = bk_alloc((size_t)m, rsz);
    bk_status st = BK_OK;
    if (!raw || !G || !col) {
        st = bk_error(BK_ERR_NOMEM, "%s: gptq: out of memory refitting a group", x->label);
        goto done;
    }
    BK_CUDA_GOTO(cudaMemcpy2DAsync(raw, (size_t)len * rsz, dW, (size_t)ldw * rsz,
                                   (size_t)len * rsz, (size_t)m, cudaMemcpyDeviceToHost,
                                   x->c->stream),
                 st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(x->c->stream), st, done);
    for (size_t t = 0; t < (size_t)m * (size_t)len; t++)
        G[t] = x->prec == BK_PREC_FP64 ? static_cast<double *>(raw)[t]
                                       : (double)static_cast<float *>(raw)[t];
    st = bk_alphabet_fit_group(al, g, G, len);
    if (st != BK_OK) {
        bk_error_prefix(st, x->label);
        goto done;
    }
    for (int pass = 0; pass < 2; pass++) {
        const float *srcv = pass == 0 ? al->scale : al->zero;
        void *dst = pass == 0 ? x->dscale : x->dzero;
        if (!srcv || !dst)
            continue;
        for (int64_t i = 0; i < m; i++) {
            const float v = srcv[i * al->groups + g];
            if (x->prec == BK_PREC_FP64)
                static_cast<double *>(col)[i] = (double)v;
            else
                static_cast<float *>(col)[i] = v;
        }
        BK_CUDA_GOTO(cudaMemcpy2DAsync(static_cast<char *>(dst) + (size_t)g * rsz,
                                       (size_t)al->groups * rsz, col, rsz, rsz, (size_t)m,
                                       cudaMemcpyHostToDevice, x->c->stream),
                     st, done);
        BK_CUDA_GOTO(cudaStreamSynchronize(x->c->stream), st, done);
    }
done:
    free(raw);
    free(G);
    free(col);
    return st;
}

/* ------------------------------------------------- device-resident factors */

/* first non-finite index (atomicMin, ULLONG_MAX if none) and max |entry|
 * (atomicMax on the bit pattern: monotonic for non-negative floats) */
__global__ void k_scan(const float *X, int64_t count, unsigned long long *first_bad,
                       unsigned int *maxbits)
{
    unsigned int mx = 0;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < count;
         t += (int64_t)gridDim.x * blockDim.x) {
        const float a = fabsf(X[t]);
        if (!(a <= FLT_MAX))
            atomicMin(first_bad, (unsigned long long)t);
        else
            mx = max(mx, __float_as_uint(a));
    }
    for (int off = 16; off > 0; off >>= 1)
        mx = max(mx, __shfl_down_sync(0xffffffffu, mx, off));
    if ((threadIdx.x & 31) == 0 && mx > 0)
        atomicMax(maxbits, mx);
}

/* prepare_matrix's symmetry check and mirror on 32x32 tiles: out[i][j] =
 * (double)X[max(i,j)][min(i,j)]; a lower entry (i > j) with
 * |X_ij - X_ji| > thr (in double, as the host) records the smallest i*k+j,
 * i.e. the host loop's first offending pair. Block 32x8. */
__global__ void k_sym_mirror(const float *X, int64_t k, double thr, double *out,
                             unsigned long long *first_asym)
{
    __shared__ float lo_t[32][33], tr_t[32][33];
    const int64_t T = (k + 31) / 32;
    const int x = threadIdx.x;
    for (int64_t tile = blockIdx.x; tile < T * T; tile += gridDim.x) {
        const int64_t r0 = (tile / T) * 32, c0 = (tile % T) * 32;
        const int lower = r0 >= c0; /* the tile has entries with i >= j */
        __syncthreads();
        for (int y = threadIdx.y; y < 32; y += 8) {
            if (lower && r0 + y < k && c0 + x < k)
                lo_t[y][x] = X[(r0 + y) * k + c0 + x];
            if (c0 + y < k && r0 + x < k)
                tr_t[y][x] = X[(c0 + y) * k + r0 + x]; /* X[c0+y][r0+x] */
        }
        __syncthreads();
        for (int y = threadIdx.y; y < 32; y += 8) {
            const int64_t i = r0 + y, j = c0 + x;
            if (i >= k || j >= k)
                continue;
            const float up = tr_t[x][y]; /* X[j][i] */
            if (i >= j) {
                const float lo = lo_t[y][x];
                if (i > j && fabs((double)lo - (double)up) > thr)
                    atomicMin(first_asym, (unsigned long long)(i * k + j));
                out[i * k + j] = (double)lo;
            } else {
                out[i * k + j] = (double)up;
            }
        }
    }
}

__global__ void k_diag_get(const double *X, int64_t k, double *d)
{
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k)
        d[j] = X[j * k + j];
}

__global__ void k_diag_set(double *X, int64_t k, const double *d)
{
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k)
        X[j * k + j] = d[j];
}

/* dst [rows, ld] (solve type) = src [rows, cols] F32, padding untouched */
template <typename R>
__global__ void k_pad_from_f32(R *dst, int64_t ld, const float *src, int64_t rows, int64_t cols)
{
    const int64_t count = rows * cols;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < count;
         t += (int64_t)gridDim.x * blockDim.x)
        dst[(t / cols) * ld + t % cols] = (R)src[t];
}

__global__ void k_f2d(double *dst, const float *src, int64_t count)
{
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < count)
        dst[t] = (double)src[t];
}

inline unsigned nblocks(int64_t count, int64_t cap)
{
    const int64_t b = (count + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > cap ? cap : b);
}

/* bk_solve_check_finite on a device F32 [k, k] matrix (the same message,
 * naming the first bad index); *maxabs receives max |entry|. */
bk_status dcheck_finite_rc(bk_cuda_ctx *c, const float *X, int64_t rows, int64_t k,
                           const char *label, double *maxabs)
{
    const int64_t count = rows * k;
    unsigned long long *scr = NULL, h[2] = {0, 0};
    float v = 0.0f;
    bk_status st = bk_dev_alloc(c, (void **)&scr, 2 * sizeof(unsigned long long),
                                "check: counters");
    if (st != BK_OK)
        return st;
    unsigned int *maxbits = reinterpret_cast<unsigned int *>(scr + 1);
    BK_CUDA_GOTO(cudaMemsetAsync(scr, 0xff, sizeof(unsigned long long), c->stream), st, done);
    k_scan<<<nblocks(count, 8192), 256, 0, c->stream>>>(X, count, scr, maxbits);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    BK_CUDA_GOTO(cudaMemcpyAsync(h, scr, sizeof h, cudaMemcpyDeviceToHost, c->stream), st, done);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
    if (h[0] != ULLONG_MAX) {
        BK_CUDA_GOTO(cudaMemcpyAsync(&v, X + h[0], sizeof v, cudaMemcpyDeviceToHost, c->stream),
                     st, done);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
        st = bk_error(BK_ERR_NONFINITE, "%s: non-finite value (%g) at [%lld, %lld]", label,
                      (double)v, (long long)(h[0] / (unsigned long long)k),
                      (long long)(h[0] % (unsigned long long)k));
        goto done;
    }
    {
        unsigned int bits = 0;
        memcpy(&bits, &h[1], sizeof bits); /* the first 4 bytes of the second word */
        float mf;
        memcpy(&mf, &bits, sizeof mf);
        *maxabs = (double)mf;
    }
done:
    bk_dev_free(c, scr);
    return st;
}

bk_status dcheck_finite(bk_cuda_ctx *c, const float *X, int64_t k, const char *label,
                        double *maxabs)
{
    return dcheck_finite_rc(c, X, k, k, label, maxabs);
}

/* prepare_matrix on the device, from a finite F32 [k, k] device matrix with
 * max |entry| maxabs: the same checks, messages and results; *out receives
 * the mirrored device double matrix (zero diagonals replaced by 1). */
bk_status prepare_dmatrix(bk_cuda_ctx *c, const float *X, int64_t k, double maxabs,
                          const char *label, int input_side, double *Wd, int64_t m,
                          int64_t *dead, double **out, double *mean_out)
{
    const size_t kk = (size_t)k * (size_t)k;
    double *dX = NULL, *dd = NULL, *hd = NULL;
    unsigned long long key = 0;
    int64_t zeros = 0;
    double mean = 0.0;
    bk_status st = bk_dev_alloc(c, (void **)&dX, sizeof(double) * kk, "factor: damped matrix");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dd, sizeof(double) * (size_t)k + sizeof key,
                          "factor: diagonal");
    if (st != BK_OK)
        goto fail;
    hd = static_cast<double *>(malloc(sizeof(double) * (size_t)k));
    if (!hd) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] factor", label,
                      (long long)k, (long long)k);
        goto fail;
    }
    {
        unsigned long long *dkey = reinterpret_cast<unsigned long long *>(dd + k);
        const int64_t T = (k + 31) / 32;
        BK_CUDA_GOTO(cudaMemsetAsync(dkey, 0xff, sizeof key, c->stream), st, fail);
        k_sym_mirror<<<nblocks(T * T * 256, 65536), dim3(32, 8), 0, c->stream>>>(
            X, k, BK_SYM_TOL * maxabs, dX, dkey);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        k_diag_get<<<nblocks(k, INT_MAX), 256, 0, c->stream>>>(dX, k, dd);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        BK_CUDA_GOTO(cudaMemcpyAsync(&key, dkey, sizeof key, cudaMemcpyDeviceToHost, c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaMemcpyAsync(hd, dd, sizeof(double) * (size_t)k, cudaMemcpyDeviceToHost,
                                     c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    }
    if (key != ULLONG_MAX) {
        const int64_t i = (int64_t)(key / (unsigned long long)k),
                      j = (int64_t)(key % (unsigned long long)k);
        float lo = 0.0f, up = 0.0f;
        BK_CUDA_GOTO(cudaMemcpyAsync(&lo, X + i * k + j, sizeof lo, cudaMemcpyDeviceToHost,
                                     c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaMemcpyAsync(&up, X + j * k + i, sizeof up, cudaMemcpyDeviceToHost,
                                     c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
        st = bk_solve_error_not_symmetric(label, i, j, (double)lo, (double)up, maxabs);
        goto fail;
    }
    /* Wd NULL: the caller rebuilds W_d from the diagonal (fast path) */
    st = bk_solve_fix_diagonal(hd, 1, k, label, input_side, Wd, m, dead, &zeros, &mean);
    if (st != BK_OK)
        goto fail;
    if (zeros > 0) {
        BK_CUDA_GOTO(cudaMemcpyAsync(dd, hd, sizeof(double) * (size_t)k, cudaMemcpyHostToDevice,
                                     c->stream),
                     st, fail);
        k_diag_set<<<nblocks(k, INT_MAX), 256, 0, c->stream>>>(dX, k, dd);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    }
    free(hd);
    bk_dev_free(c, dd);
    *mean_out = mean;
    *out = dX;
    return BK_OK;
fail:
    free(hd);
    bk_dev_free(c, dd);
    bk_dev_free(c, dX);
    return st;
}

/* ------------------------------------------------ the shared second half */

/* What the front ends (host arrays, device factors) hand over: the fitted-to-be
 * alphabet (initialized), both sides factored, W as host double with dead
 * columns zeroed, and the start time. */
typedef struct solve_state {
    bk_alphabet alpha;
    bk_dside sa, sb;
    int sa_shared; /* sa is a kept side of a bk_dshare: not released here */
    double *Wd;
    int64_t dead;
    double t0;
} solve_state;

/* The device entry's additions (NULL for bk_cuda_solve). */
typedef struct solve_extra {
    const float *W;       /* host original W (F32): E of loss_gptq */
    const float *A_plain; /* device [n, n] or NULL */
    float *d_weight;      /* device [m, n] or NULL */
    double *loss_gptq;    /* or NULL */
    const float *dW;      /* device original W [m, n] or NULL: the alphabet is fitted on the
                             device (cuda/qfit.cu) when no column is dead */
} solve_extra;

void state_release(bk_cuda_ctx *c, solve_state *s)
{
    bk_alphabet_free(&s->alpha);
    if (s->sa_shared)
        memset(&s->sa, 0, sizeof s->sa);
    else
        bk_dside_free(c, &s->sa);
    s->sa_shared = 0;
    bk_dside_free(c, &s->sb);
    free(s->Wd);
    s->Wd = NULL;
}

/* The failure exit of both entries: everything released, r emptied. */
bk_status solve_fail(bk_cuda_ctx *c, solve_state *s, bk_solve_result *r, bk_status st)
{
    cudaStreamSynchronize(c->stream);
    cudaGetLastError();
    state_release(c, s);
    bk_solve_result_free(r);
    r->loss_two_sided = r->loss_one_sided = r->bound = NAN;
    return st;
}

/* Alphabet, device problem, core, downloads, counters, statistics, result.
 * r->codes and r->weight are allocated; releases s (and r on failure). */
bk_status solve_rest(bk_cuda_ctx *c, const bk_solve_opts *o, int64_t m, int64_t n,
                     const char *lw, solve_state *s, const solve_extra *x, bk_solve_result *r)
{
    const size_t mn = (size_t)m * (size_t)n;
    const bk_precision prec = o->precision;
    const size_t rsz = prec == BK_PREC_FP64 ? sizeof(double) : sizeof(float);
    const int64_t mpad = bk_round_up(m, BK_CUDA_PAD), npad = bk_round_up(n, BK_CUDA_PAD);
    const int stats = o->compute_stats != 0;
    const int want_gptq = x && x->loss_gptq && x->A_plain;
    bk_alphabet &alpha = s->alpha;
    bk_dside &sa = s->sa, &sb = s->sb;
    double *Wd = s->Wd;
    bk_status st = BK_OK;
    void *dW = NULL, *dscale = NULL, *dzero = NULL;
    int16_t *dcodes = NULL;
    float *dweight = NULL;
    unsigned long long *dcounts = NULL, counts[3] = {0, 0, 0};
    double *dWq = NULL, *dW0 = NULL, *dAp = NULL;
    double t1, t2, t3, t4, ts = 0.0, lgptq = NAN;
    bk_stats_job sj;
    memset(&sj, 0, sizeof sj);
    /* the proxy loss from the statistics' E A~ (bk_cuda_stats_launch) */
    const int fuse = want_gptq && s->dead == 0;
    float ms = 0.0f;
    bk_core_args a;
    refit_ctx rc;
    double tp = bk_now();

    if (x && x->dW && s->dead == 0)
        st = bk_cuda_alphabet_fit(c, &alpha, x->dW, n, NULL);
    else
        st = bk_alphabet_fit(&alpha, Wd, n);
    if (st != BK_OK) {
        bk_error_prefix(st, lw);
        goto fail;
    }
    bk_cuda_pmark(c->stream, &tp, "sd.alphabet_fit");
    t1 = bk_now();

    /* device problem */
    st = bk_dev_alloc(c, &dW, rsz * (size_t)mpad * (size_t)npad, "the weight matrix");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dcodes, sizeof(int16_t) * mn, "the codes");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dweight, sizeof(float) * mn, "the dequantized weights");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&dcounts, sizeof counts, "the counters");
    if (st == BK_OK)
        st = bk_dev_alloc(c, &dscale, rsz * (size_t)m * (size_t)alpha.groups, "the scales");
    if (st == BK_OK && alpha.zero)
        st = bk_dev_alloc(c, &dzero, rsz * (size_t)m * (size_t)alpha.groups, "the zero points");
    if (st == BK_OK && Wd) {
        st = upload_as(c, dW, npad, Wd, m, n, prec);
    } else if (st == BK_OK) { /* fast path: W from its device copy (no dead column) */
        if (prec == BK_PREC_FP64)
            k_pad_from_f32<double><<<nblocks((int64_t)mn, 65536), 256, 0, c->stream>>>(
                static_cast<double *>(dW), npad, x->dW, m, n);
        else
            k_pad_from_f32<float><<<nblocks((int64_t)mn, 65536), 256, 0, c->stream>>>(
                static_cast<float *>(dW), npad, x->dW, m, n);
        st = bk_cuda_status(cudaGetLastError(), "k_pad_from_f32", __FILE__, __LINE__);
    }
    if (st == BK_OK)
        st = upload_f32_as(c, dscale, alpha.scale, (size_t)m * (size_t)alpha.groups, prec);
    if (st == BK_OK && alpha.zero)
        st = upload_f32_as(c, dzero, alpha.zero, (size_t)m * (size_t)alpha.groups, prec);
    if (st != BK_OK)
        goto fail;

    memset(&a, 0, sizeof a);
    a.m = m;
    a.n = n;
    a.mpad = mpad;
    a.npad = npad;
    a.W = dW;
    a.ldw = npad;
    a.LA = sa.dL;
    a.ldla = npad;
    a.LB = (o->algorithm == BK_ALG_GPTQ || sb.identity) ? NULL : sb.dL;
    a.ldlb = mpad;
    a.q.kind = o->quant.kind;
    a.q.qmin = alpha.qmin;
    a.q.qmax = alpha.qmax;
    a.q.group = alpha.group;
    a.q.groups = alpha.groups;
    a.q.scale = dscale;
    a.q.zero = dzero;
    a.codes = dcodes;
    a.weight = dweight;
    a.counts = dcounts;
    a.gptq_block = o->gptq_block;
    if (o->algorithm == BK_ALG_GPTQ && o->quant.refit_groups) {
        rc.c = c;
        rc.al = &alpha;
        rc.prec = prec;
        rc.dscale = dscale;
        rc.dzero = dzero;
        rc.label = lw;
        a.refit = refit_group;
        a.refit_ctx = &rc;
    }
    bk_cuda_pmark(c->stream, &tp, "sd.alloc_upload");
    st = bk_cuda_core(c, o->algorithm, prec, &a, &ms);
    bk_cuda_pmark(c->stream, &tp, "sd.core");
    if (st != BK_OK) {
        bk_error_prefix(st, lw);
        goto fail;
    }
    BK_CUDA_GOTO(cudaMemcpyAsync(counts, dcounts, sizeof counts, cudaMemcpyDeviceToHost,
                                 c->stream),
                 st, fail);
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    /* the device problem and factors are no longer needed: free them before
     * the statistics (the damped matrices stay); no free or allocation
     * follows while the statistics run on their stream (cudaFree would wait
     * for them) until the collection */
    bk_dev_free(c, dW);
    dW = NULL;
    if (!s->sa_shared) { /* a kept input side stays for the next solve of its A */
        bk_dev_free(c, sa.dL);
        sa.dL = NULL;
    }
    bk_dev_free(c, sb.dL);
    sb.dL = NULL;
    bk_cuda_pmark(c->stream, &tp, "sd.counts_free");
    if (counts[2] > 0) {
        st = bk_error(BK_ERR_NONFINITE,
                      "%s: %lld values became non-finite during the %s solve (inputs too large "
                      "for %s?)",
                      lw, (long long)counts[2], bk_algorithm_name(o->algorithm),
                      prec == BK_PREC_FP64 ? "fp64" : "fp32");
        goto fail;
    }
    if (counts[1] > 0) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "%s: integer alphabet: %lld codes exceed the int16 range of the result "
                      "(|code| <= %d)",
                      lw, (long long)counts[1], BK_Q_INT16_MAX);
        goto fail;
    }

    t2 = bk_now();
    if (stats || want_gptq) {
        /* E = weight - W in double: the weight converted on the device (exact),
         * W (dead columns zeroed) uploaded */
        st = bk_dev_alloc(c, (void **)&dWq, sizeof(double) * mn, "loss: weight");
        if (st == BK_OK)
            st = bk_dev_alloc(c, (void **)&dW0, sizeof(double) * mn, "loss: W");
        if (st != BK_OK)
            goto fail;
        if (Wd) {
            BK_CUDA_GOTO(cudaMemcpyAsync(dW0, Wd, sizeof(double) * mn, cudaMemcpyHostToDevice,
                                         c->stream),
                         st, fail);
        } else {
            k_f2d<<<nblocks((int64_t)mn, INT_MAX), 256, 0, c->stream>>>(dW0, x->dW, (int64_t)mn);
            BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        }
        k_f2d<<<nblocks((int64_t)mn, INT_MAX), 256, 0, c->stream>>>(dWq, dweight, (int64_t)mn);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    }
    bk_cuda_pmark(c->stream, &tp, "sd.dcopy_loss_prep");
    if (stats) {
        /* launched on the stats stream (ordered after the prep above); the
         * proxy loss from the same E A~ when A~ - A_plain is diagonal (no
         * dead column: its E is the same). The inputs (dWq, dW0, the damped
         * matrices, A_plain) stay until the collection below. */
        st = bk_cuda_stats_launch(c, &sj, m, n, dWq, dW0, sa.dtil, sb.identity ? NULL : sb.dtil,
                                  fuse ? x->A_plain : NULL);
        if (st != BK_OK)
            goto fail;
    }
    bk_cuda_pmark(c->stream, &tp, "sd.stats");
    ts = bk_now() - t2;

    /* while the statistics run: the codes and the weight to the host, through
     * pinned staging (bk_cuda_download: the host copies out of it on several
     * threads while the next chunk is transferred) */
    if ((st = bk_cuda_download(c, r->codes, dcodes, sizeof(int16_t) * mn)) != BK_OK)
        goto fail;
    /* the kernels store the value each code stands for as the CPU rule
     * computes it (a -0 included), so it is copied, not recomputed */
    if (r->weight && (st = bk_cuda_download(c, r->weight, dweight, sizeof(float) * mn)) != BK_OK)
        goto fail;
    if (x && x->d_weight) {
        BK_CUDA_GOTO(cudaMemcpyAsync(x->d_weight, dweight, sizeof(float) * mn,
                                     cudaMemcpyDeviceToDevice, c->stream),
                     st, fail);
        BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    }
    bk_cuda_pmark(c->stream, &tp, "sd.download_free");

    if (stats) {
        t4 = bk_now();
        if (o->algorithm != BK_ALG_RTN) {
            const int use_b = family_two_sided(o->algorithm) && !sb.identity;
            double bound = 0.0;
            double *gsum = NULL;
            if (!Wd && o->quant.kind != BK_Q_INTEGER &&
                (gsum = static_cast<double *>(calloc((size_t)alpha.groups, sizeof(double))))) {
                /* fast path: the scale is constant on a group, so per row
                 * sum_g s_g^2 sum_{j in g} rdiag_j^2 (the same terms, summed
                 * in another order than the host path's loop) */
                for (int64_t j = 0; j < n; j++)
                    gsum[j / alpha.group] += sa.rdiag[j] * sa.rdiag[j];
                for (int64_t i = 0; i < m; i++) {
                    const double rbi = use_b ? sb.rdiag[i] : 1.0;
                    double row = 0.0;
                    for (int64_t g = 0; g < alpha.groups; g++) {
                        const double sc = alpha.scale[i * alpha.groups + g];
                        row += sc * sc * gsum[g];
                    }
                    bound += rbi * rbi * row;
                }
                free(gsum);
            } else
            for (int64_t i = 0; i < m; i++) {
                const double rbi = use_b ? sb.rdiag[i] : 1.0;
                double row = 0.0;
                for (int64_t j = 0; j < n; j++) {
                    const double sc = bk_q_scale_at(&alpha, i, j);
                    row += sc * sc * sa.rdiag[j] * sa.rdiag[j];
                }
                bound += rbi * rbi * row;
            }
            r->bound = 0.25 * bound;
        }
        ts += bk_now() - t4;
        bk_cuda_pmark(c->stream, &tp, "sd.bound");
        t4 = bk_now();
        st = bk_cuda_stats_collect(c, &sj, &r->loss_one_sided, &r->loss_two_sided,
                                   fuse ? &lgptq : NULL);
        ts += bk_now() - t4;
        bk_cuda_pmark(c->stream, &tp, "sd.stats_wait");
        if (st != BK_OK)
            goto fail;
    }
    t2 = bk_now();
    if (want_gptq && std::isnan(lgptq)) {
        /* tr(E A_plain E^T), E = weight - the original W, A_plain undamped;
         * the damped matrices are done with */
        double unused = 0.0;
        if (!s->sa_shared) {
            bk_dev_free(c, sa.dtil);
            sa.dtil = NULL;
        }
        bk_dev_free(c, sb.dtil);
        sb.dtil = NULL;
        if (s->dead > 0) {
            for (size_t t = 0; t < mn; t++)
                Wd[t] = (double)x->W[t];
            BK_CUDA_GOTO(cudaMemcpyAsync(dW0, Wd, sizeof(double) * mn, cudaMemcpyHostToDevice,
                                         c->stream),
                         st, fail);
        }
        st = bk_dev_alloc(c, (void **)&dAp, sizeof(double) * (size_t)n * (size_t)n,
                          "loss: A_plain");
        if (st != BK_OK)
            goto fail;
        k_f2d<<<nblocks(n * n, INT_MAX), 256, 0, c->stream>>>(dAp, x->A_plain, n * n);
        BK_CUDA_GOTO(cudaGetLastError(), st, fail);
        st = bk_cuda_losses(c, m, n, dWq, dW0, dAp, NULL, &lgptq, &unused, NULL, NULL);
        if (st != BK_OK)
            goto fail;
        bk_dev_free(c, dAp);
        dAp = NULL;
    }
    bk_cuda_pmark(c->stream, &tp, "sd.loss_gptq");
    t3 = bk_now();

    r->m = m;
    r->n = n;
    r->groups = alpha.groups;
    r->scales = alpha.scale;
    alpha.scale = NULL;
    if (o->quant.kind == BK_Q_UNIFORM && o->quant.asym) {
        r->zeros = alpha.zero;
        alpha.zero = NULL;
    }
    /* 0 for an absent B or a precomputed factor (never set there) */
    r->damp_a = sa.damp;
    r->damp_b = sb.damp;
    r->damp_retries = sa.retries + sb.retries;
    r->dead_columns = s->dead;
    r->clamped = (int64_t)counts[0];
    r->time_factor_s = t1 - s->t0;
    r->time_solve_s = (double)ms / 1000.0;
    r->time_stats_s = stats || want_gptq ? ts + (t3 - t2) : 0.0;
    if (want_gptq)
        *x->loss_gptq = lgptq;
    state_release(c, s);
    bk_dev_free(c, dWq);
    bk_dev_free(c, dW0);
    bk_dev_free(c, dscale);
    bk_dev_free(c, dzero);
    bk_dev_free(c, dcodes);
    bk_dev_free(c, dweight);
    bk_dev_free(c, dcounts);
    bk_cuda_pmark(c->stream, &tp, "sd.free");
    return BK_OK;

fail:
    bk_cuda_stats_drop(c, &sj); /* (nothing in flight reads what is freed below) */
    cudaStreamSynchronize(c->stream);
    cudaGetLastError();
    bk_dev_free(c, dW);
    bk_dev_free(c, dWq);
    bk_dev_free(c, dW0);
    bk_dev_free(c, dAp);
    bk_dev_free(c, dscale);
    bk_dev_free(c, dzero);
    bk_dev_free(c, dcodes);
    bk_dev_free(c, dweight);
    bk_dev_free(c, dcounts);
    return solve_fail(c, s, r, st);
}

/* The host W as double and the result arrays (both entries). */
bk_status alloc_host(solve_state *s, bk_solve_result *r, const void *W, bk_dtype dt, int64_t m,
                     int64_t n, const char *lw)
{
    const size_t mn = (size_t)m * (size_t)n;
    s->Wd = static_cast<double *>(bk_alloc(mn, sizeof(double)));
    r->codes = static_cast<int16_t *>(bk_alloc(mn, sizeof(int16_t)));
    r->weight = static_cast<float *>(bk_alloc(mn, sizeof(float)));
    if (!s->Wd || !r->codes || !r->weight)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] solve", lw,
                        (long long)m, (long long)n);
    for (size_t t = 0; t < mn; t++)
        s->Wd[t] = in_at(W, dt, t);
    return BK_OK;
}

} // namespace

bk_status bk_cuda_solve(bk_cuda_ctx *c, const bk_solve_problem *p, const bk_solve_opts *o,
                        bk_solve_result *r)
{
    const char *lw = NULL, *la = NULL, *lb = NULL;
    bk_status st = bk_solve_begin(p, o, r, &lw, &la, &lb);
    if (st != BK_OK)
        return st;
    if (!p->A && !p->LA) /* rtn without a Hessian: nothing for the GPU to do */
        return bk_solve(p, o, r);
    const int64_t m = p->m, n = p->n;
    const bk_dtype dt = p->dtype;
    const bk_precision prec = o->precision;
    const int64_t mpad = bk_round_up(m, BK_CUDA_PAD), npad = bk_round_up(n, BK_CUDA_PAD);

    if ((st = bk_solve_check_finite(p->W, dt, m, n, lw)) != BK_OK)
        return st;
    if ((st = bk_solve_check_finite(p->A ? p->A : p->LA, dt, n, n, la)) != BK_OK)
        return st;
    if ((p->B || p->LB) &&
        (st = bk_solve_check_finite(p->B ? p->B : p->LB, dt, m, m, lb)) != BK_OK)
        return st;

    solve_state s;
    memset(&s, 0, sizeof s);
    double *Xh = NULL, mean = 0.0;
    const int stats = o->compute_stats != 0;
    if ((st = bk_alphabet_init(&s.alpha, &o->quant, m, n)) != BK_OK)
        return bk_error_prefix(st, lw);

    s.t0 = bk_now();
    if ((st = alloc_host(&s, r, p->W, dt, m, n, lw)) != BK_OK)
        return solve_fail(c, &s, r, st);

    if (p->A) {
        st = prepare_matrix(p->A, dt, n, la, 1, s.Wd, m, &s.dead, &Xh, &mean);
        if (st == BK_OK)
            st = bk_dside_from_matrix(c, &s.sa, Xh, n, npad, mean, la, o, c->factor_fp64, stats);
    } else {
        st = prepare_factor(p->LA, dt, n, la, &Xh);
        if (st == BK_OK)
            st = bk_dside_from_factor(c, &s.sa, Xh, n, npad, la, prec, stats);
    }
    free(Xh);
    Xh = NULL;
    if (st != BK_OK)
        return solve_fail(c, &s, r, st);
    if (p->B) {
        st = prepare_matrix(p->B, dt, m, lb, 0, NULL, 0, NULL, &Xh, &mean);
        bk_solve_opts ob = *o; /* the output side may have its own damping */
        if (o->separate_damp_b)
            ob.damp = o->damp_b;
        if (st == BK_OK)
            st = bk_dside_from_matrix(c, &s.sb, Xh, m, mpad, mean, lb, &ob, c->factor_fp64,
                                      stats);
    } else if (p->LB) {
        st = prepare_factor(p->LB, dt, m, lb, &Xh);
        if (st == BK_OK)
            st = bk_dside_from_factor(c, &s.sb, Xh, m, mpad, lb, prec, stats);
    } else {
        s.sb.identity = 1;
    }
    free(Xh);
    Xh = NULL;
    if (st != BK_OK)
        return solve_fail(c, &s, r, st);
    return solve_rest(c, o, m, n, lw, &s, NULL, r);
}

void bk_dshare_drop(bk_cuda_ctx *c, bk_dshare *s)
{
    if (!s)
        return;
    if (s->valid)
        bk_dside_free(c, &s->sa);
    memset(&s->sa, 0, sizeof s->sa);
    s->valid = 0;
}

/* ------------------------------------------ an output factor ahead of its solve */

struct bk_dprefetch {
    bk_cuda_ctx *owner;
    bk_cuda_ctx side;     /* the owner's context on the pf stream and handles; its
                             allocations count against the owner's, its frees deferred */
    bk_dev_defer defer;
    const float *B;
    int64_t m, mpad;
    bk_solve_opts ob;     /* the output side's options (damp_b applied) */
    int stats, fp64_factor;
    pthread_t tid;
    bk_status st;         /* the thread's outcome (BK_OK: sb holds the factor) */
    bk_dside sb;
};

namespace {

/* The options that shape an output side: the damping (o->damp_b where
 * separate), its escalation, precision and X~ for the statistics. */
bk_solve_opts output_side_opts(const bk_solve_opts *o)
{
    bk_solve_opts ob = *o;
    if (o->separate_damp_b)
        ob.damp = o->damp_b;
    return ob;
}

/* The prefetch's host thread: solve_dev's output side, step for step, on the
 * pf stream (its errors stay on this thread: the solve redoes the work and
 * reports them). */
void *prefetch_main(void *arg)
{
    bk_dprefetch *pf = static_cast<bk_dprefetch *>(arg);
    bk_cuda_ctx *c = &pf->side;
    const char *lb = "output factor B (ahead)";
    double t = bk_now(), maxb = 0.0, mean = 0.0;
    double *dX = NULL;
    bk_status st = bk_cuda_status(cudaSetDevice(c->device), "the prefetch thread's device",
                                  __FILE__, __LINE__);
    if (st == BK_OK)
        st = dcheck_finite(c, pf->B, pf->m, lb, &maxb);
    if (st == BK_OK)
        st = prepare_dmatrix(c, pf->B, pf->m, maxb, lb, 0, NULL, 0, NULL, &dX, &mean);
    if (st == BK_OK) /* (dX consumed) */
        st = bk_dside_from_dmatrix(c, &pf->sb, dX, pf->m, pf->mpad, mean, lb, &pf->ob,
                                   pf->fp64_factor, pf->stats);
    if (st == BK_OK) /* everything it enqueued is done when the thread is joined */
        st = bk_cuda_status(cudaStreamSynchronize(c->stream), "the prefetch stream", __FILE__,
                            __LINE__);
    pf->st = st;
    bk_prof_add("sd.factor_B_side", bk_now() - t);
    return NULL;
}

/* The pf stream and its handles, made once, with the main handles' settings. */
bk_status prefetch_init(bk_cuda_ctx *c)
{
    if (c->pf_stream && c->pf_blas && c->pf_solver && c->pf_ready)
        return BK_OK;
    int lo = 0, hi = 0;
    if (!c->pf_stream) {
        BK_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
        BK_CUDA_CHECK(cudaStreamCreateWithPriority(&c->pf_stream, cudaStreamNonBlocking, lo));
    }
    if (!c->pf_ready)
        BK_CUDA_CHECK(cudaEventCreateWithFlags(&c->pf_ready, cudaEventDisableTiming));
    /* a handle is kept only once it is bound to the pf stream with the main
     * handle's settings (a half-set one would be taken as ready next time) */
    if (!c->pf_blas) {
        cublasHandle_t h = NULL;
        BK_CUBLAS_CHECK(cublasCreate(&h));
        cublasStatus_t cs = cublasSetStream(h, c->pf_stream);
        if (cs == CUBLAS_STATUS_SUCCESS)
            cs = cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
        if (cs != CUBLAS_STATUS_SUCCESS) {
            cublasDestroy(h);
            return bk_cublas_status(cs, "the prefetch's cuBLAS handle", __FILE__, __LINE__);
        }
        c->pf_blas = h;
    }
    if (!c->pf_solver) {
        cusolverDnHandle_t h = NULL;
        BK_CUSOLVER_CHECK(cusolverDnCreate(&h));
        const cusolverStatus_t ss = cusolverDnSetStream(h, c->pf_stream);
        if (ss != CUSOLVER_STATUS_SUCCESS) {
            cusolverDnDestroy(h);
            return bk_cusolver_status(ss, "the prefetch's cuSOLVER handle", __FILE__, __LINE__);
        }
        c->pf_solver = h;
    }
    return BK_OK;
}

/* Join pf's thread; 1 when its factor serves a solve of an [m, *] problem
 * with output-side options ob (then moved into *out), else 0. pf is
 * released either way. */
int prefetch_take(bk_cuda_ctx *c, bk_dprefetch *pf, int64_t m, const bk_solve_opts *ob,
                  int stats, bk_dside *out)
{
    pthread_join(pf->tid, NULL);
    /* a thread that failed part way may have left work queued on the pf
     * stream (kernels reading B, dX or its workspaces: it synchronizes only
     * on success); everything it enqueued is finished before its buffers,
     * and the aside B the caller frees after this, are released (not left
     * to cudaFree's implicit synchronization) */
    cudaStreamSynchronize(c->pf_stream);
    cudaGetLastError();
    const int ok = pf->st == BK_OK && pf->m == m &&
                   memcmp(&pf->ob.damp, &ob->damp, sizeof ob->damp) == 0 &&
                   pf->ob.max_damp_retries == ob->max_damp_retries &&
                   pf->ob.precision == ob->precision && pf->stats == stats &&
                   pf->fp64_factor == c->factor_fp64;
    if (ok) {
        *out = pf->sb;
        memset(&pf->sb, 0, sizeof pf->sb);
    }
    bk_dside_free(c, &pf->sb);
    bk_dev_defer_flush(c, &pf->defer);
    c->pf_busy = 0;
    free(pf);
    return ok;
}

} // namespace

bk_status bk_dprefetch_start(bk_cuda_ctx *c, const float *B, int64_t m, const bk_solve_opts *o,
                             bk_dprefetch **out)
{
    *out = NULL;
    if (!c || !B || !o || m <= 0)
        return bk_error(BK_ERR_INVALID_ARG, "prefetch: bad arguments");
    if (c->pf_busy)
        return bk_error(BK_ERR_INTERNAL, "prefetch: one is in flight already");
    bk_status st = prefetch_init(c);
    if (st != BK_OK)
        return st;
    bk_dprefetch *pf = static_cast<bk_dprefetch *>(calloc(1, sizeof *pf));
    if (!pf)
        return bk_error(BK_ERR_NOMEM, "prefetch: out of memory");
    pf->owner = c;
    pf->side = *c;
    pf->side.stream = c->pf_stream;
    pf->side.cublas = c->pf_blas;
    pf->side.cusolver = c->pf_solver;
    pf->side.acct = c->acct ? c->acct : c;
    pf->side.defer = &pf->defer;
    pf->B = B;
    pf->m = m;
    pf->mpad = bk_round_up(m, BK_CUDA_PAD);
    pf->ob = output_side_opts(o);
    pf->stats = o->compute_stats != 0;
    pf->fp64_factor = c->factor_fp64;
    /* B is complete on the main stream before the pf stream reads it */
    cudaError_t e = cudaEventRecord(c->pf_ready, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamWaitEvent(c->pf_stream, c->pf_ready, 0);
    if (e != cudaSuccess) {
        free(pf);
        return bk_cuda_status(e, "prefetch: ordering its stream", __FILE__, __LINE__);
    }
    if (pthread_create(&pf->tid, NULL, prefetch_main, pf) != 0) {
        free(pf);
        return bk_error(BK_ERR_INTERNAL, "prefetch: cannot start its thread");
    }
    c->pf_busy = 1;
    *out = pf;
    return BK_OK;
}

void bk_dprefetch_drop(bk_cuda_ctx *c, bk_dprefetch *pf)
{
    if (!pf)
        return;
    bk_dside none;
    memset(&none, 0, sizeof none);
    prefetch_take(c, pf, -1, &pf->ob, pf->stats, &none);
}

namespace {

/* Does the kept side serve this solve: the same A (by name, scale,
 * generation and order) with the same input-side options (damping,
 * escalation, precision, X~ for the statistics, the factorization's
 * precision)? The generation (session-11 review R2) catches a Gram that
 * changed under the same pointer and scale where the caller did not drop the
 * kept side. */
int share_match(const bk_cuda_ctx *c, const bk_dshare *s, int64_t n, const bk_solve_opts *o)
{
    return s->src && s->valid && s->k_src == s->src &&
           memcmp(&s->k_scale, &s->scale, sizeof s->scale) == 0 && s->k_gen == s->gen &&
           s->n == n &&
           s->prec == o->precision && memcmp(&s->damp, &o->damp, sizeof s->damp) == 0 &&
           s->max_retries == o->max_damp_retries && s->stats == (o->compute_stats != 0) &&
           s->fp64_factor == c->factor_fp64;
}

/* bk_cuda_solve_dev; *Wdl: the host copy of p->dW it downloaded (p->W NULL
 * and dead columns), the caller frees it */
bk_status solve_dev(bk_cuda_ctx *c, const bk_dsolve_problem *p, const bk_solve_opts *o,
                    bk_solve_result *r, float *d_weight, double *loss_gptq, float **Wdl,
                    bk_dprefetch **pre)
{
    if (loss_gptq)
        *loss_gptq = NAN;
    if (!p || !o || !r)
        return bk_error(BK_ERR_INVALID_ARG, "solve: problem, options and result must not be NULL");
    memset(r, 0, sizeof *r);
    r->loss_two_sided = r->loss_one_sided = r->bound = NAN;
    const char *lw = p->label_w ? p->label_w : "W";
    const char *la = p->label_a ? p->label_a : "A";
    const char *lb = p->label_b ? p->label_b : "B";
    bk_solve_problem q;
    memset(&q, 0, sizeof q);
    q.m = p->m;
    q.n = p->n;
    q.dtype = BK_DT_F32;
    q.W = p->W ? static_cast<const void *>(p->W) : static_cast<const void *>(p->dW);
    q.A = p->A;
    q.B = p->B;
    bk_status st = bk_solve_check_opts(o);
    if (st == BK_OK)
        st = bk_solve_check_problem(&q, o, lw, la, lb);
    if (st == BK_OK && !p->A)
        st = bk_error(BK_ERR_INVALID_ARG, "%s: the device solve needs the input-side factor A",
                      la);
    if (st != BK_OK)
        return st;
    const int64_t m = p->m, n = p->n;
    const int64_t mpad = bk_round_up(m, BK_CUDA_PAD), npad = bk_round_up(n, BK_CUDA_PAD);
    double max_a = 0.0, max_b = 0.0;
    /* the input side of an earlier solve of the same A, or none kept: a kept
     * side of another A goes before this solve allocates */
    bk_dshare *sh = p->share;
    const int hit = sh && share_match(c, sh, n, o);
    if (sh && !hit)
        bk_dshare_drop(c, sh);

    /* W: on its device copy when there is one (the same first index and
     * message as the host scan) */
    double max_w = 0.0, tp = bk_now();
    if ((st = p->dW ? dcheck_finite_rc(c, p->dW, m, n, lw, &max_w)
                    : bk_solve_check_finite(p->W, BK_DT_F32, m, n, lw)) != BK_OK)
        return st;
    if (!hit && (st = dcheck_finite(c, p->A, n, la, &max_a)) != BK_OK)
        return st; /* (a shared A passed it in the solve that factored it) */
    if (p->B && (st = dcheck_finite(c, p->B, m, lb, &max_b)) != BK_OK)
        return st;
    bk_cuda_pmark(c->stream, &tp, "sd.check_finite");

    solve_state s;
    memset(&s, 0, sizeof s);
    double *dX = NULL, mean = 0.0;
    const int stats = o->compute_stats != 0;
    if ((st = bk_alphabet_init(&s.alpha, &o->quant, m, n)) != BK_OK)
        return bk_error_prefix(st, lw);

    s.t0 = bk_now();
    if (p->dW) {
        /* fast path: W stays on the device; W_d is built only for dead columns */
        r->codes = static_cast<int16_t *>(bk_alloc((size_t)m * (size_t)n, sizeof(int16_t)));
        if (!p->no_host_weight)
            r->weight = static_cast<float *>(bk_alloc((size_t)m * (size_t)n, sizeof(float)));
        if (!r->codes || (!r->weight && !p->no_host_weight))
            return solve_fail(c, &s, r,
                              bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] solve",
                                       lw, (long long)m, (long long)n));
    } else if ((st = alloc_host(&s, r, p->W, BK_DT_F32, m, n, lw)) != BK_OK) {
        return solve_fail(c, &s, r, st);
    }
    bk_cuda_pmark(c->stream, &tp, "sd.host_alloc");
    if (hit) {
        /* A's checks, dead columns, damping and factor from the solve that
         * kept them (s.Wd's dead columns are zeroed below) */
        s.sa = sh->sa;
        s.dead = sh->dead;
        if (sh->keep) {
            s.sa_shared = 1;
        } else { /* the last solve of this A takes the side over */
            memset(&sh->sa, 0, sizeof sh->sa);
            sh->valid = 0;
        }
        sh->hits++;
    } else {
        /* dX is consumed by bk_dside_from_dmatrix (kept as X~ or freed) */
        st = prepare_dmatrix(c, p->A, n, max_a, la, 1, s.Wd, m, &s.dead, &dX, &mean);
    }
    bk_cuda_pmark(c->stream, &tp, "sd.prepare_A");
    if (st == BK_OK && (p->dW || hit) && s.dead > 0) {
        /* dead columns: the host W_d with those columns zeroed, as the host
         * path (built here on the fast path; zeroed here for a shared A) */
        float *diag = static_cast<float *>(malloc(sizeof(float) * (size_t)n));
        if (p->dW)
            s.Wd = static_cast<double *>(bk_alloc((size_t)m * (size_t)n, sizeof(double)));
        if (!diag || !s.Wd)
            st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] solve", lw,
                          (long long)m, (long long)n);
        else
            st = bk_cuda_status(cudaMemcpy2D(diag, sizeof(float), p->A,
                                             (size_t)(n + 1) * sizeof(float), sizeof(float),
                                             (size_t)n, cudaMemcpyDeviceToHost),
                                "the diagonal of A", __FILE__, __LINE__);
        if (st == BK_OK && p->dW && !p->W) {
            /* no host W (the GPU pipeline's BF16 upload): the device copy's
             * values, which are W's */
            *Wdl = static_cast<float *>(bk_alloc((size_t)m * (size_t)n, sizeof(float)));
            if (!*Wdl)
                st = bk_error(BK_ERR_NOMEM, "%s: out of memory for a [%lld, %lld] solve", lw,
                              (long long)m, (long long)n);
            else
                st = bk_cuda_status(cudaMemcpy(*Wdl, p->dW, sizeof(float) * (size_t)m * (size_t)n,
                                               cudaMemcpyDeviceToHost),
                                    "the original weight", __FILE__, __LINE__);
        }
        if (st == BK_OK && p->dW) {
            const float *W = p->W ? p->W : *Wdl;
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++)
                    s.Wd[i * n + j] = (double)diag[j] == 0.0 ? 0.0 : (double)W[i * n + j];
        } else if (st == BK_OK) { /* (s.Wd holds W: alloc_host) */
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++)
                    if ((double)diag[j] == 0.0)
                        s.Wd[i * n + j] = 0.0;
        }
        free(diag);
        if (st != BK_OK) {
            bk_dev_free(c, dX);
            return solve_fail(c, &s, r, st);
        }
    }
    if (st == BK_OK && !hit)
        st = bk_dside_from_dmatrix(c, &s.sa, dX, n, npad, mean, la, o, c->factor_fp64, stats);
    if (st != BK_OK)
        return solve_fail(c, &s, r, st);
    if (sh && !hit && sh->src && sh->keep) { /* kept for the next solves of this A */
        sh->sa = s.sa;
        sh->valid = 1;
        sh->k_src = sh->src;
        sh->k_scale = sh->scale;
        sh->k_gen = sh->gen;
        sh->n = n;
        sh->dead = s.dead;
        sh->prec = o->precision;
        sh->damp = o->damp;
        sh->max_retries = o->max_damp_retries;
        sh->stats = stats;
        sh->fp64_factor = c->factor_fp64;
        s.sa_shared = 1;
    }
    bk_cuda_pmark(c->stream, &tp, "sd.factor_A");
    if (p->B) {
        /* the output side may have its own damping */
        const bk_solve_opts ob = output_side_opts(o);
        /* factored ahead (the same steps on the same B with the same options
         * on the pf stream): waited for and taken; else (none, or it failed:
         * the same steps here, and their messages) factored now */
        int ahead = 0;
        if (*pre) {
            ahead = prefetch_take(c, *pre, m, &ob, stats, &s.sb);
            *pre = NULL;
            bk_prof_add(ahead ? "sd.factor_B_ahead_used" : "sd.factor_B_ahead_redone", 0.0);
        }
        if (!ahead) {
            st = prepare_dmatrix(c, p->B, m, max_b, lb, 0, NULL, 0, NULL, &dX, &mean);
            if (st == BK_OK)
                st = bk_dside_from_dmatrix(c, &s.sb, dX, m, mpad, mean, lb, &ob,
                                           c->factor_fp64, stats);
        }
        bk_cuda_pmark(c->stream, &tp, "sd.factor_B");
    } else {
        s.sb.identity = 1;
    }
    if (st != BK_OK)
        return solve_fail(c, &s, r, st);
    solve_extra x = {p->W ? p->W : *Wdl, p->A_plain, d_weight, loss_gptq, p->dW};
    return solve_rest(c, o, m, n, lw, &s, &x, r);
}

} // namespace

bk_status bk_cuda_solve_dev(bk_cuda_ctx *c, const bk_dsolve_problem *p, const bk_solve_opts *o,
                            bk_solve_result *r, float *d_weight, double *loss_gptq)
{
    float *Wdl = NULL;
    bk_dprefetch *pre = p ? p->pre : NULL;
    bk_status st = solve_dev(c, p, o, r, d_weight, loss_gptq, &Wdl, &pre);
    free(Wdl);
    bk_dprefetch_drop(c, pre); /* (not reached: an earlier exit, or no B) */
    return st;
}
