/* CUDA backend — the backward pass and its flows on the GPU
 * (src/backward_gpu.h; docs/hessians.md "Backprop", "On the GPU").
 *
 * src/backward.c and src/backward_flow.c step for step, on one micro-batch
 * at a time, templated on the storage type R (double: parity mode, float:
 * F32 GEMMs; see src/backward_gpu.h for the arithmetic of each):
 *
 *   GEMMs        cuBLAS DGEMM / SGEMM (default math: no TF32) on row-major
 *                arrays (C = op(A) op(B) is col-major Cᵀ = op(B)ᵀ op(A)ᵀ);
 *   attention    per query head j, strided-batched over the sequences of the
 *                micro-batch: P = scale Q_j K_gᵀ, causal softmax one warp per
 *                row (max subtraction, double sums), O_j = P V_g; the backward
 *                recomputes P and forms dV_g += Pᵀ dO_j, dP = dO_j V_gᵀ,
 *                dS = P ⊙ (dP - rowsum(P ⊙ dP)), dQ_j = scale dS K_g,
 *                dK_g += scale dSᵀ Q_j (the CPU's order of heads);
 *   RMSNorm      one warp per row, sums in double, the saved 1/rms in double;
 *   RoPE         src/rope.c's float tables; the adjoint is the transposed
 *                rotation;
 *   head         final norm, LM head (lm_head, or embed_tokens when tied)
 *                resident in R, logits in the CPU's vocabulary blocks: per
 *                row the running max and Σ exp(l - max) in double; sampled
 *                labels by the inverse CDF, one warp per row scanning the
 *                vocabulary in order (a warp prefix sum per 32 entries)
 *                against U·Σ with the CPU's uniforms U = bk__bwd_uniform(seed,
 *                sequence, position) computed on the host; then
 *                dlogits = softmax - onehot and dxf += dlogits W_block;
 *   speed modes  --bwd-precision tf32 / bf16: the output-gradient Grams per
 *                micro-batch on tensor cores (F32), added in double; bf16:
 *                the layer weights cached as BF16, BF16 x BF16 layer GEMMs,
 *                the layer forward's attention fused (attn_flash.cu) and,
 *                with the same condition (head_dim 64 / 128), the layer
 *                backward's (attn_flash_bwd.cu: no [B, T, T] arrays);
 *   flows        naive I and recursive halving as src/backward_flow.c,
 *                micro-batch by micro-batch; the boundary matrices X_mid,
 *                G_mid, G_L in pinned host memory in R (bf16: in BF16, with
 *                h and dh rounded to BF16 at every layer boundary in both
 *                flows, so storing them is exact), copied in and out per
 *                micro-batch.
 *
 * Deterministic: the same kernels and GEMMs in the same order for a
 * micro-batch whichever flow runs it, no atomics on values (the only atomic
 * is the index of the first non-finite entry), so recursive halving and
 * naive I deliver the same bits and a rerun with the same seed is identical.
 */
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "attn_softmax.cuh" /* k_softmax, k_dsoftmax, warp_sum, warp_max */
#include "backend_impl.h"
#include "backward_gpu.h"
#include "bwd_mem.h" /* bk_bwd_cache_layers, bk_gpu_stage_reserve */
#include "cuda_internal.cuh"
#include "forward_internal.h"
#include "fwd_internal.cuh" /* bk_attn_flash (attn_flash.cu) */

extern "C" {
#include "backward_internal.h"
#include "rope.h"
#include "util.h"
}

#include "bakron/pipeline.h" /* BK_BWD_* */
#include "bakron/safetensors.h"

namespace {

/* Logit blocks of at most this many entries, head rows per block at most
 * this many (as src/backward.c, so the blocks are the CPU's). */
const int64_t LOGIT_BLOCK = (int64_t)1 << 22;
const int64_t HEAD_BLOCK = (int64_t)1 << 21;

inline unsigned grid_for(int64_t n)
{
    int64_t b = (n + 255) / 256;
    if (b < 1)
        b = 1;
    if (b > 65535 * 16)
        b = 65535 * 16;
    return (unsigned)b;
}

/* warps of 32 in blocks of 256: one warp per row */
inline unsigned warp_grid(int64_t rows)
{
    int64_t b = (rows + 7) / 8;
    return (unsigned)(b < 1 ? 1 : b);
}

#define GSTRIDE(i, n)                                                                    \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n);            \
         i += (int64_t)gridDim.x * blockDim.x)

/* ---------------------------------------------------------------- kernels */

template <typename R> __global__ void k_from_f32(R *dst, const float *src, int64_t n)
{
    GSTRIDE(i, n) dst[i] = (R)src[i];
}

template <typename R> __global__ void k_to_f64(double *dst, const R *src, int64_t n)
{
    GSTRIDE(i, n) dst[i] = (double)src[i];
}

template <typename R> __global__ void k_to_bf16_rn(const R *src, __nv_bfloat16 *dst, int64_t n)
{
    GSTRIDE(i, n) dst[i] = __float2bfloat16_rn((float)src[i]);
}

/* --bwd-precision bf16, a layer boundary: x rounded to the nearest BF16
 * (even on ties; the bits of __float2bfloat16_rn), kept as F32 */
__global__ void k_round_bf16(float *x, int64_t n)
{
    GSTRIDE(i, n) x[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
}

/* a BF16 boundary back to F32 (exact) */
__global__ void k_bf16_to_f32(const __nv_bfloat16 *src, float *dst, int64_t n)
{
    GSTRIDE(i, n) dst[i] = __bfloat162float(src[i]);
}

/* token-major src [N, heads*hd] -> BF16 group-major dst [S, heads/rep, T,
 * rep, hd] (attn_flash.cu's layout; rep = 1: [S, heads, T, hd]) */
__global__ void k_tok_to_groups_bf16(const float *src, int64_t N, int64_t T, int64_t heads,
                                     int64_t hd, int64_t rep, __nv_bfloat16 *dst)
{
    const int64_t w = heads * hd;
    GSTRIDE(idx, N * w)
    {
        const int64_t c = idx % w, n = idx / w;
        const int64_t head = c / hd, i = c % hd, s = n / T, pos = n % T;
        dst[(((s * (heads / rep) + head / rep) * T + pos) * rep + head % rep) * hd + i] =
            __float2bfloat16_rn(src[idx]);
    }
}

/* h[n] = table[tok[n]] (rows of d): the embedding of a micro-batch from the
 * device copy of embed_tokens in R (the values bk_convert gives on the host) */
template <typename R>
__global__ void k_embed_rows(const R *table, const int32_t *tok, int64_t N, int64_t d, R *h)
{
    GSTRIDE(i, N * d) h[i] = table[(int64_t)tok[i / d] * d + i % d];
}

template <typename R> __global__ void k_bias(R *Y, int64_t rows, int64_t cols, const R *b)
{
    GSTRIDE(i, rows * cols) Y[i] = (R)((double)Y[i] + (double)b[i % cols]);
}

/* out = a + b */
template <typename R> __global__ void k_add(R *out, const R *a, const R *b, int64_t n)
{
    GSTRIDE(i, n) out[i] = (R)((double)a[i] + (double)b[i]);
}

/* y = w ⊙ x r, r = (mean(x²) + eps)^(-1/2) per row; r saved */
template <typename R>
__global__ void k_rms_fwd(const R *x, int64_t rows, int64_t n, const R *w, double eps, double *r,
                          R *y)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows)
        return;
    const R *xr = x + row * n;
    R *yr = y + row * n;
    double ss = 0;
    for (int64_t k = lane; k < n; k += 32) {
        double v = (double)xr[k];
        ss += v * v;
    }
    ss = warp_sum(ss);
    const double inv = 1.0 / sqrt(ss / (double)n + eps);
    if (lane == 0)
        r[row] = inv;
    for (int64_t k = lane; k < n; k += 32)
        yr[k] = (R)((double)w[k] * ((double)xr[k] * inv));
}

/* dx (= or +=) r (w ⊙ dy) - r³ x (Σ w dy x) / n */
template <typename R>
__global__ void k_rms_back(const R *x, const double *r, int64_t rows, int64_t n, const R *w,
                           const R *dy, int accumulate, R *dx)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows)
        return;
    const R *xr = x + row * n, *dyr = dy + row * n;
    R *dxr = dx + row * n;
    double dot = 0;
    for (int64_t k = lane; k < n; k += 32)
        dot += (double)w[k] * (double)dyr[k] * (double)xr[k];
    dot = warp_sum(dot);
    const double ri = r[row];
    const double c = ri * ri * ri * dot / (double)n;
    for (int64_t k = lane; k < n; k += 32) {
        double v = ri * (double)w[k] * (double)dyr[k] - c * (double)xr[k];
        dxr[k] = (R)(accumulate ? (double)dxr[k] + v : v);
    }
}

/* rotate the heads of every row (token n at position n % T); sign -1: the
 * transposed rotation */
template <typename R>
__global__ void k_rope(R *x, int64_t N, int64_t T, int64_t heads, int64_t hd, const float *cs,
                       const float *sn, int sign)
{
    const int64_t h2 = hd / 2;
    GSTRIDE(idx, N * heads * h2)
    {
        const int64_t i = idx % h2, rr = idx / h2;
        const int64_t head = rr % heads, n = rr / heads, pos = n % T;
        R *v = x + n * heads * hd + head * hd;
        double a = (double)v[i], b = (double)v[i + h2];
        double s = sign > 0 ? (double)sn[pos * h2 + i] : -(double)sn[pos * h2 + i];
        double c = (double)cs[pos * h2 + i];
        v[i] = (R)(a * c - b * s);
        v[i + h2] = (R)(b * c + a * s);
    }
}

__device__ inline double sigm(double z)
{
    return 1.0 / (1.0 + exp(-z));
}

template <typename R> __global__ void k_swiglu(const R *zg, const R *zu, R *m, int64_t n)
{
    GSTRIDE(i, n)
    {
        double z = (double)zg[i];
        m[i] = (R)(z * sigm(z) * (double)zu[i]);
    }
}

template <typename R>
__global__ void k_swiglu_back(const R *zg, const R *zu, const R *dm, R *dzg, R *dzu, int64_t n)
{
    GSTRIDE(i, n)
    {
        double z = (double)zg[i], sg = sigm(z), d = (double)dm[i];
        dzu[i] = (R)(d * z * sg);
        dzg[i] = (R)(d * (double)zu[i] * sg * (1.0 + z * (1.0 - sg)));
    }
}

/* index of the first non-finite entry (atomicMin; *flag starts at ~0) */
template <typename R>
__global__ void k_first_bad(const R *x, int64_t n, unsigned long long *flag)
{
    GSTRIDE(i, n)
    if (!isfinite((double)x[i]))
        atomicMin(flag, (unsigned long long)i);
}

/* Σ x² per row (double), one warp per row */
template <typename R> __global__ void k_row_sq(const R *x, int64_t rows, int64_t n, double *out)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows)
        return;
    double ss = 0;
    for (int64_t k = lane; k < n; k += 32) {
        double v = (double)x[row * n + k];
        ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0)
        out[row] = ss;
}

template <typename O> __device__ inline O from_double(double v)
{
    return (O)v;
}

/* (through F32, as the F32 arrays that cuBLAS's 32F_FAST_16BF rounds) */
template <> __device__ inline __nv_bfloat16 from_double<__nv_bfloat16>(double v)
{
    return __float2bfloat16_rn((float)v);
}

/* out = sqrt(w[row]) g (w NULL: 1), computed in double, stored as O (double
 * for DSYRK; float / BF16 for the tensor-core Grams of --bwd-precision tf32 /
 * bf16) */
template <typename R, typename O>
__global__ void k_scale_rows(const R *g, int64_t rows, int64_t m, const double *w, O *out)
{
    GSTRIDE(i, rows * m)
    {
        const double v = (double)g[i];
        out[i] = from_double<O>(w ? sqrt(w[i / m]) * v : v);
    }
}

/* G += C on the column-major lower triangle (row >= column) of [m, m], one
 * panel of columns [j0, j0 + w) at a time: a micro-batch's F32 Gram into the
 * double accumulator (the entries DSYRK with CUBLAS_FILL_MODE_LOWER would
 * write; the others stay untouched). P: the panel's rows [j0, m), column c
 * at P[c * m + j0 + r] (the GEMM's output at P + j0, leading dimension m);
 * every lower entry of the panel's columns lies in those rows, so each entry
 * is added once, from the same GEMM as when the whole [m, m] was formed
 * first (the same sums in the same order) */
__global__ void k_gram_acc_panel(double *G, const float *P, int64_t m, int64_t j0, int64_t w)
{
    const int64_t h = m - j0;
    GSTRIDE(idx, h * w)
    {
        const int64_t c = idx / h, r = idx % h;
        if (r >= c)
            G[(j0 + c) * m + j0 + r] += (double)P[c * m + j0 + r];
    }
}

/* ---- head */

__global__ void k_lse_init(double *mx, double *se, int64_t N)
{
    GSTRIDE(r, N)
    {
        mx[r] = -INFINITY;
        se[r] = 0;
    }
}

/* one vocabulary block of n logits per row: the CPU's running max / sum */
template <typename R>
__global__ void k_lse_block(const R *lg, int64_t N, int64_t n, double *mx, double *se)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= N)
        return;
    const R *pr = lg + row * n;
    double cm = -INFINITY;
    for (int64_t j = lane; j < n; j += 32)
        cm = fmax(cm, (double)pr[j]);
    cm = warp_max(cm);
    double m0 = mx[row], s0 = se[row];
    if (cm > m0) {
        s0 *= exp(m0 - cm);
        m0 = cm;
    }
    double acc = 0;
    for (int64_t j = lane; j < n; j += 32)
        acc += exp((double)pr[j] - m0);
    acc = warp_sum(acc);
    if (lane == 0) {
        mx[row] = m0;
        se[row] = s0 + acc;
    }
}

/* target U·Σ, running sum 0, fallback V - 1, no label yet */
__global__ void k_sample_init(const double *U, const double *se, double *tg, double *cum,
                              int32_t *last, int32_t *lab, int64_t N, int64_t V)
{
    GSTRIDE(r, N)
    {
        tg[r] = U[r] * se[r];
        cum[r] = 0;
        last[r] = (int32_t)(V - 1);
        lab[r] = -1;
    }
}

/* inverse CDF over one block: the first v with Σ_{u<=v} exp(l_u - max) > U·Σ */
template <typename R>
__global__ void k_sample_block(const R *lg, int64_t N, int64_t n, int64_t v0, const double *mx,
                               const double *tg, double *cum, int32_t *last, int32_t *lab)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= N || lab[row] >= 0)
        return;
    const R *pr = lg + row * n;
    const double m = mx[row], target = tg[row];
    double c = cum[row];
    int32_t lst = last[row];
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
        const int64_t j = j0 + lane;
        const double e = j < n ? exp((double)pr[j] - m) : 0.0;
        double s = e;
        for (int o = 1; o < 32; o <<= 1) {
            double t = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o)
                s += t;
        }
        const unsigned pos = __ballot_sync(0xffffffffu, j < n && e > 0);
        const unsigned hit = __ballot_sync(0xffffffffu, j < n && c + s > target);
        if (hit) {
            if (lane == 0)
                lab[row] = (int32_t)(v0 + j0 + (__ffs(hit) - 1));
            return;
        }
        if (pos)
            lst = (int32_t)(v0 + j0 + (31 - __clz(pos)));
        c += __shfl_sync(0xffffffffu, s, 31);
    }
    if (lane == 0) {
        cum[row] = c;
        last[row] = lst;
    }
}

__global__ void k_sample_finish(int32_t *lab, const int32_t *last, int64_t N)
{
    GSTRIDE(r, N)
    if (lab[r] < 0)
        lab[r] = last[r];
}

__global__ void k_lse(const double *mx, const double *se, double *lse, int64_t N)
{
    GSTRIDE(r, N) lse[r] = mx[r] + log(se[r]);
}

/* dlogits = softmax - onehot over one block (rows without a label: 0); the
 * target's logit saved for the loss */
template <typename R>
__global__ void k_head_grad(R *lg, int64_t N, int64_t n, int64_t v0, const int32_t *lab,
                            const double *lse, double *tgl)
{
    GSTRIDE(i, N * n)
    {
        const int64_t r = i / n, j = i % n;
        const int32_t y = lab[r];
        if (y < 0) {
            lg[i] = (R)0;
            continue;
        }
        const double l = (double)lg[i];
        if (v0 + j == y)
            tgl[r] = l;
        lg[i] = (R)(exp(l - lse[r]) - (v0 + j == y ? 1.0 : 0.0));
    }
}

/* ---------------------------------------------------------------- GEMMs */

/* The GEMM handle and, for F32 storage, the compute type: CUBLAS_COMPUTE_32F
 * is IEEE F32 (cublasSgemm with the default math mode, no TF32); the
 * _FAST_TF32 / _FAST_16BF types run the F32 arrays on tensor cores
 * (--bwd-precision tf32 / bf16; F32 accumulation). */
struct blas_t {
    cublasHandle_t h;
    cublasComputeType_t ct;
};

/* row-major C[M, N] = alpha op(A) op(B) + beta C (cblas RowMajor semantics) */
cublasStatus_t rm_gemm(const blas_t &bl, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                       double alpha, const double *A, int64_t lda, const double *B, int64_t ldb,
                       double beta, double *C, int64_t ldc)
{
    return cublasDgemm(bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                       (int)N, (int)M, (int)K, &alpha, B, (int)ldb, A, (int)lda, &beta, C,
                       (int)ldc);
}

cublasStatus_t rm_gemm(const blas_t &bl, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                       double alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                       double beta, float *C, int64_t ldc)
{
    float a = (float)alpha, b = (float)beta;
    if (bl.ct != CUBLAS_COMPUTE_32F)
        return cublasGemmEx(bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                            (int)N, (int)M, (int)K, &a, B, CUDA_R_32F, (int)ldb, A, CUDA_R_32F,
                            (int)lda, &b, C, CUDA_R_32F, (int)ldc, bl.ct, CUBLAS_GEMM_DEFAULT);
    return cublasSgemm(bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                       (int)N, (int)M, (int)K, &a, B, (int)ldb, A, (int)lda, &b, C, (int)ldc);
}

cublasStatus_t rm_gemm_b(const blas_t &bl, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                         double alpha, const double *A, int64_t lda, int64_t sa, const double *B,
                         int64_t ldb, int64_t sb, double beta, double *C, int64_t ldc, int64_t sc,
                         int64_t batch)
{
    return cublasDgemmStridedBatched(bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha,
                                     B, (int)ldb, sb, A, (int)lda, sa, &beta, C, (int)ldc, sc,
                                     (int)batch);
}

cublasStatus_t rm_gemm_b(const blas_t &bl, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                         double alpha, const float *A, int64_t lda, int64_t sa, const float *B,
                         int64_t ldb, int64_t sb, double beta, float *C, int64_t ldc, int64_t sc,
                         int64_t batch)
{
    float a = (float)alpha, b = (float)beta;
    if (bl.ct != CUBLAS_COMPUTE_32F)
        return cublasGemmStridedBatchedEx(
            bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M,
            (int)K, &a, B, CUDA_R_32F, (int)ldb, sb, A, CUDA_R_32F, (int)lda, sa, &b, C,
            CUDA_R_32F, (int)ldc, sc, (int)batch, bl.ct, CUBLAS_GEMM_DEFAULT);
    return cublasSgemmStridedBatched(bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &a, B,
                                     (int)ldb, sb, A, (int)lda, sa, &b, C, (int)ldc, sc,
                                     (int)batch);
}

/* row-major C[M, N] (F32) = alpha op(A) op(B) + beta C with BF16 A and B,
 * F32 accumulation (--bwd-precision bf16: the layers' linear maps) */
cublasStatus_t rm_gemm_bf(const blas_t &bl, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                          float alpha, const __nv_bfloat16 *A, int64_t lda,
                          const __nv_bfloat16 *B, int64_t ldb, float beta, float *C, int64_t ldc)
{
    return cublasGemmEx(bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                        (int)N, (int)M, (int)K, &alpha, B, CUDA_R_16BF, (int)ldb, A, CUDA_R_16BF,
                        (int)lda, &beta, C, CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
}

/* strided-batched rm_gemm_bf */
cublasStatus_t rm_gemm_b_bf(const blas_t &bl, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                            float alpha, const __nv_bfloat16 *A, int64_t lda, int64_t sa,
                            const __nv_bfloat16 *B, int64_t ldb, int64_t sb, float beta, float *C,
                            int64_t ldc, int64_t sc, int64_t batch)
{
    return cublasGemmStridedBatchedEx(
        bl.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M,
        (int)K, &alpha, B, CUDA_R_16BF, (int)ldb, sb, A, CUDA_R_16BF, (int)lda, sa, &beta, C,
        CUDA_R_32F, (int)ldc, sc, (int)batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

#define GEMM_CHECK(call) BK_CUBLAS_CHECK(call)
#define LAUNCH_CHECK(what) BK_CUDA_CHECK(cudaGetLastError())
#define BK_LAUNCHED_OK() bk_cuda_status(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
#define TRY(x)                                                                                    \
    if ((st = (x)) != BK_OK)                                                                      \
    return st

/* ---------------------------------------------------------------- context */

/* one layer's weights on the device, in R */
struct gslot {
    int layer;
    int64_t used;   /* tick of the last use */
    int64_t loaded; /* tick of the upload */
    void *w[BK_MOD_COUNT], *b[BK_MOD_COUNT];
    void *an, *mn, *qn, *kn;
};

struct gbwd {
    bk_cuda_ctx *c;
    cublasHandle_t blas;
    blas_t bl; /* blas and the F32 compute type */
    int fp64;
    size_t es; /* sizeof(R) */
    const bk_model *m;
    bk_model_config cfg;
    int L;
    bk_dims dim;
    int64_t V;
    double eps;
    float *cos, *sin;
    /* one layer's forward (saved) and backward, [R, width] in R */
    void *xa, *zq, *zk, *zv, *qr, *kr, *o, *h1, *xm, *zg, *zu, *mm, *tmp;
    void *dh1, *dx, *dm, *dzg, *dzu, *dob, *dq, *dk, *dv, *cpy;
    void *P, *dP; /* [B, T, T] */
    double *r1, *r2, *rq, *rk;
    /* head */
    void *headw, *headn; /* [V, d], [d] */
    int64_t vc;
    void *xf, *dxf, *lg;
    int lg_all; /* lg holds every vocabulary block of a micro-batch ([R, V]: the
                   logits are computed once, not in each of the head's three
                   passes); else one block [R, vc], recomputed per pass */
    double *rf, *mx, *se, *tg, *cum, *lse, *tgl, *U;
    int32_t *lab, *last;
    unsigned long long *flags; /* [8] */
    /* embedding: embed_tokens in R on the device (the LM head's array when
     * the embeddings are tied, else emb_own), a micro-batch's token ids */
    void *emb;
    int emb_own;
    int32_t *dtok;
    /* --bwd-precision bf16 with head_dim 64 / 128: the layer forward's
     * attention fused (attn_flash.cu) from BF16 copies of the rotated q, k and
     * v, group-major, and the layer backward's (attn_flash_bwd.cu) from the
     * same copies, the forward's output o and its per-row log-sum-exp flse;
     * fdsum: the backward's rowsum(dO ∘ O). flse, fdsum: [S, nkv, T, rep]
     * (q's rows), R·nh floats each. No P, dP, Pb, dSb, aqb, akb, avb then
     * (adob is the backward's BF16 dO, group-major) */
    int flash;
    __nv_bfloat16 *qb, *kb, *vb;
    float *flse, *fdsum;
    /* --bwd-precision bf16: the layers' weights cached as BF16 (gslot.w;
     * uploaded as BF16 from hwb: the mapped checkpoint's BF16 or host copies
     * rounded as the device rounds) and their GEMMs on BF16 inputs, the
     * activation or gradient rounded into xb [R, widest] on the way */
    int wbf;
    __nv_bfloat16 *xb;
    /* bf16 (unfused, head_dim other than 64 / 128): the backward's attention
     * on BF16 operands: token-major copies of the rotated q, k, of v and dO,
     * and the probabilities and dS [B, T, T] */
    __nv_bfloat16 *aqb, *akb, *avb, *adob, *Pb, *dSb;
    /* weights: host copies (loaded on first use) and the device cache; hw:
     * F32 (fp32 / tf32 / fp64), hwb: BF16 matrices (bf16 mode, issue 16:
     * no matrix copied when the checkpoint stores them as BF16; else half
     * the F32 copies' bytes); wmapped: every matrix is mapped BF16 */
    bk_layer_weights *hw;
    bk_layer_weights_bf16 *hwb;
    int wmapped;
    /* hbf: the host weights are hwb (bf16 mode); not with the option
     * f32_weights (bk_gbwd_opts, tests only): the path before session 13 kept
     * for a bit check (F32 copies uploaded through wstage and rounded on the
     * device by k_to_bf16_rn: tests/test_cuda_backward.c bf16_taps) */
    int hbf;
    int *hloaded;
    /* host bytes the copies may take (half the host's available memory
     * when the flow starts) and what they take now: beyond the budget a copy
     * is dropped once uploaded and reloaded from the checkpoint on its next
     * cache miss, so a model larger than the host's memory streams instead of
     * exhausting it (70B width: 274 GB of F32 copies) */
    size_t hbudget, hbytes;
    gslot *slots;
    int nslots;
    int64_t tick;
    int64_t mb_cur, mb_prev; /* ticks at the starts of this micro-batch and the last */
    int64_t requests, uploads; /* weights() calls and layer uploads of the flow */
    float *wstage; /* device F32 staging of one tensor (fp64 mode; bf16 mode
                      uploads BF16 directly since issue 16) */
    int64_t wstage_elems;
    /* host: pinned staging [R, max width] in R; tap copies in double */
    void *hstage;
    size_t hstage_bytes;
    double *ha[4];  /* xa, o, xm, m */
    double *hg[BK_MOD_COUNT];
    size_t dev_bytes; /* device bytes of the buffers above (one micro-batch) */
};

void gb_free(gbwd *g);
void hw_free(gbwd *g, int l);

/* Device bytes the flow may still take: the free memory, and no more than
 * what the setting mem_limit leaves (bk_dev_alloc refuses beyond it; the
 * physical free memory alone sized the logits and the weight cache for the
 * whole GPU, so under a limit the cache filled it to the last byte and left
 * nothing for the leaf layers' stages). 0 when it cannot be read. */
size_t dev_avail(const gbwd *g)
{
    size_t fr = 0, tot = 0;
    if (bk_dev_mem_free(g->c, &fr, &tot) != BK_OK) {
        bk_clear_error();
        fr = 0;
    }
    return fr;
}

bk_status dalloc(gbwd *g, void **p, int64_t elems, size_t es, const char *what)
{
    uint64_t bytes;
    *p = NULL;
    if (elems < 0 || bk_mul_u64((uint64_t)elems, (uint64_t)es, &bytes))
        return bk_error(BK_ERR_DEVICE_OOM, "GPU backward: %s: size overflows", what);
    bk_status st = bk_dev_alloc(g->c, p, (size_t)(bytes ? bytes : es), what);
    if (st == BK_OK)
        g->dev_bytes += (size_t)bytes;
    return st;
}

void dfree(gbwd *g, void *p)
{
    if (p)
        bk_dev_free(g->c, p);
}

const char *head_name(const bk_model_config *c)
{
    return c->tie_embeddings ? "embed_tokens.weight" : "lm_head.weight";
}

/* rows [r0, r1) of a [rows, cols] tensor converted to R on the host, then
 * uploaded to dst */
bk_status upload_rows(gbwd *g, const bk_tensor_info *t, int64_t r0, int64_t r1, void *dst)
{
    const size_t esrc = bk_dtype_bits(t->dtype) / 8;
    const int64_t cols = t->ndim == 2 ? t->shape[1] : t->shape[0];
    const int64_t per = (int64_t)(g->hstage_bytes / g->es) / cols;
    if (per < 1)
        return bk_error(BK_ERR_INTERNAL, "GPU backward: staging smaller than one row of %s",
                        t->name ? t->name : "?");
    for (int64_t a = r0; a < r1; a += per) {
        int64_t n = r1 - a < per ? r1 - a : per;
        const unsigned char *src = (const unsigned char *)t->data + (size_t)a * cols * esrc;
        bk_status st = bk_convert(src, t->dtype, g->hstage, g->fp64 ? BK_DT_F64 : BK_DT_F32,
                                  (size_t)(n * cols));
        if (st != BK_OK)
            return bk_error_prefix(st, t->name ? t->name : "tensor");
        BK_CUDA_CHECK(cudaMemcpyAsync((char *)dst + (size_t)(a - r0) * cols * g->es, g->hstage,
                                      (size_t)(n * cols) * g->es, cudaMemcpyHostToDevice,
                                      g->c->stream));
        BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream));
    }
    return BK_OK;
}

/* a host F32 array of n into the device array dst in R */
bk_status upload_f32(gbwd *g, const float *src, int64_t n, void *dst)
{
    if (!g->fp64) {
        BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * 4, cudaMemcpyHostToDevice,
                                      g->c->stream));
        return BK_OK;
    }
    if (n > g->wstage_elems)
        return bk_error(BK_ERR_INTERNAL, "GPU backward: weight staging too small");
    BK_CUDA_CHECK(cudaMemcpyAsync(g->wstage, src, (size_t)n * 4, cudaMemcpyHostToDevice,
                                  g->c->stream));
    k_from_f32<double><<<grid_for(n), 256, 0, g->c->stream>>>((double *)dst, g->wstage, n);
    LAUNCH_CHECK("k_from_f32");
    return BK_OK;
}

/* a host weight of n into the device array dst in the slot's type: R from
 * F32, or, when g->wbf, BF16 from BF16 (the mapped checkpoint's bits, or a
 * host copy rounded by bk_f32_to_bf16_rn_dev: the bits k_to_bf16_rn gave
 * from the F32 upload before issue 16) */
bk_status upload_weight(gbwd *g, const void *src, int64_t n, void *dst)
{
    if (!g->wbf)
        return upload_f32(g, static_cast<const float *>(src), n, dst);
    if (g->hbf) {
        BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * 2, cudaMemcpyHostToDevice,
                                      g->c->stream));
        return BK_OK;
    }
    /* f32_weights: F32 through wstage, rounded on the device */
    if (n > g->wstage_elems)
        return bk_error(BK_ERR_INTERNAL, "GPU backward: weight staging too small");
    BK_CUDA_CHECK(cudaMemcpyAsync(g->wstage, src, (size_t)n * 4, cudaMemcpyHostToDevice,
                                  g->c->stream));
    k_to_bf16_rn<float><<<grid_for(n), 256, 0, g->c->stream>>>(
        static_cast<const float *>(g->wstage), (__nv_bfloat16 *)dst, n);
    LAUNCH_CHECK("k_to_bf16_rn");
    return BK_OK;
}

bk_status create(bk_backend *b, const bk_model *m, int64_t B, int64_t T, const bk_gbwd_opts *go,
                 int need_layers, gbwd **out)
{
    *out = NULL;
    if (!b || b->kind != BK_BACKEND_CUDA || !b->ops || strcmp(b->ops->name, "cuda") != 0)
        return bk_error(BK_ERR_INVALID_ARG, "GPU backward: needs the CUDA backend");
    const bk_model_config *c = bk_model_get_config(m);
    uint64_t rows;
    if (B < 1 || bk_mul_u64((uint64_t)B, (uint64_t)T, &rows) || rows > (uint64_t)INT32_MAX)
        return bk_error(BK_ERR_INVALID_ARG,
                        "GPU backward: micro-batch of %lld sequences x %lld tokens is invalid",
                        (long long)B, (long long)T);
    gbwd *g = static_cast<gbwd *>(calloc(1, sizeof(gbwd)));
    if (!g)
        return bk_error(BK_ERR_NOMEM, "GPU backward: out of memory");
    g->c = static_cast<bk_cuda_ctx *>(b->ctx);
    g->hbudget = (size_t)-1; /* (the flow sets it from the host's memory) */
    g->fp64 = go ? go->fp64 : 0;
    g->es = g->fp64 ? sizeof(double) : sizeof(float);
    g->m = m;
    g->cfg = *c;
    g->L = (int)c->n_layers;
    bk__dims_set(&g->dim, c, B, T);
    g->V = c->vocab;
    g->eps = c->rms_eps;
    bk_status st = BK_OK;
    {
        cublasStatus_t cs = cublasCreate(&g->blas);
        if (cs == CUBLAS_STATUS_SUCCESS)
            cs = cublasSetStream(g->blas, g->c->stream);
        if (cs == CUBLAS_STATUS_SUCCESS)
            cs = cublasSetMathMode(g->blas, CUBLAS_DEFAULT_MATH);
        g->bl.h = g->blas;
        g->bl.ct = (go && go->math == BK_GBWD_TF32)   ? CUBLAS_COMPUTE_32F_FAST_TF32
                   : (go && go->math == BK_GBWD_BF16) ? CUBLAS_COMPUTE_32F_FAST_16BF
                                                      : CUBLAS_COMPUTE_32F;
        if (cs != CUBLAS_STATUS_SUCCESS) {
            st = bk_cublas_status(cs, "GPU backward: cuBLAS handle", __FILE__, __LINE__);
            if (g->blas)
                cublasDestroy(g->blas);
            free(g);
            return st;
        }
    }
    const int64_t R = g->dim.rows, d = g->dim.hidden, qd = g->dim.qdim, kvd = g->dim.kvdim, NI = g->dim.inter, es = (int64_t)g->es;
    int64_t vc = LOGIT_BLOCK / R;
    if (vc > HEAD_BLOCK / d)
        vc = HEAD_BLOCK / d;
    if (vc < 16)
        vc = 16;
    if (vc > g->V)
        vc = g->V;
    g->vc = vc;
    int64_t wmax = qd > kvd ? qd : kvd;
    struct {
        void **p;
        int64_t n;
        size_t es;
        const char *what;
    } bufs[] = {
        {&g->xa, R * d, (size_t)es, "backward buffers"},   {&g->zq, R * qd, (size_t)es, "backward buffers"},
        {&g->zk, R * kvd, (size_t)es, "backward buffers"}, {&g->zv, R * kvd, (size_t)es, "backward buffers"},
        {&g->qr, R * qd, (size_t)es, "backward buffers"},  {&g->kr, R * kvd, (size_t)es, "backward buffers"},
        {&g->o, R * qd, (size_t)es, "backward buffers"},   {&g->h1, R * d, (size_t)es, "backward buffers"},
        {&g->xm, R * d, (size_t)es, "backward buffers"},   {&g->zg, R * NI, (size_t)es, "backward buffers"},
        {&g->zu, R * NI, (size_t)es, "backward buffers"},  {&g->mm, R * NI, (size_t)es, "backward buffers"},
        {&g->tmp, R * d, (size_t)es, "backward buffers"},  {&g->dh1, R * d, (size_t)es, "backward buffers"},
        {&g->dx, R * d, (size_t)es, "backward buffers"},   {&g->dm, R * NI, (size_t)es, "backward buffers"},
        {&g->dzg, R * NI, (size_t)es, "backward buffers"}, {&g->dzu, R * NI, (size_t)es, "backward buffers"},
        {&g->dob, R * qd, (size_t)es, "backward buffers"}, {&g->dq, R * qd, (size_t)es, "backward buffers"},
        {&g->dk, R * kvd, (size_t)es, "backward buffers"}, {&g->dv, R * kvd, (size_t)es, "backward buffers"},
        {&g->cpy, R * wmax, (size_t)es, "backward buffers"},
        {(void **)&g->r1, R, 8, "backward buffers"},        {(void **)&g->r2, R, 8, "backward buffers"},
        {(void **)&g->rq, R * g->dim.nh, 8, "backward buffers"}, {(void **)&g->rk, R * g->dim.nkv, 8, "backward buffers"},
        {&g->headw, g->V * d, (size_t)es, "LM head"},       {&g->headn, d, (size_t)es, "final norm"},
        {&g->xf, R * d, (size_t)es, "head buffers"},        {&g->dxf, R * d, (size_t)es, "head buffers"},
        {(void **)&g->rf, R, 8, "head buffers"},  {(void **)&g->mx, R, 8, "head buffers"},
        {(void **)&g->se, R, 8, "head buffers"},  {(void **)&g->tg, R, 8, "head buffers"},
        {(void **)&g->cum, R, 8, "head buffers"}, {(void **)&g->lse, R, 8, "head buffers"},
        {(void **)&g->tgl, R, 8, "head buffers"}, {(void **)&g->U, R, 8, "head buffers"},
        {(void **)&g->lab, R, 4, "head buffers"}, {(void **)&g->last, R, 4, "head buffers"},
        {(void **)&g->dtok, R, 4, "token ids"},
        {(void **)&g->flags, 8, 8, "flags"},
        {(void **)&g->cos, T * (g->dim.hd / 2), 4, "RoPE tables"},
        {(void **)&g->sin, T * (g->dim.hd / 2), 4, "RoPE tables"},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0] && st == BK_OK; i++)
        st = dalloc(g, bufs[i].p, bufs[i].n, bufs[i].es, bufs[i].what);
    /* the logits: one block (every block when one is the whole vocabulary);
     * head_logits_all widens it to all blocks once the buffers that cannot
     * be done without are allocated */
    g->lg_all = vc >= g->V;
    if (st == BK_OK)
        st = dalloc(g, &g->lg, R * vc, (size_t)es, "logit block");
    g->flash = bk__cuda_bwd_attn_fused(go, g->dim.hd);
    g->wbf = !g->fp64 && go && go->math == BK_GBWD_BF16;
    g->hbf = g->wbf && !go->f32_weights;
    /* the unfused attention's [B, T, T] probabilities and their gradient
     * (the fused one keeps them on chip) */
    if (st == BK_OK && !g->flash)
        st = dalloc(g, &g->P, B * T * T, (size_t)es, "attention probabilities");
    if (st == BK_OK && !g->flash)
        st = dalloc(g, &g->dP, B * T * T, (size_t)es, "attention probabilities");
    if (st == BK_OK && g->wbf) {
        int64_t xw = d > NI ? d : NI;
        xw = xw > qd ? xw : qd;
        st = dalloc(g, (void **)&g->xb, R * xw, 2, "GEMM inputs (BF16)");
    }
    {
        /* fused: dO only (the fused backward's group-major BF16 copy) */
        struct {
            __nv_bfloat16 **p;
            int64_t n;
            int fused;
        } ab[] = {{&g->aqb, R * qd, 0},  {&g->akb, R * kvd, 0},     {&g->avb, R * kvd, 0},
                  {&g->adob, R * qd, 1}, {&g->Pb, B * T * T, 0}, {&g->dSb, B * T * T, 0}};
        for (size_t i = 0; i < sizeof ab / sizeof ab[0] && st == BK_OK && g->wbf; i++)
            if (!g->flash || ab[i].fused)
                st = dalloc(g, (void **)ab[i].p, ab[i].n, 2, "attention backward (BF16)");
    }
    if (st == BK_OK && g->flash)
        st = dalloc(g, (void **)&g->qb, R * qd, 2, "attention inputs (BF16)");
    if (st == BK_OK && g->flash)
        st = dalloc(g, (void **)&g->kb, R * kvd, 2, "attention inputs (BF16)");
    if (st == BK_OK && g->flash)
        st = dalloc(g, (void **)&g->vb, R * kvd, 2, "attention inputs (BF16)");
    if (st == BK_OK && g->flash)
        st = dalloc(g, (void **)&g->flse, R * g->dim.nh, 4, "attention backward (fused)");
    if (st == BK_OK && g->flash)
        st = dalloc(g, (void **)&g->fdsum, R * g->dim.nh, 4, "attention backward (fused)");
    /* F32 staging of the largest weight (fp64 mode) */
    int64_t wbig = 0;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        if (o * in > wbig)
            wbig = o * in;
    }
    g->wstage_elems = wbig;
    if (st == BK_OK && (g->fp64 || (g->wbf && !g->hbf)))
        st = dalloc(g, (void **)&g->wstage, wbig, 4, "weight staging");
    if (st == BK_ERR_DEVICE_OOM) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bk_last_error());
        st = bk_error(BK_ERR_DEVICE_OOM,
                      "%s (GPU backward of micro-batches of %lld x %lld tokens: use a smaller "
                      "--batch)",
                      msg, (long long)B, (long long)T);
    }
    /* host: pinned staging of one micro-batch's widest array (and at least 1 MiB) */
    if (st == BK_OK) {
        int64_t wide = d > NI ? d : NI;
        wide = wide > wmax ? wide : wmax;
        g->hstage_bytes = (size_t)(R * wide) * g->es;
        if (g->hstage_bytes < ((size_t)1 << 20))
            g->hstage_bytes = (size_t)1 << 20;
        if ((size_t)d * g->es > g->hstage_bytes)
            g->hstage_bytes = (size_t)d * g->es;
        if (cudaMallocHost(&g->hstage, g->hstage_bytes) != cudaSuccess) {
            cudaGetLastError();
            g->hstage = NULL;
            st = bk_error(BK_ERR_NOMEM,
                          "GPU backward: out of pinned host memory for %.1f MiB of staging (use "
                          "a smaller --batch)",
                          (double)g->hstage_bytes / 1048576.0);
        }
    }
    /* need_layers: 1 the layers' host copies, 2 also the host tap buffers
     * (download_taps: cb->grads) */
    if (st == BK_OK && need_layers) {
        const int64_t ws[4] = {d, qd, d, NI};
        for (int i = 0; i < 4 && st == BK_OK && need_layers > 1; i++)
            if (!(g->ha[i] = (double *)bk_alloc((size_t)(R * ws[i]), sizeof(double))))
                st = BK_ERR_NOMEM;
        for (int i = 0; i < BK_MOD_COUNT && st == BK_OK && need_layers > 1; i++) {
            int64_t o, in;
            bk_module_shape(c, (bk_module)i, &o, &in);
            if (!(g->hg[i] = (double *)bk_alloc((size_t)(R * o), sizeof(double))))
                st = BK_ERR_NOMEM;
        }
        if (st != BK_OK)
            st = bk_error(BK_ERR_NOMEM,
                          "GPU backward: out of host memory for the module inputs and gradients "
                          "of one micro-batch (use a smaller --batch)");
        g->hw = static_cast<bk_layer_weights *>(calloc((size_t)g->L, sizeof(bk_layer_weights)));
        g->hloaded = static_cast<int *>(calloc((size_t)g->L, sizeof(int)));
        if (g->hbf)
            g->hwb = static_cast<bk_layer_weights_bf16 *>(
                calloc((size_t)g->L, sizeof(bk_layer_weights_bf16)));
        g->wmapped = g->hbf && bk_model_linears_mapped_bf16(m);
        if (st == BK_OK && (!g->hw || !g->hloaded || (g->hbf && !g->hwb)))
            st = bk_error(BK_ERR_NOMEM, "GPU backward: out of memory");
    }
    /* RoPE tables */
    if (st == BK_OK) {
        bk_rope rope;
        memset(&rope, 0, sizeof rope);
        st = bk_rope_init(&rope, c, T);
        if (st == BK_OK) {
            size_t nb = (size_t)(T * (g->dim.hd / 2)) * 4;
            /* on the backend's stream, then synchronised: it is non-blocking, so a
             * plain cudaMemcpy (legacy default stream) would not be ordered before
             * the kernels that read the tables */
            cudaError_t e = cudaMemcpyAsync(g->cos, rope.cos, nb, cudaMemcpyHostToDevice,
                                            g->c->stream);
            if (e == cudaSuccess)
                e = cudaMemcpyAsync(g->sin, rope.sin, nb, cudaMemcpyHostToDevice, g->c->stream);
            if (e == cudaSuccess)
                e = cudaStreamSynchronize(g->c->stream);
            st = bk_cuda_status(e, "GPU backward: RoPE tables", __FILE__, __LINE__);
        }
        bk_rope_free(&rope);
    }
    /* final norm and LM head in R */
    if (st == BK_OK) {
        const bk_tensor_info *t = bk_model_find(m, -1, head_name(c));
        const bk_tensor_info *nt = bk_model_find(m, -1, "norm.weight");
        st = bk__bwd_head_check(m);
        if (st == BK_OK && (!t || t->ndim != 2 || t->shape[0] != g->V || t->shape[1] != d ||
                            !nt || nt->ndim != 1 || nt->shape[0] != d))
            st = bk_error(BK_ERR_SHAPE, "%s / model.norm.weight: expected shapes [%lld, %lld] "
                          "and [%lld]", head_name(c), (long long)g->V, (long long)d, (long long)d);
        if (st == BK_OK)
            st = upload_rows(g, t, 0, g->V, g->headw);
        if (st == BK_OK)
            st = upload_rows(g, nt, 0, 1, g->headn);
    }
    if (st != BK_OK) {
        gb_free(g);
        return st;
    }
    *out = g;
    return BK_OK;
}

/* The logits of every vocabulary block of a micro-batch ([R, V] in R: the
 * head's three passes then compute each block's logits once instead of three
 * times; the same GEMMs) in place of the one block, when that takes at most
 * an eighth of the device memory left. Called after every buffer the run
 * cannot do without (it was allocated before them, so on a nearly full
 * device this optional buffer could make a needed one fail, with an error
 * asking for a smaller --batch or --leaf-size) and before the weight cache
 * is sized. */
void head_logits_all(gbwd *g)
{
    if (g->lg_all || !g->lg)
        return;
    const int64_t R = g->dim.rows;
    if ((double)R * (double)g->V * (double)g->es > (double)dev_avail(g) / 8)
        return;
    void *all = NULL;
    if (dalloc(g, &all, R * g->V, g->es, "logits") != BK_OK) {
        bk_clear_error(); /* (optional: the one block stays) */
        return;
    }
    dfree(g, g->lg);
    g->dev_bytes -= (size_t)(R * g->vc) * g->es;
    g->lg = all;
    g->lg_all = 1;
}

void slot_free(gbwd *g, gslot *s)
{
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        dfree(g, s->w[i]);
        dfree(g, s->b[i]);
    }
    dfree(g, s->an);
    dfree(g, s->mn);
    dfree(g, s->qn);
    dfree(g, s->kn);
    memset(s, 0, sizeof *s);
    s->layer = -1;
}

void gb_free(gbwd *g)
{
    if (!g)
        return;
    if (g->c)
        cudaStreamSynchronize(g->c->stream);
    void *bufs[] = {g->xa,  g->zq,  g->zk,  g->zv,  g->qr,    g->kr,   g->o,    g->h1,  g->xm,
                    g->zg,  g->zu,  g->mm,  g->tmp, g->dh1,   g->dx,   g->dm,   g->dzg, g->dzu,
                    g->dob, g->dq,  g->dk,  g->dv,  g->cpy,   g->P,    g->dP,   g->r1,  g->r2,
                    g->rq,  g->rk,  g->headw, g->headn, g->xf, g->dxf,  g->lg,  g->rf,
                    g->mx,  g->se,  g->tg,  g->cum, g->lse,   g->tgl,  g->U,    g->lab, g->last,
                    g->flags, g->cos, g->sin, g->wstage, g->dtok, g->qb, g->kb, g->vb, g->xb,
                    g->aqb, g->akb, g->avb, g->adob, g->Pb, g->dSb, g->flse, g->fdsum,
                    g->emb_own ? g->emb : NULL};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        dfree(g, bufs[i]);
    if (g->slots) {
        for (int k = 0; k < g->nslots; k++)
            slot_free(g, &g->slots[k]);
        free(g->slots);
    }
    for (int l = 0; l < g->L; l++)
        if (g->hloaded && g->hloaded[l])
            hw_free(g, l);
    free(g->hw);
    free(g->hwb);
    free(g->hloaded);
    for (int i = 0; i < 4; i++)
        free(g->ha[i]);
    for (int i = 0; i < BK_MOD_COUNT; i++)
        free(g->hg[i]);
    if (g->hstage)
        cudaFreeHost(g->hstage);
    if (g->blas)
        cublasDestroy(g->blas);
    free(g);
}

/* bytes of one layer's weights in R */
int64_t layer_elems(const gbwd *g)
{
    int64_t n = 0;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(&g->cfg, (bk_module)i, &o, &in);
        n += o * in + o;
    }
    return n + 2 * g->dim.hidden + 2 * g->dim.hd;
}

/* host bytes of one layer's copy: F32 (bk_layer_weights_load: layer_elems
 * as floats); bf16 mode (bk_layer_weights_bf16_load): BF16 matrices, or
 * none when mapped, F32 biases and norms (src/bwd_mem.c
 * bk_bwd_host_layer_bytes: the host plan's number). What a loaded layer
 * holds: hw_bytes. */
size_t host_layer_bytes(const gbwd *g)
{
    if (!g->hbf)
        return (size_t)layer_elems(g) * sizeof(float);
    return (size_t)bk_bwd_host_layer_bytes(&g->cfg, g->wmapped ? BK_BWD_HOST_GPU_MAPPED
                                                               : BK_BWD_HOST_GPU_BF16);
}

/* layer l's host copy: load (thread-safe: touches only hw[l] / hwb[l]),
 * its bytes, free */
bk_status hw_load(gbwd *g, int l)
{
    return g->hbf ? bk_layer_weights_bf16_load(g->m, l, &g->hwb[l])
                  : bk_layer_weights_load(g->m, l, &g->hw[l]);
}

size_t hw_bytes(const gbwd *g, int l)
{
    return g->hbf ? (size_t)g->hwb[l].host_bytes : host_layer_bytes(g);
}

void hw_free(gbwd *g, int l)
{
    if (g->hbf)
        bk_layer_weights_bf16_free(&g->hwb[l]);
    else
        bk_layer_weights_free(&g->hw[l]);
}

/* want <= 0: as many layers as fit in half of the available memory and
 * beside `reserve` (bk_bwd_cache_layers: the leaf layers' GPU stages run
 * while the flow holds its memory and need their reserve free) */
bk_status slots_init(gbwd *g, int want, uint64_t reserve)
{
    int n = want;
    if (n <= 0)
        n = bk_bwd_cache_layers(&g->cfg, g->fp64 ? BK_BWD_FP64 : g->wbf ? BK_BWD_BF16 : BK_BWD_FP32,
                                (uint64_t)dev_avail(g), reserve);
    if (n < 1)
        n = 1;
    if (n > g->L)
        n = g->L;
    g->slots = static_cast<gslot *>(calloc((size_t)n, sizeof(gslot)));
    if (!g->slots)
        return bk_error(BK_ERR_NOMEM, "GPU backward: out of memory");
    g->nslots = n;
    for (int k = 0; k < n; k++)
        g->slots[k].layer = -1;
    return BK_OK;
}

/* The host F32 copies of all layers, loaded by up to 8 threads at the start
 * of a flow (every layer is used by its first sweep, and each copy is kept
 * until the flow ends, so this holds no more host memory than loading them
 * one by one on first use; it overlaps the safetensors reads and the
 * conversions, which took ≈ 0.27 s per 1B layer on one thread). A layer
 * that fails here is left unloaded: weights() loads it again on this thread
 * and reports the error. */
struct preload_job {
    gbwd *g;
    int next, limit; /* layers [0, limit) are loaded: as many as the host budget holds */
    pthread_mutex_t mu;
};

void *preload_main(void *x)
{
    preload_job *j = static_cast<preload_job *>(x);
    for (;;) {
        pthread_mutex_lock(&j->mu);
        const int l = j->next < j->g->L ? j->next++ : -1;
        pthread_mutex_unlock(&j->mu);
        if (l < 0 || l >= j->limit)
            return NULL;
        if (hw_load(j->g, l) == BK_OK)
            j->g->hloaded[l] = 1;
    }
}

void preload_host_weights(gbwd *g)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = ncpu > 8 ? 8 : (ncpu < 1 ? 1 : (int)ncpu);
    if (nt > g->L)
        nt = g->L;
    if (nt < 2)
        return; /* (one thread: weights() loads on first use) */
    preload_job j;
    j.g = g;
    j.next = 0;
    const size_t lb = host_layer_bytes(g);
    j.limit = lb && g->hbudget / lb < (size_t)g->L ? (int)(g->hbudget / lb) : g->L;
    if (j.limit < 1)
        return; /* (weights() loads on first use, within the budget) */
    pthread_mutex_init(&j.mu, NULL);
    pthread_t tid[8];
    int started = 0;
    for (int t = 0; t < nt; t++)
        if (pthread_create(&tid[started], NULL, preload_main, &j) == 0)
            started++;
    if (started == 0) /* (no threads: weights() loads on first use) */
        j.next = g->L;
    for (int t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&j.mu);
    for (int l = 0; l < g->L; l++)
        if (g->hloaded[l])
            g->hbytes += hw_bytes(g, l);
}

/* a micro-batch begins (its embedding or its boundary load): marks which
 * slots the last two micro-batches used (weights()) */
void mb_begin(gbwd *g)
{
    g->mb_prev = g->mb_cur;
    g->mb_cur = g->tick + 1;
}

/* layer l's weights on the device (uploaded when not resident; which slot
 * is replaced: see below) */
bk_status weights(gbwd *g, int l, const gslot **out)
{
    g->tick++;
    g->requests++;
    for (int k = 0; k < g->nslots; k++)
        if (g->slots[k].layer == l) {
            g->slots[k].used = g->tick;
            *out = &g->slots[k];
            return BK_OK;
        }
    if (!g->hloaded[l]) {
        bk_status st = hw_load(g, l);
        if (st != BK_OK)
            return st;
        g->hloaded[l] = 1;
        g->hbytes += hw_bytes(g, l);
    }
    /* the host copy's pointers: matrices F32 or BF16 (bf16 mode), the rest F32 */
    struct {
        const void *w[BK_MOD_COUNT];
        const float *b[BK_MOD_COUNT];
        const float *attn_norm, *mlp_norm, *q_norm, *k_norm;
    } hl;
#define HL_TAKE(src)                                                                              \
    do {                                                                                          \
        for (int i = 0; i < BK_MOD_COUNT; i++) {                                                  \
            hl.w[i] = (src)->w[i];                                                                \
            hl.b[i] = (src)->b[i];                                                                \
        }                                                                                         \
        hl.attn_norm = (src)->attn_norm;                                                          \
        hl.mlp_norm = (src)->mlp_norm;                                                            \
        hl.q_norm = (src)->q_norm;                                                                \
        hl.k_norm = (src)->k_norm;                                                                \
    } while (0)
    if (g->hbf)
        HL_TAKE(&g->hwb[l]);
    else
        HL_TAKE(&g->hw[l]);
#undef HL_TAKE
    const auto *lw = &hl;
    for (int i = 0; i < BK_MOD_COUNT; i++)
        if (!lw->w[i])
            return bk_error(BK_ERR_INVALID_ARG, "GPU backward: layer %d lacks %s", l,
                            bk_module_name((bk_module)i));
    if (!lw->attn_norm || !lw->mlp_norm || (g->cfg.qk_norm && (!lw->q_norm || !lw->k_norm)))
        return bk_error(BK_ERR_INVALID_ARG, "GPU backward: layer %d lacks its norms", l);
    /* An empty slot; else the least recently used of the slots that neither
     * this micro-batch nor the last one used (layers of an earlier pass);
     * else the slot uploaded last. Every micro-batch of a sweep walks the same
     * layers in the same order, so with fewer slots than layers the least
     * recently used layer is always the next one needed: LRU would upload
     * every layer of every micro-batch (seen at the 8B shape under an 80 GB
     * limit: 48 uploads per micro-batch). Replacing the last upload instead
     * keeps the other slots' layers resident from one micro-batch to the next:
     * nslots - 1 layers stay, one slot rotates through the rest. */
    int v = -1;
    for (int k = 0; k < g->nslots && v < 0; k++)
        if (g->slots[k].layer < 0)
            v = k;
    for (int k = 0; k < g->nslots && v < 0; k++)
        if (g->slots[k].used < g->mb_prev)
            v = k;
    if (v >= 0 && g->slots[v].layer >= 0)
        for (int k = v + 1; k < g->nslots; k++)
            if (g->slots[k].used < g->mb_prev && g->slots[k].used < g->slots[v].used)
                v = k;
    if (v < 0) {
        v = 0;
        for (int k = 1; k < g->nslots; k++)
            if (g->slots[k].loaded > g->slots[v].loaded)
                v = k;
    }
    gslot *s = &g->slots[v];
    const int fresh = s->w[0] == NULL;
    /* make sure nothing still reads the slot, then overwrite it (every layer
     * has the same shapes: the buffers are allocated once per slot) */
    BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream));
    s->layer = -1;
    bk_status st = BK_OK;
    for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++) {
        int64_t o, in;
        bk_module_shape(&g->cfg, (bk_module)i, &o, &in);
        if (!s->w[i])
            st = dalloc(g, &s->w[i], o * in, g->wbf ? 2 : g->es, "layer weights");
        if (st == BK_OK)
            st = upload_weight(g, lw->w[i], o * in, s->w[i]);
        if (st == BK_OK && lw->b[i]) {
            if (!s->b[i])
                st = dalloc(g, &s->b[i], o, g->es, "layer biases");
            if (st == BK_OK)
                st = upload_f32(g, lw->b[i], o, s->b[i]);
        } else if (st == BK_OK && s->b[i]) {
            dfree(g, s->b[i]); /* (no bias in this layer) */
            s->b[i] = NULL;
        }
    }
    if (st == BK_OK && !s->an)
        st = dalloc(g, &s->an, g->dim.hidden, g->es, "layer norms");
    if (st == BK_OK)
        st = upload_f32(g, lw->attn_norm, g->dim.hidden, s->an);
    if (st == BK_OK && !s->mn)
        st = dalloc(g, &s->mn, g->dim.hidden, g->es, "layer norms");
    if (st == BK_OK)
        st = upload_f32(g, lw->mlp_norm, g->dim.hidden, s->mn);
    if (st == BK_OK && g->cfg.qk_norm) {
        if (!s->qn)
            st = dalloc(g, &s->qn, g->dim.hd, g->es, "layer norms");
        if (st == BK_OK)
            st = upload_f32(g, lw->q_norm, g->dim.hd, s->qn);
        if (st == BK_OK && !s->kn)
            st = dalloc(g, &s->kn, g->dim.hd, g->es, "layer norms");
        if (st == BK_OK)
            st = upload_f32(g, lw->k_norm, g->dim.hd, s->kn);
    }
    /* the slot's bytes are weights, not micro-batch buffers */
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(g->c->stream), "GPU backward: weight upload",
                            __FILE__, __LINE__);
    if (st != BK_OK) {
        slot_free(g, s);
        if (st == BK_ERR_DEVICE_OOM && fresh && v > 0) {
            /* fewer layers fit than estimated: keep the v slots that did
             * (the same request again: counted once) */
            g->nslots = v;
            g->requests--;
            return weights(g, l, out);
        }
        if (st == BK_ERR_DEVICE_OOM) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", bk_last_error());
            return bk_error(BK_ERR_DEVICE_OOM,
                            "%s (GPU backward: layer %d's weights do not fit beside the "
                            "micro-batch: use a smaller --batch)",
                            msg, l);
        }
        return st;
    }
    s->layer = l;
    s->used = s->loaded = g->tick;
    g->uploads++;
    *out = s;
    /* the host copy is needed again only after an eviction: not when every
     * layer has its own slot, and beyond the host budget it is reloaded then
     * (the upload above is complete: the stream was synchronised) */
    if (g->nslots >= g->L || g->hbytes > g->hbudget) {
        g->hbytes -= hw_bytes(g, l);
        hw_free(g, l);
        g->hloaded[l] = 0;
    }
    return BK_OK;
}

/* the first non-finite entries of up to 8 device arrays: one readback */
template <typename R>
bk_status first_bad(gbwd *g, int n, const R *const *x, const int64_t *len,
                    unsigned long long *idx)
{
    BK_CUDA_CHECK(cudaMemsetAsync(g->flags, 0xff, 8 * sizeof(unsigned long long), g->c->stream));
    for (int i = 0; i < n; i++) {
        k_first_bad<R><<<grid_for(len[i]), 256, 0, g->c->stream>>>(x[i], len[i], g->flags + i);
        LAUNCH_CHECK("k_first_bad");
    }
    BK_CUDA_CHECK(cudaMemcpyAsync(idx, g->flags, (size_t)n * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost, g->c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream));
    return BK_OK;
}

bk_status bad_grad(int layer, const char *what, unsigned long long i, int64_t cols)
{
    return bk_error(BK_ERR_NONFINITE,
                    "backward: layer %d %s: non-finite gradient at token row %lld, column %lld",
                    layer, what, (long long)(i / (unsigned long long)cols),
                    (long long)(i % (unsigned long long)cols));
}

/* ---------------------------------------------------------------- one layer */

#define RP(p) static_cast<R *>(p)
#define CRP(p) static_cast<const R *>(p)

/* X [n] rounded to BF16 into g->xb (--bwd-precision bf16) */
template <typename R> const __nv_bfloat16 *to_xb(gbwd *g, const R *X, int64_t n)
{
    k_to_bf16_rn<R><<<grid_for(n), 256, 0, g->c->stream>>>(X, g->xb, n);
    return g->xb;
}

/* Y = X Wᵀ (+ b) with module mod of slot w: W in R, or BF16 (g->wbf: X
 * rounded to BF16, F32 accumulation; xb_ready: the previous lin's X, still
 * in g->xb) */
template <typename R>
bk_status lin(gbwd *g, const R *X, int64_t N, int64_t in, const gslot *w, bk_module mod,
              int64_t out, R *Y, int xb_ready = 0)
{
    const R *b = CRP(w->b[mod]);
    if (g->wbf) {
        const __nv_bfloat16 *xb = g->xb;
        if (!xb_ready) {
            xb = to_xb<R>(g, X, N * in);
            LAUNCH_CHECK("k_to_bf16_rn");
        }
        GEMM_CHECK(rm_gemm_bf(g->bl, false, true, N, out, in, 1.0f, xb, in,
                              static_cast<const __nv_bfloat16 *>(w->w[mod]), in, 0.0f,
                              reinterpret_cast<float *>(Y), out));
    } else
        GEMM_CHECK(rm_gemm(g->bl, false, true, N, out, in, 1.0, X, in, CRP(w->w[mod]), in, 0.0,
                           Y, out));
    if (b) {
        k_bias<R><<<grid_for(N * out), 256, 0, g->c->stream>>>(Y, N, out, b);
        LAUNCH_CHECK("k_bias");
    }
    return BK_OK;
}

/* dX (= or, beta 1, +=) dY W with module mod of slot w (as lin) */
template <typename R>
bk_status lin_back(gbwd *g, const R *dY, int64_t N, int64_t out, const gslot *w, bk_module mod,
                   int64_t in, double beta, R *dX)
{
    if (g->wbf) {
        const __nv_bfloat16 *xb = to_xb<R>(g, dY, N * out);
        LAUNCH_CHECK("k_to_bf16_rn");
        GEMM_CHECK(rm_gemm_bf(g->bl, false, false, N, in, out, 1.0f, xb, out,
                              static_cast<const __nv_bfloat16 *>(w->w[mod]), in, (float)beta,
                              reinterpret_cast<float *>(dX), in));
    } else
        GEMM_CHECK(rm_gemm(g->bl, false, false, N, in, out, 1.0, dY, out, CRP(w->w[mod]), in,
                           beta, dX, in));
    return BK_OK;
}

template <typename R>
bk_status rms_fwd(gbwd *g, const R *x, int64_t rows, int64_t n, const R *w, double *r, R *y)
{
    k_rms_fwd<R><<<warp_grid(rows), 256, 0, g->c->stream>>>(x, rows, n, w, g->eps, r, y);
    LAUNCH_CHECK("k_rms_fwd");
    return BK_OK;
}

template <typename R>
bk_status rms_back(gbwd *g, const R *x, const double *r, int64_t rows, int64_t n, const R *w,
                   const R *dy, int acc, R *dx)
{
    k_rms_back<R><<<warp_grid(rows), 256, 0, g->c->stream>>>(x, r, rows, n, w, dy, acc, dx);
    LAUNCH_CHECK("k_rms_back");
    return BK_OK;
}

template <typename R> bk_status rope(gbwd *g, R *x, int64_t N, int64_t heads, int sign)
{
    k_rope<R><<<grid_for(N * heads * (g->dim.hd / 2)), 256, 0, g->c->stream>>>(
        x, N, g->dim.T, heads, g->dim.hd, g->cos, g->sin, sign);
    LAUNCH_CHECK("k_rope");
    return BK_OK;
}

/* P[s] rows r0 .. r1 (keys 0 .. r1) = causal softmax(scale Q_j K_gᵀ) for
 * every sequence s of the micro-batch (P keeps its [T, T] layout) */
template <typename R> bk_status attn_probs_rows(gbwd *g, int64_t S, int64_t j, int64_t r0, int64_t r1)
{
    const int64_t T = g->dim.T, qd = g->dim.qdim, kvd = g->dim.kvdim, hd = g->dim.hd, gi = j / g->dim.rep;
    const double scale = 1.0 / sqrt((double)hd);
    GEMM_CHECK(rm_gemm_b(g->bl, false, true, r1 - r0, r1, hd, scale, RP(g->qr) + r0 * qd + j * hd,
                         qd, T * qd, RP(g->kr) + gi * hd, kvd, T * kvd, 0.0, RP(g->P) + r0 * T, T,
                         T * T, S));
    k_softmax<<<warp_grid(S * (r1 - r0)), 256, 0, g->c->stream>>>(RP(g->P), RP(g->P),
                                                                   S * (r1 - r0), T, r0, r1 - r0,
                                                                   r1);
    LAUNCH_CHECK("k_softmax");
    return BK_OK;
}

/* the whole P[s] */
template <typename R> bk_status attn_probs(gbwd *g, int64_t S, int64_t j)
{
    return attn_probs_rows<R>(g, S, j, 0, g->dim.T);
}

/* The backward's attention in row chunks (tf32 / bf16 only): query rows
 * [r0, r1) need keys [0, r1) only, so with C chunks of T/C rows the GEMMs
 * and softmax passes cover (C+1)/2C of the [T, T] matrices (3/4 at C = 2,
 * 5/8 at C = 4) instead of all of it; the dV / dK sums then run over the
 * chunks (another order of the same sums). Two chunks from T = 16 on (so the
 * tests' short sequences take this path too), more only with at least 1024
 * rows each: each op of a chunk is a few microseconds of memory traffic per
 * head, and smaller ones would be bound by the launches (7 per chunk and
 * head). fp32 and fp64 keep one chunk (their bits). */
int attn_chunks(const gbwd *g)
{
    if (g->fp64 || g->bl.ct == CUBLAS_COMPUTE_32F || g->dim.T < 16)
        return 1;
    int64_t c = g->dim.T / 1024;
    return (int)(c < 2 ? 2 : (c > 4 ? 4 : c));
}

/* --bwd-precision bf16: the layer backward's attention (the loop of
 * layer_bwd, in the same row chunks) on BF16 operands with F32 accumulation:
 * q, k (rotated), v and dO rounded to BF16 once per layer; per head and
 * chunk the F32 scores, the probabilities as BF16 (softmax sums in double),
 * dV += Pᵀ dO, dP = dO Vᵀ (F32), dS as BF16 (double row sums), dQ = scale
 * dS K, dK += scale dSᵀ Q. The same products as the F32 arrays under
 * 32F_FAST_16BF, without its conversions, and half the bytes of P and dS for
 * the GEMMs that read them. dq, dk, dv: F32, zeroed by the caller. */
template <typename R> bk_status attn_back_bf(gbwd *, int64_t, int64_t)
{
    return bk_error(BK_ERR_INTERNAL, "GPU backward: BF16 attention needs F32 storage");
}

template <> bk_status attn_back_bf<float>(gbwd *g, int64_t S, int64_t nch)
{
    const int64_t T = g->dim.T, N = S * T, qd = g->dim.qdim, kvd = g->dim.kvdim, hd = g->dim.hd;
    cudaStream_t st = g->c->stream;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const struct {
        const void *src;
        __nv_bfloat16 *dst;
        int64_t n;
    } cv[] = {{g->qr, g->aqb, N * qd}, {g->kr, g->akb, N * kvd}, {g->zv, g->avb, N * kvd},
              {g->dob, g->adob, N * qd}};
    for (int i = 0; i < 4; i++) {
        k_to_bf16_rn<float><<<grid_for(cv[i].n), 256, 0, st>>>(static_cast<const float *>(cv[i].src),
                                                               cv[i].dst, cv[i].n);
        LAUNCH_CHECK("k_to_bf16_rn");
    }
    float *P = static_cast<float *>(g->P), *dP = static_cast<float *>(g->dP);
    for (int64_t j = 0; j < g->dim.nh; j++)
        for (int64_t c = 0; c < nch; c++) {
            const int64_t gi = j / g->dim.rep, r0 = T * c / nch, r1 = T * (c + 1) / nch,
                          rc = r1 - r0;
            const __nv_bfloat16 *Qc = g->aqb + r0 * qd + j * hd, *Kg = g->akb + gi * hd,
                                *Vg = g->avb + gi * hd, *dOc = g->adob + r0 * qd + j * hd;
            __nv_bfloat16 *Pbc = g->Pb + r0 * T, *dSbc = g->dSb + r0 * T;
            /* scores (F32), then P (BF16) */
            GEMM_CHECK(rm_gemm_b_bf(g->bl, false, true, rc, r1, hd, scale, Qc, qd, T * qd, Kg,
                                    kvd, T * kvd, 0.0f, P + r0 * T, T, T * T, S));
            k_softmax<<<warp_grid(S * rc), 256, 0, st>>>(P, g->Pb, S * rc, T, r0, rc, r1);
            LAUNCH_CHECK("k_softmax (bf16)");
            /* dV_g += Pᵀ dO_j; dP = dO_j V_gᵀ */
            GEMM_CHECK(rm_gemm_b_bf(g->bl, true, false, r1, hd, rc, 1.0f, Pbc, T, T * T, dOc, qd,
                                    T * qd, 1.0f, static_cast<float *>(g->dv) + gi * hd, kvd,
                                    T * kvd, S));
            GEMM_CHECK(rm_gemm_b_bf(g->bl, false, true, rc, r1, hd, 1.0f, dOc, qd, T * qd, Vg,
                                    kvd, T * kvd, 0.0f, dP + r0 * T, T, T * T, S));
            k_dsoftmax<<<warp_grid(S * rc), 256, 0, st>>>(g->Pb, dP, g->dSb, S * rc, T, r0, rc,
                                                           r1);
            LAUNCH_CHECK("k_dsoftmax (bf16)");
            /* dQ_j = scale dS K_g; dK_g += scale dSᵀ Q_j */
            GEMM_CHECK(rm_gemm_b_bf(g->bl, false, false, rc, hd, r1, scale, dSbc, T, T * T, Kg,
                                    kvd, T * kvd, 0.0f,
                                    static_cast<float *>(g->dq) + r0 * qd + j * hd, qd, T * qd,
                                    S));
            GEMM_CHECK(rm_gemm_b_bf(g->bl, true, false, r1, hd, rc, scale, dSbc, T, T * T, Qc, qd,
                                    T * qd, 1.0f, static_cast<float *>(g->dk) + gi * hd, kvd,
                                    T * kvd, S));
        }
    return BK_OK;
}

/* O (g->o, token-major) = causal attention of the rotated q, k (qr, kr) and
 * v (zv) in one fused kernel per micro-batch: BF16 Q, K, V and P, F32
 * scores, sums and output (attn_flash.cu); g->flash, F32 storage only. Also
 * each row's log-sum-exp (flse) for attn_back_fused: the output is the same
 * bits with and without it (bk-cuda-dev attn-bwd checks it) */
template <typename R> bk_status attn_fused(gbwd *, int64_t)
{
    return bk_error(BK_ERR_INTERNAL, "GPU backward: fused attention needs F32 storage");
}

template <> bk_status attn_fused<float>(gbwd *g, int64_t S)
{
    const int64_t T = g->dim.T, N = S * T, hd = g->dim.hd, nh = g->dim.nh, nkv = g->dim.nkv,
                  rep = g->dim.rep;
    cudaStream_t s = g->c->stream;
    k_tok_to_groups_bf16<<<grid_for(N * nh * hd), 256, 0, s>>>((const float *)g->qr, N, T, nh, hd,
                                                              rep, g->qb);
    LAUNCH_CHECK("k_tok_to_groups_bf16");
    k_tok_to_groups_bf16<<<grid_for(N * nkv * hd), 256, 0, s>>>((const float *)g->kr, N, T, nkv,
                                                               hd, 1, g->kb);
    LAUNCH_CHECK("k_tok_to_groups_bf16");
    k_tok_to_groups_bf16<<<grid_for(N * nkv * hd), 256, 0, s>>>((const float *)g->zv, N, T, nkv,
                                                               hd, 1, g->vb);
    LAUNCH_CHECK("k_tok_to_groups_bf16");
    return bk_attn_flash(g->qb, g->kb, g->vb, (float *)g->o, S, nkv, T, rep, hd,
                         (float)(1.0 / sqrt((double)hd)), NULL, s, 0, 0, g->flse);
}

/* dq, dk, dv (F32, token-major, the gradients of the rotated q, k and of v,
 * dq and dk including the score scale: attn_back_bf's results) of the
 * attention of the micro-batch from dob (dL/dO) in fused kernels
 * (attn_flash_bwd.cu: P and dS on chip, no [B, T, T] arrays): from the BF16
 * group-major qb, kb, vb, the output o and flse that layer_fwd's attn_fused
 * left (layer_bwd runs it first; nothing in between writes them); adob and
 * fdsum are its scratch. dq, dk, dv are written, not accumulated (no zeroing
 * needed). Deterministic (no atomics): the same bits on every run, so
 * recursive halving and naive I still agree bit for bit. g->flash only. */
template <typename R> bk_status attn_back_fused(gbwd *, int64_t)
{
    return bk_error(BK_ERR_INTERNAL, "GPU backward: fused attention needs F32 storage");
}

template <> bk_status attn_back_fused<float>(gbwd *g, int64_t S)
{
    return bk_attn_flash_bwd(g->qb, g->kb, g->vb, (const float *)g->o, (const float *)g->dob,
                             g->flse, (float *)g->dq, (float *)g->dk, (float *)g->dv, g->adob,
                             g->fdsum, S, g->dim.nkv, g->dim.T, g->dim.rep, g->dim.hd,
                             (float)(1.0 / sqrt((double)g->dim.hd)), g->c->stream);
}

/* the layer's forward from hin (saving what the backward needs); hout (may
 * equal hin, or be NULL) receives the output */
template <typename R> bk_status layer_fwd(gbwd *g, const gslot *w, int64_t S, const R *hin, R *hout)
{
    const int64_t T = g->dim.T, N = S * T, d = g->dim.hidden, qd = g->dim.qdim, kvd = g->dim.kvdim, hd = g->dim.hd,
                  NI = g->dim.inter;
    bk_status st;
    TRY(rms_fwd<R>(g, hin, N, d, CRP(w->an), g->r1, RP(g->xa)));
    TRY(lin<R>(g, RP(g->xa), N, d, w, BK_MOD_Q, qd, RP(g->zq)));
    TRY(lin<R>(g, RP(g->xa), N, d, w, BK_MOD_K, kvd, RP(g->zk), 1));
    TRY(lin<R>(g, RP(g->xa), N, d, w, BK_MOD_V, kvd, RP(g->zv), 1));
    if (w->qn) {
        TRY(rms_fwd<R>(g, RP(g->zq), N * g->dim.nh, hd, CRP(w->qn), g->rq, RP(g->qr)));
        TRY(rms_fwd<R>(g, RP(g->zk), N * g->dim.nkv, hd, CRP(w->kn), g->rk, RP(g->kr)));
    } else {
        BK_CUDA_CHECK(cudaMemcpyAsync(g->qr, g->zq, (size_t)(N * qd) * g->es,
                                      cudaMemcpyDeviceToDevice, g->c->stream));
        BK_CUDA_CHECK(cudaMemcpyAsync(g->kr, g->zk, (size_t)(N * kvd) * g->es,
                                      cudaMemcpyDeviceToDevice, g->c->stream));
    }
    TRY(rope<R>(g, RP(g->qr), N, g->dim.nh, +1));
    TRY(rope<R>(g, RP(g->kr), N, g->dim.nkv, +1));
    if (g->flash) {
        TRY(attn_fused<R>(g, S));
    } else
        for (int64_t j = 0; j < g->dim.nh; j++) {
            const int64_t gi = j / g->dim.rep;
            TRY(attn_probs<R>(g, S, j));
            GEMM_CHECK(rm_gemm_b(g->bl, false, false, T, hd, T, 1.0, RP(g->P), T, T * T,
                                 RP(g->zv) + gi * hd, kvd, T * kvd, 0.0, RP(g->o) + j * hd, qd,
                                 T * qd, S));
        }
    TRY(lin<R>(g, RP(g->o), N, qd, w, BK_MOD_O, d, RP(g->tmp)));
    k_add<R><<<grid_for(N * d), 256, 0, g->c->stream>>>(RP(g->h1), hin, RP(g->tmp), N * d);
    LAUNCH_CHECK("k_add");
    TRY(rms_fwd<R>(g, RP(g->h1), N, d, CRP(w->mn), g->r2, RP(g->xm)));
    TRY(lin<R>(g, RP(g->xm), N, d, w, BK_MOD_GATE, NI, RP(g->zg)));
    TRY(lin<R>(g, RP(g->xm), N, d, w, BK_MOD_UP, NI, RP(g->zu), 1));
    k_swiglu<R><<<grid_for(N * NI), 256, 0, g->c->stream>>>(RP(g->zg), RP(g->zu), RP(g->mm), N * NI);
    LAUNCH_CHECK("k_swiglu");
    if (!hout)
        return BK_OK;
    TRY(lin<R>(g, RP(g->mm), N, NI, w, BK_MOD_DOWN, d, RP(g->tmp)));
    k_add<R><<<grid_for(N * d), 256, 0, g->c->stream>>>(hout, RP(g->h1), RP(g->tmp), N * d);
    LAUNCH_CHECK("k_add");
    return BK_OK;
}

/* backward through one layer: dh = dL/d(output) on entry, dL/d(input) on
 * return; the module output gradients stay in dq, dk, dv, dh1, dzg, dzu and
 * (g_down) the entry value of dh, copied to tmp */
template <typename R>
bk_status layer_bwd(gbwd *g, const gslot *w, int layer, int64_t S, const R *hin, R *dh)
{
    const int64_t T = g->dim.T, N = S * T, d = g->dim.hidden, qd = g->dim.qdim, kvd = g->dim.kvdim, hd = g->dim.hd,
                  NI = g->dim.inter;
    bk_status st;
    TRY(layer_fwd<R>(g, w, S, hin, (R *)NULL));
    /* MLP: g_down = dh (kept in tmp) */
    BK_CUDA_CHECK(cudaMemcpyAsync(g->tmp, dh, (size_t)(N * d) * g->es, cudaMemcpyDeviceToDevice,
                                  g->c->stream));
    TRY(lin_back<R>(g, dh, N, d, w, BK_MOD_DOWN, NI, 0.0, RP(g->dm)));
    k_swiglu_back<R><<<grid_for(N * NI), 256, 0, g->c->stream>>>(
        RP(g->zg), RP(g->zu), RP(g->dm), RP(g->dzg), RP(g->dzu), N * NI);
    LAUNCH_CHECK("k_swiglu_back");
    TRY(lin_back<R>(g, RP(g->dzg), N, NI, w, BK_MOD_GATE, d, 0.0, RP(g->dx)));
    TRY(lin_back<R>(g, RP(g->dzu), N, NI, w, BK_MOD_UP, d, 1.0, RP(g->dx)));
    /* dh1 = dh2 + RMSNorm_2 adjoint */
    BK_CUDA_CHECK(cudaMemcpyAsync(g->dh1, dh, (size_t)(N * d) * g->es, cudaMemcpyDeviceToDevice,
                                  g->c->stream));
    TRY(rms_back<R>(g, RP(g->h1), g->r2, N, d, CRP(w->mn), RP(g->dx), 1, RP(g->dh1)));
    /* attention: g_o = dh1 */
    TRY(lin_back<R>(g, RP(g->dh1), N, d, w, BK_MOD_O, qd, 0.0, RP(g->dob)));
    if (!g->flash) { /* (the unfused paths accumulate dk, dv over heads and chunks) */
        BK_CUDA_CHECK(cudaMemsetAsync(g->dq, 0, (size_t)(N * qd) * g->es, g->c->stream));
        BK_CUDA_CHECK(cudaMemsetAsync(g->dk, 0, (size_t)(N * kvd) * g->es, g->c->stream));
        BK_CUDA_CHECK(cudaMemsetAsync(g->dv, 0, (size_t)(N * kvd) * g->es, g->c->stream));
    }
    const double scale = 1.0 / sqrt((double)hd);
    const int64_t nch = attn_chunks(g);
    if (g->flash) {
        TRY(attn_back_fused<R>(g, S));
    } else if (g->wbf) {
        TRY(attn_back_bf<R>(g, S, nch));
    } else
    for (int64_t j = 0; j < g->dim.nh; j++)
        for (int64_t c = 0; c < nch; c++) {
            /* query rows [r0, r1) of head j against keys [0, r1) (one chunk:
             * the whole [T, T]) */
            const int64_t gi = j / g->dim.rep, r0 = T * c / nch, r1 = T * (c + 1) / nch,
                          rc = r1 - r0;
            R *Pc = RP(g->P) + r0 * T, *dPc = RP(g->dP) + r0 * T;
            const R *dOc = RP(g->dob) + r0 * qd + j * hd;
            TRY(attn_probs_rows<R>(g, S, j, r0, r1));
            /* dV_g += Pᵀ dO_j; dP = dO_j V_gᵀ */
            GEMM_CHECK(rm_gemm_b(g->bl, true, false, r1, hd, rc, 1.0, Pc, T, T * T, dOc, qd,
                                 T * qd, 1.0, RP(g->dv) + gi * hd, kvd, T * kvd, S));
            GEMM_CHECK(rm_gemm_b(g->bl, false, true, rc, r1, hd, 1.0, dOc, qd, T * qd,
                                 RP(g->zv) + gi * hd, kvd, T * kvd, 0.0, dPc, T, T * T, S));
            k_dsoftmax<<<warp_grid(S * rc), 256, 0, g->c->stream>>>(RP(g->P), RP(g->dP), RP(g->dP),
                                                                     S * rc, T, r0, rc, r1);
            LAUNCH_CHECK("k_dsoftmax");
            /* dQ_j = scale dS K_g; dK_g += scale dSᵀ Q_j */
            GEMM_CHECK(rm_gemm_b(g->bl, false, false, rc, hd, r1, scale, dPc, T, T * T,
                                 RP(g->kr) + gi * hd, kvd, T * kvd, 0.0,
                                 RP(g->dq) + r0 * qd + j * hd, qd, T * qd, S));
            GEMM_CHECK(rm_gemm_b(g->bl, true, false, r1, hd, rc, scale, dPc, T, T * T,
                                 RP(g->qr) + r0 * qd + j * hd, qd, T * qd, 1.0,
                                 RP(g->dk) + gi * hd, kvd, T * kvd, S));
        }
    /* RoPE adjoint, then the q/k norm adjoints: dq, dk become the gradients
     * of the q_proj / k_proj outputs */
    TRY(rope<R>(g, RP(g->dq), N, g->dim.nh, -1));
    TRY(rope<R>(g, RP(g->dk), N, g->dim.nkv, -1));
    if (w->qn) {
        BK_CUDA_CHECK(cudaMemcpyAsync(g->cpy, g->dq, (size_t)(N * qd) * g->es,
                                      cudaMemcpyDeviceToDevice, g->c->stream));
        TRY(rms_back<R>(g, RP(g->zq), g->rq, N * g->dim.nh, hd, CRP(w->qn), RP(g->cpy), 0, RP(g->dq)));
        BK_CUDA_CHECK(cudaMemcpyAsync(g->cpy, g->dk, (size_t)(N * kvd) * g->es,
                                      cudaMemcpyDeviceToDevice, g->c->stream));
        TRY(rms_back<R>(g, RP(g->zk), g->rk, N * g->dim.nkv, hd, CRP(w->kn), RP(g->cpy), 0, RP(g->dk)));
    }
    /* dxa = dq Wq + dk Wk + dv Wv; dh = dh1 + RMSNorm_1 adjoint */
    TRY(lin_back<R>(g, RP(g->dq), N, qd, w, BK_MOD_Q, d, 0.0, RP(g->dx)));
    TRY(lin_back<R>(g, RP(g->dk), N, kvd, w, BK_MOD_K, d, 1.0, RP(g->dx)));
    TRY(lin_back<R>(g, RP(g->dv), N, kvd, w, BK_MOD_V, d, 1.0, RP(g->dx)));
    BK_CUDA_CHECK(cudaMemcpyAsync(dh, g->dh1, (size_t)(N * d) * g->es, cudaMemcpyDeviceToDevice,
                                  g->c->stream));
    TRY(rms_back<R>(g, hin, g->r1, N, d, CRP(w->an), RP(g->dx), 1, dh));

    /* every module's output gradient must be finite (the CPU's order) */
    const R *gs[8] = {RP(g->dq), RP(g->dk), RP(g->dv), RP(g->dh1), RP(g->dzg), RP(g->dzu),
                      RP(g->tmp), dh};
    int64_t cols[8];
    int64_t len[8];
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(&g->cfg, (bk_module)i, &o, &in);
        cols[i] = o;
    }
    cols[7] = d;
    for (int i = 0; i < 8; i++)
        len[i] = N * cols[i];
    unsigned long long idx[8];
    TRY(first_bad<R>(g, 8, gs, len, idx));
    for (int i = 0; i < 8; i++)
        if (idx[i] != ~0ull)
            return bad_grad(layer,
                            i < 7 ? bk_module_name((bk_module)i)
                                  : "input_layernorm (gradient of the layer's input)",
                            idx[i], cols[i]);
    return BK_OK;
}

/* host double copies of the taps of the last layer_bwd (S sequences) */
template <typename R> bk_status download_taps(gbwd *g, int64_t S, bk_grad_taps *t)
{
    const int64_t N = S * g->dim.T;
    const void *as[4] = {g->xa, g->o, g->xm, g->mm};
    const int64_t aw[4] = {g->dim.hidden, g->dim.qdim, g->dim.hidden, g->dim.inter};
    const void *gs[BK_MOD_COUNT] = {g->dq, g->dk, g->dv, g->dh1, g->dzg, g->dzu, g->tmp};
    for (int k = 0; k < 4 + BK_MOD_COUNT; k++) {
        const void *src;
        double *dst;
        int64_t n;
        if (k < 4) {
            src = as[k];
            dst = g->ha[k];
            n = N * aw[k];
        } else {
            int64_t o, in;
            bk_module_shape(&g->cfg, (bk_module)(k - 4), &o, &in);
            src = gs[k - 4];
            dst = g->hg[k - 4];
            n = N * o;
        }
        if (g->fp64) {
            BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * 8, cudaMemcpyDeviceToHost,
                                          g->c->stream));
        } else {
            if ((size_t)n * 4 > g->hstage_bytes)
                return bk_error(BK_ERR_INTERNAL, "GPU backward: tap staging too small");
            BK_CUDA_CHECK(cudaMemcpyAsync(g->hstage, src, (size_t)n * 4, cudaMemcpyDeviceToHost,
                                          g->c->stream));
            BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream));
            const float *h = static_cast<const float *>(g->hstage);
            for (int64_t i = 0; i < n; i++)
                dst[i] = (double)h[i];
        }
    }
    BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream));
    t->a[BK_MOD_Q] = t->a[BK_MOD_K] = t->a[BK_MOD_V] = g->ha[0];
    t->a[BK_MOD_O] = g->ha[1];
    t->a[BK_MOD_GATE] = t->a[BK_MOD_UP] = g->ha[2];
    t->a[BK_MOD_DOWN] = g->ha[3];
    for (int i = 0; i < BK_MOD_COUNT; i++)
        t->g[i] = g->hg[i];
    return BK_OK;
}

/* ---------------------------------------------------------------- head */

/* h [S*T, d] (device) of sequences seq0.. -> labels (device g->lab; host copy
 * in labels_out when not NULL), dh (device, may be NULL) and *loss (may be
 * NULL). tokens: host, this micro-batch's. */
template <typename R>
bk_status head_run(gbwd *g, const R *h, int64_t S, int64_t seq0, const int32_t *tokens,
                   bk_fisher_kind fisher, uint64_t seed, const int32_t *given_labels, R *dh,
                   double *loss, int32_t *labels_out)
{
    const int64_t T = g->dim.T, N = S * T, V = g->V, d = g->dim.hidden;
    cudaStream_t s = g->c->stream;
    bk_status st;
    TRY(rms_fwd<R>(g, h, N, d, CRP(g->headn), g->rf, RP(g->xf)));
    k_lse_init<<<grid_for(N), 256, 0, s>>>(g->mx, g->se, N);
    LAUNCH_CHECK("k_lse_init");
    /* block v0's logits [N, n]: at N·v0 in lg when every block is kept */
#define LGB(v0) (RP(g->lg) + (g->lg_all ? N * (v0) : 0))
    for (int64_t v0 = 0; v0 < V; v0 += g->vc) {
        const int64_t n = V - v0 < g->vc ? V - v0 : g->vc;
        GEMM_CHECK(rm_gemm(g->bl, false, true, N, n, d, 1.0, RP(g->xf), d,
                           CRP(g->headw) + v0 * d, d, 0.0, LGB(v0), n));
        k_lse_block<R><<<warp_grid(N), 256, 0, s>>>(LGB(v0), N, n, g->mx, g->se);
        LAUNCH_CHECK("k_lse_block");
    }
    /* finite logits (as the CPU) */
    {
        double *hm = static_cast<double *>(malloc((size_t)N * 2 * sizeof(double)));
        if (!hm)
            return bk_error(BK_ERR_NOMEM, "GPU backward: out of memory");
        cudaError_t e = cudaMemcpyAsync(hm, g->mx, (size_t)N * 8, cudaMemcpyDeviceToHost, s);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(hm + N, g->se, (size_t)N * 8, cudaMemcpyDeviceToHost, s);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(s);
        st = bk_cuda_status(e, "GPU backward: log-sum-exp", __FILE__, __LINE__);
        for (int64_t r = 0; r < N && st == BK_OK; r++)
            if (!std::isfinite(hm[r]) || !std::isfinite(hm[N + r]) || !(hm[N + r] > 0))
                st = bk_error(BK_ERR_NONFINITE,
                              "backward: non-finite logits at token row %lld (the model "
                              "produced NaN/Inf)",
                              (long long)r);
        free(hm);
        if (st != BK_OK)
            return st;
    }
    int32_t *hl = static_cast<int32_t *>(malloc((size_t)N * sizeof(int32_t)));
    double *hd_ = static_cast<double *>(malloc((size_t)N * 2 * sizeof(double)));
    if (!hl || !hd_) {
        free(hl);
        free(hd_);
        return bk_error(BK_ERR_NOMEM, "GPU backward: out of memory");
    }
    st = BK_OK;
    if (given_labels) {
        memcpy(hl, given_labels, (size_t)N * sizeof(int32_t));
        st = bk_cuda_status(cudaMemcpyAsync(g->lab, hl, (size_t)N * 4, cudaMemcpyHostToDevice, s),
                            "GPU backward: labels", __FILE__, __LINE__);
    } else if (fisher == BK_FISHER_EMPIRICAL) {
        for (int64_t r = 0; r < N; r++)
            hl[r] = (r % T == T - 1) ? -1 : tokens[r + 1];
        st = bk_cuda_status(cudaMemcpyAsync(g->lab, hl, (size_t)N * 4, cudaMemcpyHostToDevice, s),
                            "GPU backward: labels", __FILE__, __LINE__);
    } else {
        /* the CPU's uniforms, then the inverse CDF on the device */
        for (int64_t r = 0; r < N; r++)
            hd_[r] = bk__bwd_uniform(seed, seq0 + r / T, r % T);
        st = bk_cuda_status(cudaMemcpyAsync(g->U, hd_, (size_t)N * 8, cudaMemcpyHostToDevice, s),
                            "GPU backward: uniforms", __FILE__, __LINE__);
        if (st == BK_OK) {
            k_sample_init<<<grid_for(N), 256, 0, s>>>(g->U, g->se, g->tg, g->cum, g->last, g->lab,
                                                      N, V);
            st = BK_LAUNCHED_OK();
        }
        for (int64_t v0 = 0; v0 < V && st == BK_OK; v0 += g->vc) {
            const int64_t n = V - v0 < g->vc ? V - v0 : g->vc;
            if (!g->lg_all)
                st = bk_cublas_status(rm_gemm(g->bl, false, true, N, n, d, 1.0, RP(g->xf), d,
                                              CRP(g->headw) + v0 * d, d, 0.0, LGB(v0), n),
                                      "GPU backward: logits", __FILE__, __LINE__);
            if (st == BK_OK) {
                k_sample_block<R><<<warp_grid(N), 256, 0, s>>>(LGB(v0), N, n, v0, g->mx, g->tg,
                                                               g->cum, g->last, g->lab);
                st = BK_LAUNCHED_OK();
            }
        }
        if (st == BK_OK) {
            k_sample_finish<<<grid_for(N), 256, 0, s>>>(g->lab, g->last, N);
            st = BK_LAUNCHED_OK();
        }
        if (st == BK_OK)
            st = bk_cuda_status(cudaMemcpyAsync(hl, g->lab, (size_t)N * 4, cudaMemcpyDeviceToHost, s),
                                "GPU backward: labels", __FILE__, __LINE__);
    }
    /* gradient of the summed cross entropy */
    if (st == BK_OK) {
        k_lse<<<grid_for(N), 256, 0, s>>>(g->mx, g->se, g->lse, N);
        st = BK_LAUNCHED_OK();
    }
    if (st == BK_OK && dh)
        st = bk_cuda_status(cudaMemsetAsync(g->dxf, 0, (size_t)(N * d) * g->es, s),
                            "GPU backward: head", __FILE__, __LINE__);
    if (st == BK_OK)
        st = bk_cuda_status(cudaMemsetAsync(g->tgl, 0, (size_t)N * 8, s), "GPU backward: head",
                            __FILE__, __LINE__);
    for (int64_t v0 = 0; v0 < V && st == BK_OK; v0 += g->vc) {
        const int64_t n = V - v0 < g->vc ? V - v0 : g->vc;
        if (!g->lg_all)
            st = bk_cublas_status(rm_gemm(g->bl, false, true, N, n, d, 1.0, RP(g->xf), d,
                                          CRP(g->headw) + v0 * d, d, 0.0, LGB(v0), n),
                                  "GPU backward: logits", __FILE__, __LINE__);
        if (st == BK_OK) {
            k_head_grad<R><<<grid_for(N * n), 256, 0, s>>>(LGB(v0), N, n, v0, g->lab, g->lse,
                                                           g->tgl);
            st = BK_LAUNCHED_OK();
        }
        if (st == BK_OK && dh)
            st = bk_cublas_status(rm_gemm(g->bl, false, false, N, d, n, 1.0, LGB(v0), n,
                                          CRP(g->headw) + v0 * d, d, 1.0, RP(g->dxf), d),
                                  "GPU backward: head gradient", __FILE__, __LINE__);
    }
    if (st == BK_OK && dh)
        st = rms_back<R>(g, h, g->rf, N, d, CRP(g->headn), RP(g->dxf), 0, dh);
    if (st == BK_OK && (loss || labels_out)) {
        cudaError_t e = cudaMemcpyAsync(hd_, g->lse, (size_t)N * 8, cudaMemcpyDeviceToHost, s);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(hd_ + N, g->tgl, (size_t)N * 8, cudaMemcpyDeviceToHost, s);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(s);
        st = bk_cuda_status(e, "GPU backward: loss", __FILE__, __LINE__);
        if (st == BK_OK && loss) {
            double sum = 0;
            for (int64_t r = 0; r < N; r++)
                if (hl[r] >= 0)
                    sum += hd_[r] - hd_[N + r];
            *loss += sum;
        }
        if (st == BK_OK && labels_out)
            memcpy(labels_out, hl, (size_t)N * sizeof(int32_t));
    }
    free(hl);
    free(hd_);
    if (st == BK_OK && dh) {
        const R *x[1] = {dh};
        int64_t len[1] = {N * d};
        unsigned long long idx[1];
        TRY(first_bad<R>(g, 1, x, len, idx));
        if (idx[0] != ~0ull)
            return bad_grad((int)g->cfg.n_layers, "model.norm (gradient of the last layer's output)",
                            idx[0], d);
    }
    return st;
#undef LGB
}

/* embed_tokens on the device in R, once: the LM head's array when tied (the
 * same tensor, converted by the same upload_rows), else a copy of its own */
bk_status embed_init(gbwd *g)
{
    const bk_tensor_info *t = bk_model_find(g->m, -1, "embed_tokens.weight");
    if (!t || t->ndim != 2 || t->shape[0] != g->V || t->shape[1] != g->dim.hidden)
        return bk_error(BK_ERR_MISSING_TENSOR, "embed_tokens.weight: missing or of a wrong shape");
    if (g->emb)
        return BK_OK;
    if (g->cfg.tie_embeddings) {
        g->emb = g->headw;
        return BK_OK;
    }
    bk_status st = dalloc(g, &g->emb, g->V * g->dim.hidden, g->es, "embedding table");
    if (st == BK_OK) {
        g->emb_own = 1;
        st = upload_rows(g, t, 0, g->V, g->emb);
    }
    return st;
}

/* embedding rows of S sequences (host token ids, checked by the flow) into
 * the device array h (R): a gather from the device table */
template <typename R> bk_status embed(gbwd *g, const int32_t *tokens, int64_t S, void *h)
{
    bk_status st = embed_init(g);
    if (st != BK_OK)
        return st;
    const int64_t N = S * g->dim.T, d = g->dim.hidden;
    /* (pageable source: the copy has read it when the call returns) */
    BK_CUDA_CHECK(cudaMemcpyAsync(g->dtok, tokens, (size_t)N * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, g->c->stream));
    k_embed_rows<R><<<grid_for(N * d), 256, 0, g->c->stream>>>(CRP(g->emb), g->dtok, N, d, RP(h));
    LAUNCH_CHECK("k_embed_rows");
    return BK_OK;
}

/* ---------------------------------------------------------------- flows */

/* The GPU's operations of the backward flow (bk_bwd_flow_ops,
 * src/backward_internal.h; the flow itself: bk__bwd_flow_drive in
 * src/backward_flow.c). The boundary matrices are pinned host arrays. */
struct flow {
    gbwd *g;
    const bk_bwd_flow_opts *o;
    const bk_bwd_flow_cb *cb;
    int64_t S, T, B, d;
    void *h, *dh;    /* device [B*T, d] */
    void *acts;      /* device [acts_layers, B*T, d] */
    int64_t acts_layers;
    /* cb->grams: the leaf's output-gradient Grams on the device, [leaf][module]
     * [out, out] double; |g|² per token on the host [leaf][module][S*T] */
    int gleaf;
    double *gram[64][BK_MOD_COUNT];
    double *hgw[64][BK_MOD_COUNT];
    double *dgw[64][BK_MOD_COUNT]; /* cb->grams_dev, weighted: |g|² per token on the device */
    double *gscr, *rn_g, *rn_a; /* device [B*T, max out] (BF16 / F32 on tensor cores, else
                                   double), [B*T], [B*T] */
    float *g32;                 /* tf32 / bf16: one column panel of a micro-batch's F32 Gram
                                   [max out, 1024 or 512] */
    double *hG;                 /* host [max out²] */
    /* boundary stores off the compute stream: the micro-batch's h or dh is
     * copied to a device scratch (sbuf[0] for h, [1] for dh) on the compute
     * stream, then to the pinned boundary on cs; ev_done[k] marks the end
     * of scratch k's last device-to-host copy, whose host range is
     * [pend_lo[k], pend_hi[k]) */
    cudaStream_t cs;
    cudaEvent_t ev_ready, ev_done[2];
    void *sbuf[2];
    const char *pend_lo[2], *pend_hi[2];
    /* --bwd-precision bf16 (issue 16, session 14): h and dh rounded to BF16
     * at every layer boundary (after the embedding, each layer's forward,
     * the head and each layer's backward), in both flows, as a BF16 model's
     * hidden states and their gradients are; the boundary matrices are then
     * BF16 host arrays (2 bytes an element, exact) and sbuf[k] the BF16
     * staging of stores and loads */
    int bfb;
};

/* h or dh ([sb*T, d]) rounded to BF16 in place when f->bfb */
bk_status bf_round(flow *f, void *buf, int64_t sb)
{
    if (!f->bfb)
        return BK_OK;
    const int64_t n = sb * f->T * f->d;
    k_round_bf16<<<grid_for(n), 256, 0, f->g->c->stream>>>(static_cast<float *>(buf), n);
    LAUNCH_CHECK("k_round_bf16");
    return BK_OK;
}

/* this micro-batch's (sequences s0 .. s0+sb) output gradients of the last
 * layer_bwd into the Grams of leaf layer k */
template <typename R> bk_status gram_add(flow *f, int k, int64_t s0, int64_t sb)
{
    gbwd *g = f->g;
    cudaStream_t s = g->c->stream;
    const int64_t N = sb * f->T;
    const void *gs[BK_MOD_COUNT] = {g->dq, g->dk, g->dv, g->dh1, g->dzg, g->dzu, g->tmp};
    const void *as[BK_MOD_COUNT] = {g->xa, g->xa, g->xa, g->o, g->xm, g->xm, g->mm};
    const double one = 1.0;
    const int dev = f->cb->grams_dev != NULL;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t m, n;
        bk_module_shape(&g->cfg, (bk_module)i, &m, &n);
        /* |g|² per token: to the host (cb->grams), or into the device array
         * of the leaf layer (cb->grams_dev; only Shampoo uses them) */
        if (!dev || f->cb->gram_weighted) {
            k_row_sq<R><<<warp_grid(N), 256, 0, s>>>(
                CRP(gs[i]), N, m, dev ? f->dgw[k][i] + s0 * f->T : f->rn_g);
            LAUNCH_CHECK("k_row_sq");
        }
        if (f->cb->gram_weighted) {
            k_row_sq<R><<<warp_grid(N), 256, 0, s>>>(CRP(as[i]), N, n, f->rn_a);
            LAUNCH_CHECK("k_row_sq");
        }
        const double *wrow = f->cb->gram_weighted ? f->rn_a : (const double *)NULL;
        if (f->g32) {
            /* --bwd-precision tf32 / bf16: this micro-batch's Gram on tensor
             * cores in the flow's GEMM arithmetic (F32 inputs and
             * accumulation), lower-trapezoid panels of the column-major view
             * (X = [m, N], C[j0:m, j0:j1] = X[j0:m, :] X[j0:j1, :]ᵀ), then
             * added in double to the leaf's Gram: the sum over micro-batches
             * stays in double as with DSYRK */
            /* bf16: the scaled gradients stored as BF16 and BF16 x BF16 GEMMs
             * (CUBLAS_COMPUTE_32F; the products 32F_FAST_16BF forms from F32
             * arrays, without its conversions); tf32: F32 with 32F_FAST_TF32 */
            const bool bf = g->wbf != 0;
            void *xs = f->gscr;
            if (bf)
                k_scale_rows<R, __nv_bfloat16><<<grid_for(N * m), 256, 0, s>>>(
                    CRP(gs[i]), N, m, wrow, static_cast<__nv_bfloat16 *>(xs));
            else
                k_scale_rows<R, float><<<grid_for(N * m), 256, 0, s>>>(CRP(gs[i]), N, m, wrow,
                                                                       static_cast<float *>(xs));
            LAUNCH_CHECK("k_scale_rows");
            const size_t xe = bf ? 2 : 4;
            const cudaDataType_t xt = bf ? CUDA_R_16BF : CUDA_R_32F;
            const cublasComputeType_t ct = bf ? CUBLAS_COMPUTE_32F : g->bl.ct;
            const float one32 = 1.0f, zero32 = 0.0f;
            const int64_t nb = m >= 8192 ? 1024 : 512;
            for (int64_t j0 = 0; j0 < m; j0 += nb) {
                const int64_t w = m - j0 < nb ? m - j0 : nb;
                const void *xj = static_cast<const char *>(xs) + (size_t)j0 * xe;
                /* the panel [m - j0, w] into g32 ([m, nb], rows from j0), then
                 * added: g32 holds one panel, not the whole [m, m] */
                GEMM_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_T, (int)(m - j0), (int)w,
                                        (int)N, &one32, xj, xt, (int)m, xj, xt, (int)m, &zero32,
                                        f->g32 + j0, CUDA_R_32F, (int)m, ct,
                                        CUBLAS_GEMM_DEFAULT));
                k_gram_acc_panel<<<grid_for((m - j0) * w), 256, 0, s>>>(f->gram[k][i], f->g32,
                                                                        m, j0, w);
                LAUNCH_CHECK("k_gram_acc_panel");
            }
        } else {
            k_scale_rows<R, double><<<grid_for(N * m), 256, 0, s>>>(CRP(gs[i]), N, m, wrow,
                                                                    f->gscr);
            LAUNCH_CHECK("k_scale_rows");
            /* row-major upper triangle of Σ x xᵀ = cuBLAS's column-major lower */
            GEMM_CHECK(cublasDsyrk(g->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)m, (int)N,
                                   &one, f->gscr, (int)m, &one, f->gram[k][i], (int)m));
        }
        if (!dev)
            BK_CUDA_CHECK(cudaMemcpyAsync(f->hgw[k][i] + s0 * f->T, f->rn_g, (size_t)N * 8,
                                          cudaMemcpyDeviceToHost, s));
    }
    if (!dev) /* (the host copies are read next) */
        BK_CUDA_CHECK(cudaStreamSynchronize(s));
    return BK_OK;
}

/* the Grams of the leaf [lo, hi) to cb->grams, then zeroed */
bk_status grams_deliver(flow *f, int lo, int hi)
{
    gbwd *g = f->g;
    for (int l = lo; l < hi; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            int64_t m, n;
            bk_module_shape(&g->cfg, (bk_module)i, &m, &n);
            double *Gd = f->gram[l - lo][i];
            BK_CUDA_CHECK(cudaMemcpyAsync(f->hG, Gd, (size_t)(m * m) * 8, cudaMemcpyDeviceToHost,
                                          g->c->stream));
            BK_CUDA_CHECK(cudaMemsetAsync(Gd, 0, (size_t)(m * m) * 8, g->c->stream));
            BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream));
            bk_status st = f->cb->grams(f->cb->user, l, (bk_module)i, f->hG, f->hgw[l - lo][i], f->S);
            if (st != BK_OK)
                return st;
        }
    return BK_OK;
}

/* BK_PROFILE: where the flow's time goes (each mark synchronises) */

/* The boundary matrices: pinned host memory. One cudaMallocHost of GBs
 * pins about 1.7 GB/s on the H200's host (session 14: ≈ 35 s of the 8B job's
 * start went to 15 matrices of 4.3 GB), so the pages are first populated by
 * several threads (transparent huge pages where the kernel allows them) and
 * then registered with the driver; cudaMallocHost when that fails. A page of
 * header before the matrix keeps its size and how it was made, for the free.
 * The host plan (src/bwd_mem.c) has checked the memory before the flow. */
struct bhdr {
    size_t bytes;   /* the whole mapping, header included */
    int registered; /* 1: mmap + cudaHostRegister; 0: cudaMallocHost */
};
static const size_t BHDR = 4096;

struct touch_job {
    char *p;
    size_t n;
};

static void *touch_main(void *a)
{
    touch_job *t = static_cast<touch_job *>(a);
    for (size_t i = 0; i < t->n; i += 4096)
        t->p[i] = 0;
    return NULL;
}

/* one write per page of [p, p + n), on up to 16 threads */
static void touch_pages(char *p, size_t n)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = ncpu < 1 ? 1 : ncpu > 16 ? 16 : (int)ncpu;
    const size_t per = (n / (size_t)nt + 4095) / 4096 * 4096;
    touch_job tj[16];
    pthread_t tid[16];
    int nj = 0, started[16] = {0};
    for (int k = 0; k < nt && (size_t)k * per < n; k++) {
        const size_t off = (size_t)k * per;
        tj[nj].p = p + off;
        tj[nj].n = off + per < n ? per : n - off;
        nj++;
    }
    for (int k = 1; k < nj; k++)
        started[k] = pthread_create(&tid[k], NULL, touch_main, &tj[k]) == 0;
    touch_main(&tj[0]);
    for (int k = 1; k < nj; k++) {
        if (started[k])
            pthread_join(tid[k], NULL);
        else
            touch_main(&tj[k]); /* (no thread: this one does it) */
    }
}

void *op_boundary_alloc(void *, size_t bytes)
{
    const double t0 = bk_now();
    if (bytes > SIZE_MAX - 2 * BHDR) /* (the rounding below would wrap) */
        return NULL;
    const size_t n = BHDR + (bytes + 4095) / 4096 * 4096;
    char *base = NULL;
    int registered = 0;
    /* (populating pages the host does not have would wake the kernel's OOM
     * killer: the host plan has checked the flow's memory, this checks it
     * again now (bk_host_avail_bytes: MemAvailable and a cgroup limit), with
     * 1 GiB spare; short of that, cudaMallocHost; short of the matrix
     * itself, nothing: pinning it would reclaim what the host does not have
     * (the OOM killer again), the driver names --bwd-boundaries 0 instead) */
    const uint64_t avail = bk_host_avail_bytes();
    if (avail && avail < (uint64_t)n)
        return NULL;
    void *m = avail && avail < (uint64_t)n + ((uint64_t)1 << 30)
                  ? MAP_FAILED
                  : mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
#ifdef MADV_HUGEPAGE
        madvise(m, n, MADV_HUGEPAGE); /* (advice: ignored where not available) */
#endif
        touch_pages(static_cast<char *>(m), n);
        if (cudaHostRegister(m, n, cudaHostRegisterDefault) == cudaSuccess) {
            base = static_cast<char *>(m);
            registered = 1;
        } else {
            cudaGetLastError();
            munmap(m, n);
        }
    }
    if (!base) {
        void *q = NULL;
        if (cudaMallocHost(&q, n) != cudaSuccess) {
            cudaGetLastError();
            return NULL;
        }
        base = static_cast<char *>(q);
    }
    bhdr *h = reinterpret_cast<bhdr *>(base);
    h->bytes = n;
    h->registered = registered;
    bk_prof_add("bwd.boundary_alloc", bk_now() - t0);
    return base + BHDR;
}

void op_boundary_free(void *x, void *p)
{
    flow *f = static_cast<flow *>(x);
    cudaStreamSynchronize(f->g->c->stream);
    cudaStreamSynchronize(f->cs); /* (a store into it may still be running) */
    const double t0 = bk_now();
    bhdr *h = reinterpret_cast<bhdr *>(static_cast<char *>(p) - BHDR);
    if (h->registered) {
        const size_t n = h->bytes;
        cudaHostUnregister(h);
        munmap(h, n);
    } else {
        cudaFreeHost(h);
    }
    bk_prof_add("bwd.boundary_free", bk_now() - t0);
}

template <typename R> bk_status op_embed(void *x, const int32_t *tokens, int64_t sb)
{
    flow *f = static_cast<flow *>(x);
    double tp = bk_now();
    mb_begin(f->g);
    bk_status st = embed<R>(f->g, tokens, sb, f->h);
    if (st == BK_OK)
        st = bf_round(f, f->h, sb);
    bk_cuda_pmark(f->g->c->stream, &tp, "bwd.embed");
    return st;
}

bk_status op_load(void *x, int buf, const void *src, size_t bytes)
{
    flow *f = static_cast<flow *>(x);
    double tp = bk_now();
    cudaStream_t s = f->g->c->stream;
    /* a store still copying into these host bytes: wait for it (on the
     * device). Only the last store of each scratch can be pending: a store
     * waits for the previous copy out of its scratch before reusing it, and
     * every later operation of the compute stream is ordered after that */
    const char *lo = static_cast<const char *>(src), *hi = lo + bytes;
    if (buf == BK_BWD_H)
        mb_begin(f->g);
    for (int k = 0; k < 2; k++)
        if (f->pend_lo[k] && lo < f->pend_hi[k] && hi > f->pend_lo[k])
            BK_CUDA_CHECK(cudaStreamWaitEvent(s, f->ev_done[k], 0));
    void *dst = buf == BK_BWD_H ? f->h : f->dh;
    if (f->bfb) {
        /* BF16 (bytes / 2 elements) into the buffer's staging, then
         * widened: the scratch must be free of its last device-to-host copy */
        const int k = buf == BK_BWD_H ? 0 : 1;
        const int64_t n = (int64_t)(bytes / 2);
        if (!f->sbuf[k])
            return bk_error(BK_ERR_INTERNAL, "GPU backward: a boundary load without its scratch");
        BK_CUDA_CHECK(cudaStreamWaitEvent(s, f->ev_done[k], 0));
        BK_CUDA_CHECK(cudaMemcpyAsync(f->sbuf[k], src, bytes, cudaMemcpyHostToDevice, s));
        k_bf16_to_f32<<<grid_for(n), 256, 0, s>>>(static_cast<const __nv_bfloat16 *>(f->sbuf[k]),
                                                  static_cast<float *>(dst), n);
        LAUNCH_CHECK("k_bf16_to_f32");
    } else {
        BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    }
    bk_cuda_pmark(s, &tp, "bwd.boundary_in");
    return BK_OK;
}

/* h or dh to a boundary without stalling the compute stream: a device copy
 * into the buffer's scratch, then the device-to-host copy on f->cs
 * (overlapping the next layers); op_load and op_boundary_free wait for it */
bk_status op_store(void *x, int buf, void *dst, size_t bytes)
{
    flow *f = static_cast<flow *>(x);
    double tp = bk_now();
    cudaStream_t s = f->g->c->stream;
    const int k = buf == BK_BWD_H ? 0 : 1;
    if (!f->sbuf[k]) /* (allocated for the flows that store boundaries) */
        return bk_error(BK_ERR_INTERNAL, "GPU backward: a boundary store without its scratch");
    BK_CUDA_CHECK(cudaStreamWaitEvent(s, f->ev_done[k], 0)); /* (scratch k free) */
    if (f->bfb) {
        /* bytes / 2 elements, already BF16 values (bf_round): exact */
        const int64_t n = (int64_t)(bytes / 2);
        k_to_bf16_rn<float><<<grid_for(n), 256, 0, s>>>(static_cast<const float *>(k ? f->dh : f->h),
                                                        static_cast<__nv_bfloat16 *>(f->sbuf[k]), n);
        LAUNCH_CHECK("k_to_bf16_rn");
    } else {
        BK_CUDA_CHECK(cudaMemcpyAsync(f->sbuf[k], k ? f->dh : f->h, bytes,
                                      cudaMemcpyDeviceToDevice, s));
    }
    BK_CUDA_CHECK(cudaEventRecord(f->ev_ready, s));
    BK_CUDA_CHECK(cudaStreamWaitEvent(f->cs, f->ev_ready, 0));
    BK_CUDA_CHECK(cudaMemcpyAsync(dst, f->sbuf[k], bytes, cudaMemcpyDeviceToHost, f->cs));
    BK_CUDA_CHECK(cudaEventRecord(f->ev_done[k], f->cs));
    f->pend_lo[k] = static_cast<const char *>(dst);
    f->pend_hi[k] = f->pend_lo[k] + bytes;
    bk_cuda_pmark(s, &tp, "bwd.boundary_out");
    return BK_OK;
}

bk_status op_keep(void *x, int k, int64_t sb)
{
    flow *f = static_cast<flow *>(x);
    char *dst = (char *)f->acts + (size_t)k * f->B * f->T * f->d * f->g->es;
    BK_CUDA_CHECK(cudaMemcpyAsync(dst, f->h, (size_t)(sb * f->T * f->d) * f->g->es,
                                  cudaMemcpyDeviceToDevice, f->g->c->stream));
    return BK_OK;
}

/* layer l's weights for the forward or backward of one micro-batch */
bk_status op_weights(flow *f, int layer, double *tp, const gslot **w)
{
    bk_status st = weights(f->g, layer, w);
    if (st == BK_OK)
        bk_cuda_pmark(f->g->c->stream, tp, "bwd.weights");
    return st;
}

template <typename R> bk_status op_forward(void *x, int layer, int64_t sb)
{
    flow *f = static_cast<flow *>(x);
    double tp = bk_now();
    const gslot *w;
    bk_status st = op_weights(f, layer, &tp, &w);
    if (st == BK_OK)
        st = layer_fwd<R>(f->g, w, sb, RP(f->h), RP(f->h));
    if (st == BK_OK)
        st = bf_round(f, f->h, sb);
    bk_cuda_pmark(f->g->c->stream, &tp, "bwd.layer_forward");
    return st;
}

template <typename R> bk_status op_head(void *x, const int32_t *tokens, int64_t sb, int64_t seq0)
{
    flow *f = static_cast<flow *>(x);
    double tp = bk_now();
    bk_status st = head_run<R>(f->g, RP(f->h), sb, seq0, tokens, f->o->fisher, f->o->seed, NULL,
                               RP(f->dh), NULL, NULL);
    if (st == BK_OK)
        st = bf_round(f, f->dh, sb);
    bk_cuda_pmark(f->g->c->stream, &tp, "bwd.head");
    return st;
}

template <typename R> bk_status op_backward(void *x, int layer, int k, int64_t sb, int)
{
    flow *f = static_cast<flow *>(x);
    double tp = bk_now();
    const gslot *w;
    bk_status st = op_weights(f, layer, &tp, &w);
    if (st == BK_OK)
        st = layer_bwd<R>(f->g, w, layer, sb, RP(f->acts) + (size_t)k * f->B * f->T * f->d,
                          RP(f->dh));
    /* (the layer's taps are copies in g: not rounded) */
    if (st == BK_OK)
        st = bf_round(f, f->dh, sb);
    bk_cuda_pmark(f->g->c->stream, &tp, "bwd.layer_backward");
    return st;
}

template <typename R> bk_status op_deliver(void *x, int layer, int k, int64_t s0, int64_t sb)
{
    flow *f = static_cast<flow *>(x);
    bk_status st = BK_OK;
    if (f->cb->grams || f->cb->grams_dev) {
        double tp = bk_now();
        st = gram_add<R>(f, k, s0, sb);
        bk_cuda_pmark(f->g->c->stream, &tp, "bwd.grams");
    }
    if (st == BK_OK && f->cb->grads) {
        bk_grad_taps taps;
        st = download_taps<R>(f->g, sb, &taps);
        if (st == BK_OK)
            st = f->cb->grads(f->cb->user, layer, s0, sb, &taps);
    }
    return st;
}

bk_status op_sync(void *x)
{
    flow *f = static_cast<flow *>(x);
    BK_CUDA_CHECK(cudaStreamSynchronize(f->g->c->stream));
    return BK_OK;
}

/* a leaf pass begins: its Grams start from the sums cb->grams_start gives
 * (MPI ranks, ordered), else from zero (as cleared after the last leaf) */
bk_status op_leaf_begin(void *x, int lo, int hi)
{
    flow *f = static_cast<flow *>(x);
    if (!f->cb->grams_start)
        return BK_OK;
    gbwd *g = f->g;
    for (int l = lo; l < hi; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            int64_t m, n;
            bk_module_shape(&g->cfg, (bk_module)i, &m, &n);
            int set = 0;
            memset(f->hG, 0, (size_t)(m * m) * 8);
            bk_status st = f->cb->grams_start(f->cb->user, l, (bk_module)i, f->hG, &set);
            if (st != BK_OK)
                return st;
            if (!set)
                continue;
            BK_CUDA_CHECK(cudaMemcpyAsync(f->gram[l - lo][i], f->hG, (size_t)(m * m) * 8,
                                          cudaMemcpyHostToDevice, g->c->stream));
            BK_CUDA_CHECK(cudaStreamSynchronize(g->c->stream)); /* (hG is reused) */
        }
    return BK_OK;
}

bk_status op_leaf_done(void *x, int lo, int hi)
{
    flow *f = static_cast<flow *>(x);
    if (f->cb->grams_dev) {
        /* the device Grams to the consumer, valid until leaf_done returns */
        bk_status st = BK_OK;
        for (int l = lo; l < hi && st == BK_OK; l++)
            for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++)
                st = f->cb->grams_dev(f->cb->user, l, (bk_module)i, f->gram[l - lo][i],
                                      f->cb->gram_weighted ? f->dgw[l - lo][i] : NULL, f->S);
        if (st == BK_OK && f->cb->leaf_done)
            st = f->cb->leaf_done(f->cb->user, lo, hi);
        for (int l = lo; l < hi && st == BK_OK; l++)
            for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++) {
                int64_t m, n;
                bk_module_shape(&f->g->cfg, (bk_module)i, &m, &n);
                st = bk_cuda_status(cudaMemsetAsync(f->gram[l - lo][i], 0, (size_t)(m * m) * 8,
                                                    f->g->c->stream),
                                    "GPU backward: clearing the Grams", __FILE__, __LINE__);
            }
        return st;
    }
    if (f->cb->grams) {
        double tp = bk_now();
        bk_status st = grams_deliver(f, lo, hi);
        bk_prof_add("bwd.grams_deliver", bk_now() - tp);
        if (st != BK_OK)
            return st;
    }
    if (!f->cb->leaf_done)
        return BK_OK;
    return f->cb->leaf_done(f->cb->user, lo, hi);
}

template <typename R> bk_bwd_flow_ops flow_ops(int bfb)
{
    bk_bwd_flow_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.elem_bytes = bfb ? 2 : sizeof(R); /* (bf16: BF16 boundaries) */
    ops.boundary_mem = "pinned host memory";
    ops.boundary_alloc = op_boundary_alloc;
    ops.boundary_free = op_boundary_free;
    ops.embed = op_embed<R>;
    ops.load = op_load;
    ops.store = op_store;
    ops.keep = op_keep;
    ops.forward = op_forward<R>;
    ops.head = op_head<R>;
    ops.backward = op_backward<R>;
    ops.deliver = op_deliver<R>;
    ops.sync = op_sync;
    ops.leaf_done = op_leaf_done;
    ops.leaf_begin = op_leaf_begin;
    return ops;
}

} // namespace

extern "C" void bk_gbwd_opts_default(bk_gbwd_opts *o)
{
    memset(o, 0, sizeof *o);
}

extern "C" bk_status bk_cuda_bwd_flow_run(bk_backend *b, const bk_model *m, const int32_t *tokens,
                                          int64_t S, int64_t T, const bk_bwd_flow_opts *o,
                                          const bk_gbwd_opts *go, const bk_bwd_flow_cb *cb,
                                          bk_bwd_flow_stats *stats)
{
    if (!b)
        return bk_error(BK_ERR_INVALID_ARG, "backprop flow: NULL argument");
    int64_t B, acts_layers;
    bk_status st = bk__bwd_flow_check(m, tokens, S, T, o, cb, stats, &B, &acts_layers);
    if (st != BK_OK)
        return st;
    const bk_model_config *c = bk_model_get_config(m);
    /* the CPU forward's checks of the configuration (RoPE, sliding window) */
    {
        bk_fwd *probe = NULL;
        st = bk_fwd_create(c, 1, T, &probe);
        bk_fwd_free(probe);
        if (st != BK_OK)
            return bk_error_prefix(st, "backward");
    }
    flow f;
    memset(&f, 0, sizeof f);
    f.o = o;
    f.cb = cb;
    f.S = S;
    f.T = T;
    f.B = B;
    f.d = c->hidden;
    f.acts_layers = acts_layers;
    const int L = (int)c->n_layers;
    bk_gbwd_opts dflt;
    bk_gbwd_opts_default(&dflt);
    if (!go)
        go = &dflt;
    /* (the host tap copies only where taps are downloaded: cb->grads) */
    st = create(b, m, f.B, T, go, cb->grads ? 2 : 1, &f.g);
    if (st != BK_OK)
        return st;
    gbwd *g = f.g;
    const int64_t mrow = f.B * T * f.d;
    st = dalloc(g, &f.h, mrow, g->es, "micro-batch hidden states");
    if (st == BK_OK)
        st = dalloc(g, &f.dh, mrow, g->es, "micro-batch gradients");
    if (st == BK_OK)
        st = embed_init(g);
    /* (the naive flow stores no boundaries; bf16: BF16 boundaries, BF16 staging) */
    f.bfb = g->wbf;
    if (st == BK_OK && o->flow != BK_FLOW_NAIVE)
        st = dalloc(g, &f.sbuf[0], mrow, f.bfb ? 2 : g->es, "boundary staging");
    if (st == BK_OK && o->flow != BK_FLOW_NAIVE)
        st = dalloc(g, &f.sbuf[1], mrow, f.bfb ? 2 : g->es, "boundary staging");
    if (st == BK_OK) {
        cudaError_t e = cudaStreamCreateWithFlags(&f.cs, cudaStreamNonBlocking);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&f.ev_ready, cudaEventDisableTiming);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&f.ev_done[0], cudaEventDisableTiming);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&f.ev_done[1], cudaEventDisableTiming);
        st = bk_cuda_status(e, "GPU backward: copy stream", __FILE__, __LINE__);
    }
    if (st == BK_OK)
        st = dalloc(g, &f.acts, mrow * f.acts_layers, g->es, "micro-batch layer inputs");
    stats->micro_bytes = (uint64_t)g->dev_bytes;
    if (st == BK_ERR_DEVICE_OOM) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bk_last_error());
        st = bk_error(BK_ERR_DEVICE_OOM,
                      "%s (GPU backward: the inputs of %lld layers of one micro-batch are kept: "
                      "use a smaller --batch, or a smaller --leaf-size)",
                      msg, (long long)f.acts_layers);
    }
    if (st == BK_OK && (cb->grams || cb->grams_dev)) {
        f.gleaf = o->leaf < L ? o->leaf : L;
        if (f.gleaf > 64)
            st = bk_error(BK_ERR_INVALID_ARG,
                          "GPU backward: --leaf-size %d: at most 64 layers' Grams on the device",
                          o->leaf);
        int64_t mo = 0;
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            int64_t mm, nn;
            bk_module_shape(c, (bk_module)i, &mm, &nn);
            mo = mm > mo ? mm : mo;
        }
        /* the scaled gradients in the Gram's input type (BF16 / F32 on tensor
         * cores, double for DSYRK); the F32 Gram one column panel at a time
         * ([mo, nb], gram_add's panel width for the widest module) */
        const bool tc = !g->fp64 && g->bl.ct != CUBLAS_COMPUTE_32F;
        if (st == BK_OK)
            st = dalloc(g, (void **)&f.gscr, f.B * T * mo, tc ? (g->wbf ? 2 : 4) : 8,
                        "gradient Gram scratch");
        if (st == BK_OK && tc)
            st = dalloc(g, (void **)&f.g32, mo * (mo >= 8192 ? 1024 : 512), 4,
                        "gradient Gram scratch");
        if (st == BK_OK)
            st = dalloc(g, (void **)&f.rn_g, f.B * T, 8, "gradient norms");
        if (st == BK_OK)
            st = dalloc(g, (void **)&f.rn_a, f.B * T, 8, "gradient norms");
        for (int k = 0; k < f.gleaf && st == BK_OK; k++)
            for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++) {
                int64_t mm, nn;
                bk_module_shape(c, (bk_module)i, &mm, &nn);
                st = dalloc(g, (void **)&f.gram[k][i], mm * mm, 8, "output-gradient Grams");
                if (st == BK_OK && cb->grams_dev && cb->gram_weighted)
                    st = dalloc(g, (void **)&f.dgw[k][i], S * T, 8, "token weights");
                else if (st == BK_OK && !cb->grams_dev &&
                         !(f.hgw[k][i] =
                               static_cast<double *>(bk_alloc((size_t)(S * T), sizeof(double)))))
                    st = bk_error(BK_ERR_NOMEM,
                                  "GPU backward: out of host memory for token weights (use a "
                                  "smaller --leaf-size)");
            }
        if (st == BK_OK && !cb->grams_dev &&
            !(f.hG = static_cast<double *>(bk_alloc((size_t)(mo * mo), sizeof(double)))))
            st = bk_error(BK_ERR_NOMEM, "GPU backward: out of memory");
        if (st == BK_ERR_DEVICE_OOM) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", bk_last_error());
            st = bk_error(BK_ERR_DEVICE_OOM,
                          "%s (GPU backward: the output-gradient Grams of %d layers are held on "
                          "the device: use a smaller --leaf-size, or a smaller --batch)",
                          msg, f.gleaf);
        }
        stats->micro_bytes = (uint64_t)g->dev_bytes;
    }
    if (st == BK_OK) {
        head_logits_all(g);
        stats->micro_bytes = (uint64_t)g->dev_bytes;
    }
    if (st == BK_OK)
        /* (the job's flows: the GPU stages of the leaf layers keep their
         * reserve, as they do next to the calibration states) */
        st = slots_init(g, go->max_resident_layers,
                        cb->grams || cb->grams_dev ? bk_gpu_stage_reserve(c, 4, 2) : 0);
    if (st == BK_OK) {
        const size_t avail = (size_t)bk_host_avail_bytes();
        g->hbudget = avail ? avail / 2 : (size_t)-1;
        g->hbytes = 0;
        double tp = bk_now();
        preload_host_weights(g);
        bk_prof_add("bwd.preload_weights", bk_now() - tp);
    }
    if (st == BK_OK) {
        const bk_bwd_flow_ops ops = g->fp64 ? flow_ops<double>(0) : flow_ops<float>(f.bfb);
        st = bk__bwd_flow_drive(&ops, &f, m, tokens, S, T, B, o, cb, stats);
        stats->resident_layers = g->nslots;
        stats->weight_requests = g->requests;
        stats->weight_uploads = g->uploads;
    }
    if (f.cs) {
        /* the last stores (their boundaries are freed by the driver already,
         * after a synchronisation; nothing should be left) */
        cudaError_t e = cudaStreamSynchronize(f.cs);
        if (st == BK_OK)
            st = bk_cuda_status(e, "GPU backward: boundary copies", __FILE__, __LINE__);
        cudaStreamDestroy(f.cs);
    }
    if (f.ev_ready)
        cudaEventDestroy(f.ev_ready);
    for (int k = 0; k < 2; k++)
        if (f.ev_done[k])
            cudaEventDestroy(f.ev_done[k]);
    dfree(g, f.sbuf[0]);
    dfree(g, f.sbuf[1]);
    dfree(g, f.h);
    dfree(g, f.dh);
    dfree(g, f.acts);
    dfree(g, f.gscr);
    dfree(g, f.g32);
    dfree(g, f.rn_g);
    dfree(g, f.rn_a);
    for (int k = 0; k < 64; k++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            dfree(g, f.gram[k][i]);
            dfree(g, f.dgw[k][i]);
            free(f.hgw[k][i]);
        }
    free(f.hG);
    gb_free(g);
    return st;
}

extern "C" bk_status bk__cuda_bwd_head(bk_backend *b, const bk_model *m, const bk_gbwd_opts *go,
                                       int64_t T, const double *h, const int32_t *tokens,
                                       int64_t S, int64_t seq0, bk_fisher_kind fisher,
                                       uint64_t seed, int32_t *labels, double *dh, double *loss)
{
    if (!b || !m || !go || !h || !tokens || !labels)
        return bk_error(BK_ERR_INVALID_ARG, "GPU backward head: NULL argument");
    bk_status st = bk__bwd_head_check(m);
    if (st != BK_OK)
        return st;
    gbwd *g = NULL;
    st = create(b, m, S, T, go, 0, &g);
    if (st != BK_OK)
        return st;
    const int64_t n = S * T * g->dim.hidden;
    void *dh_dev = NULL, *h_dev = NULL;
    st = dalloc(g, &h_dev, n, g->es, "test hidden states");
    if (st == BK_OK)
        st = dalloc(g, &dh_dev, n, g->es, "test gradients");
    /* h: double on the host -> R on the device (through a double buffer) */
    double *hd_dev = NULL;
    if (st == BK_OK)
        st = dalloc(g, (void **)&hd_dev, n, 8, "test staging");
    if (st == BK_OK)
        head_logits_all(g);
    /* Every copy goes on the backend's stream and is synchronised before the
     * head's kernels run: that stream is non-blocking, so it is not ordered
     * after plain cudaMemcpy calls (legacy default stream), and a
     * device-to-device cudaMemcpy (or the DMA of a pageable upload) can still
     * be running when it returns. Plain cudaMemcpy here let the head read h
     * while the copy was under way (fp64: a part of the rows' labels differed
     * from the CPU's on an H200). */
    cudaStream_t cs = g->c->stream;
    if (st == BK_OK)
        st = bk_cuda_status(cudaMemcpyAsync(hd_dev, h, (size_t)n * 8, cudaMemcpyHostToDevice, cs),
                            "upload", __FILE__, __LINE__);
    if (st == BK_OK) {
        if (g->fp64)
            st = bk_cuda_status(
                cudaMemcpyAsync(h_dev, hd_dev, (size_t)n * 8, cudaMemcpyDeviceToDevice, cs),
                "copy", __FILE__, __LINE__);
        else {
            /* round to F32 on the host (the flow's F32 storage) */
            float *hf = static_cast<float *>(malloc((size_t)n * 4));
            if (!hf)
                st = bk_error(BK_ERR_NOMEM, "out of memory");
            else {
                for (int64_t i = 0; i < n; i++)
                    hf[i] = (float)h[i];
                st = bk_cuda_status(
                    cudaMemcpyAsync(h_dev, hf, (size_t)n * 4, cudaMemcpyHostToDevice, cs),
                    "upload", __FILE__, __LINE__);
                if (st == BK_OK) /* hf is freed next */
                    st = bk_cuda_status(cudaStreamSynchronize(cs), "upload", __FILE__, __LINE__);
                free(hf);
            }
        }
    }
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(cs), "upload", __FILE__, __LINE__);
    if (st == BK_OK) {
        if (g->fp64)
            st = head_run<double>(g, static_cast<double *>(h_dev), S, seq0, tokens, fisher, seed,
                                  NULL, dh ? static_cast<double *>(dh_dev) : NULL, loss, labels);
        else
            st = head_run<float>(g, static_cast<float *>(h_dev), S, seq0, tokens, fisher, seed,
                                 NULL, dh ? static_cast<float *>(dh_dev) : NULL, loss, labels);
    }
    if (st == BK_OK && dh) {
        const void *src = dh_dev;
        if (!g->fp64) {
            k_to_f64<float><<<grid_for(n), 256, 0, cs>>>(hd_dev, static_cast<const float *>(dh_dev),
                                                        n);
            st = BK_LAUNCHED_OK();
            src = hd_dev;
        }
        if (st == BK_OK)
            st = bk_cuda_status(cudaMemcpyAsync(dh, src, (size_t)n * 8, cudaMemcpyDeviceToHost, cs),
                                "download", __FILE__, __LINE__);
        if (st == BK_OK)
            st = bk_cuda_status(cudaStreamSynchronize(cs), "download", __FILE__, __LINE__);
    }
    dfree(g, h_dev);
    dfree(g, dh_dev);
    dfree(g, hd_dev);
    gb_free(g);
    return st;
}

extern "C" int bk__cuda_bwd_attn_fused(const bk_gbwd_opts *g, int64_t head_dim)
{
    return g && !g->fp64 && g->math == BK_GBWD_BF16 && bk_attn_flash_supported(head_dim);
}

extern "C" bk_status bk__cuda_download(bk_backend *b, void *dst, const void *src, size_t bytes)
{
    if (!b || b->kind != BK_BACKEND_CUDA || !dst || !src)
        return bk_error(BK_ERR_INVALID_ARG, "bk__cuda_download: bad argument");
    cudaStream_t s = static_cast<bk_cuda_ctx *>(b->ctx)->stream;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(s);
    return bk_cuda_status(e, "download", __FILE__, __LINE__);
}
