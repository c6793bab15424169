/* bk-cuda-dev attn — the GPU forward's attention core, unfused (cuBLAS
 * scores in TF32, causal softmax, cuBLAS P V, as BF16 mode runs it without
 * the fused kernel) against the fused kernel (cuda/attn_flash.cu), on one
 * bk_gfwd in BF16 mode (bk_g_attn_core, fwd_internal.cuh):
 *
 *   bk-cuda-dev attn [--seqs S] [--T T] [--heads H] [--kv K] [--hd D,D..]
 *                    [--amp A,A..] [--reps N] [--variants]
 *
 * Defaults: 2 sequences x 2048 tokens, 32 query / 8 kv heads (Llama-3-8B),
 * head_dim 128 and 64, query amplitudes 1 (score std 1) and 4 (peaked
 * softmax), 10 timed repetitions. Inputs: the rotated queries, keys and
 * values head-major, N(0, 1) (queries N(0, amp^2)) rounded to BF16 numbers,
 * so both paths see exactly the same operands; the reference is the same
 * attention in double on the device (all rows). Printed per case: max abs
 * error and max relative error (max |x - ref| / max |ref|, and per (token,
 * head) row) of each path against the reference and of fused against
 * unfused, and the median time per call (CUDA events) of each path. The
 * verdict line "attn: ok" / "attn: FAILED" checks the fused kernel against
 * the reference (ATTN_TOL, ATTN_ROW_TOL). --variants: also kernels the
 * product does not use (the other key-block size: 64 at head_dim 128, 32 at
 * 64; two m-tiles per warp), checked and timed the same way; their
 * failures are counted on their own line, not in the verdict. One JSON object per case on stderr
 * ("JSON ..."). */
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../fwd_internal.cuh"
#include "dev_common.cuh"

extern "C" {
#include "bakron/backend.h"
#include "util.h"
}

int cmd_attn(int argc, char **argv);

namespace {

/* fused vs the double reference, BF16-exact operands: only the BF16
 * rounding of the probabilities (2^-9 relative) and F32 sums remain */
const double ATTN_TOL = 5e-3;     /* max |x - ref| / max |ref| */
const double ATTN_ROW_TOL = 2e-2; /* the same per (token, head) row */



/* dst[i] = BF16-rounded N(0, amp^2) in F32 and as BF16 */
__global__ void k_gen(float *dst, __nv_bfloat16 *dstb, int64_t n, double amp, uint64_t seed)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t a = dev_mix(seed * 0x632be59bd9b4e019ull + 2 * (uint64_t)i),
                 b = dev_mix(a ^ (2 * (uint64_t)i + 1));
        double u1 = ((a >> 11) + 0.5) * (1.0 / 9007199254740992.0);
        double u2 = (b >> 11) * (1.0 / 9007199254740992.0);
        const float g = (float)(amp * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        const __nv_bfloat16 h = __float2bfloat16_rn(g);
        dstb[i] = h;
        dst[i] = __bfloat162float(h);
    }
}

/* reference: one block of 128 threads per query row (pair, row), in double;
 * out token-major [S*T, nkv*rep*hd] */
__global__ void k_ref(const float *q, const float *k, const float *v, double *out, int64_t T,
                      int64_t nkv, int64_t rep, int64_t hd, double scale)
{
    extern __shared__ double sh[]; /* q [hd], scores [T], reduction [128] */
    double *sq = sh, *sc = sh + hd, *red = sc + T;
    const int64_t RP = T * rep;
    const int64_t pair = blockIdx.x / RP, row = blockIdx.x % RP, pos = row / rep;
    const int tid = threadIdx.x;
    const float *qr = q + (pair * RP + row) * hd;
    const float *kp = k + pair * T * hd, *vp = v + pair * T * hd;
    for (int64_t c = tid; c < hd; c += blockDim.x)
        sq[c] = qr[c];
    __syncthreads();
    /* scores: a warp per key, the lanes along head_dim */
    const int lane = tid & 31, nw = blockDim.x >> 5;
    for (int64_t j = tid >> 5; j <= pos; j += nw) {
        double d = 0;
        for (int64_t c = lane; c < hd; c += 32)
            d += sq[c] * (double)kp[j * hd + c];
        for (int o = 16; o; o >>= 1)
            d += __shfl_xor_sync(0xffffffffu, d, o);
        if (lane == 0)
            sc[j] = d * scale;
    }
    __syncthreads();
    double mx = -INFINITY;
    for (int64_t j = tid; j <= pos; j += blockDim.x)
        mx = sc[j] > mx ? sc[j] : mx;
    red[tid] = mx;
    __syncthreads();
    for (int o = blockDim.x / 2; o; o >>= 1) {
        if (tid < o)
            red[tid] = red[tid + o] > red[tid] ? red[tid + o] : red[tid];
        __syncthreads();
    }
    mx = red[0];
    __syncthreads();
    double sum = 0;
    for (int64_t j = tid; j <= pos; j += blockDim.x) {
        sc[j] = exp(sc[j] - mx);
        sum += sc[j];
    }
    red[tid] = sum;
    __syncthreads();
    for (int o = blockDim.x / 2; o; o >>= 1) {
        if (tid < o)
            red[tid] += red[tid + o];
        __syncthreads();
    }
    sum = red[0];
    const int64_t s = pair / nkv, g = pair % nkv;
    double *dst = out + (s * T + pos) * nkv * rep * hd + (g * rep + row % rep) * hd;
    for (int64_t c = tid; c < hd; c += blockDim.x) {
        double acc = 0;
        for (int64_t j = 0; j <= pos; j++)
            acc += sc[j] * (double)vp[j * hd + c];
        dst[c] = acc / sum;
    }
}

double median_ms(bk_gfwd *f, int64_t S, float *d_o, int fused, int reps, int bn = 0, int mt = 0)
{
    cudaStream_t sm = f->c->stream;
    cudaEvent_t a, b;
    CU(cudaEventCreate(&a));
    CU(cudaEventCreate(&b));
    CK(bk_g_attn_core(f, S, d_o, fused, bn, mt)); /* warm-up */
    std::vector<float> t;
    for (int i = 0; i < reps; i++) {
        CU(cudaEventRecord(a, sm));
        CK(bk_g_attn_core(f, S, d_o, fused, bn, mt));
        CU(cudaEventRecord(b, sm));
        CU(cudaEventSynchronize(b));
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CU(cudaEventDestroy(a));
    CU(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

} // namespace

int cmd_attn(int argc, char **argv)
{
    int64_t S = 2, T = 2048, nh = 32, nkv = 8;
    int reps = 10, variants = 0;
    std::vector<int64_t> hds = {128, 64};
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
        else if (a == "--variants")
            variants = 1;
        else {
            fprintf(stderr, "bk-cuda-dev attn: unknown or incomplete option %s\n", a.c_str());
            return 1;
        }
    }
    if (S < 1 || T < 1 || nh < 1 || nkv < 1 || nh % nkv || reps < 1 || hds.empty() ||
        amps.empty()) {
        fprintf(stderr, "bk-cuda-dev attn: bad sizes\n");
        return 1;
    }
    bk_backend *be = NULL;
    CK(bk_backend_create(BK_BACKEND_CUDA, &be));
    bk_backend_set_gemm_math(be, BK_GEMM_BF16);
    int bad = 0, bad_var = 0;
    printf("attention core, %lld x %lld tokens, %lld query / %lld kv heads, BF16 mode; "
           "errors against double (max abs | max rel | max per-row rel), median of %d\n",
           (long long)S, (long long)T, (long long)nh, (long long)nkv, reps);
    for (int64_t hd : hds) {
        bk_model_config c;
        memset(&c, 0, sizeof c);
        c.arch = BK_ARCH_LLAMA;
        strcpy(c.model_type, "llama");
        c.n_layers = 1;
        c.hidden = 64;
        c.intermediate = 64;
        c.n_heads = nh;
        c.n_kv_heads = nkv;
        c.head_dim = hd;
        c.vocab = 17;
        c.max_positions = T;
        c.rms_eps = 1e-5;
        c.rope_theta = 500000.0;
        c.rope_type = BK_ROPE_DEFAULT;
        strcpy(c.hidden_act, "silu");
        c.bos_token_id = c.eos_token_id = -1;
        bk_gfwd *f = NULL;
        CK(bk_gfwd_create(be, &c, S, T, &f));
        if (!bk_gfwd_attn_fused(f)) {
            printf("hd %lld: the fused kernel does not support this head_dim: skipped\n",
                   (long long)hd);
            bad++;
            bk_gfwd_free(f);
            continue;
        }
        /* the unfused path's F32 inputs (allocated on first use in fused mode) */
        CK(bk_g_attn_unfused_alloc(f));
        const int64_t N = S * T, qd = nh * hd, kd = nkv * hd, rep = nh / nkv;
        float *d_old = NULL, *d_new = NULL;
        double *d_ref = NULL;
        CK(bk_gpu_alloc(f, (void **)&d_old, (size_t)(N * qd) * 4, "unfused output"));
        CK(bk_gpu_alloc(f, (void **)&d_new, (size_t)(N * qd) * 4, "fused output"));
        CK(bk_gpu_alloc(f, (void **)&d_ref, (size_t)(N * qd) * 8, "reference output"));
        std::vector<float> h_old((size_t)(N * qd)), h_new((size_t)(N * qd));
        std::vector<double> h_ref((size_t)(N * qd));
        for (double amp : amps) {
            cudaStream_t sm = f->c->stream;
            k_gen<<<bk_grid(N * qd), 256, 0, sm>>>(f->qh, f->qb, N * qd, amp, 11 + (uint64_t)hd);
            k_gen<<<bk_grid(N * kd), 256, 0, sm>>>(f->kh, f->kb, N * kd, 1.0, 12 + (uint64_t)hd);
            k_gen<<<bk_grid(N * kd), 256, 0, sm>>>(f->vh, f->vb, N * kd, 1.0, 13 + (uint64_t)hd);
            CK(BK_LAUNCHED("k_gen"));
            const size_t rsh = (size_t)(hd + T + 128) * sizeof(double);
            CU(cudaFuncSetAttribute(k_ref, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)rsh));
            k_ref<<<(unsigned)(S * nkv * T * rep), 128, rsh, sm>>>(
                f->qh, f->kh, f->vh, d_ref, T, nkv, rep, hd, 1.0 / sqrt((double)hd));
            CK(BK_LAUNCHED("k_ref"));
            CK(bk_gfwd_nf_clear(f));
            CK(bk_g_attn_core(f, S, d_old, 0));
            CK(bk_g_attn_core(f, S, d_new, 1));
            CK(bk_gpu_download(f, h_old.data(), d_old, h_old.size() * 4));
            CK(bk_gpu_download(f, h_new.data(), d_new, h_new.size() * 4));
            CK(bk_gpu_download(f, h_ref.data(), d_ref, h_ref.size() * 8));
            const double t_old = median_ms(f, S, d_old, 0, reps);
            const double t_new = median_ms(f, S, d_new, 1, reps);
            const errs eo = compare(h_old.data(), h_ref.data(), N * nh, hd);
            const errs en = compare(h_new.data(), h_ref.data(), N * nh, hd);
            const errs enu = compare(h_new.data(), h_old.data(), N * nh, hd);
            const double flop = 4.0 * (double)(S * nh * hd) * (double)T * (double)(T + 1) / 2;
            const int fail = en.nonfinite || !(en.rel <= ATTN_TOL) || !(en.row_rel <= ATTN_ROW_TOL);
            bad += fail;
            printf("hd %3lld amp %.1f  unfused: %.3e | %.3e | %.3e  %8.3f ms\n", (long long)hd, amp,
                   eo.max_abs, eo.rel, eo.row_rel, t_old);
            printf(
                "hd %3lld amp %.1f  fused  : %.3e | %.3e | %.3e  %8.3f ms  (%.1f TFLOP/s causal, "
                "%.2fx)%s\n",
                (long long)hd, amp, en.max_abs, en.rel, en.row_rel, t_new, flop / t_new * 1e-9,
                t_old / t_new, fail ? "  <-- FAIL" : "");
            printf("hd %3lld amp %.1f  fused vs unfused: %.3e | %.3e | %.3e; non-finite: fused "
                   "%lld, unfused %lld\n",
                   (long long)hd, amp, enu.max_abs, enu.rel, enu.row_rel, (long long)en.nonfinite,
                   (long long)eo.nonfinite);
            if (variants) {
                /* kernels the product does not use: the other key-block size,
                 * two m-tiles per warp (4 warps of 32 rows, up to 255 registers) */
                const int vb[3][2] = {{hd == 128 ? 64 : 32, 1}, {hd == 128 ? 32 : 64, 2}, {64, 2}};
                for (int vi = 0; vi < (hd == 128 ? 3 : 2); vi++) {
                    const int bn = vb[vi][0], mt = vb[vi][1];
                    CK(bk_g_attn_core(f, S, d_new, 1, bn, mt));
                    CK(bk_gpu_download(f, h_new.data(), d_new, h_new.size() * 4));
                    const errs ev = compare(h_new.data(), h_ref.data(), N * nh, hd);
                    const double t_v = median_ms(f, S, d_new, 1, reps, bn, mt);
                    const int vf =
                        ev.nonfinite || !(ev.rel <= ATTN_TOL) || !(ev.row_rel <= ATTN_ROW_TOL);
                    bad_var += vf;
                    printf("hd %3lld amp %.1f  variant bn %2d mt %d: %.3e | %.3e | %.3e  %8.3f ms "
                           "(%.2fx)%s\n",
                           (long long)hd, amp, bn, mt, ev.max_abs, ev.rel, ev.row_rel, t_v,
                           t_old / t_v, vf ? "  <-- FAIL" : "");
                }
            }
            fprintf(stderr,
                    "JSON {\"bench\":\"attn\",\"S\":%lld,\"T\":%lld,\"heads\":%lld,\"kv\":%lld,"
                    "\"hd\":%lld,\"amp\":%g,\"ms_unfused\":%.4f,\"ms_fused\":%.4f,"
                    "\"rel_unfused\":%.4e,\"rel_fused\":%.4e,\"row_rel_unfused\":%.4e,"
                    "\"row_rel_fused\":%.4e,\"row_rel_fused_vs_unfused\":%.4e,\"ok\":%s}\n",
                    (long long)S, (long long)T, (long long)nh, (long long)nkv, (long long)hd, amp,
                    t_old, t_new, eo.rel, en.rel, eo.row_rel, en.row_rel, enu.row_rel,
                    fail ? "false" : "true");
        }
        bk_gpu_free(f, d_old);
        bk_gpu_free(f, d_new);
        bk_gpu_free(f, d_ref);
        bk_gfwd_free(f);
    }
    bk_backend_destroy(be);
    if (variants)
        printf("attn variants (not used by the product): %s (%d failures)\n",
               bad_var ? "FAILED" : "ok", bad_var);
    printf("attn: %s (%d failures)\n", bad ? "FAILED" : "ok", bad);
    return bad ? 1 : 0;
}
