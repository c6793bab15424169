/* The fused attention kernel (cuda/attn_flash_kernel.cuh) run on the host:
 * its source compiled as host code with FA_EMU, one CTA at a time, its 256 (128)
 * threads as coroutines (ucontext) switched at every warp operation and
 * barrier. The warp operations are emulated from the PTX ISA's definitions,
 * written here independently of the kernel:
 *   - ldmatrix .m8n8.x4 (.trans): matrix m's row i at the address of lane
 *     8 m + i; lane l receives row l/4, elements 2 (l%4), +1 (transposed:
 *     rows 2 (l%4), +1 of column l/4), the lower index in the low half;
 *   - mma.m16n8k16.row.col BF16 -> F32: lane l (g = l/4, t = l%4) holds A
 *     [g][2t..], [g+8][2t..], [g][2t+8..], [g+8][2t+8..] in a0..a3, B
 *     [2t..][g], [2t+8..][g] in b0, b1, C/D [g][2t..], [g+8][2t..];
 *   - cp.async 16 bytes (zero-fill with src-size 0), its groups completed
 *     at cp.async.wait_group — either as late as allowed or at once (both
 *     orders must give the same result);
 *   - shfl.xor, bar.sync (all threads of the CTA; a barrier or warp operation
 *     reached by only some of the threads is reported as a failure).
 * Checked: 16-byte alignment and bounds of every cp.async and ldmatrix
 * address, global reads inside the inputs, shared memory filled with NaN
 * before each CTA (a read of an unloaded element shows), every output
 * written once (NaN sentinels) and nothing around it; the outputs against a
 * double reference on the same BF16 operands: only the BF16 rounding of the
 * probabilities and F32 sums differ, per (token, head) row
 * max |x - ref| / max |ref| <= EMU_ROW_TOL. Shapes: head_dim 64 and 128,
 * 1, 2, 3, 4 and 8 query heads per kv group, T not a multiple of the key block
 * or of 128 rows, T below a block, more pairs than a scheduling group, a
 * peaked softmax (query amplitude 4). Suite cpu (no GPU needed). */
#include "attn_emu.h"

#include "../cuda/attn_flash_kernel.cuh"

/* ------------------------------------------------------------- the cases */

struct kargs {
    const __nv_bfloat16 *q, *k, *v;
    float *out;
    int64_t npairs;
    int T, nkv, rep, nblk;
    float scale_log2;
};
static kargs emu_args;
template <int HD, int BN, int MT> static void body()
{
    const kargs &a = emu_args;
    k_attn_flash<HD, BN, MT>(a.q, a.k, a.v, a.out, a.npairs, a.T, a.nkv, a.rep, a.nblk,
                             a.scale_log2, NULL, NULL);
}

#define EMU_ROW_TOL 1e-2
#define EMU_GUARD 64

template <int HD, int BN = fa_default_bn<HD>::value, int MT = 1>
static std::vector<float> run_case(int64_t S, int64_t nkv, int64_t rep, int64_t T, double amp)
{
    emu_rng = 88172645463325252ull + (uint64_t)(T * 131 + rep * 7 + nkv);
    const int64_t pairs = S * nkv, RP = T * rep, nq = pairs * RP * HD, nk = pairs * T * HD;
    const int64_t qd = nkv * rep * HD, nout = S * T * qd;
    std::vector<__nv_bfloat16> q(nq), k(nk), v(nk);
    std::vector<double> qf(nq), kf(nk), vf(nk);
    for (int64_t i = 0; i < nq; i++) {
        q[i] = __float2bfloat16_rn((float)(amp * emu_gauss()));
        qf[i] = __bfloat162float(q[i]);
    }
    for (int64_t i = 0; i < nk; i++) {
        k[i] = __float2bfloat16_rn((float)emu_gauss());
        kf[i] = __bfloat162float(k[i]);
        v[i] = __float2bfloat16_rn((float)emu_gauss());
        vf[i] = __bfloat162float(v[i]);
    }
    std::vector<float> outbuf(nout + 2 * EMU_GUARD, NAN);
    float *out = outbuf.data() + EMU_GUARD;
    emu_inputs = {
        {q.data(), (size_t)nq * 2}, {k.data(), (size_t)nk * 2}, {v.data(), (size_t)nk * 2}};
    const int64_t nblk = (RP + FA_BM - 1) / FA_BM;
    const double scale = 1.0 / sqrt((double)HD);
    emu_args = {q.data(), k.data(), v.data(), out,       pairs,
                (int)T,   (int)nkv, (int)rep, (int)nblk, (float)(scale * 1.4426950408889634)};
    emu_nonfinite = 0;
    emu_run_grid(body<HD, BN, MT>, pairs * nblk, fa_shape<HD, BN, MT>::THREADS,
                 fa_shape<HD, BN, MT>::SMEM);
    int64_t unwritten = 0, guard = 0;
    for (int64_t i = 0; i < EMU_GUARD; i++)
        guard += !std::isnan(outbuf[i]) + !std::isnan(outbuf[EMU_GUARD + nout + i]);
    for (int64_t i = 0; i < nout; i++)
        unwritten += std::isnan(out[i]);
    /* reference in double */
    double worst = 0;
    std::vector<double> sc(T);
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t r = 0; r < RP; r++) {
            const int64_t pos = r / rep, s = p / nkv, gk = p % nkv;
            double mx = -INFINITY;
            for (int64_t j = 0; j <= pos; j++) {
                double d = 0;
                for (int c = 0; c < HD; c++)
                    d += qf[(p * RP + r) * HD + c] * kf[(p * T + j) * HD + c];
                sc[j] = d * scale;
                mx = std::fmax(mx, sc[j]);
            }
            double sum = 0;
            for (int64_t j = 0; j <= pos; j++) {
                sc[j] = exp(sc[j] - mx);
                sum += sc[j];
            }
            const float *o = out + (s * T + pos) * qd + (gk * rep + r % rep) * HD;
            double e = 0, m = 0;
            for (int c = 0; c < HD; c++) {
                double acc = 0;
                for (int64_t j = 0; j <= pos; j++)
                    acc += sc[j] * vf[(p * T + j) * HD + c];
                acc /= sum;
                const double d = fabs((double)o[c] - acc);
                e = d > e || std::isnan(d) ? d : e;
                m = std::fmax(m, fabs(acc));
            }
            const double rel = m > 0 ? e / m : e;
            worst = rel > worst || std::isnan(rel) ? rel : worst;
        }
    const int fail = unwritten || guard || emu_nonfinite || !(worst <= EMU_ROW_TOL);
    printf("  hd %3d bn %2d mt %d, %lld x %lld kv heads, rep %lld, T %4lld, amp %.0f, cp.async %s: "
           "%lld "
           "CTAs, "
           "row rel err %.3e, unwritten %lld, guard %lld, non-finite %lld%s\n",
           HD, BN, MT, (long long)S, (long long)nkv, (long long)rep, (long long)T, amp,
           emu_immediate ? "at once" : "late   ", (long long)(pairs * nblk), worst,
           (long long)unwritten, (long long)guard, (long long)emu_nonfinite,
           fail ? "  <-- FAIL" : "");
    emu_failures += fail;
    return std::vector<float>(out, out + nout);
}

int main(void)
{
    printf("fused attention kernel, host emulation (tolerance %.0e per row)\n", EMU_ROW_TOL);
    std::vector<float> r[2][12];
    for (emu_immediate = 0; emu_immediate < 2; emu_immediate++) {
        std::vector<float> *o = r[emu_immediate];
        o[0] = run_case<128>(1, 2, 4, 72, 4.0);  /* 288 rows: 3 row blocks; keys 2 x 32 + 8 */
        o[1] = run_case<128>(1, 1, 1, 150, 1.0); /* 2nd row block of 22 rows: 6 warps idle */
        o[2] = run_case<64>(2, 1, 3, 100, 4.0);  /* rep 3; keys 64 + 36 */
        o[3] = run_case<64>(1, 1, 1, 5, 1.0);    /* T = 5 */
        o[4] = run_case<64>(1, 18, 1, 8, 1.0);   /* 18 pairs: two scheduling groups (16 + 2) */
        /* the dev harness's variants (key blocks of 64 at hd 128, 32 at hd 64) */
        o[5] = run_case<128, 64>(1, 2, 4, 72, 4.0);
        o[6] = run_case<64, 32>(2, 1, 3, 100, 4.0);
        o[7] = run_case<128>(2, 1, 8, 33, 4.0); /* rep 8: 264 rows, a warp = 2 positions */
        o[8] = run_case<64>(1, 2, 2, 129, 1.0); /* rep 2, T = 2 key blocks + 1 */
        /* two m-tiles per warp (4 warps of 32 rows) */
        o[9] = run_case<128, 32, 2>(1, 2, 4, 72, 4.0);
        o[10] = run_case<128, 64, 2>(1, 1, 1, 150, 1.0);
        o[11] = run_case<64, 64, 2>(2, 1, 3, 100, 4.0);
    }
    /* the order in which the copies land must not matter */
    for (int i = 0; i < 12; i++)
        if (r[0][i].size() != r[1][i].size() ||
            memcmp(r[0][i].data(), r[1][i].data(), r[0][i].size() * sizeof(float))) {
            printf("  case %d: late and immediate cp.async give different outputs  <-- FAIL\n", i);
            emu_failures++;
        }
    printf("attn_flash_emu: %s (%d failures)\n", emu_failures ? "FAILED" : "ok", emu_failures);
    return emu_failures ? 1 : 0;
}
