/* The fused attention backward (cuda/attn_flash_bwd_kernel.cuh) run on the
 * host with the warp operations emulated (tests/attn_emu.h: ldmatrix,
 * mma.m16n8k16 BF16, cp.async with late or immediate completion, shfl.xor,
 * bar.sync, from the PTX fragment definitions; see test_attn_flash_emu.cu).
 * Per case: the forward kernel (emulated) with its log-sum-exp output, then
 * the backward's three kernels (prep: D and dO in BF16; dK/dV; dQ), each CTA
 * with shared memory filled with NaN first; outputs pre-filled with NaN
 * between guard regions (every entry written, nothing around).
 * Checked against a double reference on the same BF16 operands (q, k, v and
 * dO BF16-exact): the forward's L (log2 units, |L - ref| <= EMU_L_TOL), and
 * dQ, dK, dV per (token, head) row: max |x - ref| / max |ref| <= EMU_ROW_TOL,
 * and over each whole array <= EMU_TOL (what remains: the BF16 rounding of P
 * and dS, F32 sums). Both cp.async completion orders must give the same
 * bytes. Shapes: head_dim 64 and 128, 1, 2, 3, 4, 8 query heads per kv group,
 * T below a key block, T not a multiple of the 128-key CTA or of the 32-row
 * query blocks, several key CTAs per pair, more pairs than a scheduling
 * group, a peaked softmax (query amplitude 4). Suite cpu (no GPU needed).
 * EMU_BUG (compile-time, tests/attn_bwd_mutants.sh) names a deliberate bug
 * applied to a copy of the kernel source; the test must then fail. */
#include "attn_emu.h"

#include "../cuda/attn_flash_bwd_kernel.cuh"

/* ------------------------------------------------------------- the cases */

struct bargs {
    const __nv_bfloat16 *q, *k, *v;
    __nv_bfloat16 *dob;
    const float *o, *dout;
    float *lse, *dsum, *dq, *dk, *dv, *out;
    int64_t npairs, nrows;
    int T, nkv, rep, nblk, nkb;
    float scale_log2, scale;
};
static bargs emu_b;

template <int HD> static void body_fwd()
{
    const bargs &a = emu_b;
    k_attn_flash<HD, fa_default_bn<HD>::value, 1>(a.q, a.k, a.v, a.out, a.npairs, a.T, a.nkv,
                                                  a.rep, a.nblk, a.scale_log2, NULL, a.lse);
}
template <int HD> static void body_prep()
{
    const bargs &a = emu_b;
    k_attn_bwd_prep<HD>(a.o, a.dout, a.dob, a.dsum, a.nrows, a.T, a.nkv, a.rep);
}
template <int HD> static void body_dkdv()
{
    const bargs &a = emu_b;
    using kv = fb_kv_default<HD>;
    k_attn_bwd_dkdv<HD, kv::NW, kv::BMQ, kv::MINB>(a.q, a.k, a.v, a.dob, a.lse, a.dsum, a.dk,
                                                     a.dv, a.npairs, a.T, a.nkv, a.rep, a.nkb,
                                                     a.scale_log2, a.scale);
}
template <int HD> static void body_dq()
{
    const bargs &a = emu_b;
    k_attn_bwd_dq<HD, fb_q_default<HD>::BN>(a.q, a.k, a.v, a.dob, a.lse, a.dsum, a.dq, a.npairs,
                                            a.T, a.nkv, a.rep, a.nblk, a.scale_log2, a.scale);
}

#define EMU_L_TOL 5e-3
#define EMU_TOL 1e-2
#define EMU_ROW_TOL 5e-2
#define EMU_GUARD 64

/* a buffer of n floats between NaN guards, pre-filled with NaN */
struct guarded {
    std::vector<float> buf;
    int64_t n;
    explicit guarded(int64_t n_) : buf((size_t)(n_ + 2 * EMU_GUARD), NAN), n(n_) {}
    float *p() { return buf.data() + EMU_GUARD; }
    int64_t unwritten()
    {
        int64_t u = 0;
        for (int64_t i = 0; i < n; i++)
            u += std::isnan(p()[i]);
        return u;
    }
    int64_t guard()
    {
        int64_t g = 0;
        for (int64_t i = 0; i < EMU_GUARD; i++)
            g += !std::isnan(buf[i]) + !std::isnan(buf[EMU_GUARD + n + i]);
        return g;
    }
};

/* max |x - ref| / max |ref| per row of w, and over everything */
static void rel_err(const float *x, const double *ref, int64_t rows, int64_t w, double *row_rel,
                    double *all_rel)
{
    double worst = 0, ea = 0, ma = 0;
    for (int64_t r = 0; r < rows; r++) {
        double e = 0, m = 0;
        for (int64_t c = 0; c < w; c++) {
            const double d = fabs((double)x[r * w + c] - ref[r * w + c]);
            e = d > e || std::isnan(d) ? d : e;
            m = std::fmax(m, fabs(ref[r * w + c]));
        }
        const double rel = m > 0 ? e / m : e;
        worst = rel > worst || std::isnan(rel) ? rel : worst;
        ea = e > ea || std::isnan(e) ? e : ea;
        ma = std::fmax(ma, m);
    }
    *row_rel = worst;
    *all_rel = ma > 0 ? ea / ma : ea;
}

template <int HD>
static std::vector<float> run_case(int64_t S, int64_t nkv, int64_t rep, int64_t T, double amp)
{
    emu_rng = 0x9e3779b97f4a7c15ull + (uint64_t)(T * 131 + rep * 7 + nkv * 3 + HD);
    const int64_t pairs = S * nkv, RP = T * rep, nq = pairs * RP * HD, nk = pairs * T * HD;
    const int64_t qd = nkv * rep * HD, kd = nkv * HD, N = S * T;
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
    /* dO token-major F32, BF16-exact */
    std::vector<float> dout((size_t)(N * qd));
    for (float &x : dout)
        x = __bfloat162float(__float2bfloat16_rn((float)emu_gauss()));
    std::vector<__nv_bfloat16> dob((size_t)nq);
    const double scale = 1.0 / sqrt((double)HD);
    const int64_t nblk = (RP + FA_BM - 1) / FA_BM;
    using kv = fb_kv_default<HD>;
    using shk = fb_kv_shape<HD, kv::NW, kv::BMQ>;
    const int64_t nkb = (T + shk::KEYS - 1) / shk::KEYS;
    guarded out(N * qd), lse(pairs * RP), dsum(pairs * RP), dq(N * qd), dk(N * kd), dv(N * kd);
    emu_b = {q.data(),  k.data(),  v.data(),  dob.data(), out.p(),  dout.data(),
             lse.p(),   dsum.p(),  dq.p(),    dk.p(),     dv.p(),   out.p(),
             pairs,     pairs * RP, (int)T,   (int)nkv,   (int)rep, (int)nblk,
             (int)nkb,  (float)(scale * 1.4426950408889634), (float)scale};
    emu_nonfinite = 0;
    /* the forward (its own checks in test_attn_flash_emu), with L */
    emu_inputs = {
        {q.data(), (size_t)nq * 2}, {k.data(), (size_t)nk * 2}, {v.data(), (size_t)nk * 2}};
    emu_run_grid(body_fwd<HD>, pairs * nblk, fa_shape<HD, fa_default_bn<HD>::value, 1>::THREADS,
             fa_shape<HD, fa_default_bn<HD>::value, 1>::SMEM);
    /* prep: no shared memory, no cp.async */
    emu_run_grid(body_prep<HD>, (pairs * RP + 7) / 8, 256, 0);
    emu_inputs.push_back({dob.data(), (size_t)nq * 2});
    emu_run_grid(body_dkdv<HD>, pairs * nkb, shk::THREADS, shk::SMEM);
    emu_run_grid(body_dq<HD>, pairs * nblk, fb_q_shape<HD, fb_q_default<HD>::BN>::THREADS,
             fb_q_shape<HD, fb_q_default<HD>::BN>::SMEM);

    int64_t unwritten = 0, guard = 0;
    guarded *outs[6] = {&out, &lse, &dsum, &dq, &dk, &dv};
    for (guarded *g : outs) {
        unwritten += g->unwritten();
        guard += g->guard();
    }
    /* reference in double: token-major dq [N, qd], dk, dv [N, kd] */
    std::vector<double> rq((size_t)(N * qd), 0.0), rk((size_t)(N * kd), 0.0),
        rv((size_t)(N * kd), 0.0), P(T), dP(T);
    double lerr = 0;
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t r = 0; r < RP; r++) {
            const int64_t pos = r / rep, s = p / nkv, gk = p % nkv;
            const double *qr = &qf[(p * RP + r) * HD];
            const int64_t to = (s * T + pos) * qd + (gk * rep + r % rep) * HD;
            const float *dor = &dout[to];
            double mx = -INFINITY;
            for (int64_t j = 0; j <= pos; j++) {
                double d = 0;
                for (int c = 0; c < HD; c++)
                    d += qr[c] * kf[(p * T + j) * HD + c];
                P[j] = d * scale;
                mx = std::fmax(mx, P[j]);
            }
            double sum = 0;
            for (int64_t j = 0; j <= pos; j++) {
                P[j] = exp(P[j] - mx);
                sum += P[j];
            }
            const double Lref = (mx + log(sum)) * 1.4426950408889634;
            const double le = fabs((double)lse.p()[p * RP + r] - Lref);
            lerr = le > lerr || std::isnan(le) ? le : lerr;
            double D = 0;
            for (int64_t j = 0; j <= pos; j++) {
                P[j] /= sum;
                double d = 0;
                for (int c = 0; c < HD; c++)
                    d += (double)dor[c] * vf[(p * T + j) * HD + c];
                dP[j] = d;
                D += P[j] * d;
            }
            for (int64_t j = 0; j <= pos; j++) {
                const double ds = P[j] * (dP[j] - D);
                const int64_t kr = (s * T + j) * kd + gk * HD;
                for (int c = 0; c < HD; c++) {
                    rq[to + c] += scale * ds * kf[(p * T + j) * HD + c];
                    rk[kr + c] += scale * ds * qr[c];
                    rv[kr + c] += P[j] * (double)dor[c];
                }
            }
        }
    double eq, ek, ev, aq, ak, av;
    rel_err(dq.p(), rq.data(), N * nkv * rep, HD, &eq, &aq);
    rel_err(dk.p(), rk.data(), N * nkv, HD, &ek, &ak);
    rel_err(dv.p(), rv.data(), N * nkv, HD, &ev, &av);
    const double row = std::fmax(eq, std::fmax(ek, ev)), all = std::fmax(aq, std::fmax(ak, av));
    const int fail = unwritten || guard || emu_nonfinite || !(lerr <= EMU_L_TOL) ||
                     !(row <= EMU_ROW_TOL) || !(all <= EMU_TOL);
    printf("  hd %3d, %lld x %lld kv heads, rep %lld, T %4lld, amp %.0f, cp.async %s: L %.1e, "
           "row rel dq %.2e dk %.2e dv %.2e, all %.2e %.2e %.2e, unwritten %lld, guard %lld, "
           "non-finite %lld%s\n",
           HD, (long long)S, (long long)nkv, (long long)rep, (long long)T, amp,
           emu_immediate ? "at once" : "late   ", lerr, eq, ek, ev, aq, ak, av,
           (long long)unwritten, (long long)guard, (long long)emu_nonfinite,
           fail ? "  <-- FAIL" : "");
    emu_failures += fail;
    std::vector<float> res;
    for (guarded *g : outs)
        res.insert(res.end(), g->p(), g->p() + g->n);
    return res;
}

int main(void)
{
    printf("fused attention backward, host emulation (tolerances: L %.0e, rows %.0e, arrays "
           "%.0e)\n",
           EMU_L_TOL, EMU_ROW_TOL, EMU_TOL);
    const int NC = 10;
    std::vector<float> r[2][NC];
    for (emu_immediate = 0; emu_immediate < 2; emu_immediate++) {
        std::vector<float> *o = r[emu_immediate];
        o[0] = run_case<64>(1, 1, 1, 100, 1.0);  /* one key CTA (100 of 128 keys), 4 query blocks */
        o[1] = run_case<64>(2, 1, 3, 50, 4.0);   /* rep 3: 150 rows, uneven blocks; peaked */
        o[2] = run_case<128>(1, 2, 4, 40, 4.0);  /* rep 4: 160 rows, 2 row blocks of dQ */
        o[3] = run_case<128>(1, 1, 1, 150, 1.0); /* two key CTAs (128 + 22), dQ keys 32 x 4 + 22 */
        o[4] = run_case<64>(1, 1, 2, 260, 1.0);  /* three key CTAs; 520 rows */
        o[5] = run_case<64>(1, 1, 1, 5, 1.0);    /* T = 5 */
        o[6] = run_case<64>(1, 18, 1, 8, 1.0);   /* 18 pairs: two scheduling groups */
        o[7] = run_case<128>(1, 1, 2, 33, 1.0);  /* rep 2, hd 128, a query block across */
        o[8] = run_case<128>(1, 1, 8, 37, 4.0);  /* rep 8 (70B's groups): 4 positions a block */
        o[9] = run_case<64>(2, 2, 4, 140, 1.0);  /* 4 pairs, rep 4, two key CTAs of 128 + 12 */
    }
    for (int i = 0; i < NC; i++)
        if (r[0][i].size() != r[1][i].size() ||
            memcmp(r[0][i].data(), r[1][i].data(), r[0][i].size() * sizeof(float))) {
            printf("  case %d: late and immediate cp.async give different outputs  <-- FAIL\n", i);
            emu_failures++;
        }
    printf("attn_bwd_emu: %s (%d failures)\n", emu_failures ? "FAILED" : "ok", emu_failures);
    return emu_failures ? 1 : 0;
}
