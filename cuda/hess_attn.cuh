/* CUDA backend — the fully-local attention Hessian blocks (hessian.cu), one
 * work item at a time. The items are __host__ __device__ so that the index
 * arithmetic can also be run on the host (cuda/dev/hess_attn_check.cu
 * compares them with src/hessian.c without a GPU).
 *
 * Notation (src/hessian.c, docs/hessians.md): h = head_dim, h2 = h/2; RoPE
 * rotates the pairs (i, i + h2) by angle t·w_i; R_t is that rotation at
 * position t; rot_sandwich(C) = R_tᵀ C R_t. A "quad" (p, q) is the 2x2 block
 * of rows {p, p+h2} x columns {q, q+h2}: the entries one rotation mixes.
 */
#ifndef BK_HESS_ATTN_CUH
#define BK_HESS_ATTN_CUH

#include <cstdint>

#ifdef __CUDACC__
#define BK_HD __host__ __device__
#else
#define BK_HD
#endif

/* One running Gram per (sequence, block): vectors vec[row, (blk*nv + i)*h ..]
 * (i < nv) are added at each position, forward (prefix: q_proj, the keys of
 * kv head blk) or backward (suffix: k_proj, the queries of its group). */
struct quad_args {
    const float *vec;
    int64_t vstride;
    int nv;
    int64_t S, T, nb, h;
    const float *cs, *sn; /* [T, h/2] RoPE tables */
    const double *w;      /* [S*T] weight of each position, or NULL (all 1) */
    int backward;
    double *part;         /* [S, nb, h, h] */
};

/* o = R_tᵀ C R_t on the quad: C entries c00 = C[p][q], c01 = C[p][q+h2],
 * c10 = C[p+h2][q], c11 = C[p+h2][q+h2]; (cp, sp) the cosine/sine of
 * row pair p, (cq, sq) of column pair q. */
BK_HD inline void rot_quad(double c00, double c01, double c10, double c11, double cp, double sp,
                           double cq, double sq, double *o)
{
    /* tmp = C R_t (columns q, q+h2), then R_tᵀ tmp (rows p, p+h2) */
    const double t00 = c00 * cq + c01 * sq;
    const double t01 = c01 * cq - c00 * sq;
    const double t10 = c10 * cq + c11 * sq;
    const double t11 = c11 * cq - c10 * sq;
    o[0] = t00 * cp + t10 * sp;
    o[1] = t01 * cp + t11 * sp;
    o[2] = t10 * cp - t00 * sp;
    o[3] = t11 * cp - t01 * sp;
}

/* One position of a quad: the running quad Gram c += Σ_i v_i v_iᵀ over the
 * nv vectors of row (h entries each), then acc += wt · R_tᵀ C_t R_t on the
 * quad ((cp, sp), (cq, sq): RoPE of row pair p, column pair q at t). V is
 * float (the activations) or double (a staged copy: the same values). */
template <typename V>
BK_HD inline void quad_step(const V *row, int nv, int64_t h, int64_t p, int64_t q, double cp,
                            double sp, double cq, double sq, double wt, double *c, double *acc)
{
    const int64_t h2 = h / 2;
    for (int i = 0; i < nv; i++) {
        const V *v = row + i * h;
        const double vp = v[p], vP = v[p + h2], vq = v[q], vQ = v[q + h2];
        c[0] += vp * vq;
        c[1] += vp * vQ;
        c[2] += vP * vq;
        c[3] += vP * vQ;
    }
    double o[4];
    rot_quad(c[0], c[1], c[2], c[3], cp, sp, cq, sq, o);
    acc[0] += wt * o[0];
    acc[1] += wt * o[1];
    acc[2] += wt * o[2];
    acc[3] += wt * o[3];
}

BK_HD inline void quad_store(const quad_args &a, int64_t s, int64_t blk, int64_t p, int64_t q,
                             const double *acc)
{
    const int64_t h2 = a.h / 2;
    double *d = a.part + (s * a.nb + blk) * a.h * a.h;
    d[p * a.h + q] = acc[0];
    d[p * a.h + q + h2] = acc[1];
    d[(p + h2) * a.h + q] = acc[2];
    d[(p + h2) * a.h + q + h2] = acc[3];
}

/* Item idx = ((s * nb + blk) * h2 + p) * h2 + q: the quad's running Gram over
 * the positions, and Σ_t w_t R_tᵀ C_t R_t on the quad into part[s, blk]. */
BK_HD inline void quad_item(const quad_args &a, int64_t idx)
{
    const int64_t h2 = a.h / 2, nq = h2 * h2;
    const int64_t q = idx % h2, p = (idx / h2) % h2;
    const int64_t blk = (idx / nq) % a.nb, s = idx / (nq * a.nb);
    double c[4] = {0, 0, 0, 0}, acc[4] = {0, 0, 0, 0};
    for (int64_t step = 0; step < a.T; step++) {
        const int64_t t = a.backward ? a.T - 1 - step : step;
        const float *row = a.vec + (s * a.T + t) * a.vstride + blk * a.nv * a.h;
        const double wt = a.w ? a.w[s * a.T + t] : 1.0;
        quad_step(row, a.nv, a.h, p, q, a.cs[t * h2 + p], a.sn[t * h2 + p], a.cs[t * h2 + q],
                  a.sn[t * h2 + q], wt, c, acc);
    }
    quad_store(a, s, blk, p, q, acc);
}

/* The staged form of the quads (k_attn_quads_staged below): the quads of one
 * (sequence s, block blk) head, tc positions a round. Shared memory of a
 * round, doubles: vs [tc, nv·h] (the head's vectors), cs, sn [tc, h/2] (the
 * RoPE rows), ws [tc] (the weights). Round c0 holds steps c0 .. c0+n-1 (the
 * positions in prefix or suffix order). Thread tid of nthreads copies its
 * share (quad_stage), then each quad runs quad_step over the round
 * (quad_round): the same operations in the same order as quad_item. */
BK_HD inline int64_t quad_round_doubles(const quad_args &a, int64_t tc)
{
    return tc * ((int64_t)a.nv * a.h + 2 * (a.h / 2) + 1);
}

/* Shared memory of one staged round (48 KiB: no opt-in needed). */
constexpr int64_t QUAD_SMEM = 48 * 1024;

/* Positions a staged round holds (at most 32, at most T), or 0 where one
 * position does not fit in QUAD_SMEM (h = 128 fits up to nv = 46). */
BK_HD inline int64_t quad_round_positions(const quad_args &a)
{
    const int64_t per = quad_round_doubles(a, 1) * (int64_t)sizeof(double);
    int64_t tc = QUAD_SMEM / per;
    if (tc > 32)
        tc = 32;
    if (tc > a.T)
        tc = a.T;
    return tc;
}

BK_HD inline void quad_stage(const quad_args &a, int tc, int64_t s, int64_t blk, int64_t c0, int n,
                             int tid, int nthreads, double *sh)
{
    const int vw = a.nv * (int)a.h, h2 = (int)(a.h / 2);
    double *vs = sh, *cs = vs + (int64_t)tc * vw, *sn = cs + (int64_t)tc * h2,
           *ws = sn + (int64_t)tc * h2;
    /* entry e = j·width + r of the round, (j, r) stepped without a division
     * per entry: the loop has no other dependence, so the unrolled loads of
     * several entries are in flight together */
    {
        int j = tid / vw, r = tid % vw;
        const int dj = nthreads / vw, dr = nthreads % vw;
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
        for (int e = tid; e < n * vw; e += nthreads) {
            const int64_t t = a.backward ? a.T - 1 - (c0 + j) : c0 + j;
            vs[e] = a.vec[(s * a.T + t) * a.vstride + blk * vw + r];
            j += dj;
            r += dr;
            if (r >= vw) {
                r -= vw;
                j++;
            }
        }
    }
    {
        int j = tid / h2, r = tid % h2;
        const int dj = nthreads / h2, dr = nthreads % h2;
        for (int e = tid; e < n * h2; e += nthreads) {
            const int64_t t = a.backward ? a.T - 1 - (c0 + j) : c0 + j;
            cs[e] = a.cs[t * h2 + r];
            sn[e] = a.sn[t * h2 + r];
            j += dj;
            r += dr;
            if (r >= h2) {
                r -= h2;
                j++;
            }
        }
    }
    for (int j = tid; j < n; j += nthreads) {
        const int64_t t = a.backward ? a.T - 1 - (c0 + j) : c0 + j;
        ws[j] = a.w ? a.w[s * a.T + t] : 1.0;
    }
}

BK_HD inline void quad_round(const quad_args &a, int tc, const double *sh, int n, int64_t p,
                             int64_t q, double *c, double *acc)
{
    const int vw = a.nv * (int)a.h, h2 = (int)(a.h / 2);
    const double *vs = sh, *cs = vs + (int64_t)tc * vw, *sn = cs + (int64_t)tc * h2,
                 *ws = sn + (int64_t)tc * h2;
    for (int j = 0; j < n; j++)
        quad_step(vs + j * vw, a.nv, a.h, p, q, cs[j * h2 + p], sn[j * h2 + p], cs[j * h2 + q],
                  sn[j * h2 + q], ws[j], c, acc);
}

#ifdef __CUDACC__
/* The quads on the device, positions staged in shared memory. The per-thread
 * form (one thread = one quad_item, reading its four entries of every vector
 * from global memory at every position) is latency-bound: each of the T
 * serial steps waits for global loads (nv of them per step for k_proj) and
 * converts each float to double in every thread. Here a block holds quads
 * of one (sequence, block) head, the same quad per thread as quad_item's
 * index order, and stages tc positions at a time (quad_stage: coalesced
 * loads, converted once); each thread then runs quad_round over them.
 * The same operations in the same order as the per-thread form, but not
 * bitwise the same results on the device: nvcc contracts multiply-adds
 * differently in the two kernels (H200, session 11; test_cuda_hess_quads
 * compares them to 1e-13 relative, test_cuda_hess_items bitwise on the
 * host). */
template <int NOTHING = 0>
__global__ void k_attn_quads_staged(quad_args a, int tc)
{
    extern __shared__ double quad_sh[];
    const int64_t h2 = a.h / 2, nq = h2 * h2;
    const int64_t bph = (nq + blockDim.x - 1) / blockDim.x;
    const int64_t head = blockIdx.x / bph, s = head / a.nb, blk = head % a.nb;
    const int64_t quad = (blockIdx.x % bph) * blockDim.x + threadIdx.x;
    const bool on = quad < nq;
    const int64_t p = on ? quad / h2 : 0, q = on ? quad % h2 : 0;
    double c[4] = {0, 0, 0, 0}, acc[4] = {0, 0, 0, 0};
    for (int64_t c0 = 0; c0 < a.T; c0 += tc) {
        const int n = a.T - c0 < tc ? (int)(a.T - c0) : tc;
        __syncthreads(); /* the previous round's reads are done */
        quad_stage(a, tc, s, blk, c0, n, (int)threadIdx.x, (int)blockDim.x, quad_sh);
        __syncthreads();
        if (on)
            quad_round(a, tc, quad_sh, n, p, q, c, acc);
    }
    if (on)
        quad_store(a, s, blk, p, q, acc);
}

template <int NOTHING = 0>
__global__ void k_attn_quads_thread(quad_args a)
{
    const int64_t n = a.S * a.nb * (a.h / 2) * (a.h / 2);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        quad_item(a, i);
}

/* All quads of a: part[s, blk] for every sequence and block. Staged when one
 * position fits in QUAD_SMEM (quad_round_positions), else one thread per
 * quad_item; per_thread forces the latter (the test compares the two).
 * Returns the launch's error. */
inline cudaError_t quads_launch(const quad_args &a, cudaStream_t stream, int per_thread)
{
    const int64_t nq = (a.h / 2) * (a.h / 2), n = a.S * a.nb * nq;
    const int64_t tc = quad_round_positions(a);
    if (n <= 0)
        return cudaSuccess;
    if (per_thread || tc < 1) {
        int64_t b = (n + 255) / 256;
        if (b > 1048576)
            b = 1048576;
        k_attn_quads_thread<<<(unsigned)b, 256, 0, stream>>>(a);
        return cudaGetLastError();
    }
    /* 256 threads, or the quads of a small head rounded up to a warp */
    const int64_t bd = nq >= 256 ? 256 : (nq + 31) / 32 * 32;
    const int64_t grid = a.S * a.nb * ((nq + bd - 1) / bd);
    if (grid > 2147483647)
        return cudaErrorInvalidConfiguration;
    k_attn_quads_staged<<<(unsigned)grid, (unsigned)bd,
                          (size_t)quad_round_doubles(a, tc) * sizeof(double), stream>>>(a, (int)tc);
    return cudaGetLastError();
}
#endif

/* Shampoo A-weights without q/k norm: wout[s*T + t] = mult · Σ_blk tr(C_t)
 * (tr R_tᵀ C R_t = tr C, the running Σ |v|² over the positions seen; the CPU
 * adds the trace of each of the mult identical blocks). Three steps, each
 * parallel (a single thread per sequence made this the slowest Hessian on the
 * GPU: its cost grew with the number of micro-batches):
 * 1. rows[(s*nb + blk)*T + t] = Σ_c v_c² over block blk's nv·h entries at t
 *    (item = (s, blk, t));
 * 2. the running sum of rows over t, forward or backward, in place
 *    (item = (s, blk));
 * 3. wout[s*T + t] = Σ_blk Σ_{mult} rows[s, blk, t] (item = (s, t)). */
BK_HD inline void trace_rows_item(const float *vec, int64_t vstride, int nv, int64_t T,
                                  int64_t nb, int64_t h, double *rows, int64_t idx)
{
    const int64_t t = idx % T, blk = (idx / T) % nb, s = idx / (T * nb);
    const float *row = vec + (s * T + t) * vstride + blk * nv * h;
    double acc = 0.0;
    for (int64_t c = 0; c < nv * h; c++) {
        const double v = row[c];
        acc += v * v;
    }
    rows[idx] = acc;
}

BK_HD inline void trace_scan_item(double *rows, int64_t T, int backward, int64_t idx)
{
    double *r = rows + idx * T, run = 0.0;
    for (int64_t step = 0; step < T; step++) {
        const int64_t t = backward ? T - 1 - step : step;
        run += r[t];
        r[t] = run;
    }
}

BK_HD inline void trace_sum_item(const double *rows, int64_t T, int64_t nb, int mult,
                                 double *wout, int64_t idx)
{
    const int64_t t = idx % T, s = idx / T;
    double acc = 0.0;
    for (int64_t blk = 0; blk < nb; blk++) {
        const double v = rows[(s * nb + blk) * T + t];
        for (int m = 0; m < mult; m++)
            acc += v;
    }
    wout[idx] = acc;
}

/* ---- with q_norm / k_norm: one position t in five rounds ----
 * nb blocks (kv heads) of running Grams C; nn normalized heads; head m
 * belongs to block m / (nn / nb) and has the pre-norm vector
 * z[row, m*h ..] and the norm weight gamma (src/hessian.c norm_sandwich). */
struct qn_args {
    const float *vec;
    int64_t vstride;
    int nv;
    const float *z;
    int64_t zstride;
    const float *gamma; /* [h] */
    int64_t S, T, nb, nn, h;
    const float *cs, *sn;
    double eps;
    const double *w; /* [S*T] or NULL */
    double *C, *M;   /* [S, nb, h, h] */
    double *acc;     /* [S, nn, h, h] */
    double *v;       /* [S, nn, h] */
    double *sc;      /* [S, nn, 4]: rho2, beta, alpha */
    double *tr;      /* [S, nn, T] or NULL */
};

/* 1. C[s, blk] += Σ_i vec_i vec_iᵀ (item = (s, blk, entry)) */
BK_HD inline void qn_gram_item(const qn_args &a, int64_t t, int64_t idx)
{
    const int64_t hh = a.h * a.h;
    const int64_t e = idx % hh, blk = (idx / hh) % a.nb, s = idx / (hh * a.nb);
    const int64_t i = e / a.h, j = e % a.h;
    const float *row = a.vec + (s * a.T + t) * a.vstride + blk * a.nv * a.h;
    double c = a.C[idx];
    for (int k = 0; k < a.nv; k++)
        c += (double)row[k * a.h + i] * (double)row[k * a.h + j];
    a.C[idx] = c;
}

/* 2. M = R_tᵀ C R_t (item = (s, blk, quad)) */
BK_HD inline void qn_rot_item(const qn_args &a, int64_t t, int64_t idx)
{
    const int64_t h2 = a.h / 2, nq = h2 * h2;
    const int64_t q = idx % h2, p = (idx / h2) % h2, sb = idx / nq;
    const double *C = a.C + sb * a.h * a.h;
    double *M = a.M + sb * a.h * a.h;
    double o[4];
    rot_quad(C[p * a.h + q], C[p * a.h + q + h2], C[(p + h2) * a.h + q],
             C[(p + h2) * a.h + q + h2], a.cs[t * h2 + p], a.sn[t * h2 + p], a.cs[t * h2 + q],
             a.sn[t * h2 + q], o);
    M[p * a.h + q] = o[0];
    M[p * a.h + q + h2] = o[1];
    M[(p + h2) * a.h + q] = o[2];
    M[(p + h2) * a.h + q + h2] = o[3];
}

/* 3. v[s, m, i] = Σ_j (γ_i M_ij γ_j) z_j (item = (s, m, i)) */
BK_HD inline void qn_v_item(const qn_args &a, int64_t t, int64_t idx)
{
    const int64_t i = idx % a.h, m = (idx / a.h) % a.nn, s = idx / (a.h * a.nn);
    const int64_t blk = m / (a.nn / a.nb);
    const double *M = a.M + (s * a.nb + blk) * a.h * a.h;
    const float *z = a.z + (s * a.T + t) * a.zstride + m * a.h;
    double acc = 0.0;
    for (int64_t j = 0; j < a.h; j++)
        acc += ((double)a.gamma[i] * M[i * a.h + j] * (double)a.gamma[j]) * (double)z[j];
    a.v[idx] = acc;
}

/* 4. rho2 = 1 / (mean(z²) + eps), beta = rho2 / h, alpha = zᵀ v, and the
 * trace of the sandwiched block when wanted (item = (s, m)) */
BK_HD inline void qn_scalars_item(const qn_args &a, int64_t t, int64_t idx)
{
    const int64_t m = idx % a.nn, s = idx / a.nn;
    const int64_t blk = m / (a.nn / a.nb);
    const float *z = a.z + (s * a.T + t) * a.zstride + m * a.h;
    const double *v = a.v + idx * a.h;
    double ms = 0.0, alpha = 0.0;
    for (int64_t i = 0; i < a.h; i++) {
        ms += (double)z[i] * (double)z[i];
        alpha += (double)z[i] * v[i];
    }
    ms /= (double)a.h;
    const double rho2 = 1.0 / (ms + a.eps), beta = rho2 / (double)a.h;
    a.sc[idx * 4 + 0] = rho2;
    a.sc[idx * 4 + 1] = beta;
    a.sc[idx * 4 + 2] = alpha;
    if (a.tr) {
        const double *M = a.M + (s * a.nb + blk) * a.h * a.h;
        double tr = 0.0;
        for (int64_t i = 0; i < a.h; i++) {
            const double zi = z[i], g = a.gamma[i];
            const double out = g * M[i * a.h + i] * g;
            const double val = out - beta * zi * v[i] - beta * v[i] * zi + beta * beta * alpha * zi * zi;
            tr += rho2 * val;
        }
        a.tr[idx * a.T + t] = tr;
    }
}

/* 5. acc[s, m] += w_t rho2 (γ_i M_ij γ_j - β z_i v_j - β v_i z_j + β² α z_i z_j)
 * (item = (s, m, entry)) */
BK_HD inline void qn_acc_item(const qn_args &a, int64_t t, int64_t idx)
{
    const int64_t hh = a.h * a.h;
    const int64_t e = idx % hh, sm = idx / hh, m = sm % a.nn, s = sm / a.nn;
    const int64_t i = e / a.h, j = e % a.h;
    const int64_t blk = m / (a.nn / a.nb);
    const double *M = a.M + (s * a.nb + blk) * hh;
    const float *z = a.z + (s * a.T + t) * a.zstride + m * a.h;
    const double *v = a.v + sm * a.h;
    const double rho2 = a.sc[sm * 4 + 0], beta = a.sc[sm * 4 + 1], alpha = a.sc[sm * 4 + 2];
    const double zi = z[i], zj = z[j];
    const double out = (double)a.gamma[i] * M[i * a.h + j] * (double)a.gamma[j];
    const double val = out - beta * zi * v[j] - beta * v[i] * zj + beta * beta * alpha * zi * zj;
    const double wt = a.w ? a.w[s * a.T + t] : 1.0;
    a.acc[idx] += wt * (rho2 * val);
}

/* ---- with q_norm / k_norm: a round of positions at a time ----
 * The five rounds above, one position each, meant 5 launches per position
 * (2 x 5 x T per micro-batch: launch-bound). Only the running Gram C is
 * sequential over the positions; the rest of a position reads C_t alone. So
 * a round of n positions (steps c0 .. c0+n-1 in prefix or suffix order) is
 * four launches: the Gram and its sandwich M_j per quad for every position
 * of the round in order (qn_gramrot_item), v and the scalars for every
 * (position, head) (qn_slot: per-position copies j of M, v, sc), and the
 * accumulation per entry over the round's positions in order. Every entry
 * sees the same operations in the same order as the per-position rounds
 * (bitwise equal on the host; on the device within 1e-13 relative, not
 * bitwise: multiply-add contraction differs between the kernels). */
BK_HD inline int64_t qn_t(const qn_args &a, int backward, int64_t c0, int64_t j)
{
    return backward ? a.T - 1 - (c0 + j) : c0 + j;
}

/* a with M, v, sc moved to position slot j of a round */
BK_HD inline qn_args qn_slot(const qn_args &a, int64_t j)
{
    qn_args b = a;
    b.M = a.M + j * a.S * a.nb * a.h * a.h;
    b.v = a.v + j * a.S * a.nn * a.h;
    b.sc = a.sc + j * a.S * a.nn * 4;
    return b;
}

/* 1 + 2 for a round (item = (s, blk, quad)): C updated entry by entry as
 * qn_gram_item, M_j = R_tᵀ C R_t as qn_rot_item into slot j */
BK_HD inline void qn_gramrot_item(const qn_args &a, int backward, int64_t c0, int64_t n, int64_t idx)
{
    const int64_t h = a.h, h2 = h / 2, nq = h2 * h2, hh = h * h;
    const int64_t q = idx % h2, p = (idx / h2) % h2, sb = idx / nq;
    const int64_t s = sb / a.nb, blk = sb % a.nb;
    const int64_t ii[4] = {p, p, p + h2, p + h2}, jj[4] = {q, q + h2, q, q + h2};
    double *C = a.C + sb * hh;
    double c[4];
    for (int u = 0; u < 4; u++)
        c[u] = C[ii[u] * h + jj[u]];
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = qn_t(a, backward, c0, j);
        const float *row = a.vec + (s * a.T + t) * a.vstride + blk * a.nv * h;
        for (int u = 0; u < 4; u++)
            for (int k = 0; k < a.nv; k++)
                c[u] += (double)row[k * h + ii[u]] * (double)row[k * h + jj[u]];
        double o[4];
        rot_quad(c[0], c[1], c[2], c[3], a.cs[t * h2 + p], a.sn[t * h2 + p], a.cs[t * h2 + q],
                 a.sn[t * h2 + q], o);
        double *M = qn_slot(a, j).M + sb * hh;
        for (int u = 0; u < 4; u++)
            M[ii[u] * h + jj[u]] = o[u];
    }
    for (int u = 0; u < 4; u++)
        C[ii[u] * h + jj[u]] = c[u];
}

/* 3 for a round (item = (j, s, m, i)) */
BK_HD inline void qn_v_round_item(const qn_args &a, int backward, int64_t c0, int64_t idx)
{
    const int64_t per = a.S * a.nn * a.h, j = idx / per;
    qn_v_item(qn_slot(a, j), qn_t(a, backward, c0, j), idx % per);
}

/* 4 for a round (item = (j, s, m)) */
BK_HD inline void qn_scalars_round_item(const qn_args &a, int backward, int64_t c0, int64_t idx)
{
    const int64_t per = a.S * a.nn, j = idx / per;
    qn_scalars_item(qn_slot(a, j), qn_t(a, backward, c0, j), idx % per);
}

/* 5 for a round (item = (s, m, entry)): the positions in order */
BK_HD inline void qn_acc_round_item(const qn_args &a, int backward, int64_t c0, int64_t n, int64_t idx)
{
    for (int64_t j = 0; j < n; j++)
        qn_acc_item(qn_slot(a, j), qn_t(a, backward, c0, j), idx);
}

#ifdef __CUDACC__
#define BK_QN_LOOP(i, n)                                                                     \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n);              \
         i += (int64_t)gridDim.x * blockDim.x)

template <int NOTHING = 0>
__global__ void k_qn_gramrot(qn_args a, int bwd, int64_t c0, int64_t n)
{
    BK_QN_LOOP(idx, a.S * a.nb * (a.h / 2) * (a.h / 2))
    qn_gramrot_item(a, bwd, c0, n, idx);
}

template <int NOTHING = 0>
__global__ void k_qn_v_round(qn_args a, int bwd, int64_t c0, int64_t n)
{
    BK_QN_LOOP(idx, n * a.S * a.nn * a.h)
    qn_v_round_item(a, bwd, c0, idx);
}

template <int NOTHING = 0>
__global__ void k_qn_scalars_round(qn_args a, int bwd, int64_t c0, int64_t n)
{
    BK_QN_LOOP(idx, n * a.S * a.nn)
    qn_scalars_round_item(a, bwd, c0, idx);
}

template <int NOTHING = 0>
__global__ void k_qn_acc_round(qn_args a, int bwd, int64_t c0, int64_t n)
{
    BK_QN_LOOP(idx, a.S * a.nn * a.h * a.h)
    qn_acc_round_item(a, bwd, c0, n, idx);
}
#undef BK_QN_LOOP

inline unsigned qn_grid(int64_t n)
{
    int64_t b = (n + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > 1048576 ? 1048576 : b);
}

/* Every position of a q/k-norm part (prefix: backward 0, suffix: 1) in
 * rounds of nr positions; a.M, a.v, a.sc hold nr positions, a.C and a.acc
 * start zeroed (the caller's). Returns the first launch error. */
inline cudaError_t qn_rounds_launch(const qn_args &a, int backward, int64_t nr, cudaStream_t stream)
{
    const int64_t hh = a.h * a.h;
    for (int64_t c0 = 0; c0 < a.T; c0 += nr) {
        const int64_t n = a.T - c0 < nr ? a.T - c0 : nr;
        k_qn_gramrot<<<qn_grid(a.S * a.nb * hh / 4), 256, 0, stream>>>(a, backward, c0, n);
        k_qn_v_round<<<qn_grid(n * a.S * a.nn * a.h), 256, 0, stream>>>(a, backward, c0, n);
        k_qn_scalars_round<<<qn_grid(n * a.S * a.nn), 256, 0, stream>>>(a, backward, c0, n);
        k_qn_acc_round<<<qn_grid(a.S * a.nn * hh), 256, 0, stream>>>(a, backward, c0, n);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}
#endif

#endif /* BK_HESS_ATTN_CUH */
