/* The fully-local attention items of the GPU Hessians (cuda/hess_attn.cuh)
 * run on the HOST, against the CPU accumulator (src/hessian.c): the index
 * arithmetic, the quad RoPE sandwich, prefix/suffix order, GQA grouping,
 * the q_norm/k_norm rounds and the Shampoo traces, without a GPU (suite
 * cpu; built in CUDA builds only). The blocks are finished here the way
 * docs/hessians.md defines the factors (block diagonal, 1/P), independently
 * of cuda/hessian.cu's host code.
 */
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../cuda/hess_attn.cuh"

extern "C" {
#include "bakron/hessian.h"
#include "rope.h"
#include "util.h"
}

namespace {

int failures = 0;

double rel(const std::vector<double> &a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = std::fabs(a[i] - (double)b[i]);
        if (!(d <= md))
            md = std::isnan(d) ? INFINITY : d;
        mb = std::fmax(mb, std::fabs((double)b[i]));
    }
    return mb > 0 ? md / mb : md;
}

void check(const char *what, double e, double tol)
{
    const bool ok = e <= tol;
    printf("  %-52s rel err %.3e %s\n", what, e, ok ? "ok" : "FAIL");
    if (!ok)
        failures++;
}

std::vector<float> randn(bk_rng *r, size_t n, double scale, double offset = 0.0)
{
    std::vector<float> v(n);
    for (auto &x : v)
        x = (float)(offset + scale * bk_rng_normal(r));
    return v;
}

/* The staged form (k_attn_quads_staged's quad_stage / quad_round, its
 * threads run one after the other: stage, then every quad) gives the
 * per-item results bitwise: with the launch's round size and 3 staging
 * threads (fewer than a row's entries), and with rounds of 2 positions (a
 * remainder round when T is odd) and 37 threads (more than a row). */
void staged_same(const quad_args &a, const std::vector<double> &want, const char *what)
{
    const int64_t h2 = a.h / 2, nq = h2 * h2;
    const int64_t sizes[2] = {quad_round_positions(a), 2};
    for (int k = 0; k < 2; k++) {
        const int tc = (int)sizes[k];
        std::vector<double> sh((size_t)quad_round_doubles(a, tc), NAN);
        std::vector<double> got((size_t)(a.S * a.nb * a.h * a.h), NAN);
        std::vector<double> c((size_t)(nq * 4)), acc((size_t)(nq * 4));
        quad_args b = a;
        b.part = got.data();
        for (int64_t s = 0; s < a.S; s++)
            for (int64_t blk = 0; blk < a.nb; blk++) {
                std::fill(c.begin(), c.end(), 0.0);
                std::fill(acc.begin(), acc.end(), 0.0);
                for (int64_t c0 = 0; c0 < a.T; c0 += tc) {
                    const int n = a.T - c0 < tc ? (int)(a.T - c0) : tc;
                    const int nth = k == 0 ? 3 : 37;
                    for (int tid = 0; tid < nth; tid++)
                        quad_stage(b, tc, s, blk, c0, n, tid, nth, sh.data());
                    for (int64_t quad = 0; quad < nq; quad++)
                        quad_round(b, tc, sh.data(), n, quad / h2, quad % h2, &c[quad * 4],
                                   &acc[quad * 4]);
                }
                for (int64_t quad = 0; quad < nq; quad++)
                    quad_store(b, s, blk, quad / h2, quad % h2, &acc[quad * 4]);
            }
        const size_t n = (size_t)(a.S * a.nb * a.h * a.h);
        const bool ok = tc >= 1 && memcmp(got.data(), want.data(), n * sizeof(double)) == 0;
        printf("  staged %s, rounds of %d positions, %d threads: %s\n", what, tc,
               k == 0 ? 3 : 37, ok ? "bitwise equal ok" : "FAIL");
        if (!ok)
            failures++;
    }
}

/* The q/k-norm rounds (qn_gramrot_item, qn_*_round_item: several positions
 * a launch) give the one-position-at-a-time results bitwise (the partial
 * blocks and the Shampoo traces): rounds of 3 positions (a remainder round
 * at T = 4) and of T. */
void qn_rounds_same(const qn_args &a0, int backward, const std::vector<double> &want_acc,
                    const std::vector<double> &want_tr, const char *what)
{
    const int64_t hh = a0.h * a0.h, sizes[2] = {3, a0.T};
    for (int k = 0; k < 2; k++) {
        const int64_t nr = sizes[k];
        std::vector<double> C((size_t)(a0.S * a0.nb * hh), 0.0),
            M((size_t)(nr * a0.S * a0.nb * hh), NAN), v((size_t)(nr * a0.S * a0.nn * a0.h), NAN),
            sc((size_t)(nr * a0.S * a0.nn * 4), NAN), acc(want_acc.size(), 0.0),
            tr(want_tr.size(), NAN);
        qn_args a = a0;
        a.C = C.data();
        a.M = M.data();
        a.v = v.data();
        a.sc = sc.data();
        a.acc = acc.data();
        a.tr = a0.tr ? tr.data() : NULL;
        for (int64_t c0 = 0; c0 < a.T; c0 += nr) {
            const int64_t n = a.T - c0 < nr ? a.T - c0 : nr;
            for (int64_t i = 0; i < a.S * a.nb * hh / 4; i++)
                qn_gramrot_item(a, backward, c0, n, i);
            for (int64_t i = 0; i < n * a.S * a.nn * a.h; i++)
                qn_v_round_item(a, backward, c0, i);
            for (int64_t i = 0; i < n * a.S * a.nn; i++)
                qn_scalars_round_item(a, backward, c0, i);
            for (int64_t i = 0; i < a.S * a.nn * hh; i++)
                qn_acc_round_item(a, backward, c0, n, i);
        }
        const size_t na = (size_t)(a.S * a.nn * hh), nt = (size_t)(a.S * a.nn * a.T);
        const bool ok = memcmp(acc.data(), want_acc.data(), na * sizeof(double)) == 0 &&
                        (!a0.tr || memcmp(tr.data(), want_tr.data(), nt * sizeof(double)) == 0);
        printf("  q/k-norm %s%s, rounds of %lld positions: %s\n", a0.tr ? "shampoo " : "", what,
               (long long)nr, ok ? "bitwise equal ok" : "FAIL");
        if (!ok)
            failures++;
    }
}

void run_case(bool qknorm, bool shampoo, int64_t H, int64_t G, int64_t h, int64_t T, int64_t S)
{
    bk_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = qknorm ? BK_ARCH_QWEN3 : BK_ARCH_LLAMA;
    c.n_layers = 1;
    c.hidden = 6;
    c.intermediate = 5;
    c.n_heads = H;
    c.n_kv_heads = G;
    c.head_dim = h;
    c.vocab = 7;
    c.max_positions = T;
    c.rms_eps = 1e-6;
    c.rope_theta = 100.0;
    c.rope_type = BK_ROPE_DEFAULT;
    c.rope_factor = 1.0;
    c.qk_norm = qknorm;
    strcpy(c.hidden_act, "silu");
    const int64_t d = c.hidden, qd = H * h, kd = G * h, N = S * T, r = H / G, hh = h * h;
    bk_rng rng;
    bk_rng_seed(&rng, 11 + (uint64_t)qknorm * 2 + (uint64_t)shampoo);
    std::vector<float> x = randn(&rng, (size_t)(N * d), 1.0), qr = randn(&rng, (size_t)(N * qd), 1.0),
                       kr = randn(&rng, (size_t)(N * kd), 1.0);
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    std::vector<std::vector<float>> w(BK_MOD_COUNT);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        int64_t o, in;
        bk_module_shape(&c, (bk_module)m, &o, &in);
        w[m] = randn(&rng, (size_t)(o * in), 0.5);
        lw.w[m] = w[m].data();
    }
    std::vector<float> qn = randn(&rng, (size_t)h, 0.2, 1.0), kn = randn(&rng, (size_t)h, 0.2, 1.0);
    if (qknorm) {
        lw.q_norm = qn.data();
        lw.k_norm = kn.data();
    }
    const bk_hessian_kind kind = shampoo ? BK_HESS_FULLYLOCAL_SHAMPOO : BK_HESS_FULLYLOCAL_KFAC;
    bk_hess_acc *acc = NULL;
    if (bk_hess_acc_create(&c, kind, 0, T, &acc) != BK_OK ||
        bk_hess_add_attn(acc, &lw, x.data(), qr.data(), kr.data(), S) != BK_OK) {
        printf("  CPU accumulator: %s FAIL\n", bk_last_error());
        failures++;
        bk_hess_acc_free(acc);
        return;
    }
    bk_rope rope;
    bk_rope_init(&rope, &c, T);
    /* B-side weights: |x|^2 (Shampoo) or none */
    std::vector<double> sw((size_t)N, 1.0);
    for (int64_t n = 0; n < N; n++) {
        double s = 0;
        for (int64_t i = 0; i < d; i++)
            s += (double)x[n * d + i] * x[n * d + i];
        sw[n] = s;
    }
    const int64_t nq = qknorm ? H : G;
    std::vector<double> bq((size_t)(nq * hh), 0.0), bk((size_t)(G * hh), 0.0);
    std::vector<double> wq((size_t)N, 0.0), wk((size_t)N, 0.0);
    std::vector<double> part((size_t)(S * (H > G ? H : G) * hh));
    if (!qknorm) {
        for (int p = 0; p < 2; p++) {
            quad_args a;
            a.vec = p == 0 ? kr.data() : qr.data();
            a.vstride = p == 0 ? kd : qd;
            a.nv = p == 0 ? 1 : (int)r;
            a.S = S;
            a.T = T;
            a.nb = G;
            a.h = h;
            a.cs = rope.cos;
            a.sn = rope.sin;
            a.w = shampoo ? sw.data() : NULL;
            a.backward = p;
            a.part = part.data();
            for (int64_t idx = 0; idx < S * G * hh / 4; idx++)
                quad_item(a, idx);
            staged_same(a, part, p == 0 ? "q_proj" : "k_proj");
            std::vector<double> &dst = p == 0 ? bq : bk;
            for (int64_t e = 0; e < G * hh; e++)
                for (int64_t s = 0; s < S; s++)
                    dst[e] += part[s * G * hh + e];
            std::vector<double> rows((size_t)(S * G * T));
            for (int64_t idx = 0; idx < S * G * T; idx++)
                trace_rows_item(a.vec, a.vstride, a.nv, T, G, h, rows.data(), idx);
            for (int64_t idx = 0; idx < S * G; idx++)
                trace_scan_item(rows.data(), T, p, idx);
            for (int64_t idx = 0; idx < S * T; idx++)
                trace_sum_item(rows.data(), T, G, p == 0 ? (int)r : 1,
                               p == 0 ? wq.data() : wk.data(), idx);
        }
    } else {
        std::vector<float> zq((size_t)(N * qd)), zk((size_t)(N * kd));
        for (int64_t n = 0; n < N; n++) {
            for (int64_t j = 0; j < qd; j++) {
                double s = 0;
                for (int64_t i = 0; i < d; i++)
                    s += (double)w[BK_MOD_Q][j * d + i] * x[n * d + i];
                zq[n * qd + j] = (float)s;
            }
            for (int64_t j = 0; j < kd; j++) {
                double s = 0;
                for (int64_t i = 0; i < d; i++)
                    s += (double)w[BK_MOD_K][j * d + i] * x[n * d + i];
                zk[n * kd + j] = (float)s;
            }
        }
        std::vector<double> C((size_t)(S * G * hh)), M((size_t)(S * G * hh)), v((size_t)(S * H * h)),
            sc((size_t)(S * H * 4)), tr((size_t)(S * H * T));
        for (int p = 0; p < 2; p++) {
            qn_args a;
            a.vec = p == 0 ? kr.data() : qr.data();
            a.vstride = p == 0 ? kd : qd;
            a.nv = p == 0 ? 1 : (int)r;
            a.z = p == 0 ? zq.data() : zk.data();
            a.zstride = p == 0 ? qd : kd;
            a.gamma = p == 0 ? qn.data() : kn.data();
            a.S = S;
            a.T = T;
            a.nb = G;
            a.nn = p == 0 ? H : G;
            a.h = h;
            a.cs = rope.cos;
            a.sn = rope.sin;
            a.eps = c.rms_eps;
            a.w = shampoo ? sw.data() : NULL;
            a.C = C.data();
            a.M = M.data();
            a.acc = part.data();
            a.v = v.data();
            a.sc = sc.data();
            a.tr = shampoo ? tr.data() : NULL;
            std::fill(C.begin(), C.end(), 0.0);
            std::fill(part.begin(), part.end(), 0.0);
            for (int64_t step = 0; step < T; step++) {
                const int64_t t = p == 0 ? step : T - 1 - step;
                for (int64_t i = 0; i < S * G * hh; i++)
                    qn_gram_item(a, t, i);
                for (int64_t i = 0; i < S * G * hh / 4; i++)
                    qn_rot_item(a, t, i);
                for (int64_t i = 0; i < S * a.nn * h; i++)
                    qn_v_item(a, t, i);
                for (int64_t i = 0; i < S * a.nn; i++)
                    qn_scalars_item(a, t, i);
                for (int64_t i = 0; i < S * a.nn * hh; i++)
                    qn_acc_item(a, t, i);
            }
            qn_rounds_same(a, p, part, tr, p == 0 ? "q_proj" : "k_proj");
            std::vector<double> &dst = p == 0 ? bq : bk;
            for (int64_t e = 0; e < a.nn * hh; e++)
                for (int64_t s = 0; s < S; s++)
                    dst[e] += part[s * a.nn * hh + e];
            if (shampoo)
                for (int64_t s = 0; s < S; s++)
                    for (int64_t t = 0; t < T; t++) {
                        double sum = 0;
                        for (int64_t m = 0; m < a.nn; m++)
                            sum += tr[(s * a.nn + m) * T + t];
                        (p == 0 ? wq : wk)[s * T + t] = sum;
                    }
        }
    }
    /* the factors as docs/hessians.md defines them */
    const double P = (double)(S * (T * (T + 1) / 2));
    for (int p = 0; p < 2; p++) {
        const bk_module mod = p == 0 ? BK_MOD_Q : BK_MOD_K;
        const int64_t m = p == 0 ? qd : kd, heads = p == 0 ? H : G;
        const float *A = NULL, *B = NULL;
        if (bk_hess_factors(acc, &lw, mod, &A, &B) != BK_OK || !B) {
            printf("  CPU factors: %s FAIL\n", bk_last_error());
            failures++;
            continue;
        }
        std::vector<double> full((size_t)(m * m), 0.0);
        for (int64_t j = 0; j < heads; j++) {
            const double *blk = (p == 0 ? bq.data() : bk.data()) +
                                (p == 0 && !qknorm ? j / r : j) * hh;
            for (int64_t i = 0; i < h; i++)
                for (int64_t k = 0; k < h; k++)
                    full[(j * h + i) * m + j * h + k] = 0.5 * (blk[i * h + k] + blk[k * h + i]) / P;
        }
        char what[128];
        snprintf(what, sizeof what, "%s%s %s B", qknorm ? "q/k-norm " : "",
                 shampoo ? "shampoo" : "kfac", p == 0 ? "q_proj" : "k_proj");
        /* the CPU factor is float: agreement to float rounding */
        check(what, rel(full, B, (size_t)(m * m)), 1e-6);
        if (shampoo) {
            /* A = Σ_t w_t x_t x_tᵀ / P */
            std::vector<double> Ad((size_t)(d * d), 0.0);
            const std::vector<double> &wt = p == 0 ? wq : wk;
            for (int64_t n = 0; n < N; n++)
                for (int64_t i = 0; i < d; i++)
                    for (int64_t k = 0; k < d; k++)
                        Ad[i * d + k] += std::fmax(wt[n], 0.0) * x[n * d + i] * x[n * d + k] / P;
            snprintf(what, sizeof what, "%sshampoo %s A (trace weights)", qknorm ? "q/k-norm " : "",
                     p == 0 ? "q_proj" : "k_proj");
            check(what, rel(Ad, A, (size_t)(d * d)), 1e-5);
        }
    }
    bk_rope_free(&rope);
    bk_hess_acc_free(acc);
}

} // namespace

int main()
{
    printf("fully-local attention items on the host vs src/hessian.c\n");
    run_case(false, false, 4, 2, 8, 5, 2);
    run_case(false, true, 4, 2, 8, 5, 2);
    run_case(true, false, 6, 2, 4, 4, 3);
    run_case(true, true, 6, 2, 4, 4, 3);
    run_case(false, false, 3, 3, 6, 7, 1);
    printf("%s\n", failures ? "FAILED" : "all ok");
    return failures ? 1 : 0;
}
