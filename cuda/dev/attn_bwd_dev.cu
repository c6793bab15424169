/* bk-cuda-dev attn-bwd — the fused attention backward (cuda/attn_flash_bwd.cu,
 * written without a GPU) against the unfused BF16 backward of the GPU backprop
 * flow (cuda/backward.cu attn_back_bf, its GEMM sequence reproduced here, its
 * softmax / dsoftmax kernels shared through cuda/attn_softmax.cuh) and
 * a double reference:
 *
 *   bk-cuda-dev attn-bwd [--seqs S] [--T T] [--heads H] [--kv K] [--hd D,D..]
 *                        [--amp A,A..] [--reps N] [--chunks C]
 *
 * Defaults: the Llama-3.2-1B flow's micro-batch (4 sequences x 2048 tokens,
 * 32 query / 8 kv heads), head_dim 64 and 128, query amplitudes 1 and 4, 10
 * timed repetitions; --chunks: the unfused path's row chunks (default as
 * backward.cu's attn_chunks: T / 1024 within [2, 4]). Inputs token-major F32,
 * N(0, 1) rounded to BF16 numbers (queries N(0, amp^2)): q, k (as if
 * rotated), v and the output gradient dO; the fused path gets them
 * group-major in BF16 (as backward.cu's attn_fused writes them) and the
 * forward's output and log-sum-exp from bk_attn_flash. Reference: dQ, dK, dV
 * in double from the same operands (P exact). Printed per case and output:
 * max abs | max rel | max per-row rel against the reference for each path,
 * fused vs unfused, the median time per call (CUDA events) of the unfused
 * backward attention (conversions included) and of the fused one (prep, dK/dV,
 * dQ), and of the forward with and without the log-sum-exp. Also checked:
 * the forward's output is bitwise the same with and without lse, and two
 * fused runs give the same bytes. Verdict "attn-bwd: ok" / "FAILED": the fused
 * path within BWD_TOL (whole array) and max(BWD_ROW_TOL, 2 x the unfused
 * path's) per row, deterministic, forward unchanged. JSON per case on stderr. */
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "../attn_softmax.cuh" /* backward.cu's k_softmax, k_dsoftmax */
#include "../fwd_internal.cuh"
#include "dev_common.cuh"

extern "C" {
#include "bakron/backend.h"
#include "util.h"
}

int cmd_attn_bwd(int argc, char **argv);

namespace {

const double BWD_TOL = 1e-2;     /* max |x - ref| / max |ref| */
const double BWD_ROW_TOL = 5e-2; /* the same per (token, head) row, or 2x unfused */

inline unsigned grid_of(int64_t n)
{
    int64_t b = (n + 255) / 256;
    return (unsigned)(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

/* dst[i] = BF16-rounded N(0, amp^2) in F32 */
__global__ void k_gen(float *dst, int64_t n, double amp, uint64_t seed)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t a = dev_mix(seed * 0x632be59bd9b4e019ull + 2 * (uint64_t)i),
                 b = dev_mix(a ^ (2 * (uint64_t)i + 1));
        double u1 = ((a >> 11) + 0.5) * (1.0 / 9007199254740992.0);
        double u2 = (b >> 11) * (1.0 / 9007199254740992.0);
        dst[i] = __bfloat162float(__float2bfloat16_rn(
            (float)(amp * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2))));
    }
}

__global__ void k_bf(const float *src, __nv_bfloat16 *dst, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* backward.cu's k_tok_to_groups_bf16 */
__global__ void k_groups(const float *src, int64_t N, int64_t T, int64_t heads, int64_t hd,
                         int64_t rep, __nv_bfloat16 *dst)
{
    const int64_t w = heads * hd;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * w;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = idx % w, n = idx / w;
        const int64_t head = c / hd, i = c % hd, s = n / T, pos = n % T;
        dst[(((s * (heads / rep) + head / rep) * T + pos) * rep + head % rep) * hd + i] =
            __float2bfloat16_rn(src[idx]);
    }
}

/* reference, pass 1: a CTA of 128 threads per (sequence, head, position):
 * lse (natural log), D = Σ P dP and the dQ row, in double; token-major q/dO
 * [N, qd], k/v [N, kd]; sh: scores [T], P dP [T], reduction [128] */
__global__ void k_ref_rows(const float *q, const float *k, const float *v, const float *dO,
                           double *lse, double *Dr, double *dq, int64_t T, int64_t nh,
                           int64_t rep, int64_t hd, double scale)
{
    extern __shared__ double sh[];
    double *sc = sh, *pd = sh + T, *red = pd + T;
    const int64_t pos = blockIdx.x % T, j = (blockIdx.x / T) % nh, s = blockIdx.x / (T * nh);
    const int64_t qd = nh * hd, kd = nh / rep * hd, gk = j / rep;
    const float *qr = q + (s * T + pos) * qd + j * hd, *dr = dO + (s * T + pos) * qd + j * hd;
    const int tid = threadIdx.x, lane = tid & 31, nw = blockDim.x >> 5;
    for (int64_t u = tid >> 5; u <= pos; u += nw) {
        const float *kr = k + (s * T + u) * kd + gk * hd, *vr = v + (s * T + u) * kd + gk * hd;
        double a = 0, b = 0;
        for (int64_t c = lane; c < hd; c += 32) {
            a += (double)qr[c] * kr[c];
            b += (double)dr[c] * vr[c];
        }
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) {
            sc[u] = a * scale;
            pd[u] = b;
        }
    }
    __syncthreads();
    double mx = -INFINITY;
    for (int64_t u = tid; u <= pos; u += blockDim.x)
        mx = fmax(mx, sc[u]);
    red[tid] = mx;
    __syncthreads();
    for (int o = blockDim.x / 2; o; o >>= 1) {
        if (tid < o)
            red[tid] = fmax(red[tid], red[tid + o]);
        __syncthreads();
    }
    mx = red[0];
    __syncthreads();
    double sum = 0;
    for (int64_t u = tid; u <= pos; u += blockDim.x)
        sum += exp(sc[u] - mx);
    red[tid] = sum;
    __syncthreads();
    for (int o = blockDim.x / 2; o; o >>= 1) {
        if (tid < o)
            red[tid] += red[tid + o];
        __syncthreads();
    }
    const double L = mx + log(red[0]);
    __syncthreads();
    double dd = 0;
    for (int64_t u = tid; u <= pos; u += blockDim.x) {
        sc[u] = exp(sc[u] - L); /* P */
        dd += sc[u] * pd[u];
    }
    red[tid] = dd;
    __syncthreads();
    for (int o = blockDim.x / 2; o; o >>= 1) {
        if (tid < o)
            red[tid] += red[tid + o];
        __syncthreads();
    }
    const double D = red[0];
    const int64_t row = (s * nh + j) * T + pos;
    if (tid == 0) {
        lse[row] = L;
        Dr[row] = D;
    }
    for (int64_t c = tid; c < hd; c += blockDim.x) {
        double acc = 0;
        for (int64_t u = 0; u <= pos; u++)
            acc += sc[u] * (pd[u] - D) * (double)k[(s * T + u) * kd + gk * hd + c];
        dq[(s * T + pos) * qd + j * hd + c] = acc * scale;
    }
}

/* reference, pass 2: a CTA of hd threads per (sequence, kv head, key): dK and
 * dV of the key over the group's heads and the positions from the key on */
__global__ void k_ref_keys(const float *q, const float *k, const float *v, const float *dO,
                           const double *lse, const double *Dr, double *dk, double *dv,
                           int64_t T, int64_t nh, int64_t rep, int64_t hd, double scale)
{
    extern __shared__ double sh2[]; /* reduction [2 hd] */
    const int64_t u = blockIdx.x % T, gk = (blockIdx.x / T) % (nh / rep),
                  s = blockIdx.x / (T * (nh / rep));
    const int64_t qd = nh * hd, kd = nh / rep * hd;
    const int c = threadIdx.x;
    const double kc = k[(s * T + u) * kd + gk * hd + c], vc = v[(s * T + u) * kd + gk * hd + c];
    double ak = 0, av = 0;
    for (int64_t pos = u; pos < T; pos++)
        for (int64_t h = 0; h < rep; h++) {
            const int64_t j = gk * rep + h, row = (s * nh + j) * T + pos;
            const double qc = q[(s * T + pos) * qd + j * hd + c],
                         dc = dO[(s * T + pos) * qd + j * hd + c];
            sh2[c] = qc * kc;
            sh2[hd + c] = dc * vc;
            __syncthreads();
            for (int o = (int)hd / 2; o; o >>= 1) {
                if (c < o) {
                    sh2[c] += sh2[c + o];
                    sh2[hd + c] += sh2[hd + c + o];
                }
                __syncthreads();
            }
            const double P = exp(sh2[0] * scale - lse[row]), dS = P * (sh2[hd] - Dr[row]);
            __syncthreads();
            ak += dS * qc;
            av += P * dc;
        }
    dk[(s * T + u) * kd + gk * hd + c] = ak * scale;
    dv[(s * T + u) * kd + gk * hd + c] = av;
}

struct bufs {
    int64_t S, T, nh, nkv, rep, hd, N, qd, kd, nch;
    float scale;
    cudaStream_t st;
    cublasHandle_t bl;
    float *q, *k, *v, *dO, *o, *lse, *dsum, *dq, *dk, *dv, *P, *dP;
    __nv_bfloat16 *qb, *kb, *vb, *dob, *aq, *ak, *av, *ado, *Pb, *dSb;
};

#define CB(x)                                                                                     \
    do {                                                                                          \
        cublasStatus_t s_ = (x);                                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                        \
            fprintf(stderr, "FAILED %s: cuBLAS status %d\n", #x, (int)s_);                         \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

/* row-major strided-batched C = alpha op(A) op(B) + beta C, BF16 in, F32 out
 * (backward.cu's rm_gemm_b_bf) */
void gemm(const bufs &b, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
          const __nv_bfloat16 *A, int64_t lda, int64_t sa, const __nv_bfloat16 *B, int64_t ldb,
          int64_t sb, float beta, float *C, int64_t ldc, int64_t sc, int64_t batch)
{
    CB(cublasGemmStridedBatchedEx(b.bl, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha,
                                  B, CUDA_R_16BF, (int)ldb, sb, A, CUDA_R_16BF, (int)lda, sa, &beta,
                                  C, CUDA_R_32F, (int)ldc, sc, (int)batch, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
}

/* backward.cu's attn_back_bf (dq, dk, dv zeroed first, as layer_bwd does) */
void unfused(bufs &b)
{
    const int64_t T = b.T, N = b.N, qd = b.qd, kvd = b.kd, hd = b.hd, S = b.S;
    cudaStream_t st = b.st;
    CU(cudaMemsetAsync(b.dq, 0, (size_t)(N * qd) * 4, st));
    CU(cudaMemsetAsync(b.dk, 0, (size_t)(N * kvd) * 4, st));
    CU(cudaMemsetAsync(b.dv, 0, (size_t)(N * kvd) * 4, st));
    k_bf<<<grid_of(N * qd), 256, 0, st>>>(b.q, b.aq, N * qd);
    k_bf<<<grid_of(N * kvd), 256, 0, st>>>(b.k, b.ak, N * kvd);
    k_bf<<<grid_of(N * kvd), 256, 0, st>>>(b.v, b.av, N * kvd);
    k_bf<<<grid_of(N * qd), 256, 0, st>>>(b.dO, b.ado, N * qd);
    const int64_t nch = b.nch;
    for (int64_t j = 0; j < b.nh; j++)
        for (int64_t c = 0; c < nch; c++) {
            const int64_t gi = j / b.rep, r0 = T * c / nch, r1 = T * (c + 1) / nch, rc = r1 - r0;
            const __nv_bfloat16 *Qc = b.aq + r0 * qd + j * hd, *Kg = b.ak + gi * hd,
                                *Vg = b.av + gi * hd, *dOc = b.ado + r0 * qd + j * hd;
            __nv_bfloat16 *Pbc = b.Pb + r0 * T, *dSbc = b.dSb + r0 * T;
            gemm(b, false, true, rc, r1, hd, b.scale, Qc, qd, T * qd, Kg, kvd, T * kvd, 0.0f,
                 b.P + r0 * T, T, T * T, S);
            k_softmax<<<(unsigned)((S * rc + 7) / 8), 256, 0, st>>>(b.P, b.Pb, S * rc, T, r0,
                                                                       rc, r1);
            gemm(b, true, false, r1, hd, rc, 1.0f, Pbc, T, T * T, dOc, qd, T * qd, 1.0f,
                 b.dv + gi * hd, kvd, T * kvd, S);
            gemm(b, false, true, rc, r1, hd, 1.0f, dOc, qd, T * qd, Vg, kvd, T * kvd, 0.0f,
                 b.dP + r0 * T, T, T * T, S);
            k_dsoftmax<<<(unsigned)((S * rc + 7) / 8), 256, 0, st>>>(b.Pb, b.dP, b.dSb, S * rc,
                                                                        T, r0, rc, r1);
            gemm(b, false, false, rc, hd, r1, b.scale, dSbc, T, T * T, Kg, kvd, T * kvd, 0.0f,
                 b.dq + r0 * qd + j * hd, qd, T * qd, S);
            gemm(b, true, false, r1, hd, rc, b.scale, dSbc, T, T * T, Qc, qd, T * qd, 1.0f,
                 b.dk + gi * hd, kvd, T * kvd, S);
        }
    CK(bk_launch_status("unfused attention backward", __FILE__, __LINE__));
}

/* the fused path: the group-major BF16 copies (backward.cu's attn_fused does
 * them for the forward already), then the backward */
void fused(bufs &b)
{
    CK(bk_attn_flash_bwd(b.qb, b.kb, b.vb, b.o, b.dO, b.lse, b.dq, b.dk, b.dv, b.dob, b.dsum, b.S,
                         b.nkv, b.T, b.rep, b.hd, b.scale, b.st));
}

void forward(bufs &b, int with_lse)
{
    CK(bk_attn_flash(b.qb, b.kb, b.vb, b.o, b.S, b.nkv, b.T, b.rep, b.hd, b.scale, NULL, b.st, 0,
                     0, with_lse ? b.lse : NULL));
}

template <typename F> double median_ms(bufs &b, F fn, int reps)
{
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    fn(b); /* warm-up */
    std::vector<float> t;
    for (int i = 0; i < reps; i++) {
        CU(cudaEventRecord(e0, b.st));
        fn(b);
        CU(cudaEventRecord(e1, b.st));
        CU(cudaEventSynchronize(e1));
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <typename T> T *dmalloc(int64_t n)
{
    void *p = NULL;
    CU(cudaMalloc(&p, (size_t)n * sizeof(T)));
    return static_cast<T *>(p);
}

template <typename T> std::vector<T> down(const T *d, int64_t n, cudaStream_t st)
{
    std::vector<T> h((size_t)n);
    CU(cudaStreamSynchronize(st));
    CU(cudaMemcpy(h.data(), d, (size_t)n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

} // namespace

int cmd_attn_bwd(int argc, char **argv)
{
    int64_t S = 4, T = 2048, nh = 32, nkv = 8, chunks = 0;
    int reps = 10;
    std::vector<int64_t> hds = {64, 128};
    std::vector<double> amps = {1.0, 4.0};
    for (int i = 0; i < argc; i++) {
        std::string a = argv[i];
        const bool more = i + 1 < argc;
        if (a == "--seqs" && more)
            S = atoll(argv[++i]);
        else if (a == "--T" && more)
            T = atoll(argv[++i]);
        else if (a == "--heads" && more)
            nh = atoll(argv[++i]);
        else if (a == "--kv" && more)
            nkv = atoll(argv[++i]);
        else if (a == "--hd" && more)
            hds = num_list<int64_t>(argv[++i], atoll);
        else if (a == "--amp" && more)
            amps = num_list<double>(argv[++i], atof);
        else if (a == "--reps" && more)
            reps = atoi(argv[++i]);
        else if (a == "--chunks" && more)
            chunks = atoll(argv[++i]);
        else {
            fprintf(stderr, "bk-cuda-dev attn-bwd: unknown or incomplete option %s\n", a.c_str());
            return 1;
        }
    }
    if (S < 1 || T < 1 || nh < 1 || nkv < 1 || nh % nkv || reps < 1 || hds.empty() ||
        amps.empty() || chunks < 0 || chunks > T) {
        fprintf(stderr, "bk-cuda-dev attn-bwd: bad sizes\n");
        return 1;
    }
    if (!chunks)
        chunks = T < 16 ? 1 : std::min<int64_t>(4, std::max<int64_t>(2, T / 1024));
    int bad = 0;
    printf("attention backward, %lld x %lld tokens, %lld query / %lld kv heads, unfused in %lld "
           "row chunks; errors against double (max abs | max rel | max per-row rel), median of "
           "%d\n",
           (long long)S, (long long)T, (long long)nh, (long long)nkv, (long long)chunks, reps);
    for (int64_t hd : hds) {
        if (!bk_attn_flash_supported(hd)) {
            printf("hd %lld: not supported by the fused kernels: skipped\n", (long long)hd);
            bad++;
            continue;
        }
        bufs b;
        memset(&b, 0, sizeof b);
        b.S = S;
        b.T = T;
        b.nh = nh;
        b.nkv = nkv;
        b.rep = nh / nkv;
        b.hd = hd;
        b.N = S * T;
        b.qd = nh * hd;
        b.kd = nkv * hd;
        b.nch = chunks;
        b.scale = (float)(1.0 / sqrt((double)hd));
        CU(cudaStreamCreate(&b.st));
        CB(cublasCreate(&b.bl));
        CB(cublasSetStream(b.bl, b.st));
        const int64_t N = b.N, qd = b.qd, kd = b.kd;
        b.q = dmalloc<float>(N * qd);
        b.dO = dmalloc<float>(N * qd);
        b.o = dmalloc<float>(N * qd);
        b.dq = dmalloc<float>(N * qd);
        b.k = dmalloc<float>(N * kd);
        b.v = dmalloc<float>(N * kd);
        b.dk = dmalloc<float>(N * kd);
        b.dv = dmalloc<float>(N * kd);
        b.lse = dmalloc<float>(N * nh);
        b.dsum = dmalloc<float>(N * nh);
        b.P = dmalloc<float>(S * T * T);
        b.dP = dmalloc<float>(S * T * T);
        b.qb = dmalloc<__nv_bfloat16>(N * qd);
        b.dob = dmalloc<__nv_bfloat16>(N * qd);
        b.aq = dmalloc<__nv_bfloat16>(N * qd);
        b.ado = dmalloc<__nv_bfloat16>(N * qd);
        b.kb = dmalloc<__nv_bfloat16>(N * kd);
        b.vb = dmalloc<__nv_bfloat16>(N * kd);
        b.ak = dmalloc<__nv_bfloat16>(N * kd);
        b.av = dmalloc<__nv_bfloat16>(N * kd);
        b.Pb = dmalloc<__nv_bfloat16>(S * T * T);
        b.dSb = dmalloc<__nv_bfloat16>(S * T * T);
        double *r_lse = dmalloc<double>(N * nh), *r_D = dmalloc<double>(N * nh);
        double *r_dq = dmalloc<double>(N * qd), *r_dk = dmalloc<double>(N * kd),
               *r_dv = dmalloc<double>(N * kd);
        for (double amp : amps) {
            cudaStream_t st = b.st;
            k_gen<<<grid_of(N * qd), 256, 0, st>>>(b.q, N * qd, amp, 21 + (uint64_t)hd);
            k_gen<<<grid_of(N * kd), 256, 0, st>>>(b.k, N * kd, 1.0, 22 + (uint64_t)hd);
            k_gen<<<grid_of(N * kd), 256, 0, st>>>(b.v, N * kd, 1.0, 23 + (uint64_t)hd);
            k_gen<<<grid_of(N * qd), 256, 0, st>>>(b.dO, N * qd, 1.0, 24 + (uint64_t)hd);
            k_groups<<<grid_of(N * qd), 256, 0, st>>>(b.q, N, T, nh, hd, b.rep, b.qb);
            k_groups<<<grid_of(N * kd), 256, 0, st>>>(b.k, N, T, nkv, hd, 1, b.kb);
            k_groups<<<grid_of(N * kd), 256, 0, st>>>(b.v, N, T, nkv, hd, 1, b.vb);
            CK(bk_launch_status("inputs", __FILE__, __LINE__));
            /* reference */
            const size_t rsh = (size_t)(2 * T + 128) * sizeof(double);
            CU(cudaFuncSetAttribute(k_ref_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)rsh));
            k_ref_rows<<<(unsigned)(S * nh * T), 128, rsh, st>>>(b.q, b.k, b.v, b.dO, r_lse, r_D,
                                                                 r_dq, T, nh, b.rep, hd,
                                                                 (double)b.scale);
            k_ref_keys<<<(unsigned)(S * nkv * T), (unsigned)hd, 2 * hd * sizeof(double), st>>>(
                b.q, b.k, b.v, b.dO, r_lse, r_D, r_dk, r_dv, T, nh, b.rep, hd, (double)b.scale);
            CK(bk_launch_status("reference", __FILE__, __LINE__));
            const std::vector<double> hq = down(r_dq, N * qd, st), hk = down(r_dk, N * kd, st),
                                      hv = down(r_dv, N * kd, st);
            /* the forward without and with lse: the same output */
            forward(b, 0);
            const std::vector<float> o0 = down(b.o, N * qd, st);
            forward(b, 1);
            const std::vector<float> o1 = down(b.o, N * qd, st);
            const int fwd_same = !memcmp(o0.data(), o1.data(), o0.size() * 4);
            /* unfused */
            unfused(b);
            const std::vector<float> uq = down(b.dq, N * qd, st), uk = down(b.dk, N * kd, st),
                                     uv = down(b.dv, N * kd, st);
            /* fused, twice */
            fused(b);
            const std::vector<float> fq = down(b.dq, N * qd, st), fk = down(b.dk, N * kd, st),
                                     fv = down(b.dv, N * kd, st);
            CU(cudaMemsetAsync(b.dq, 0xff, (size_t)(N * qd) * 4, st));
            CU(cudaMemsetAsync(b.dk, 0xff, (size_t)(N * kd) * 4, st));
            CU(cudaMemsetAsync(b.dv, 0xff, (size_t)(N * kd) * 4, st));
            fused(b);
            const std::vector<float> gq = down(b.dq, N * qd, st), gk = down(b.dk, N * kd, st),
                                     gv = down(b.dv, N * kd, st);
            const int det = !memcmp(fq.data(), gq.data(), fq.size() * 4) &&
                            !memcmp(fk.data(), gk.data(), fk.size() * 4) &&
                            !memcmp(fv.data(), gv.data(), fv.size() * 4);
            const double t_old = median_ms(b, unfused, reps);
            const double t_new = median_ms(b, fused, reps);
            const double t_f0 = median_ms(b, [](bufs &x) { forward(x, 0); }, reps);
            const double t_f1 = median_ms(b, [](bufs &x) { forward(x, 1); }, reps);
            const char *nm[3] = {"dq", "dk", "dv"};
            const float *U[3] = {uq.data(), uk.data(), uv.data()},
                        *F[3] = {fq.data(), fk.data(), fv.data()};
            const double *Rf[3] = {hq.data(), hk.data(), hv.data()};
            const int64_t rows[3] = {N * nh, N * nkv, N * nkv};
            int fail = !det || !fwd_same;
            for (int i = 0; i < 3; i++) {
                const errs eu = compare(U[i], Rf[i], rows[i], hd);
                const errs ef = compare(F[i], Rf[i], rows[i], hd);
                const errs efu = compare(F[i], U[i], rows[i], hd);
                const int f = ef.nonfinite || !(ef.rel <= BWD_TOL) ||
                              !(ef.row_rel <= std::max(BWD_ROW_TOL, 2 * eu.row_rel));
                fail |= f;
                printf("hd %3lld amp %.1f %s  unfused: %.3e | %.3e | %.3e   fused: %.3e | %.3e | "
                       "%.3e   fused vs unfused: %.3e | %.3e | %.3e%s\n",
                       (long long)hd, amp, nm[i], eu.max_abs, eu.rel, eu.row_rel, ef.max_abs,
                       ef.rel, ef.row_rel, efu.max_abs, efu.rel, efu.row_rel,
                       f ? "  <-- FAIL" : "");
            }
            /* causal backward FLOP of the 5 products (as the forward's 2) */
            const double flop = 10.0 * (double)(S * nh * hd) * (double)T * (double)(T + 1) / 2;
            printf("hd %3lld amp %.1f  unfused %8.3f ms, fused %8.3f ms (%.2fx, %.1f TFLOP/s "
                   "causal of 5 products); forward %.3f ms, with lse %.3f ms; deterministic %s, "
                   "forward unchanged by lse %s%s\n",
                   (long long)hd, amp, t_old, t_new, t_old / t_new, flop / t_new * 1e-9, t_f0,
                   t_f1, det ? "yes" : "NO", fwd_same ? "yes" : "NO", fail ? "  <-- FAIL" : "");
            fprintf(stderr,
                    "JSON {\"bench\":\"attn-bwd\",\"S\":%lld,\"T\":%lld,\"heads\":%lld,\"kv\":%lld,"
                    "\"hd\":%lld,\"amp\":%g,\"ms_unfused\":%.4f,\"ms_fused\":%.4f,"
                    "\"ms_fwd\":%.4f,\"ms_fwd_lse\":%.4f,\"deterministic\":%s,\"ok\":%s}\n",
                    (long long)S, (long long)T, (long long)nh, (long long)nkv, (long long)hd, amp,
                    t_old, t_new, t_f0, t_f1, det ? "true" : "false", fail ? "false" : "true");
            bad += fail;
        }
        void *all[] = {b.q,  b.dO, b.o,  b.dq,  b.k,  b.v,   b.dk,  b.dv, b.lse, b.dsum,
                       b.P,  b.dP, b.qb, b.dob, b.aq, b.ado, b.kb,  b.vb, b.ak,  b.av,
                       b.Pb, b.dSb, r_lse, r_D, r_dq, r_dk, r_dv};
        for (void *p : all)
            CU(cudaFree(p));
        CB(cublasDestroy(b.bl));
        CU(cudaStreamDestroy(b.st));
    }
    printf("attn-bwd: %s (%d failures)\n", bad ? "FAILED" : "ok", bad);
    return bad ? 1 : 0;
}
