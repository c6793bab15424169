/* CUDA backend — the native forward pass on the GPU, src/forward.c step for
 * step in F32 (docs/forward.md, docs/DEVICE.md "Pipeline on the GPU"):
 *   projections    cuBLAS SGEMM (IEEE F32: the context's math mode is the
 *                  default, no TF32), then the bias;
 *   RMSNorm        one warp per row, sum of squares in double, then the same
 *                  float steps as the CPU;
 *   RoPE           src/rope.c's tables, uploaded once; the products and sums
 *                  rounded one by one (no FMA contraction), as the CPU;
 *   attention      queries/keys/values rearranged group-major (a kv group's
 *                  query heads interleaved per position), causal: the query
 *                  positions in chunks of about T/8 that see only the keys up
 *                  to the chunk's end; per chunk the scores of all (sequence,
 *                  kv group) pairs with strided-batched SGEMMs, causal softmax
 *                  (max subtraction, double sum) one warp per row, P V with
 *                  another batched SGEMM; the score buffer is bounded (fewer
 *                  pairs per call, or rows of a chunk split when one pair's
 *                  chunk is larger). A single-pass softmax with the row in
 *                  registers was tried: slower (occupancy), 8B forward 27 s
 *                  instead of 22 s. BF16 mode with head_dim 64 / 128: one
 *                  fused kernel instead (attn_flash.cu, bk_g_attn_core);
 *   MLP, residual  silu(z) = z / (1 + exp(-z)), module output formed first,
 *                  then added;
 *   head, NLL      final norm, LM head converted to F32 on the device once,
 *                  vocabulary blocks as the CPU, online log-sum-exp per row,
 *                  the final sum on the host in row order.
 */
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <pthread.h>
#include <unistd.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend_impl.h"
#include "fwd_internal.cuh"
#include "forward_internal.h"

extern "C" {
#include "rope.h"
#include "util.h"
}

namespace {

/* (Logits and head rows in the CPU's vocabulary blocks: bk__fwd_vocab_block.) */
/* Attention scores: at most this many floats at a time (256 MiB). */
const int64_t SCORE_FLOATS = (int64_t)1 << 26;

/* ---------------------------------------------------------------- kernels */

__global__ void k_bias_rows(float *Y, int64_t rows, int64_t cols, const float *b)
{
    const int64_t n = rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        Y[i] = __fadd_rn(Y[i], b[i % cols]);
}

/* Note a non-finite v at flat index i of an operation's output in its flag
 * (fwd_internal.cuh, bk_gfwd::nf): the smallest index wins; a NULL flag
 * checks nothing. Off the hot path only when v is not finite. */
__device__ __forceinline__ void nf_note(unsigned long long *flag, float v, int64_t i)
{
    bk_nf_note(flag, v, i);
}

/* h += (t + b): the module output first (bias included), then the residual;
 * nf_mod / nf_res flag the module output / the new residual stream. */
__global__ void k_residual(float *h, const float *t, const float *b, int64_t rows, int64_t cols,
                           unsigned long long *nf_mod, unsigned long long *nf_res)
{
    const int64_t n = rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v = t[i];
        if (b)
            v = __fadd_rn(v, b[i % cols]);
        nf_note(nf_mod, v, i);
        const float r = __fadd_rn(h[i], v);
        nf_note(nf_res, r, i);
        h[i] = r;
    }
}

/* One warp per row: y = w * (x * (1 / sqrt(mean(x^2) + eps))); nf_in / nf_out
 * flag x / y (flat index row * n + i; y may equal x: x is read first). */
__global__ void k_rmsnorm(const float *x, int64_t rows, int64_t n, const float *w, float eps,
                          float *y, unsigned long long *nf_in, unsigned long long *nf_out)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows)
        return;
    const float *xr = x + row * n;
    float *yr = y + row * n;
    double ss = 0.0;
    for (int64_t i = lane; i < n; i += 32) {
        nf_note(nf_in, xr[i], row * n + i);
        double v = xr[i];
        ss = __dadd_rn(ss, __dmul_rn(v, v));
    }
    for (int o = 16; o; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float var = (float)(ss / (double)n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    for (int64_t i = lane; i < n; i += 32) {
        const float v = __fmul_rn(w[i], __fmul_rn(xr[i], inv));
        nf_note(nf_out, v, row * n + i);
        yr[i] = v;
    }
}

/* src token-major [N, heads*hd] -> dst head-major [S, heads, T, hd], rotated
 * by RoPE at position n % T when rotate (rotate_half pairs (i, i + hd/2));
 * rot (optional) receives the same values token-major; dst (optional) F32,
 * dstb (optional) the same rounded to BF16. */
__global__ void k_rope_heads(const float *src, int64_t N, int64_t T, int64_t heads, int64_t hd,
                             int64_t rep, const float *cs, const float *sn, int rotate, float *dst,
                             __nv_bfloat16 *dstb, float *rot, unsigned long long *nf_in,
                             unsigned long long *nf_out)
{
    const int64_t h2 = hd / 2, total = N * heads * h2;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = idx % h2, r = idx / h2;
        const int64_t head = r % heads, n = r / heads;
        const int64_t pos = n % T, s = n / T;
        const int64_t at = n * heads * hd + head * hd; /* token-major [N, heads*hd] */
        const float *v = src + at;
        float a = v[i], b = v[i + h2];
        nf_note(nf_in, a, at + i);
        nf_note(nf_in, b, at + i + h2);
        float ya = a, yb = b;
        if (rotate) {
            const float c = cs[pos * h2 + i], sv = sn[pos * h2 + i];
            ya = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sv));
            yb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sv));
        }
        nf_note(nf_out, ya, at + i);
        nf_note(nf_out, yb, at + i + h2);
        /* group-major [S, heads/rep, T, rep, hd]: the rows of a (sequence,
         * group) pair are its rep heads per position, position-major */
        const int64_t g = head / rep, hr = head % rep;
        const int64_t at_h = (((s * (heads / rep) + g) * T + pos) * rep + hr) * hd;
        if (dst) {
            dst[at_h + i] = ya;
            dst[at_h + i + h2] = yb;
        }
        if (dstb) {
            dstb[at_h + i] = __float2bfloat16_rn(ya);
            dstb[at_h + i + h2] = __float2bfloat16_rn(yb);
        }
        if (rot) {
            float *q = rot + n * heads * hd + head * hd;
            q[i] = ya;
            q[i + h2] = yb;
        }
    }
}

/* group-major [S, heads/rep, T, rep, hd] -> token-major [S*T, heads*hd] */
__global__ void k_heads_to_tok(const float *oh, int64_t S, int64_t heads, int64_t T, int64_t hd,
                               int64_t rep, float *o, unsigned long long *nf_out)
{
    const int64_t w = heads * hd, total = S * T * w;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = idx % w, n = idx / w;
        const int64_t head = c / hd, i = c % hd, s = n / T, t = n % T;
        const float v = oh[(((s * (heads / rep) + head / rep) * T + t) * rep + head % rep) * hd + i];
        nf_note(nf_out, v, idx);
        o[idx] = v;
    }
}

/* Causal softmax of rows of sc [nrows, T] (one warp per row; T keys). Row r
 * is row (r0 + r % rc) of its (sequence, group) pair's chunk of query
 * positions starting at t0, rep rows per position, i.e. position
 * t0 + (r0 + r % rc) / rep: entries j <= t are normalized, the others set
 * to 0. */
__global__ void k_causal_softmax(float *sc, int64_t nrows, int64_t T, int64_t rc, int64_t r0,
                                 int64_t rep, int64_t t0)
{
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= nrows)
        return;
    float *x = sc + row * T;
    const int64_t t = t0 + (r0 + row % rc) / rep;
    float mx = x[0];
    for (int64_t j = 1 + lane; j <= t; j += 32)
        mx = x[j] > mx ? x[j] : mx;
    for (int o = 16; o; o >>= 1) {
        float other = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = other > mx ? other : mx;
    }
    double sum = 0.0;
    for (int64_t j = lane; j <= t; j += 32) {
        float e = expf(__fsub_rn(x[j], mx));
        x[j] = e;
        sum += (double)e;
    }
    for (int o = 16; o; o >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float fs = (float)sum;
    for (int64_t j = lane; j < T; j += 32)
        x[j] = j <= t ? __fdiv_rn(x[j], fs) : 0.0f;
}

/* d = silu(g) * u; nf_g / nf_u / nf_d flag g / u / d. */
__global__ void k_swiglu(const float *g, const float *u, float *d, int64_t n,
                         unsigned long long *nf_g, unsigned long long *nf_u,
                         unsigned long long *nf_d)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float z = g[i], uu = u[i];
        nf_note(nf_g, z, i);
        nf_note(nf_u, uu, i);
        const float v = __fmul_rn(__fdiv_rn(z, __fadd_rn(1.0f, expf(-z))), uu);
        nf_note(nf_d, v, i);
        d[i] = v;
    }
}

__device__ __forceinline__ float load_as_f32(const void *p, int dt, int64_t i)
{
    if (dt == BK_DT_BF16) {
        unsigned int bits = (unsigned int)static_cast<const unsigned short *>(p)[i] << 16;
        return __uint_as_float(bits);
    }
    if (dt == BK_DT_F16)
        return __half2float(static_cast<const __half *>(p)[i]);
    return static_cast<const float *>(p)[i];
}

/* h[n, :] = table[tok[n], :] as F32 */
__global__ void k_embed(const void *table, int dt, const int32_t *tok, int64_t N, int64_t hidden,
                        float *h)
{
    const int64_t total = N * hidden;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = idx / hidden, c = idx % hidden;
        h[idx] = load_as_f32(table, dt, (int64_t)tok[n] * hidden + c);
    }
}

__global__ void k_to_f32(const void *src, int dt, int64_t n, float *dst)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = load_as_f32(src, dt, i);
}

/* Online log-sum-exp over one vocabulary block lg [N, n] (columns v0..v0+n),
 * one warp per row, as src/forward.c's bk_fwd_nll. */
__global__ void k_lse_block(const float *lg, int64_t N, int64_t n, int64_t T, int64_t v0,
                            const int32_t *tok, float *mx, double *se, float *tgt)
{
    const int64_t r = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (r >= N || r % T == T - 1)
        return;
    const float *row = lg + r * n;
    float cm = row[0];
    for (int64_t j = 1 + lane; j < n; j += 32)
        cm = row[j] > cm ? row[j] : cm;
    for (int o = 16; o; o >>= 1) {
        float other = __shfl_xor_sync(0xffffffffu, cm, o);
        cm = other > cm ? other : cm;
    }
    const float old = mx[r];
    double s = se[r];
    float m0 = old;
    if (cm > old) {
        if (s > 0.0)
            s *= exp((double)old - (double)cm);
        m0 = cm;
    }
    double acc = 0.0;
    for (int64_t j = lane; j < n; j += 32)
        acc += (double)expf(__fsub_rn(row[j], m0));
    for (int o = 16; o; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
        mx[r] = m0;
        se[r] = s + acc;
        const int64_t y = tok[r + 1];
        if (y >= v0 && y < v0 + n)
            tgt[r] = row[y - v0];
    }
}

__global__ void k_lse_init(float *mx, double *se, float *tgt, int64_t N)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
         i += (int64_t)gridDim.x * blockDim.x) {
        mx[i] = -INFINITY;
        se[i] = 0.0;
        tgt[i] = NAN;
    }
}

/* flag[0] = smallest flat index of a non-finite entry (ULLONG_MAX: none). */
__global__ void k_to_bf16(const float *src, __nv_bfloat16 *dst, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void k_first_nonfinite(const float *d, int64_t n, unsigned long long *flag)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        if (!isfinite(d[i]))
            atomicMin(flag, (unsigned long long)i);
}

/* --------------------------------------------------------------- helpers */

/* Row-major strided-batched GEMM (as bk_rm_gemm, see mem.cu). */
bk_status rm_gemm_batched(cublasHandle_t h, int ta, int tb, int64_t M, int64_t N, int64_t K,
                          float alpha, const float *A, int64_t lda, int64_t sA, const float *B,
                          int64_t ldb, int64_t sB, float beta, float *C, int64_t ldc, int64_t sC,
                          int64_t batch)
{
    if (M <= 0 || N <= 0 || batch <= 0)
        return BK_OK;
    BK_CUBLAS_CHECK(cublasSgemmStridedBatched_64(
        h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B,
        ldb, sB, A, lda, sA, &beta, C, ldc, sC, batch));
    return BK_OK;
}

bk_status g_alloc_f32(bk_gfwd *f, float **p, int64_t a, int64_t b, const char *what)
{
    uint64_t n, bytes;
    *p = NULL;
    if (a < 0 || b < 0 || bk_mul_u64((uint64_t)a, (uint64_t)b, &n) || bk_mul_u64(n, 4, &bytes) ||
        bytes > (uint64_t)SIZE_MAX / 2)
        return bk_error(BK_ERR_DEVICE_OOM, "CUDA: %s: %lld x %lld floats overflow", what,
                        (long long)a, (long long)b);
    void *q = NULL;
    bk_status st = bk_dev_alloc(f->c, &q, bytes ? (size_t)bytes : 4, what);
    *p = static_cast<float *>(q);
    return st;
}

/* the shared checks (src/forward.c) */
bk_status check_batch(const bk_gfwd *f, int64_t S, const char *what)
{
    return bk__fwd_check_batch(f ? &f->dim : NULL, S, "GPU forward", what);
}

/* A dtype the device converts (F32, BF16, F16); other numeric dtypes the
 * host does. */
int device_dtype(bk_dtype dt)
{
    return dt == BK_DT_F32 || dt == BK_DT_BF16 || dt == BK_DT_F16;
}

/* Rows [r0, r1) of a 2-D tensor as F32 into device dst: raw bytes uploaded
 * and converted on the device (F32/BF16/F16), else converted on the host;
 * in chunks of at most 64 MiB. */
bk_status upload_rows_f32(bk_gfwd *f, const bk_tensor_info *t, int64_t r0, int64_t r1, float *dst)
{
    const size_t es = bk_dtype_bits(t->dtype) / 8;
    const int64_t cols = t->shape[1];
    const int64_t per = ((int64_t)64 << 20) / (int64_t)(cols * 4) > 0
                            ? ((int64_t)64 << 20) / (int64_t)(cols * 4)
                            : 1;
    const int64_t chunk = per < r1 - r0 ? per : r1 - r0;
    bk_status st = BK_OK;
    void *dev = NULL, *host = NULL;
    const int on_dev = device_dtype(t->dtype);
    if (on_dev)
        st = bk_dev_alloc(f->c, &dev, (size_t)(chunk * cols) * es, "tensor staging");
    else if (!(host = bk_alloc((size_t)(chunk * cols), sizeof(float))))
        st = bk_error(BK_ERR_NOMEM, "%s: out of host memory converting rows", t->name);
    for (int64_t a = r0; a < r1 && st == BK_OK; a += chunk) {
        const int64_t nr = r1 - a < chunk ? r1 - a : chunk;
        const unsigned char *src = static_cast<const unsigned char *>(t->data) + (size_t)a * cols * es;
        float *d = dst + (a - r0) * cols;
        if (on_dev) {
            st = bk_cuda_status(cudaMemcpyAsync(dev, src, (size_t)(nr * cols) * es,
                                                cudaMemcpyHostToDevice, f->c->stream),
                                "upload tensor rows", __FILE__, __LINE__);
            if (st != BK_OK)
                break;
            k_to_f32<<<bk_grid(nr * cols), 256, 0, f->c->stream>>>(dev, (int)t->dtype, nr * cols, d);
            st = BK_LAUNCHED("k_to_f32");
            if (st == BK_OK)
                st = bk_cuda_status(cudaStreamSynchronize(f->c->stream), "convert tensor rows",
                                    __FILE__, __LINE__);
        } else {
            st = bk_convert(src, t->dtype, host, BK_DT_F32, (size_t)(nr * cols));
            if (st != BK_OK) {
                bk_error_prefix(st, t->name ? t->name : "tensor");
                break;
            }
            st = bk_gpu_upload(f, d, host, (size_t)(nr * cols) * 4);
        }
    }
    bk_dev_free(f->c, dev);
    free(host);
    return st;
}

/* A 1-D tensor of n elements as host F32, finite (as src/forward.c). */
bk_status load_vec(const bk_model *m, const char *suffix, int64_t n, float **out)
{
    *out = NULL;
    const bk_tensor_info *t = bk_model_find(m, -1, suffix);
    if (!t)
        return bk_error(BK_ERR_MISSING_TENSOR, "%s: missing (the config implies it)", suffix);
    const char *tn = t->name ? t->name : suffix;
    if (t->ndim != 1 || t->shape[0] != n)
        return bk_error(BK_ERR_SHAPE, "%s: expected shape [%lld]", tn, (long long)n);
    float *v = static_cast<float *>(bk_alloc((size_t)n, sizeof(float)));
    if (!v)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", tn);
    bk_status st = bk_tensor_to_f32(t, v);
    for (int64_t i = 0; st == BK_OK && i < n; i++)
        if (!std::isfinite(v[i]))
            st = bk_error(BK_ERR_NONFINITE, "%s: element %lld is %s (weights must be finite)", tn,
                          (long long)i, std::isnan(v[i]) ? "NaN" : "Inf");
    if (st != BK_OK) {
        free(v);
        return st;
    }
    *out = v;
    return BK_OK;
}

/* Final norm weight and the whole LM head as F32 on the device (once). */
bk_status head_load(bk_gfwd *f, const bk_model *m)
{
    if (f->head_w)
        return BK_OK;
    const bk_tensor_info *t = NULL;
    const char *which = f->cfg.tie_embeddings ? "embed_tokens.weight" : "lm_head.weight";
    bk_status st = bk__fwd_find_matrix(m, which, f->cfg.vocab, f->dim.hidden, &t);
    float *norm = NULL;
    if (st == BK_OK)
        st = load_vec(m, "norm.weight", f->dim.hidden, &norm);
    if (st == BK_OK)
        st = g_alloc_f32(f, &f->head_norm, f->dim.hidden, 1, "final norm");
    if (st == BK_OK)
        st = bk_gpu_upload(f, f->head_norm, norm, (size_t)f->dim.hidden * 4);
    free(norm);
    if (st == BK_OK)
        st = g_alloc_f32(f, &f->head_w, f->cfg.vocab, f->dim.hidden, "LM head (F32)");
    if (st == BK_OK)
        st = upload_rows_f32(f, t, 0, f->cfg.vocab, f->head_w);
    if (st != BK_OK) {
        bk_dev_free(f->c, f->head_w);
        bk_dev_free(f->c, f->head_norm);
        f->head_w = f->head_norm = NULL;
    }
    return st;
}

bk_status upload_tokens(bk_gfwd *f, const int32_t *tokens, int64_t N)
{
    /* ordered on the stream: the previous micro-batch's kernels read f->tok */
    return bk_gpu_upload(f, f->tok, tokens, (size_t)N * sizeof(int32_t));
}

/* The unfused attention's buffers, on first use (session-11 review R1): in
 * fused mode (BF16, head_dim 64 / 128) the attention never touches the F32
 * head-major qh/kh/vh/oh and only the LM head uses the score buffer: rows x
 * (2 q_dim + 2 kv_dim) x 4 B + 256 MiB not allocated (416 MiB at the 8B
 * shape's 2 x 2048 rows, ~1.4 GiB at 70B width with 2 x 8192). Tracked
 * allocations (bk_dev_alloc), so the peak memory counts them from when they
 * exist; those allocated stay until bk_gfwd_free (after a failure too: a
 * later call allocates only the missing ones). Errors unprefixed
 * (bk_gfwd_create prefixes its own). */
bk_status g_scores_alloc(bk_gfwd *f)
{
    /* score_floats floats: the unfused attention's scores, the logits' and
     * the log-sum-exp's vocabulary blocks */
    return f->scores ? BK_OK
                     : g_alloc_f32(f, &f->scores, f->score_floats, 1,
                                   "score buffer (attention scores, LM head blocks)");
}

bk_status g_unfused_alloc(bk_gfwd *f)
{
    const int64_t R = f->dim.rows;
    struct {
        float **p;
        int64_t w;
        const char *what;
    } bufs[] = {{&f->qh, f->dim.qdim, "queries (head-major)"},
                {&f->kh, f->dim.kvdim, "keys (head-major)"},
                {&f->vh, f->dim.kvdim, "values (head-major)"},
                {&f->oh, f->dim.qdim, "attention output (head-major)"}};
    bk_status st = BK_OK;
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0] && st == BK_OK; i++)
        if (!*bufs[i].p)
            st = g_alloc_f32(f, bufs[i].p, R, bufs[i].w, bufs[i].what);
    return st == BK_OK ? g_scores_alloc(f) : st;
}

} // namespace

bk_status bk_g_attn_unfused_alloc(bk_gfwd *f)
{
    if (f->qh && f->kh && f->vh && f->oh && f->scores)
        return BK_OK;
    bk_status st = g_unfused_alloc(f);
    return st == BK_OK ? st : bk_error_prefix(st, "GPU forward (unfused attention)");
}

/* check_op (the stages' checks) and bk_gfwd_layer */
#define FWD_CTX bk_gfwd
#define FWD_LW bk_glayer
#define FWD(op) bk_gfwd_##op
#define FWD_EXPORT extern "C"
#define FWD_WHO "GPU forward"
#include "fwd_layer_tmpl.h" /* (undefines its parameters) */

/* ------------------------------------------------------- shared helpers */

bk_status bk_g_linear(bk_gfwd *f, const float *X, int64_t N, int64_t in, const float *W,
                      int64_t out, const float *b, float *Y)
{
    bk_status st = bk_rm_gemm(f->blas, 0, 1, N, out, in, 1.0, X, in, W, in, 0.0, Y, out);
    if (st != BK_OK || !b)
        return st;
    k_bias_rows<<<bk_grid(N * out), 256, 0, f->c->stream>>>(Y, N, out, b);
    return BK_LAUNCHED("k_bias_rows");
}

namespace {

bk_status linear_mod(bk_gfwd *f, const float *X, int64_t N, int64_t in, const bk_glayer *lw,
                     bk_module mod, int64_t out, int with_bias, float *Y, int same)
{
    const float *b = with_bias ? lw->b[mod] : NULL;
    const int have = same && f->xb_src && f->xb_src == X && f->xb_n == N * in;
    f->xb_src = NULL; /* (set again below once xb holds X) */
    if (!f->bf16 || !lw->wb[mod] || N * in > f->xb_elems)
        return bk_g_linear(f, X, N, in, lw->w[mod], out, b, Y);
    if (!have) {
        k_to_bf16<<<bk_grid(N * in), 256, 0, f->c->stream>>>(X, f->xb, N * in);
        bk_status st = BK_LAUNCHED("k_to_bf16");
        if (st != BK_OK)
            return st;
    }
    f->xb_src = X;
    f->xb_n = N * in;
    const float one = 1.0f, zero = 0.0f;
    /* column-major: Y^T [out, N] = W [in, out]^T X^T [in, N] */
    BK_CUBLAS_CHECK(cublasGemmEx_64(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, &one, lw->wb[mod],
                                    CUDA_R_16BF, in, f->xb, CUDA_R_16BF, in, &zero, Y, CUDA_R_32F,
                                    out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (!b)
        return BK_OK;
    k_bias_rows<<<bk_grid(N * out), 256, 0, f->c->stream>>>(Y, N, out, b);
    return BK_LAUNCHED("k_bias_rows");
}

} // namespace

bk_status bk_g_linear_mod(bk_gfwd *f, const float *X, int64_t N, int64_t in, const bk_glayer *lw,
                          bk_module mod, int64_t out, int with_bias, float *Y)
{
    return linear_mod(f, X, N, in, lw, mod, out, with_bias, Y, 0);
}

bk_status bk_g_linear_mod_same(bk_gfwd *f, const float *X, int64_t N, int64_t in,
                               const bk_glayer *lw, bk_module mod, int64_t out, int with_bias,
                               float *Y)
{
    return linear_mod(f, X, N, in, lw, mod, out, with_bias, Y, 1);
}

bk_status bk_g_syrk(bk_gfwd *f, int64_t n, int64_t rows, const float *X, float *C)
{
    f->xb_src = NULL; /* (xb is overwritten below) */
    if (rows <= 0 || n <= 0)
        return BK_OK;
    const float one = 1.0f;
    if (f->bf16 && n >= 512 && f->xb_elems >= n) {
        /* row chunks of X rounded to BF16, lower-trapezoid panels, fp32 C */
        const int64_t ch = f->xb_elems / n;
        const int64_t nb = n >= 8192 ? 1024 : 512;
        for (int64_t r0 = 0; r0 < rows; r0 += ch) {
            const int64_t k = rows - r0 < ch ? rows - r0 : ch;
            k_to_bf16<<<bk_grid(k * n), 256, 0, f->c->stream>>>(X + r0 * n, f->xb, k * n);
            bk_status st = BK_LAUNCHED("k_to_bf16");
            if (st != BK_OK)
                return st;
            for (int64_t j0 = 0; j0 < n; j0 += nb) {
                const int64_t w = n - j0 < nb ? n - j0 : nb;
                BK_CUBLAS_CHECK(cublasGemmEx_64(f->blas, CUBLAS_OP_N, CUBLAS_OP_T, n - j0, w, k,
                                                &one, f->xb + j0, CUDA_R_16BF, n, f->xb + j0,
                                                CUDA_R_16BF, n, &one, C + j0 * n + j0, CUDA_R_32F,
                                                n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
        }
        return BK_OK;
    }
    if (!f->tf32 || n < 512) {
        BK_CUBLAS_CHECK(cublasSsyrk_64(f->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, n, rows, &one,
                                       X, n, &one, C, n));
        return BK_OK;
    }
    /* column-major view: X is [n, rows] (ld n), C [n, n]; panel j0..j1 of the
     * lower trapezoid: C[j0:n, j0:j1] += X[j0:n, :] X[j0:j1, :]^T */
    const int64_t nb = n >= 8192 ? 1024 : 512;
    for (int64_t j0 = 0; j0 < n; j0 += nb) {
        const int64_t w = n - j0 < nb ? n - j0 : nb;
        BK_CUBLAS_CHECK(cublasSgemm_64(f->blas, CUBLAS_OP_N, CUBLAS_OP_T, n - j0, w, rows, &one,
                                       X + j0, n, X + j0, n, &one, C + j0 * n + j0, n));
    }
    return BK_OK;
}

/* bk_g_rmsnorm, flagging x (nf_in) and y (nf_out) when not NULL. */
static bk_status g_rmsnorm_nf(bk_gfwd *f, const float *x, int64_t rows, int64_t n, const float *w,
                       float *y, unsigned long long *nf_in, unsigned long long *nf_out)
{
    if (rows <= 0)
        return BK_OK;
    const int64_t blocks = (rows + 7) / 8;
    if (blocks > INT32_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: %lld rows are too many for RMSNorm",
                        (long long)rows);
    k_rmsnorm<<<(unsigned)blocks, 256, 0, f->c->stream>>>(x, rows, n, w, f->eps, y, nf_in,
                                                           nf_out);
    return BK_LAUNCHED("k_rmsnorm");
}

bk_status bk_g_rmsnorm(bk_gfwd *f, const float *x, int64_t rows, int64_t n, const float *w,
                       float *y)
{
    return g_rmsnorm_nf(f, x, rows, n, w, y, NULL, NULL);
}

bk_status bk_g_first_nonfinite(bk_gfwd *f, const float *d, int64_t rows, int64_t cols,
                               int *found, int64_t *row, int64_t *col, float *val)
{
    *found = 0;
    const unsigned long long none = ~0ull; /* (all bytes 0xff: set by a memset, not a
                                              * copy from pageable memory) */
    BK_CUDA_CHECK(cudaMemsetAsync(f->flag, 0xff, sizeof none, f->c->stream));
    const int64_t n = rows * cols;
    if (n > 0) {
        k_first_nonfinite<<<bk_grid(n), 256, 0, f->c->stream>>>(d, n, f->flag);
        bk_status st = BK_LAUNCHED("k_first_nonfinite");
        if (st != BK_OK)
            return st;
    }
    unsigned long long at = none;
    BK_CUDA_CHECK(cudaMemcpyAsync(&at, f->flag, sizeof at, cudaMemcpyDeviceToHost, f->c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(f->c->stream));
    if (at == none)
        return BK_OK;
    float v = 0;
    BK_CUDA_CHECK(cudaMemcpyAsync(&v, d + at, sizeof v, cudaMemcpyDeviceToHost, f->c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(f->c->stream));
    *found = 1;
    *row = (int64_t)(at / (unsigned long long)cols);
    *col = (int64_t)(at % (unsigned long long)cols);
    *val = v;
    return BK_OK;
}

/* ------------------------------------------- non-finite activations */

bk_status bk_gfwd_nf_clear(bk_gfwd *f)
{
    BK_CUDA_CHECK(cudaMemsetAsync(f->nf, 0xff, BK_FS_COUNT * sizeof(unsigned long long),
                                  f->c->stream));
    return BK_OK;
}

bk_status bk_gfwd_nf_fetch(bk_gfwd *f)
{
    BK_CUDA_CHECK(cudaMemcpyAsync(f->nf_host, f->nf, BK_FS_COUNT * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost, f->c->stream));
    return BK_OK;
}

namespace {

/* bk_fwd_wget over a device layer: each weight downloaded into host memory
 * kept until the message is made */
struct nf_weights {
    const bk_glayer *lw;
    float *host[8];
    int n;
    bk_status st;
};

const float *gpu_wget(void *ctx, bk_fwd_wref r, int64_t n)
{
    nf_weights *g = static_cast<nf_weights *>(ctx);
    const float *d = NULL;
    switch (r.kind) {
    case BK_FW_WEIGHT: d = g->lw->w[r.mod]; break;
    case BK_FW_BIAS: d = g->lw->b[r.mod]; break;
    case BK_FW_ATTN_NORM: d = g->lw->attn_norm; break;
    case BK_FW_MLP_NORM: d = g->lw->mlp_norm; break;
    case BK_FW_Q_NORM: d = g->lw->q_norm; break;
    case BK_FW_K_NORM: d = g->lw->k_norm; break;
    }
    if (!d || n <= 0 || g->n >= 8 || g->st != BK_OK)
        return NULL;
    float *h = static_cast<float *>(malloc((size_t)n * sizeof(float)));
    if (!h)
        return NULL;
    cudaError_t e = cudaMemcpy(h, d, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        free(h);
        g->st = bk_cuda_status(e, "downloading a weight for the non-finite message", __FILE__,
                               __LINE__);
        return NULL;
    }
    g->host[g->n++] = h;
    return h;
}

} // namespace

bk_status bk_gfwd_nf_report(bk_gfwd *f, const bk_glayer *lw)
{
    int site = -1;
    for (int s = 0; s < BK_FS_COUNT; s++)
        if (f->nf_host[s] != ~0ull) {
            site = s;
            break;
        }
    if (site < 0)
        return BK_OK;
    const unsigned long long code = f->nf_host[site];
    const unsigned long long at = code >> 2;
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float value = (code & 2) ? ((code & 1) ? -nan : nan) : ((code & 1) ? -inf : inf);
    const int64_t w = bk_fwd_site_width(&f->cfg, (bk_fwd_site)site);
    nf_weights g;
    memset(&g, 0, sizeof g);
    g.lw = lw;
    bk_status st = bk_fwd_nonfinite_error(&f->cfg, lw ? lw->layer : -1, (bk_fwd_site)site, value,
                                          (int64_t)(at / (unsigned long long)w),
                                          (int64_t)(at % (unsigned long long)w),
                                          lw ? gpu_wget : NULL, &g);
    for (int i = 0; i < g.n; i++)
        free(g.host[i]);
    if (g.st != BK_OK)
        return g.st;
    bk_gfwd_nf_clear(f); /* an error path: the next check starts clean */
    return st;
}

/* ------------------------------------------------------------ the context */

/* ------------------------------------------------- weight uploads */

namespace {

void upload_defaults(bk_gfwd *f)
{
    f->up_chunk = (int64_t)1 << 24;    /* 64 MiB of F32 per pinned slot */
    f->up_min_part = (int64_t)1 << 20; /* 4 MiB of F32 per host thread at least */
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    f->up_threads = nc < 2 ? 1 : nc > 16 ? 8 : (int)(nc / 2);
}

void upload_release(bk_gfwd *f)
{
    for (int i = 0; i < 2; i++) {
        if (f->up_ev[i]) {
            cudaEventSynchronize(f->up_ev[i]);
            cudaEventDestroy(f->up_ev[i]);
        }
        if (f->up_pin[i])
            cudaFreeHost(f->up_pin[i]);
        bk_dev_free(f->c, f->up_dev[i]);
        f->up_ev[i] = NULL;
        f->up_pin[i] = NULL;
        f->up_dev[i] = NULL;
    }
}

bk_status upload_setup(bk_gfwd *f)
{
    if (f->up_pin[1])
        return BK_OK;
    bk_status st = BK_OK;
    for (int i = 0; i < 2 && st == BK_OK; i++) {
        void *p = NULL;
        st = bk_cuda_status(cudaHostAlloc(&p, (size_t)f->up_chunk * sizeof(float),
                                          cudaHostAllocDefault),
                            "pinned staging of weight uploads", __FILE__, __LINE__);
        f->up_pin[i] = p;
        if (st == BK_OK)
            st = bk_dev_alloc(f->c, &p, (size_t)f->up_chunk * sizeof(uint16_t),
                              "BF16 staging of weight uploads");
        f->up_dev[i] = static_cast<uint16_t *>(p);
        if (st == BK_OK)
            st = bk_cuda_status(cudaEventCreateWithFlags(&f->up_ev[i], cudaEventDisableTiming),
                                "upload event", __FILE__, __LINE__);
    }
    if (st != BK_OK)
        upload_release(f);
    return st;
}

/* One host thread's share of a chunk: narrow src to BF16 into dst while every
 * value is one (low 16 bits zero); lossy = 1 at the first that is not. */
struct narrow_job {
    const uint32_t *src;
    uint16_t *dst;
    int64_t n;
    int lossy;
    pthread_t tid;
    int started;
};

void narrow_part(narrow_job *j)
{
    const uint32_t *s = j->src;
    uint16_t *d = j->dst;
    const int64_t n = j->n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint32_t low = 0;
        for (int k = 0; k < 8; k++) {
            low |= s[i + k] & 0xffffu;
            d[i + k] = (uint16_t)(s[i + k] >> 16);
        }
        if (low) {
            j->lossy = 1;
            return;
        }
    }
    for (; i < n; i++) {
        if (s[i] & 0xffffu) {
            j->lossy = 1;
            return;
        }
        d[i] = (uint16_t)(s[i] >> 16);
    }
}

void *narrow_main(void *arg)
{
    narrow_part(static_cast<narrow_job *>(arg));
    return NULL;
}

/* Split [0, n) into parts of at least min_part elements, at most threads. */
int parts_of(const bk_gfwd *f, int64_t n)
{
    int64_t p = n / (f->up_min_part > 0 ? f->up_min_part : 1);
    if (p > f->up_threads)
        p = f->up_threads;
    return p < 1 ? 1 : (int)p;
}

/* The chunk src [n] into the pinned slot: as BF16 (returns 1) when every
 * value is a BF16 number, else as F32 (returns 0). Helper threads for the
 * parts after the first; a part whose thread cannot start runs here. */
int stage_chunk(const bk_gfwd *f, const float *src, int64_t n, void *pin)
{
    enum { MAXP = 64 };
    const int np = parts_of(f, n) < MAXP ? parts_of(f, n) : MAXP;
    narrow_job nj[MAXP];
    const uint32_t *s = reinterpret_cast<const uint32_t *>(src);
    uint16_t *d = static_cast<uint16_t *>(pin);
    for (int p = 0; p < np; p++) {
        const int64_t a = n * p / np, b = n * (p + 1) / np;
        nj[p].src = s + a;
        nj[p].dst = d + a;
        nj[p].n = b - a;
        nj[p].lossy = 0;
        nj[p].started = p > 0 && pthread_create(&nj[p].tid, NULL, narrow_main, &nj[p]) == 0;
    }
    for (int p = 0; p < np; p++)
        if (!nj[p].started)
            narrow_part(&nj[p]);
    int lossy = 0;
    for (int p = 0; p < np; p++) {
        if (nj[p].started)
            pthread_join(nj[p].tid, NULL);
        lossy |= nj[p].lossy;
    }
    if (!lossy)
        return 1;
    bk_host_copy_parts(static_cast<char *>(pin), reinterpret_cast<const char *>(src),
                       (size_t)n * 4, np);
    return 0;
}

__global__ void k_widen_bf16(const uint16_t *src, float *dst, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __uint_as_float((uint32_t)src[i] << 16);
}

} // namespace

extern "C" void bk_gpu_upload_tune(bk_gfwd *f, int64_t chunk, int64_t min_part, int threads)
{
    if (!f)
        return;
    if (chunk > 0 && chunk != f->up_chunk) {
        upload_release(f);
        f->up_chunk = chunk;
    }
    if (min_part > 0)
        f->up_min_part = min_part;
    if (threads > 0)
        f->up_threads = threads;
}

namespace {

/* The layer uploads of bk_gpu_upload_f32 / bk_gpu_upload_bf16: n elements of
 * src (F32, or BF16 with src_bf16) into dst (F32 on the device) in chunks
 * through the two pinned slots. Slot k&1: the host stages chunk k while chunk
 * k-1 is copied; a slot is reused once the copy out of it (its event) is
 * done. F32 chunks exact in BF16 travel as BF16 (stage_chunk) and BF16 ones
 * always; both are widened on the device, a BF16 source landing in dst_bf16
 * (the layer's BF16 copy) when given, else in the slot's device buffer. */
bk_status upload_chunks(bk_gfwd *f, float *dst, uint16_t *dst_bf16, const void *src, int src_bf16,
                        int64_t n)
{
    if (n <= 0)
        return BK_OK;
    bk_status st = upload_setup(f);
    if (st != BK_OK)
        return st;
    cudaStream_t s = f->c->stream;
    int k = 0;
    for (int64_t off = 0; off < n && st == BK_OK; off += f->up_chunk, k++) {
        const int64_t cnt = n - off < f->up_chunk ? n - off : f->up_chunk;
        const int slot = k & 1;
        st = bk_cuda_status(cudaEventSynchronize(f->up_ev[slot]), "weight upload: slot event",
                            __FILE__, __LINE__);
        if (st != BK_OK)
            break;
        int bf = 1;
        if (src_bf16) {
            const int np = parts_of(f, cnt) < 64 ? parts_of(f, cnt) : 64;
            bk_host_copy_parts(static_cast<char *>(f->up_pin[slot]),
                               reinterpret_cast<const char *>(static_cast<const uint16_t *>(src) + off),
                               (size_t)cnt * sizeof(uint16_t), np);
        } else {
            bf = stage_chunk(f, static_cast<const float *>(src) + off, cnt, f->up_pin[slot]);
        }
        if (bf) {
            uint16_t *land = src_bf16 && dst_bf16 ? dst_bf16 + off : f->up_dev[slot];
            st = bk_cuda_status(cudaMemcpyAsync(land, f->up_pin[slot],
                                                (size_t)cnt * sizeof(uint16_t),
                                                cudaMemcpyHostToDevice, s),
                                "weight upload: BF16 chunk", __FILE__, __LINE__);
            if (st == BK_OK) {
                k_widen_bf16<<<bk_grid(cnt), 256, 0, s>>>(land, dst + off, cnt);
                st = BK_LAUNCHED("k_widen_bf16");
            }
        } else {
            st = bk_cuda_status(cudaMemcpyAsync(dst + off, f->up_pin[slot],
                                                (size_t)cnt * sizeof(float),
                                                cudaMemcpyHostToDevice, s),
                                "weight upload: F32 chunk", __FILE__, __LINE__);
        }
        /* recorded whatever happened above (session-11 review R6): the slot's
         * event covers every copy queued out of its pinned buffer, the one
         * before a widening that failed to launch included, since the next
         * chunk or upload staged into that buffer waits on it */
        const cudaError_t er = cudaEventRecord(f->up_ev[slot], s);
        if (st == BK_OK)
            st = bk_cuda_status(er, "weight upload: recording the slot event", __FILE__,
                                __LINE__);
    }
    if (st != BK_OK) {
        /* nothing queued out of the pinned slots is left in flight after an
         * error (the error's message stays the first one) */
        cudaStreamSynchronize(s);
        cudaGetLastError();
        return st;
    }
    BK_CUDA_CHECK(cudaStreamSynchronize(s));
    return BK_OK;
}

} // namespace

extern "C" bk_status bk_gpu_upload_f32(bk_gfwd *f, float *dst, const float *src, int64_t n)
{
    return upload_chunks(f, dst, NULL, src, 0, n);
}

extern "C" bk_status bk_gpu_upload_bf16(bk_gfwd *f, float *dst, uint16_t *dst_bf16,
                                        const uint16_t *src, int64_t n)
{
    return upload_chunks(f, dst, dst_bf16, src, 1, n);
}

extern "C" void bk_gfwd_free(bk_gfwd *f)
{
    if (!f)
        return;
    bk_cuda_ctx *c = f->c;
    float *bufs[] = {f->cos, f->sin, f->q,    f->k,   f->v,    f->qh,      f->kh,
                     f->vh,  f->oh,  f->o,    f->x,   f->tmp,  f->gate,    f->up,
                     f->down, f->scores, f->head_w, f->head_norm, f->lse_mx, f->lse_tgt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        bk_dev_free(c, bufs[i]);
    bk_dev_free(c, f->qb);
    bk_dev_free(c, f->kb);
    bk_dev_free(c, f->vb);
    bk_dev_free(c, f->lse_se);
    bk_dev_free(c, f->tok);
    bk_dev_free(c, f->flag);
    bk_dev_free(c, f->nf);
    if (f->nf_host)
        cudaFreeHost(f->nf_host);
    bk_dev_free(c, f->emb);
    bk_dev_free(c, f->xb);
    upload_release(f);
    if (f->blas)
        cublasDestroy(f->blas);
    free(f);
}

extern "C" int bk_gfwd_attn_fused(const bk_gfwd *f)
{
    return f ? f->attn_fused : 0;
}

extern "C" bk_status bk_gfwd_set_attn_fused(bk_gfwd *f, int on)
{
    if (!f)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: NULL forward");
    if (on && !f->qb)
        return bk_error(BK_ERR_INVALID_ARG,
                        "GPU forward: fused attention needs BF16 GEMM mode and head_dim 64 or "
                        "128 (head_dim %lld)",
                        (long long)f->dim.hd);
    f->attn_fused = on ? 1 : 0;
    return BK_OK;
}

extern "C" int64_t bk_gfwd_max_seqs(const bk_gfwd *f)
{
    return f ? f->dim.max_seqs : 0;
}

extern "C" bk_status bk_gfwd_create(bk_backend *b, const bk_model_config *cfg, int64_t max_seqs,
                                    int64_t seqlen, bk_gfwd **out)
{
    *out = NULL;
    if (!b || !cfg)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: NULL backend or config");
    if (b->kind != BK_BACKEND_CUDA || strcmp(b->ops->name, "cuda") != 0)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: needs the CUDA backend (got %s)",
                        b->ops->name);
    /* The CPU forward's own checks of the configuration, sizes, RoPE and
     * sliding window: one source of truth (its buffers of one sequence are
     * allocated, never touched, and freed). */
    bk_fwd *probe = NULL;
    bk_status st = bk_fwd_create(cfg, 1, seqlen, &probe);
    if (st != BK_OK)
        return st;
    bk_fwd_free(probe);
    uint64_t rows;
    if (max_seqs < 1 || bk_mul_u64((uint64_t)max_seqs, (uint64_t)seqlen, &rows) ||
        rows > (uint64_t)INT32_MAX)
        return bk_error(BK_ERR_INVALID_ARG,
                        "GPU forward: micro-batch of %lld sequences x %lld tokens is not "
                        "supported (1 to %d rows)",
                        (long long)max_seqs, (long long)seqlen, INT32_MAX);
    bk_gfwd *f = static_cast<bk_gfwd *>(calloc(1, sizeof(bk_gfwd)));
    if (!f)
        return bk_error(BK_ERR_NOMEM, "GPU forward: out of memory");
    f->c = static_cast<bk_cuda_ctx *>(b->ctx);
    upload_defaults(f);
    f->bf16 = b->gemm_math == BK_GEMM_BF16;
    f->tf32 = b->gemm_math == BK_GEMM_TF32 || f->bf16; /* bf16: the rest in TF32 */
    {
        cublasStatus_t cs = cublasCreate(&f->blas);
        if (cs == CUBLAS_STATUS_SUCCESS)
            cs = cublasSetStream(f->blas, f->c->stream);
        if (cs == CUBLAS_STATUS_SUCCESS)
            cs = cublasSetMathMode(f->blas,
                                   f->tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
        if (cs != CUBLAS_STATUS_SUCCESS) {
            st = bk_cublas_status(cs, "GPU forward: cuBLAS handle", __FILE__, __LINE__);
            bk_gfwd_free(f);
            return st;
        }
    }
    f->cfg = *cfg;
    bk__dims_set(&f->dim, cfg, max_seqs, seqlen);
    f->eps = (float)cfg->rms_eps;
    bk_rope rope;
    memset(&rope, 0, sizeof rope);
    st = bk_rope_init(&rope, cfg, seqlen);
    if (st != BK_OK) {
        free(f);
        return bk_error_prefix(st, "GPU forward");
    }
    const int64_t R = f->dim.rows, h2 = f->dim.hd / 2;
    if ((st = g_alloc_f32(f, &f->cos, seqlen, h2, "RoPE cos")) == BK_OK &&
        (st = g_alloc_f32(f, &f->sin, seqlen, h2, "RoPE sin")) == BK_OK) {
        st = bk_gpu_upload(f, f->cos, rope.cos, (size_t)(seqlen * h2) * 4);
        if (st == BK_OK)
            st = bk_gpu_upload(f, f->sin, rope.sin, (size_t)(seqlen * h2) * 4);
    }
    bk_rope_free(&rope);
    /* score buffer: at least one row of T, at most SCORE_FLOATS unless one
     * (sequence, group) pair of rows is smaller */
    int64_t pair = f->dim.rep * seqlen * seqlen;
    f->score_floats = pair * max_seqs * f->dim.nkv;
    if (f->score_floats > SCORE_FLOATS)
        f->score_floats = SCORE_FLOATS > seqlen ? SCORE_FLOATS / seqlen * seqlen : seqlen;
    struct {
        float **p;
        int64_t w;
        const char *what;
    } bufs[] = {
        {&f->q, f->dim.qdim, "queries"},       {&f->k, f->dim.kvdim, "keys"},
        {&f->v, f->dim.kvdim, "values"},       {&f->o, f->dim.qdim, "attention output"},
        {&f->x, f->dim.hidden > f->dim.qdim ? f->dim.hidden : f->dim.qdim, "normalized input"},
        {&f->tmp, f->dim.hidden, "module output"}, {&f->gate, f->dim.inter, "gate projection"},
        {&f->up, f->dim.inter, "up projection"},   {&f->down, f->dim.inter, "down_proj input"},
        {&f->lse_mx, 1, "log-sum-exp state"},  {&f->lse_tgt, 1, "log-sum-exp state"},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0] && st == BK_OK; i++)
        st = g_alloc_f32(f, bufs[i].p, R, bufs[i].w, bufs[i].what);
    void *p = NULL;
    if (st == BK_OK && (st = bk_dev_alloc(f->c, &p, (size_t)R * sizeof(double), "log-sum-exp")) == BK_OK)
        f->lse_se = static_cast<double *>(p);
    if (st == BK_OK && (st = bk_dev_alloc(f->c, &p, (size_t)R * sizeof(int32_t), "token ids")) == BK_OK)
        f->tok = static_cast<int32_t *>(p);
    if (st == BK_OK && (st = bk_dev_alloc(f->c, &p, 2 * sizeof(unsigned long long), "flags")) == BK_OK)
        f->flag = static_cast<unsigned long long *>(p);
    if (st == BK_OK && (st = bk_dev_alloc(f->c, &p, BK_FS_COUNT * sizeof(unsigned long long),
                                          "non-finite flags")) == BK_OK)
        f->nf = static_cast<unsigned long long *>(p);
    if (st == BK_OK) {
        st = bk_cuda_status(cudaHostAlloc(&p, BK_FS_COUNT * sizeof(unsigned long long),
                                          cudaHostAllocDefault),
                            "pinned host memory for the non-finite flags", __FILE__, __LINE__);
        if (st == BK_OK)
            f->nf_host = static_cast<unsigned long long *>(p);
    }
    if (st == BK_OK)
        st = bk_gfwd_nf_clear(f);
    /* fused attention: BF16 mode, head_dim 64 or 128 */
    if (st == BK_OK && f->bf16 && bk_attn_flash_supported(f->dim.hd)) {
        struct {
            __nv_bfloat16 **p;
            int64_t w;
            const char *what;
        } hb[] = {{&f->qb, f->dim.qdim, "queries (BF16, head-major)"},
                  {&f->kb, f->dim.kvdim, "keys (BF16, head-major)"},
                  {&f->vb, f->dim.kvdim, "values (BF16, head-major)"}};
        for (size_t i = 0; i < sizeof hb / sizeof hb[0] && st == BK_OK; i++) {
            p = NULL;
            st = bk_dev_alloc(f->c, &p, (size_t)(R * hb[i].w) * sizeof(__nv_bfloat16), hb[i].what);
            *hb[i].p = static_cast<__nv_bfloat16 *>(p);
        }
        f->attn_fused = st == BK_OK;
    }
    /* the unfused path's buffers (bk_g_attn_unfused_alloc): here when the
     * forward runs unfused, so that running out of device memory shows at
     * creation (where the GPU stages halve the micro-batch); on first use in
     * fused mode */
    if (st == BK_OK && !f->attn_fused)
        st = g_unfused_alloc(f);
    if (st == BK_OK && f->bf16) {
        int64_t wmax = f->dim.hidden > f->dim.qdim ? f->dim.hidden : f->dim.qdim;
        if (f->dim.inter > wmax)
            wmax = f->dim.inter;
        f->xb_elems = R * wmax;
        if (f->xb_elems < ((int64_t)1 << 24))
            f->xb_elems = (int64_t)1 << 24; /* room for Gram chunks of tall matrices */
        if ((st = bk_dev_alloc(f->c, &p, (size_t)f->xb_elems * sizeof(__nv_bfloat16),
                               "BF16 staging of GEMM inputs")) == BK_OK)
            f->xb = static_cast<__nv_bfloat16 *>(p);
    }
    if (st != BK_OK) {
        bk_gfwd_free(f);
        return bk_error_prefix(st, "GPU forward");
    }
    *out = f;
    return BK_OK;
}

/* ------------------------------------------------------- device memory */

extern "C" bk_status bk_gpu_alloc(bk_gfwd *f, void **p, size_t bytes, const char *what)
{
    return bk_dev_alloc(f->c, p, bytes, what);
}

extern "C" void bk_gpu_free(bk_gfwd *f, void *p)
{
    if (f)
        bk_dev_free(f->c, p);
}

extern "C" bk_status bk_gpu_upload(bk_gfwd *f, void *dst, const void *src, size_t bytes)
{
    if (!bytes)
        return BK_OK;
    BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, f->c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(f->c->stream));
    return BK_OK;
}

extern "C" bk_status bk_gpu_download(bk_gfwd *f, void *dst, const void *src, size_t bytes)
{
    if (!bytes)
        return BK_OK;
    BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, f->c->stream));
    BK_CUDA_CHECK(cudaStreamSynchronize(f->c->stream));
    return BK_OK;
}

extern "C" bk_status bk_gpu_copy(bk_gfwd *f, void *dst, const void *src, size_t bytes)
{
    if (!bytes)
        return BK_OK;
    BK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, f->c->stream));
    return BK_OK;
}

extern "C" bk_status bk_gpu_sync(bk_gfwd *f)
{
    BK_CUDA_CHECK(cudaStreamSynchronize(f->c->stream));
    return BK_OK;
}

/* (within the setting mem_limit: bk_dev_mem_free) */
extern "C" bk_status bk_gpu_mem_info(bk_gfwd *f, size_t *free_bytes, size_t *total_bytes)
{
    return bk_dev_mem_free(f ? f->c : NULL, free_bytes, total_bytes);
}

/* ------------------------------------------------------- layer weights */

extern "C" void bk_glayer_free(bk_gfwd *f, bk_glayer *g)
{
    if (!g)
        return;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        bk_dev_free(f->c, g->w[i]);
        bk_dev_free(f->c, g->wb[i]);
        bk_dev_free(f->c, g->b[i]);
    }
    bk_dev_free(f->c, g->attn_norm);
    bk_dev_free(f->c, g->mlp_norm);
    bk_dev_free(f->c, g->q_norm);
    bk_dev_free(f->c, g->k_norm);
    free(g);
}

extern "C" int bk_glayer_index(const bk_glayer *g)
{
    return g ? g->layer : -1;
}

extern "C" bk_status bk_glayer_download(bk_gfwd *f, const bk_glayer *g, bk_module mod, float *w,
                                        uint16_t *wb, int *has_bf16)
{
    if (!f || !g || !w || (unsigned)mod >= BK_MOD_COUNT || !g->w[mod])
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: bad arguments downloading a weight");
    int64_t o, in;
    bk_module_shape(&f->cfg, mod, &o, &in);
    if (has_bf16)
        *has_bf16 = g->wb[mod] != NULL;
    bk_status st = bk_gpu_download(f, w, g->w[mod], (size_t)(o * in) * sizeof(float));
    if (st == BK_OK && wb && g->wb[mod])
        st = bk_gpu_download(f, wb, g->wb[mod], (size_t)(o * in) * sizeof(uint16_t));
    return st;
}

namespace {

/* dst = a device copy of n floats from host (src_host) or device (src_dev). */
bk_status dup_f32(bk_gfwd *f, float **dst, const float *src, int64_t n, int from_host,
                  const char *what)
{
    *dst = NULL;
    if (!src)
        return BK_OK;
    bk_status st = g_alloc_f32(f, dst, n, 1, what);
    if (st != BK_OK)
        return st;
    if (from_host) {
        st = bk_gpu_upload_f32(f, *dst, src, n);
        return st == BK_OK ? st : bk_error_prefix(st, what);
    }
    return bk_cuda_status(cudaMemcpyAsync(*dst, src, (size_t)n * 4,
                                          from_host ? cudaMemcpyHostToDevice
                                                    : cudaMemcpyDeviceToDevice,
                                          f->c->stream),
                          what, __FILE__, __LINE__);
}

struct layer_src {
    int layer;
    const float *w[BK_MOD_COUNT], *b[BK_MOD_COUNT];
    const uint16_t *wb[BK_MOD_COUNT]; /* host BF16 instead of w[i] (from_host only) */
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm;
};

bk_status glayer_make(bk_gfwd *f, const layer_src *s, int from_host, bk_glayer **out)
{
    *out = NULL;
    bk_glayer *g = static_cast<bk_glayer *>(calloc(1, sizeof(bk_glayer)));
    if (!g)
        return bk_error(BK_ERR_NOMEM, "GPU forward: out of memory");
    g->layer = s->layer;
    bk_status st = BK_OK;
    for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++) {
        int64_t o, in;
        bk_module_shape(&f->cfg, (bk_module)i, &o, &in);
        if (from_host && s->wb[i] && !s->w[i]) {
            /* BF16 from the host: half the bytes; widened on the device, and
             * in BF16 mode landed straight in the BF16 copy (the bits
             * k_to_bf16 would give back: the values are BF16 numbers) */
            st = g_alloc_f32(f, &g->w[i], o * in, 1, bk_module_name((bk_module)i));
            if (st == BK_OK && f->bf16) {
                void *p = NULL;
                st = bk_dev_alloc(f->c, &p, (size_t)(o * in) * sizeof(__nv_bfloat16),
                                  "BF16 weight copy");
                g->wb[i] = static_cast<__nv_bfloat16 *>(p);
            }
            if (st == BK_OK) {
                st = bk_gpu_upload_bf16(f, g->w[i], reinterpret_cast<uint16_t *>(g->wb[i]),
                                        s->wb[i], o * in);
                if (st != BK_OK) /* (as dup_f32's messages) */
                    st = bk_error_prefix(st, bk_module_name((bk_module)i));
            }
            if (st == BK_OK)
                st = dup_f32(f, &g->b[i], s->b[i], o, from_host, "bias");
            continue;
        }
        st = dup_f32(f, &g->w[i], s->w[i], o * in, from_host, bk_module_name((bk_module)i));
        if (st == BK_OK)
            st = dup_f32(f, &g->b[i], s->b[i], o, from_host, "bias");
        if (st == BK_OK && f->bf16 && g->w[i]) {
            void *p = NULL;
            st = bk_dev_alloc(f->c, &p, (size_t)(o * in) * sizeof(__nv_bfloat16),
                              "BF16 weight copy");
            g->wb[i] = static_cast<__nv_bfloat16 *>(p);
            if (st == BK_OK)
                st = bk_glayer_sync_bf16(f, g, (bk_module)i);
        }
    }
    if (st == BK_OK)
        st = dup_f32(f, &g->attn_norm, s->attn_norm, f->dim.hidden, from_host, "input_layernorm");
    if (st == BK_OK)
        st = dup_f32(f, &g->mlp_norm, s->mlp_norm, f->dim.hidden, from_host,
                     "post_attention_layernorm");
    if (st == BK_OK)
        st = dup_f32(f, &g->q_norm, s->q_norm, f->dim.hd, from_host, "q_norm");
    if (st == BK_OK)
        st = dup_f32(f, &g->k_norm, s->k_norm, f->dim.hd, from_host, "k_norm");
    if (st == BK_OK)
        st = bk_cuda_status(cudaStreamSynchronize(f->c->stream), "upload layer weights",
                            __FILE__, __LINE__);
    if (st != BK_OK) {
        bk_glayer_free(f, g);
        char pre[64];
        snprintf(pre, sizeof pre, "layer %d", s->layer);
        return bk_error_prefix(st, pre);
    }
    *out = g;
    return BK_OK;
}

} // namespace

extern "C" bk_status bk_glayer_upload(bk_gfwd *f, const bk_layer_weights *lw, bk_glayer **out)
{
    *out = NULL;
    if (!f || !lw)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: NULL layer weights");
    layer_src s;
    s.layer = lw->layer;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        s.w[i] = lw->w[i];
        s.wb[i] = lw->wb[i];
        s.b[i] = lw->b[i];
    }
    s.attn_norm = lw->attn_norm;
    s.mlp_norm = lw->mlp_norm;
    s.q_norm = lw->q_norm;
    s.k_norm = lw->k_norm;
    return glayer_make(f, &s, 1, out);
}

extern "C" bk_status bk_glayer_clone(bk_gfwd *f, const bk_glayer *src, bk_glayer **out)
{
    *out = NULL;
    if (!f || !src)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: NULL layer weights");
    layer_src s;
    s.layer = src->layer;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        s.w[i] = src->w[i];
        s.wb[i] = NULL;
        s.b[i] = src->b[i];
    }
    s.attn_norm = src->attn_norm;
    s.mlp_norm = src->mlp_norm;
    s.q_norm = src->q_norm;
    s.k_norm = src->k_norm;
    return glayer_make(f, &s, 0, out);
}

extern "C" bk_status bk_glayer_set(bk_gfwd *f, bk_glayer *g, bk_module mod, const float *w)
{
    if (!f || !g || !w || (unsigned)mod >= BK_MOD_COUNT || !g->w[mod])
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward: bad arguments replacing a weight");
    int64_t o, in;
    bk_module_shape(&f->cfg, mod, &o, &in);
    bk_status st = bk_gpu_upload_f32(f, g->w[mod], w, o * in);
    if (st == BK_OK)
        st = bk_glayer_sync_bf16(f, g, mod);
    return st;
}

bk_status bk_glayer_sync_bf16(bk_gfwd *f, bk_glayer *g, bk_module mod)
{
    if (!f->bf16 || !g->wb[mod] || !g->w[mod])
        return BK_OK;
    int64_t o, in;
    bk_module_shape(&f->cfg, mod, &o, &in);
    k_to_bf16<<<bk_grid(o * in), 256, 0, f->c->stream>>>(g->w[mod], g->wb[mod], o * in);
    return BK_LAUNCHED("k_to_bf16 (weights)");
}

/* --------------------------------------------------------------- stages */

extern "C" bk_status bk_gfwd_embed(bk_gfwd *f, const bk_model *m, const int32_t *tokens,
                                   int64_t S, float *d_h)
{
    const bk_tensor_info *t;
    bk_status st = bk__fwd_check_embed(f ? &f->dim : NULL, m, tokens, S, "GPU forward", &t);
    if (st != BK_OK)
        return st;
    const int64_t N = S * f->dim.T;
    if (!device_dtype(t->dtype)) {
        /* other numeric dtypes: rows converted on the host */
        float *host = static_cast<float *>(bk_alloc((size_t)(N * f->dim.hidden), sizeof(float)));
        if (!host)
            return bk_error(BK_ERR_NOMEM, "GPU forward embed: out of host memory");
        const size_t es = bk_dtype_bits(t->dtype) / 8;
        for (int64_t n = 0; n < N && st == BK_OK; n++)
            st = bk_convert(static_cast<const unsigned char *>(t->data) +
                                (size_t)tokens[n] * (size_t)f->dim.hidden * es,
                            t->dtype, host + n * f->dim.hidden, BK_DT_F32, (size_t)f->dim.hidden);
        if (st == BK_OK)
            st = bk_gpu_upload(f, d_h, host, (size_t)(N * f->dim.hidden) * sizeof(float));
        else
            bk_error_prefix(st, t->name ? t->name : "embed_tokens.weight");
        free(host);
        return st;
    }
    if (!f->emb) {
        st = bk_dev_alloc(f->c, &f->emb, (size_t)t->nbytes, "embedding table");
        if (st == BK_OK)
            st = bk_gpu_upload(f, f->emb, t->data, (size_t)t->nbytes);
        if (st != BK_OK) {
            bk_dev_free(f->c, f->emb);
            f->emb = NULL;
            return st;
        }
        f->emb_dt = (int)t->dtype;
    }
    if ((st = upload_tokens(f, tokens, N)) != BK_OK)
        return st;
    k_embed<<<bk_grid(N * f->dim.hidden), 256, 0, f->c->stream>>>(f->emb, f->emb_dt, f->tok, N,
                                                              f->dim.hidden, d_h);
    return BK_LAUNCHED("k_embed");
}

extern "C" void bk_gfwd_embed_release(bk_gfwd *f)
{
    if (f && f->emb) {
        bk_dev_free(f->c, f->emb);
        f->emb = NULL;
    }
}

extern "C" bk_status bk_gfwd_attn_in(bk_gfwd *f, const bk_glayer *lw, const float *d_h,
                                     int64_t S, float *d_x)
{
    bk_status st = check_op(f, S, lw, FWD_ATTN_IN);
    if (st != BK_OK)
        return st;
    return g_rmsnorm_nf(f, d_h, S * f->dim.T, f->dim.hidden, lw->attn_norm, d_x, NULL,
                        f->nf + BK_FS_ATTN_IN);
}

namespace {

/* The queries and keys of bk_gfwd_attention from d_x (the layer checked):
 * q_proj / k_proj outputs (+ bias) into f->q / f->k, q_norm / k_norm where the
 * layer has them (in place), then RoPE (k_rope_heads) into the rotated
 * token-major d_qrot / d_krot (each optional) and, with heads, into the
 * head-major copies the attention core reads (f->qh / f->kh, or f->qb / f->kb
 * as BF16 when fused). Flags q_proj / k_proj outputs where they are read next
 * (q_norm / k_norm or RoPE) and the rotated queries and keys where RoPE writes
 * them. bk_gfwd_attention and bk_gfwd_qk_rot share it: the same launches with
 * the same arguments, so the rotated values are the same bits either way. */
bk_status attn_qk(bk_gfwd *f, const bk_glayer *lw, const float *d_x, int64_t S, float *d_qrot,
                  float *d_krot, int heads)
{
    const int64_t T = f->dim.T, N = S * T, hd = f->dim.hd, qd = f->dim.qdim, kd = f->dim.kvdim;
    cudaStream_t sm = f->c->stream;
    bk_status st;
    if ((st = bk_g_linear_mod(f, d_x, N, f->dim.hidden, lw, BK_MOD_Q, qd, 1, f->q)) ||
        (st = bk_g_linear_mod_same(f, d_x, N, f->dim.hidden, lw, BK_MOD_K, kd, 1, f->k)))
        return st;
    unsigned long long *nf = f->nf;
    if (lw->q_norm && (st = g_rmsnorm_nf(f, f->q, N * f->dim.nh, hd, lw->q_norm, f->q,
                                         nf + BK_FS_Q, NULL)) != BK_OK)
        return st;
    if (lw->k_norm && (st = g_rmsnorm_nf(f, f->k, N * f->dim.nkv, hd, lw->k_norm, f->k,
                                         nf + BK_FS_K, NULL)) != BK_OK)
        return st;
    /* fused: the rotated heads as BF16 only (the kernel's inputs); unfused:
     * as F32 into qh/kh/vh (allocated on the first unfused call) */
    const int fu = f->attn_fused;
    if (!fu && (st = bk_g_attn_unfused_alloc(f)) != BK_OK)
        return st;
    k_rope_heads<<<bk_grid(N * f->dim.nh * hd / 2), 256, 0, sm>>>(
        f->q, N, T, f->dim.nh, hd, f->dim.rep, f->cos, f->sin, 1, heads && !fu ? f->qh : NULL,
        heads && fu ? f->qb : NULL, d_qrot, lw->q_norm ? NULL : nf + BK_FS_Q, nf + BK_FS_QROT);
    if ((st = BK_LAUNCHED("k_rope_heads (queries)")) != BK_OK)
        return st;
    k_rope_heads<<<bk_grid(N * f->dim.nkv * hd / 2), 256, 0, sm>>>(
        f->k, N, T, f->dim.nkv, hd, 1, f->cos, f->sin, 1, heads && !fu ? f->kh : NULL,
        heads && fu ? f->kb : NULL, d_krot, lw->k_norm ? NULL : nf + BK_FS_K, nf + BK_FS_KROT);
    return BK_LAUNCHED("k_rope_heads (keys)");
}

} // namespace

extern "C" bk_status bk_gfwd_attention(bk_gfwd *f, const bk_glayer *lw, const float *d_x,
                                       int64_t S, float *d_o, float *d_qrot, float *d_krot,
                                       float *d_v)
{
    bk_status st = check_op(f, S, lw, FWD_ATTENTION);
    if (st != BK_OK)
        return st;
    const int64_t T = f->dim.T, N = S * T, hd = f->dim.hd, kd = f->dim.kvdim;
    cudaStream_t sm = f->c->stream;
    /* the rotated queries and keys (and their head-major copies), then the
     * values; the v_proj output is flagged where RoPE's copy reads it */
    if ((st = attn_qk(f, lw, d_x, S, d_qrot, d_krot, 1)) != BK_OK ||
        (st = bk_g_linear_mod_same(f, d_x, N, f->dim.hidden, lw, BK_MOD_V, kd, 1, f->v)) != BK_OK)
        return st;
    const int fu = f->attn_fused;
    k_rope_heads<<<bk_grid(N * f->dim.nkv * hd / 2), 256, 0, sm>>>(
        f->v, N, T, f->dim.nkv, hd, 1, f->cos, f->sin, 0, fu ? NULL : f->vh, fu ? f->vb : NULL, d_v,
        f->nf + BK_FS_V, NULL);
    if ((st = BK_LAUNCHED("k_rope_heads (values)")) != BK_OK)
        return st;
    return bk_g_attn_core(f, S, d_o, fu);
}

extern "C" bk_status bk_gfwd_qk_rot(bk_gfwd *f, const bk_glayer *lw, const float *d_x, int64_t S,
                                    float *d_qrot, float *d_krot)
{
    bk_status st = check_op(f, S, lw, FWD_ATTENTION);
    if (st != BK_OK)
        return st;
    if (!d_qrot || !d_krot)
        return bk_error(BK_ERR_INVALID_ARG, "GPU forward qk_rot: layer %d: NULL output",
                        lw->layer);
    return attn_qk(f, lw, d_x, S, d_qrot, d_krot, 0);
}

bk_status bk_g_attn_core(bk_gfwd *f, int64_t S, float *d_o, int fused, int bn, int mt)
{
    const int64_t T = f->dim.T, N = S * T, hd = f->dim.hd, qd = f->dim.qdim;
    const float scale = (float)(1.0 / sqrt((double)hd));
    if (fused) {
        if (!f->attn_fused)
            return bk_error(BK_ERR_INTERNAL, "GPU forward: fused attention not set up");
        return bk_attn_flash(f->qb, f->kb, f->vb, d_o, S, f->dim.nkv, T, f->dim.rep, hd, scale,
                             f->nf + BK_FS_O_IN, f->c->stream, bn, mt);
    }
    cudaStream_t sm = f->c->stream;
    /* (a no-op after bk_gfwd_attention or the dev harness allocated them) */
    bk_status st = bk_g_attn_unfused_alloc(f);
    if (st != BK_OK)
        return st;
    /* (sequence, kv group) pairs; a pair's query rows are T positions x rep
     * heads. Causal: the queries are taken in chunks of positions [t0, t0+tc)
     * that see only the keys [0, t0+tc), so about half of the score work and
     * memory is skipped for long sequences (the skipped entries are exact
     * zeros after the softmax). */
    const int64_t pairs = S * f->dim.nkv, RP = f->dim.rep * T, rep = f->dim.rep;
    int64_t tcn = T >= 512 ? (T + 7) / 8 : T;
    tcn = (tcn + 31) / 32 * 32;
    if (tcn > T)
        tcn = T;
    cublasHandle_t h = f->blas;
    for (int64_t t0 = 0; t0 < T; t0 += tcn) {
        const int64_t tc = T - t0 < tcn ? T - t0 : tcn, kv = t0 + tc, CR = tc * rep;
        int64_t pb, rc;
        if (CR * kv <= f->score_floats) {
            rc = CR;
            pb = f->score_floats / (CR * kv);
            if (pb > pairs)
                pb = pairs;
        } else {
            pb = 1;
            rc = f->score_floats / kv;
        }
        for (int64_t b0 = 0; b0 < pairs; b0 += pb) {
            const int64_t nb = pairs - b0 < pb ? pairs - b0 : pb;
            for (int64_t r0 = 0; r0 < CR; r0 += rc) {
                const int64_t nr = CR - r0 < rc ? CR - r0 : rc;
                const int64_t q0 = t0 * rep + r0; /* first query row in the pair */
                st = rm_gemm_batched(h, 0, 1, nr, kv, hd, scale, f->qh + b0 * RP * hd + q0 * hd,
                                     hd, RP * hd, f->kh + b0 * T * hd, hd, T * hd, 0.0f,
                                     f->scores, kv, nr * kv, nb);
                if (st != BK_OK)
                    return st;
                const int64_t rows = nb * nr;
                k_causal_softmax<<<(unsigned)((rows + 7) / 8), 256, 0, sm>>>(f->scores, rows, kv,
                                                                             nr, r0, rep, t0);
                if ((st = BK_LAUNCHED("k_causal_softmax")) != BK_OK)
                    return st;
                st = rm_gemm_batched(h, 0, 0, nr, hd, kv, 1.0f, f->scores, kv, nr * kv,
                                     f->vh + b0 * T * hd, hd, T * hd, 0.0f,
                                     f->oh + b0 * RP * hd + q0 * hd, hd, RP * hd, nb);
                if (st != BK_OK)
                    return st;
            }
        }
    }
    k_heads_to_tok<<<bk_grid(N * qd), 256, 0, sm>>>(f->oh, S, f->dim.nh, T, hd, rep, d_o,
                                                    f->nf + BK_FS_O_IN);
    return BK_LAUNCHED("k_heads_to_tok");
}

extern "C" bk_status bk_gfwd_attn_out(bk_gfwd *f, const bk_glayer *lw, const float *d_o,
                                      int64_t S, float *d_h)
{
    bk_status st = check_op(f, S, lw, FWD_ATTN_OUT);
    if (st != BK_OK)
        return st;
    const int64_t N = S * f->dim.T;
    if ((st = bk_g_linear_mod(f, d_o, N, f->dim.qdim, lw, BK_MOD_O, f->dim.hidden, 0, f->tmp)) != BK_OK)
        return st;
    k_residual<<<bk_grid(N * f->dim.hidden), 256, 0, f->c->stream>>>(
        d_h, f->tmp, lw->b[BK_MOD_O], N, f->dim.hidden, f->nf + BK_FS_O_OUT, f->nf + BK_FS_RESID_ATTN);
    return BK_LAUNCHED("k_residual");
}

extern "C" bk_status bk_gfwd_mlp_in(bk_gfwd *f, const bk_glayer *lw, const float *d_h,
                                    int64_t S, float *d_x)
{
    bk_status st = check_op(f, S, lw, FWD_MLP_IN);
    if (st != BK_OK)
        return st;
    return g_rmsnorm_nf(f, d_h, S * f->dim.T, f->dim.hidden, lw->mlp_norm, d_x, NULL,
                        f->nf + BK_FS_MLP_IN);
}

extern "C" bk_status bk_gfwd_mlp_hidden(bk_gfwd *f, const bk_glayer *lw, const float *d_x,
                                        int64_t S, float *d_down, float *d_gate_pre,
                                        float *d_up_pre)
{
    bk_status st = check_op(f, S, lw, FWD_MLP_HIDDEN);
    if (st != BK_OK)
        return st;
    const int64_t N = S * f->dim.T, ni = f->dim.inter;
    float *g = d_gate_pre ? d_gate_pre : f->gate;
    float *u = d_up_pre ? d_up_pre : f->up;
    if ((st = bk_g_linear_mod(f, d_x, N, f->dim.hidden, lw, BK_MOD_GATE, ni, 1, g)) ||
        (st = bk_g_linear_mod_same(f, d_x, N, f->dim.hidden, lw, BK_MOD_UP, ni, 1, u)))
        return st;
    k_swiglu<<<bk_grid(N * ni), 256, 0, f->c->stream>>>(g, u, d_down, N * ni, f->nf + BK_FS_GATE,
                                                        f->nf + BK_FS_UP, f->nf + BK_FS_DOWN_IN);
    return BK_LAUNCHED("k_swiglu");
}

extern "C" bk_status bk_gfwd_mlp_out(bk_gfwd *f, const bk_glayer *lw, const float *d_down,
                                     int64_t S, float *d_h)
{
    bk_status st = check_op(f, S, lw, FWD_MLP_OUT);
    if (st != BK_OK)
        return st;
    const int64_t N = S * f->dim.T;
    if ((st = bk_g_linear_mod(f, d_down, N, f->dim.inter, lw, BK_MOD_DOWN, f->dim.hidden, 0, f->tmp)) !=
        BK_OK)
        return st;
    k_residual<<<bk_grid(N * f->dim.hidden), 256, 0, f->c->stream>>>(
        d_h, f->tmp, lw->b[BK_MOD_DOWN], N, f->dim.hidden, f->nf + BK_FS_DOWN_OUT,
        f->nf + BK_FS_RESID_MLP);
    return BK_LAUNCHED("k_residual");
}


/* ---------------------------------------------------------------- the head */

extern "C" bk_status bk_gfwd_logits(bk_gfwd *f, const bk_model *m, const float *d_h, int64_t S,
                                    float *logits)
{
    bk_status st = bk__fwd_check_call(f ? &f->dim : NULL, m, NULL, S, "GPU forward", "logits");
    if (st == BK_OK)
        st = head_load(f, m);
    if (st == BK_OK)
        st = g_scores_alloc(f);
    if (st != BK_OK)
        return st;
    const int64_t N = S * f->dim.T, V = f->cfg.vocab;
    /* logits of a vocabulary block go through the score buffer */
    int64_t vc = bk__fwd_vocab_block(&f->dim, 0);
    if (N * vc > f->score_floats)
        vc = f->score_floats / N > 0 ? f->score_floats / N : 1;
    if ((st = bk_g_rmsnorm(f, d_h, N, f->dim.hidden, f->head_norm, f->x)) != BK_OK)
        return st;
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
        const int64_t n = V - v0 < vc ? V - v0 : vc;
        st = bk_rm_gemm(f->blas, 0, 1, N, n, f->dim.hidden, 1.0, f->x, f->dim.hidden,
                        f->head_w + v0 * f->dim.hidden, f->dim.hidden, 0.0, f->scores, n);
        if (st != BK_OK)
            return st;
        BK_CUDA_CHECK(cudaMemcpy2DAsync(logits + v0, (size_t)V * 4, f->scores, (size_t)n * 4,
                                        (size_t)n * 4, (size_t)N, cudaMemcpyDeviceToHost,
                                        f->c->stream));
        BK_CUDA_CHECK(cudaStreamSynchronize(f->c->stream));
    }
    return BK_OK;
}

extern "C" bk_status bk_gfwd_nll(bk_gfwd *f, const bk_model *m, const float *d_h,
                                 const int32_t *tokens, int64_t S, double *nll_sum, int64_t *count)
{
    int predict;
    bk_status st = bk__fwd_check_nll(f ? &f->dim : NULL, m, tokens, S, "GPU forward", &predict);
    if (st != BK_OK || !predict) /* (fewer than 2 tokens: nothing to predict) */
        return st;
    const int64_t T = f->dim.T, N = S * T, V = f->cfg.vocab;
    if ((st = head_load(f, m)) != BK_OK || (st = g_scores_alloc(f)) != BK_OK ||
        (st = upload_tokens(f, tokens, N)) != BK_OK)
        return st;
    int64_t vc = bk__fwd_vocab_block(&f->dim, N);
    if (N * vc > f->score_floats) /* the block goes through the score buffer */
        vc = f->score_floats / N > 0 ? f->score_floats / N : 1;
    cudaStream_t sm = f->c->stream;
    if ((st = bk_g_rmsnorm(f, d_h, N, f->dim.hidden, f->head_norm, f->x)) != BK_OK)
        return st;
    k_lse_init<<<bk_grid(N), 256, 0, sm>>>(f->lse_mx, f->lse_se, f->lse_tgt, N);
    if ((st = BK_LAUNCHED("k_lse_init")) != BK_OK)
        return st;
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
        const int64_t n = V - v0 < vc ? V - v0 : vc;
        st = bk_rm_gemm(f->blas, 0, 1, N, n, f->dim.hidden, 1.0, f->x, f->dim.hidden,
                        f->head_w + v0 * f->dim.hidden, f->dim.hidden, 0.0, f->scores, n);
        if (st != BK_OK)
            return st;
        k_lse_block<<<(unsigned)((N + 7) / 8), 256, 0, sm>>>(f->scores, N, n, T, v0, f->tok,
                                                             f->lse_mx, f->lse_se, f->lse_tgt);
        if ((st = BK_LAUNCHED("k_lse_block")) != BK_OK)
            return st;
    }
    float *mx = static_cast<float *>(bk_alloc((size_t)N, sizeof(float)));
    float *tgt = static_cast<float *>(bk_alloc((size_t)N, sizeof(float)));
    double *se = static_cast<double *>(bk_alloc((size_t)N, sizeof(double)));
    if (!mx || !tgt || !se)
        st = bk_error(BK_ERR_NOMEM, "GPU forward nll: out of memory for %lld rows", (long long)N);
    if (st == BK_OK)
        st = bk_gpu_download(f, mx, f->lse_mx, (size_t)N * sizeof(float));
    if (st == BK_OK)
        st = bk_gpu_download(f, tgt, f->lse_tgt, (size_t)N * sizeof(float));
    if (st == BK_OK)
        st = bk_gpu_download(f, se, f->lse_se, (size_t)N * sizeof(double));
    if (st == BK_OK) /* summed on the host in row order, as on the CPU */
        st = bk_fwd_nll_rows(se, mx, tgt, S, T, nll_sum, count);
    free(mx);
    free(tgt);
    free(se);
    return st;
}
