/* The device-resident solve entry bk_cuda_solve_dev (cuda/solve.cu) against
 * the host-array entry bk_cuda_solve on the same problems. Suite cuda; exit
 * 77 = skipped without a GPU.
 *
 *   - random SPD problems (96x160, 256x320), gptq and bakron, with and
 *     without B, fp64 and fp32, the level alphabet and uniform 4-bit
 *     (asymmetric) groups of 64: fp64 identical codes, weights, scales,
 *     damping and statistics; fp32 >= 99.9% identical codes and statistics
 *     within 1e-4 relative; loss_gptq = tr(E A_plain E^T) of an independent
 *     host double computation within 1e-9 relative; d_weight = r->weight;
 *   - compute_stats = 0 still gives loss_gptq; A_plain NULL gives NAN;
 *   - A_plain equal to A (a copy, the same pointer), or to A but its diagonal
 *     (loss_gptq from the statistics' E A~), or not (one more entry changed:
 *     the GEMM): loss_gptq with the statistics on within 1e-12 of off;
 *   - damping escalation and a factor that stays non-PD: the same damping,
 *     statuses and messages as the host entry;
 *   - bad inputs (NaN/Inf in the device A/B, asymmetric A, a negative diagonal
 *     in B, no A): the host entry's status and message, naming the label;
 *     a zero diagonal in A: one dead column and the host entry's codes;
 *   - nothing leaks: the tracked device memory is back to its start value;
 *   - the same with the device copy of W passed too (dW: the alphabet fitted
 *     on the device, W read from the device, its finiteness checked there);
 *   - an input side shared between solves of one A (bk_dshare: q/k/v, gate/up
 *     in the GPU stages): each result bit for bit that of its solve alone
 *     (gptq/bakron, fp32/fp64, with B, statistics off, a dead column,
 *     escalated damping; with and without dW), the kept side really used,
 *     another name or damping factored anew, a NULL name and bk_dshare_drop
 *     release it;
 *   - the kept side against the GPU accumulator's generations (bk_ghess,
 *     cuda/hessian.cu; session-11 review R2): o_proj's A formed twice with
 *     nothing in between reuses it; the Gram reset and accumulated again from
 *     other rows (same pointer, same scale) or exchanged by the sums, with
 *     the kept side NOT dropped, is factored anew: bit for bit the solve of
 *     the new A alone (set_grads' raise is not exercised here);
 *   - bk_cuda_download (the codes' and weights' pinned, multi-threaded
 *     download): byte for byte, around its size limits, unaligned, ordered
 *     after queued work, nothing written past the end.
 */
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

extern "C" { /* cmocka 1.1 declares its functions without C linkage in C++ */
#include <cmocka.h>
}

#include "cuda/cuda_internal.cuh"
#include "pipeline_gpu.h"

static bk_cuda_ctx *g_c;

/* ------------------------------------------------------------- problems */

struct rng {
    uint64_t s;
    int have;
    double spare;
};

static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_unif(rng *r)
{
    return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static double rng_normal(rng *r)
{
    if (r->have) {
        r->have = 0;
        return r->spare;
    }
    double u, v, s;
    do {
        u = 2.0 * rng_unif(r) - 1.0;
        v = 2.0 * rng_unif(r) - 1.0;
        s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double f = std::sqrt(-2.0 * std::log(s) / s);
    r->spare = v * f;
    r->have = 1;
    return u * f;
}

static float *hbuf(size_t count)
{
    float *p = static_cast<float *>(calloc(count, sizeof(float)));
    assert_non_null(p);
    return p;
}

/* A = X^T X / N + ridge I (F32, exactly symmetric), X [N, k] with
 * correlated neighbouring columns and varying column scales */
static float *spd(int64_t k, uint64_t seed, double ridge)
{
    rng r = {seed * 7919u + 17u, 0, 0.0};
    const int64_t N = k + 32;
    double *X = static_cast<double *>(malloc(sizeof(double) * (size_t)(N * k)));
    double *sc = static_cast<double *>(malloc(sizeof(double) * (size_t)k));
    assert_non_null(X);
    assert_non_null(sc);
    for (int64_t j = 0; j < k; j++)
        sc[j] = 0.5 + rng_unif(&r);
    for (int64_t t = 0; t < N; t++) {
        double prev = 0.0;
        for (int64_t j = 0; j < k; j++) {
            const double g = rng_normal(&r);
            X[t * k + j] = sc[j] * (g + 0.6 * prev);
            prev = g;
        }
    }
    float *A = hbuf((size_t)(k * k));
    for (int64_t i = 0; i < k; i++)
        for (int64_t j = 0; j <= i; j++) {
            double s = 0.0;
            for (int64_t t = 0; t < N; t++)
                s += X[t * k + i] * X[t * k + j];
            const float v = (float)(s / (double)N + (i == j ? ridge : 0.0));
            A[i * k + j] = A[j * k + i] = v;
        }
    free(X);
    free(sc);
    return A;
}

static float *weights(int64_t m, int64_t n, uint64_t seed)
{
    rng r = {seed * 104729u + 3u, 0, 0.0};
    float *W = hbuf((size_t)(m * n));
    for (int64_t t = 0; t < m * n; t++)
        W[t] = (float)(0.05 * rng_normal(&r));
    return W;
}

/* device copies made with cudaMalloc: not counted in the context's memory */
static float *dcopy(const float *h, size_t count)
{
    float *d = NULL;
    assert_int_equal(cudaMalloc((void **)&d, count * sizeof(float)), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, count * sizeof(float), cudaMemcpyHostToDevice),
                     cudaSuccess);
    return d;
}

/* tr(E Ap E^T), E = weight - W, all in double on the host */
static double host_loss_gptq(const float *weight, const float *W, const float *Ap, int64_t m,
                             int64_t n)
{
    double *e = static_cast<double *>(malloc(sizeof(double) * (size_t)n));
    assert_non_null(e);
    double total = 0.0;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++)
            e[j] = (double)weight[i * n + j] - (double)W[i * n + j];
        for (int64_t j = 0; j < n; j++) {
            double s = 0.0;
            for (int64_t l = 0; l < n; l++)
                s += (double)Ap[j * n + l] * e[l];
            total += e[j] * s;
        }
    }
    free(e);
    return total;
}

static double rel(double a, double b)
{
    if (a == b)
        return 0.0;
    return std::fabs(a - b) / std::fmax(std::fabs(a), std::fabs(b));
}

/* One problem on the host and the device side. */
struct dcase {
    int64_t m, n;
    float *W, *A, *B, *Ap; /* host; B may be NULL */
    float *dA, *dB, *dAp;  /* device copies */
    float *dW;             /* device copy of W (the fast path, g_use_dw) */
};

/* 1: problems also pass the device copy of W (bk_dsolve_problem.dW: device
 * alphabet fit, W from the device, finiteness of W on the device) */
static int g_use_dw;

static dcase make_case(int64_t m, int64_t n, uint64_t seed, int with_b)
{
    dcase c;
    memset(&c, 0, sizeof c);
    c.m = m;
    c.n = n;
    c.W = weights(m, n, seed);
    c.A = spd(n, seed + 1, 1e-3);
    c.B = with_b ? spd(m, seed + 2, 1e-3) : NULL;
    c.Ap = spd(n, seed + 3, 0.0);
    return c;
}

static void case_upload(dcase *c)
{
    cudaFree(c->dA);
    cudaFree(c->dB);
    cudaFree(c->dAp);
    cudaFree(c->dW);
    c->dW = dcopy(c->W, (size_t)(c->m * c->n));
    c->dA = dcopy(c->A, (size_t)(c->n * c->n));
    c->dB = c->B ? dcopy(c->B, (size_t)(c->m * c->m)) : NULL;
    c->dAp = dcopy(c->Ap, (size_t)(c->n * c->n));
}

static void case_free(dcase *c)
{
    free(c->W);
    free(c->A);
    free(c->B);
    free(c->Ap);
    cudaFree(c->dA);
    cudaFree(c->dB);
    cudaFree(c->dAp);
    cudaFree(c->dW);
    memset(c, 0, sizeof *c);
}

static void host_problem(const dcase *c, bk_solve_problem *p)
{
    memset(p, 0, sizeof *p);
    p->m = c->m;
    p->n = c->n;
    p->dtype = BK_DT_F32;
    p->W = c->W;
    p->A = c->A;
    p->B = c->B;
    p->label_w = "lbl_w";
    p->label_a = "lbl_a";
    p->label_b = "lbl_b";
}

/* 1: A_plain is passed as the very pointer of A (as the GPU stages pass it for
 * every kind but the Shampoo ones); c->Ap then holds A's values */
static int g_plain_is_a;

static void dev_problem(const dcase *c, bk_dsolve_problem *p)
{
    memset(p, 0, sizeof *p);
    p->m = c->m;
    p->n = c->n;
    p->W = c->W;
    p->A = c->dA;
    p->B = c->dB;
    p->A_plain = g_plain_is_a ? c->dA : c->dAp;
    p->label_w = "lbl_w";
    p->label_a = "lbl_a";
    p->label_b = "lbl_b";
    if (g_use_dw)
        p->dW = c->dW;
}

static bk_solve_opts make_opts(bk_algorithm alg, bk_precision prec, int uniform)
{
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.algorithm = alg;
    o.precision = prec;
    if (uniform) {
        o.quant.kind = BK_Q_UNIFORM;
        o.quant.bits = 4;
        o.quant.group = 64;
        o.quant.asym = 1;
    }
    return o;
}

/* ------------------------------------------------------------ comparison */

static int64_t g_same, g_total; /* fp32 codes over every case */

/* Solve c with both entries and compare. Returns the device loss_gptq. */
static double compare(const dcase *c, const bk_solve_opts *o, const char *what)
{
    const int64_t m = c->m, n = c->n, mn = m * n;
    const size_t mem0 = g_c->mem_current;
    bk_solve_problem hp;
    bk_dsolve_problem dp;
    host_problem(c, &hp);
    dev_problem(c, &dp);
    bk_solve_result rh, rd;
    bk_status sh = bk_cuda_solve(g_c, &hp, o, &rh);
    if (sh != BK_OK)
        fail_msg("%s: host entry: %s", what, bk_last_error());
    assert_int_equal(g_c->mem_current, mem0);
    float *dw = NULL;
    assert_int_equal(cudaMalloc((void **)&dw, sizeof(float) * (size_t)mn), cudaSuccess);
    double lg = 0.0;
    bk_status sd = bk_cuda_solve_dev(g_c, &dp, o, &rd, dw, &lg);
    if (sd != BK_OK)
        fail_msg("%s: device entry: %s", what, bk_last_error());
    assert_int_equal(g_c->mem_current, mem0);

    /* d_weight is the device copy of r->weight */
    float *hw = hbuf((size_t)mn);
    assert_int_equal(cudaMemcpy(hw, dw, sizeof(float) * (size_t)mn, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    assert_memory_equal(hw, rd.weight, sizeof(float) * (size_t)mn);
    free(hw);
    cudaFree(dw);

    /* the alphabet is fitted on the host from the same W: identical */
    assert_int_equal(rh.groups, rd.groups);
    assert_memory_equal(rh.scales, rd.scales, sizeof(float) * (size_t)(m * rh.groups));
    assert_true((rh.zeros == NULL) == (rd.zeros == NULL));
    if (rh.zeros)
        assert_memory_equal(rh.zeros, rd.zeros, sizeof(float) * (size_t)(m * rh.groups));
    assert_int_equal(rh.dead_columns, rd.dead_columns);

    int64_t same = 0;
    for (int64_t t = 0; t < mn; t++)
        same += rh.codes[t] == rd.codes[t];
    const double tol = o->precision == BK_PREC_FP64 ? 1e-12 : 1e-4;
    if (o->precision == BK_PREC_FP64) {
        if (same != mn)
            fail_msg("%s: %lld of %lld codes differ", what, (long long)(mn - same),
                     (long long)mn);
        assert_memory_equal(rh.weight, rd.weight, sizeof(float) * (size_t)mn);
        assert_true(rh.damp_a == rd.damp_a);
        assert_true(rh.damp_b == rd.damp_b);
        assert_int_equal(rh.damp_retries, rd.damp_retries);
        assert_int_equal(rh.clamped, rd.clamped);
    } else {
        g_same += same;
        g_total += mn;
        if ((double)same < 0.999 * (double)mn)
            fail_msg("%s: only %lld of %lld codes identical", what, (long long)same,
                     (long long)mn);
    }
    if (o->compute_stats) {
        const double d1 = rel(rh.loss_one_sided, rd.loss_one_sided);
        const double d2 = rel(rh.loss_two_sided, rd.loss_two_sided);
        const double d3 = rel(rh.bound, rd.bound);
        if (!(d1 <= tol && d2 <= tol && d3 <= tol))
            fail_msg("%s: statistics differ: one-sided %.17g / %.17g, two-sided %.17g / %.17g, "
                     "bound %.17g / %.17g",
                     what, rh.loss_one_sided, rd.loss_one_sided, rh.loss_two_sided,
                     rd.loss_two_sided, rh.bound, rd.bound);
    } else {
        assert_true(std::isnan(rd.loss_one_sided) && std::isnan(rd.loss_two_sided) &&
                    std::isnan(rd.bound));
        assert_true(rd.time_stats_s >= 0.0);
    }
    const double want = host_loss_gptq(rd.weight, c->W, c->Ap, m, n);
    if (!(rel(lg, want) <= 1e-9))
        fail_msg("%s: loss_gptq %.17g, host %.17g", what, lg, want);
    bk_solve_result_free(&rh);
    bk_solve_result_free(&rd);
    return lg;
}

/* ------------------------------------------------------------------ tests */

static void test_parity(void **state)
{
    (void)state;
    const int64_t shapes[2][2] = {{96, 160}, {256, 320}};
    const bk_algorithm algs[2] = {BK_ALG_GPTQ, BK_ALG_BAKRON};
    const bk_precision precs[2] = {BK_PREC_FP64, BK_PREC_FP32};
    for (int s = 0; s < 2; s++)
        for (int with_b = 0; with_b < 2; with_b++) {
            dcase c = make_case(shapes[s][0], shapes[s][1], 100u + 10u * (uint64_t)s, with_b);
            case_upload(&c);
            for (int a = 0; a < 2; a++)
                for (int pr = 0; pr < 2; pr++)
                    for (int u = 0; u < 2; u++) {
                        bk_solve_opts o = make_opts(algs[a], precs[pr], u);
                        char what[160];
                        snprintf(what, sizeof what, "%lldx%lld %s %s %s%s",
                                 (long long)c.m, (long long)c.n, bk_algorithm_name(algs[a]),
                                 precs[pr] == BK_PREC_FP64 ? "fp64" : "fp32",
                                 u ? "uniform4 g64" : "levels", with_b ? " with B" : "");
                        compare(&c, &o, what);
                    }
            case_free(&c);
        }
    print_message("fp32: %.4f%% identical codes (device vs host entry)\n",
                  100.0 * (double)g_same / (double)g_total);
}

static void test_refit_and_fp64_factor(void **state)
{
    (void)state;
    dcase c = make_case(96, 160, 7, 1);
    case_upload(&c);
    bk_solve_opts o = make_opts(BK_ALG_GPTQ, BK_PREC_FP64, 1);
    o.quant.refit_groups = 1;
    compare(&c, &o, "gptq refit_groups fp64");
    /* the factorization in fp64 for an fp32 solve */
    const int keep = g_c->factor_fp64;
    g_c->factor_fp64 = 1;
    bk_solve_opts o2 = make_opts(BK_ALG_BAKRON, BK_PREC_FP32, 0);
    compare(&c, &o2, "bakron fp32 with fp64 factors");
    g_c->factor_fp64 = keep;
    /* separate damping of B */
    bk_solve_opts o3 = make_opts(BK_ALG_BAKRON, BK_PREC_FP64, 0);
    o3.separate_damp_b = 1;
    o3.damp_b = 0.05;
    compare(&c, &o3, "bakron fp64 damp_b");
    case_free(&c);
}

static void test_no_stats_and_no_plain(void **state)
{
    (void)state;
    dcase c = make_case(96, 160, 11, 1);
    case_upload(&c);
    bk_solve_opts o = make_opts(BK_ALG_BAKRON, BK_PREC_FP64, 0);
    const double with_stats = compare(&c, &o, "stats on");
    o.compute_stats = 0;
    const double without = compare(&c, &o, "stats off");
    assert_true(rel(with_stats, without) <= 1e-12);

    /* A_plain NULL: NAN; d_weight NULL is fine */
    const size_t mem0 = g_c->mem_current;
    bk_dsolve_problem dp;
    dev_problem(&c, &dp);
    dp.A_plain = NULL;
    bk_solve_result r;
    double lg = 0.0;
    assert_int_equal(bk_cuda_solve_dev(g_c, &dp, &o, &r, NULL, &lg), BK_OK);
    assert_true(std::isnan(lg));
    bk_solve_result_free(&r);
    /* loss_gptq NULL with A_plain given */
    dp.A_plain = c.dAp;
    assert_int_equal(bk_cuda_solve_dev(g_c, &dp, &o, &r, NULL, NULL), BK_OK);
    bk_solve_result_free(&r);
    assert_int_equal(g_c->mem_current, mem0);
    case_free(&c);
}

/* Both entries fail with the same status and message (which names `label`). */
static void same_failure(const dcase *c, const bk_solve_opts *o, bk_status want,
                         const char *label, const char *what)
{
    const size_t mem0 = g_c->mem_current;
    bk_solve_problem hp;
    bk_dsolve_problem dp;
    host_problem(c, &hp);
    dev_problem(c, &dp);
    bk_solve_result rh, rd;
    bk_status sh = bk_cuda_solve(g_c, &hp, o, &rh);
    char hmsg[1024];
    snprintf(hmsg, sizeof hmsg, "%s", bk_last_error());
    assert_int_equal(g_c->mem_current, mem0);
    float *dw = NULL;
    assert_int_equal(cudaMalloc((void **)&dw, sizeof(float) * (size_t)(c->m * c->n)),
                     cudaSuccess);
    double lg = 0.0;
    bk_status sd = bk_cuda_solve_dev(g_c, &dp, o, &rd, dw, &lg);
    const char *dmsg = bk_last_error();
    cudaFree(dw);
    assert_int_equal(g_c->mem_current, mem0);
    if (sh != want || sd != want)
        fail_msg("%s: want %s, host %s (%s), device %s (%s)", what, bk_status_name(want),
                 bk_status_name(sh), hmsg, bk_status_name(sd), dmsg);
    if (strcmp(hmsg, dmsg))
        fail_msg("%s: messages differ:\n  host:   %s\n  device: %s", what, hmsg, dmsg);
    if (!strstr(dmsg, label))
        fail_msg("%s: the message does not name %s: %s", what, label, dmsg);
    print_message("%s: %s\n", what, dmsg);
    assert_null(rd.codes);
    assert_null(rd.weight);
    assert_true(std::isnan(lg));
}

static void test_bad_inputs(void **state)
{
    (void)state;
    const bk_solve_opts o = make_opts(BK_ALG_BAKRON, BK_PREC_FP64, 0);
    const int64_t m = 96, n = 160;
    {
        dcase c = make_case(m, n, 21, 1);
        c.A[5 * n + 7] = NAN;
        case_upload(&c);
        same_failure(&c, &o, BK_ERR_NONFINITE, "lbl_a", "NaN in A");
        c.A[5 * n + 7] = INFINITY;
        c.A[2 * n + 150] = -INFINITY; /* an earlier index: the first one is named */
        case_upload(&c);
        same_failure(&c, &o, BK_ERR_NONFINITE, "lbl_a", "Inf in A");
        case_free(&c);
    }
    {
        dcase c = make_case(m, n, 26, 1);
        c.W[7 * n + 9] = NAN;
        c.W[3 * n + 150] = INFINITY; /* an earlier index: the first one is named */
        case_upload(&c);
        same_failure(&c, &o, BK_ERR_NONFINITE, "lbl_w", "NaN/Inf in W");
        case_free(&c);
    }
    {
        dcase c = make_case(m, n, 22, 1);
        c.B[40 * m + 41] = INFINITY;
        case_upload(&c);
        same_failure(&c, &o, BK_ERR_NONFINITE, "lbl_b", "Inf in B");
        case_free(&c);
    }
    {
        dcase c = make_case(m, n, 23, 1);
        c.A[100 * n + 3] += 1.0f; /* lower entry only */
        c.A[130 * n + 70] += 1.0f;
        case_upload(&c);
        same_failure(&c, &o, BK_ERR_INVALID_ARG, "lbl_a", "asymmetric A");
        case_free(&c);
    }
    {
        dcase c = make_case(m, n, 24, 1);
        c.B[4 * m + 4] = -1.0f;
        case_upload(&c);
        same_failure(&c, &o, BK_ERR_NOT_PD, "lbl_b", "negative diagonal in B");
        case_free(&c);
    }
    {
        /* no A */
        dcase c = make_case(m, n, 25, 0);
        case_upload(&c);
        const size_t mem0 = g_c->mem_current;
        bk_dsolve_problem dp;
        dev_problem(&c, &dp);
        dp.A = NULL;
        bk_solve_result r;
        assert_int_equal(bk_cuda_solve_dev(g_c, &dp, &o, &r, NULL, NULL), BK_ERR_INVALID_ARG);
        assert_non_null(strstr(bk_last_error(), "lbl_a"));
        bk_solve_opts ortn = o;
        ortn.algorithm = BK_ALG_RTN;
        assert_int_equal(bk_cuda_solve_dev(g_c, &dp, &ortn, &r, NULL, NULL),
                         BK_ERR_INVALID_ARG);
        assert_int_equal(g_c->mem_current, mem0);
        case_free(&c);
    }
}

static void test_zero_diagonals(void **state)
{
    (void)state;
    const int64_t m = 96, n = 160;
    for (int pr = 0; pr < 2; pr++) {
        dcase c = make_case(m, n, 31, 1);
        for (int64_t t = 0; t < n; t++)
            c.A[17 * n + t] = c.A[t * n + 17] = 0.0f; /* a dead input column */
        for (int64_t t = 0; t < m; t++)
            c.B[9 * m + t] = c.B[t * m + 9] = 0.0f; /* an output without weight */
        case_upload(&c);
        bk_solve_opts o = make_opts(BK_ALG_BAKRON, pr ? BK_PREC_FP32 : BK_PREC_FP64, 0);
        bk_solve_problem hp;
        host_problem(&c, &hp);
        bk_solve_result r;
        assert_int_equal(bk_cuda_solve(g_c, &hp, &o, &r), BK_OK);
        assert_int_equal(r.dead_columns, 1);
        bk_solve_result_free(&r);
        compare(&c, &o, pr ? "zero diagonals fp32" : "zero diagonals fp64");
        case_free(&c);
    }
}

static void test_escalation_and_not_pd(void **state)
{
    (void)state;
    const int64_t m = 96, n = 160;
    dcase c = make_case(m, n, 41, 1);
    /* an indefinite A (eigenvalues 1 +- 2 in the leading block) */
    for (int64_t t = 0; t < n * n; t++)
        c.A[t] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        c.A[j * n + j] = 1.0f;
    c.A[0 * n + 1] = c.A[1 * n + 0] = 2.0f;
    case_upload(&c);
    bk_solve_opts o = make_opts(BK_ALG_BAKRON, BK_PREC_FP64, 0);
    o.damp = 0.0;
    o.max_damp_retries = 0;
    same_failure(&c, &o, BK_ERR_NOT_PD, "lbl_a", "indefinite A, no escalation");
    o.max_damp_retries = 5;
    compare(&c, &o, "indefinite A, escalated");
    bk_solve_opts o32 = o;
    o32.precision = BK_PREC_FP32;
    compare(&c, &o32, "indefinite A, escalated, fp32");
    case_free(&c);
}

/* loss_gptq with the statistics on, where A~ - A_plain is diagonal (taken
 * from the statistics' E A~, no second GEMM: cuda/stats.cu) or not (the GEMM
 * with A_plain), against the statistics off (always the GEMM) and the host */
static void plain_on_off(dcase *c, const char *what)
{
    const bk_algorithm algs[2] = {BK_ALG_GPTQ, BK_ALG_BAKRON};
    const bk_precision precs[2] = {BK_PREC_FP64, BK_PREC_FP32};
    case_upload(c);
    for (int a = 0; a < 2; a++)
        for (int pr = 0; pr < 2; pr++) {
            bk_solve_opts o = make_opts(algs[a], precs[pr], pr);
            char w[200];
            snprintf(w, sizeof w, "%s, %s %s%s", what, bk_algorithm_name(algs[a]),
                     precs[pr] == BK_PREC_FP64 ? "fp64" : "fp32", c->B ? " with B" : "");
            const double on = compare(c, &o, w);
            o.compute_stats = 0;
            const double off = compare(c, &o, w);
            if (!(rel(on, off) <= 1e-12))
                fail_msg("%s: loss_gptq with statistics %.17g, without %.17g", w, on, off);
        }
}

static void test_plain_from_stats(void **state)
{
    (void)state;
    for (int with_b = 0; with_b < 2; with_b++) {
        dcase c = make_case(96, 160, 41u + (uint64_t)with_b, with_b);
        const int64_t n = c.n;
        memcpy(c.Ap, c.A, sizeof(float) * (size_t)(n * n));
        plain_on_off(&c, "A_plain = A (a copy)");
        g_plain_is_a = 1;
        plain_on_off(&c, "A_plain = A (the same pointer)");
        g_plain_is_a = 0;
        for (int64_t j = 0; j < n; j++)
            c.Ap[j * n + j] *= 0.75f;
        plain_on_off(&c, "A_plain = A but the diagonal");
        c.Ap[3 * n + 5] = std::nextafter(c.Ap[3 * n + 5], 1.0f);
        plain_on_off(&c, "A_plain = A but the diagonal and one entry");
        case_free(&c);
    }
}

/* ------------------------------------------------- a shared input side */

/* Bit for bit: everything of a result that the input side enters. */
static void same_bits(const bk_solve_result *a, const bk_solve_result *b, const float *dwa,
                      const float *dwb, double lga, double lgb, const char *what)
{
    const int64_t m = a->m, n = a->n, mn = m * n;
    if (b->m != m || b->n != n || b->groups != a->groups)
        fail_msg("%s: shapes differ", what);
    int64_t diff = 0;
    for (int64_t t = 0; t < mn; t++)
        diff += a->codes[t] != b->codes[t];
    if (diff)
        fail_msg("%s: %lld of %lld codes differ", what, (long long)diff, (long long)mn);
    assert_true((a->weight == NULL) == (b->weight == NULL));
    if (a->weight)
        assert_memory_equal(a->weight, b->weight, sizeof(float) * (size_t)mn);
    assert_memory_equal(dwa, dwb, sizeof(float) * (size_t)mn);
    assert_memory_equal(a->scales, b->scales, sizeof(float) * (size_t)(m * a->groups));
    assert_true((a->zeros == NULL) == (b->zeros == NULL));
    if (a->zeros)
        assert_memory_equal(a->zeros, b->zeros, sizeof(float) * (size_t)(m * a->groups));
    const double da[6] = {a->damp_a, a->damp_b, a->loss_one_sided, a->loss_two_sided, a->bound,
                          lga};
    const double db[6] = {b->damp_a, b->damp_b, b->loss_one_sided, b->loss_two_sided, b->bound,
                          lgb};
    if (memcmp(da, db, sizeof da))
        fail_msg("%s: damping or statistics differ: damp_a %.17g / %.17g, one-sided %.17g / "
                 "%.17g, two-sided %.17g / %.17g, bound %.17g / %.17g, loss_gptq %.17g / %.17g",
                 what, da[0], db[0], da[2], db[2], da[3], db[3], da[4], db[4], da[5], db[5]);
    assert_int_equal(a->damp_retries, b->damp_retries);
    assert_int_equal(a->dead_columns, b->dead_columns);
    assert_int_equal(a->clamped, b->clamped);
}

/* One device solve of c (share may be NULL); *dwh receives d_weight on the host. */
static void dsolve(const dcase *c, const bk_solve_opts *o, bk_dshare *share, bk_solve_result *r,
                   double *lg, float **dwh, const char *what)
{
    const size_t mn = (size_t)(c->m * c->n);
    bk_dsolve_problem dp;
    dev_problem(c, &dp);
    dp.share = share;
    float *dw = NULL;
    assert_int_equal(cudaMalloc((void **)&dw, sizeof(float) * mn), cudaSuccess);
    if (bk_cuda_solve_dev(g_c, &dp, o, r, dw, lg) != BK_OK)
        fail_msg("%s: %s", what, bk_last_error());
    *dwh = hbuf(mn);
    assert_int_equal(cudaMemcpy(*dwh, dw, sizeof(float) * mn, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    cudaFree(dw);
}

struct share_cfg {
    bk_algorithm alg;
    bk_precision prec;
    int uniform, with_b, stats, dead, indefinite;
    const char *name;
};

/* Three problems with one A (different W, B, row counts), as q/k/v: solved
 * with the input side kept after the first two, each bit for bit equal to its
 * solve without sharing; the kept side is used (A overwritten under the same
 * name still gives the first A's results), another name or other input-side
 * options factor anew, a NULL name drops it; nothing leaks. */
static void shared_side(const share_cfg *k)
{
    const int64_t n = 160, ms[3] = {96, 64, 96};
    static int name1, name2;
    dcase c[3];
    for (int i = 0; i < 3; i++) {
        c[i] = make_case(ms[i], n, 300u + 37u * (uint64_t)i, k->with_b);
        if (i > 0)
            memcpy(c[i].A, c[0].A, sizeof(float) * (size_t)(n * n));
    }
    for (int i = 0; i < 3; i++) {
        float *A = c[i].A;
        if (k->indefinite) { /* eigenvalues 1 +- 2 in the leading block: escalation */
            for (int64_t t = 0; t < n * n; t++)
                A[t] = 0.0f;
            for (int64_t j = 0; j < n; j++)
                A[j * n + j] = 1.0f;
            A[0 * n + 1] = A[1 * n + 0] = 2.0f;
        }
        if (k->dead)
            for (int64_t t = 0; t < n; t++)
                A[17 * n + t] = A[t * n + 17] = 0.0f;
        case_upload(&c[i]);
    }
    bk_solve_opts o = make_opts(k->alg, k->prec, k->uniform);
    o.compute_stats = k->stats;
    if (k->indefinite)
        o.damp = 0.0;
    const size_t mem0 = g_c->mem_current;
    char what[200];

    /* without sharing */
    bk_solve_result ref[3];
    float *rdw[3];
    double rlg[3];
    for (int i = 0; i < 3; i++) {
        snprintf(what, sizeof what, "%s%s: problem %d alone", k->name, g_use_dw ? " (dW)" : "", i);
        dsolve(&c[i], &o, NULL, &ref[i], &rlg[i], &rdw[i], what);
    }
    if (k->dead)
        assert_int_equal(ref[0].dead_columns, 1);
    if (k->indefinite)
        assert_true(ref[0].damp_retries > 0);
    assert_int_equal(g_c->mem_current, mem0);

    /* shared: kept after the first two, taken over by the third */
    bk_dshare sh;
    memset(&sh, 0, sizeof sh);
    sh.src = &name1;
    sh.scale = 0.25;
    for (int i = 0; i < 3; i++) {
        sh.keep = i < 2;
        bk_solve_result r;
        float *dwh = NULL;
        double lg = 0.0;
        snprintf(what, sizeof what, "%s%s: problem %d shared", k->name, g_use_dw ? " (dW)" : "", i);
        dsolve(&c[i], &o, &sh, &r, &lg, &dwh, what);
        same_bits(&ref[i], &r, rdw[i], dwh, rlg[i], lg, what);
        assert_int_equal(sh.hits, i);
        assert_int_equal(sh.valid, i < 2);
        if (i < 2)
            assert_true(g_c->mem_current > mem0);
        bk_solve_result_free(&r);
        free(dwh);
    }
    assert_int_equal(g_c->mem_current, mem0);

    /* the kept side is what the second solve uses: A overwritten, same name */
    dcase other = make_case(ms[1], n, 977u, k->with_b);
    memcpy(other.W, c[1].W, sizeof(float) * (size_t)(ms[1] * n));
    if (k->with_b)
        memcpy(other.B, c[1].B, sizeof(float) * (size_t)(ms[1] * ms[1]));
    memcpy(other.Ap, c[1].Ap, sizeof(float) * (size_t)(n * n));
    if (k->dead) /* (the dead columns are read from the A at hand) */
        for (int64_t t = 0; t < n; t++)
            other.A[17 * n + t] = other.A[t * n + 17] = 0.0f;
    case_upload(&other);
    bk_solve_result r0, r1, r2;
    float *w0 = NULL, *w1 = NULL, *w2 = NULL;
    double l0 = 0.0, l1 = 0.0, l2 = 0.0;
    memset(&sh, 0, sizeof sh);
    sh.src = &name1;
    sh.scale = 0.25;
    sh.keep = 1;
    snprintf(what, sizeof what, "%s%s: kept side used", k->name, g_use_dw ? " (dW)" : "");
    dsolve(&c[0], &o, &sh, &r0, &l0, &w0, what);
    dsolve(&other, &o, &sh, &r1, &l1, &w1, what);
    assert_int_equal(sh.hits, 1);
    same_bits(&ref[1], &r1, rdw[1], w1, rlg[1], l1, what);
    /* another name: factored anew (the other A's results), the kept side gone */
    bk_solve_result ro;
    float *wo = NULL;
    double lo = 0.0;
    dsolve(&other, &o, NULL, &ro, &lo, &wo, what);
    if (ro.loss_one_sided == r1.loss_one_sided && lo == l1 &&
        !memcmp(ro.codes, r1.codes, sizeof(int16_t) * (size_t)(ms[1] * n)))
        fail_msg("%s: the other A gives the same results: the test cannot tell", what);
    sh.src = &name2;
    sh.keep = 0;
    dsolve(&other, &o, &sh, &r2, &l2, &w2, what);
    same_bits(&ro, &r2, wo, w2, lo, l2, what);
    assert_int_equal(sh.hits, 1);
    assert_false(sh.valid);
    assert_int_equal(g_c->mem_current, mem0);
    bk_solve_result_free(&r0);
    bk_solve_result_free(&r1);
    bk_solve_result_free(&r2);
    free(w0);
    free(w1);
    free(w2);

    /* other input-side options under the same name: factored anew */
    memset(&sh, 0, sizeof sh);
    sh.src = &name1;
    sh.scale = 0.25;
    sh.keep = 1;
    dsolve(&c[0], &o, &sh, &r0, &l0, &w0, what);
    bk_solve_opts o2 = o;
    o2.damp = k->indefinite ? 1e-3 : 0.125;
    dsolve(&c[1], &o2, NULL, &r1, &l1, &w1, what);
    dsolve(&c[1], &o2, &sh, &r2, &l2, &w2, what);
    assert_int_equal(sh.hits, 0);
    same_bits(&r1, &r2, w1, w2, l1, l2, "other damping under the same name");
    assert_true(sh.valid); /* (kept: keep is still 1) */
    /* a NULL name drops it */
    sh.src = NULL;
    bk_solve_result_free(&r0);
    free(w0);
    dsolve(&c[0], &o, &sh, &r0, &l0, &w0, what);
    assert_false(sh.valid);
    same_bits(&ref[0], &r0, rdw[0], w0, rlg[0], l0, "a NULL name");
    assert_int_equal(g_c->mem_current, mem0);
    /* bk_dshare_drop releases a kept side */
    sh.src = &name1;
    sh.keep = 1;
    bk_solve_result_free(&r0);
    free(w0);
    dsolve(&c[0], &o, &sh, &r0, &l0, &w0, what);
    assert_true(sh.valid && g_c->mem_current > mem0);
    bk_dshare_drop(g_c, &sh);
    assert_false(sh.valid);
    assert_int_equal(g_c->mem_current, mem0);

    bk_solve_result_free(&r0);
    bk_solve_result_free(&r1);
    bk_solve_result_free(&r2);
    bk_solve_result_free(&ro);
    free(w0);
    free(w1);
    free(w2);
    free(wo);
    case_free(&other);
    for (int i = 0; i < 3; i++) {
        bk_solve_result_free(&ref[i]);
        free(rdw[i]);
        case_free(&c[i]);
    }
}

/* ------------------------------------------- kept side vs the Grams' generation */

/* A collective that leaves every buffer as it is (bk_ghess_sums' fn). */
static bk_status sums_noop(void *user, void *buf, size_t n, int f64, int dev, void *stream)
{
    (void)user;
    (void)buf;
    (void)n;
    (void)f64;
    (void)dev;
    (void)stream;
    return BK_OK;
}

struct keyed_a {
    const float *A; /* device, the accumulator's (one buffer, reused) */
    const void *src;
    double scale;
    uint64_t gen;
};

static keyed_a factors_o(bk_ghess *a)
{
    keyed_a k;
    const float *B = NULL, *P = NULL;
    int shared = 0;
    if (bk_ghess_factors_dev(a, NULL, BK_MOD_O, &k.A, &B, &P) != BK_OK)
        fail_msg("o_proj factors: %s", bk_last_error());
    bk_ghess_factor_key(a, &k.src, &k.scale, &k.gen, &shared);
    assert_non_null(k.src);
    return k;
}

/* o_proj's solve on A = k->A, the input side shared through sh (or not) */
static void solve_o(bk_cuda_ctx *c, const keyed_a *k, const float *W, int64_t m, int64_t n,
                    bk_dshare *sh, const bk_solve_opts *o, bk_solve_result *r, float **dwh)
{
    bk_dsolve_problem dp;
    memset(&dp, 0, sizeof dp);
    dp.m = m;
    dp.n = n;
    dp.W = W;
    dp.A = k->A;
    dp.label_w = "o_proj";
    dp.label_a = "A";
    if (sh) { /* as the GPU stages name it (g_solve_dev) */
        sh->src = k->src;
        sh->scale = k->scale;
        sh->gen = k->gen;
        sh->keep = 1;
    }
    dp.share = sh;
    const size_t mn = (size_t)(m * n);
    float *dw = NULL;
    assert_int_equal(cudaMalloc((void **)&dw, sizeof(float) * mn), cudaSuccess);
    if (bk_cuda_solve_dev(c, &dp, o, r, dw, NULL) != BK_OK)
        fail_msg("o_proj solve: %s", bk_last_error());
    *dwh = hbuf(mn);
    assert_int_equal(cudaMemcpy(*dwh, dw, sizeof(float) * mn, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    cudaFree(dw);
}

static void test_share_generation(void **state)
{
    (void)state;
    bk_backend *be = NULL;
    if (bk_backend_create(BK_BACKEND_CUDA, &be) != BK_OK)
        fail_msg("CUDA backend: %s", bk_last_error());
    bk_cuda_ctx *c = static_cast<bk_cuda_ctx *>(be->ctx);
    bk_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.arch = BK_ARCH_LLAMA;
    strcpy(cfg.model_type, "llama");
    cfg.n_layers = 1;
    cfg.hidden = 64;
    cfg.intermediate = 96;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 2;
    cfg.head_dim = 16;
    cfg.vocab = 17;
    cfg.max_positions = 16;
    cfg.rms_eps = 1e-5;
    cfg.rope_theta = 10000.0;
    cfg.rope_type = BK_ROPE_DEFAULT;
    strcpy(cfg.hidden_act, "silu");
    cfg.bos_token_id = cfg.eos_token_id = -1;
    const int64_t S = 4, T = 16, N = S * T, m = cfg.hidden, n = cfg.n_heads * cfg.head_dim;
    bk_gfwd *f = NULL;
    bk_ghess *a = NULL;
    if (bk_gfwd_create(be, &cfg, S, T, &f) != BK_OK ||
        bk_ghess_create(f, BK_HESS_GPTQ, 0, 0, &a) != BK_OK)
        fail_msg("GPU forward / accumulator: %s", bk_last_error());
    /* two sets of o_proj input rows: the same count (the same scale 1/N) */
    rng r = {4242u, 0, 0.0};
    float *X1 = hbuf((size_t)(N * n)), *X2 = hbuf((size_t)(N * n));
    for (int64_t t = 0; t < N * n; t++) {
        X1[t] = (float)rng_normal(&r);
        X2[t] = (float)rng_normal(&r);
    }
    float *dX1 = dcopy(X1, (size_t)(N * n)), *dX2 = dcopy(X2, (size_t)(N * n));
    float *W = weights(m, n, 77u);
    const bk_solve_opts o = make_opts(BK_ALG_GPTQ, BK_PREC_FP64, 0);
    bk_dshare sh;
    memset(&sh, 0, sizeof sh);
    bk_solve_result r1, r1b, fresh, r2, r3;
    float *w1 = NULL, *w1b = NULL, *wf = NULL, *w2 = NULL, *w3 = NULL;

    /* generation of X1: factored and kept */
    bk_ghess_reset(a);
    if (bk_ghess_add_o(a, dX1, S) != BK_OK)
        fail_msg("add_o: %s", bk_last_error());
    const keyed_a k1 = factors_o(a);
    solve_o(c, &k1, W, m, n, &sh, &o, &r1, &w1);
    assert_true(sh.valid);
    assert_int_equal(sh.hits, 0);
    /* nothing changed: the same name and generation, the kept side used */
    const keyed_a k1b = factors_o(a);
    assert_ptr_equal(k1b.A, k1.A);
    assert_ptr_equal(k1b.src, k1.src);
    assert_true(k1b.gen == k1.gen);
    solve_o(c, &k1b, W, m, n, &sh, &o, &r1b, &w1b);
    assert_int_equal(sh.hits, 1);
    same_bits(&r1, &r1b, w1, w1b, 0.0, 0.0, "generation: the same A twice");

    /* the Gram reset and accumulated from X2 WITHOUT bk_dshare_drop: the
     * same device A, name and scale, another generation: factored anew */
    bk_ghess_reset(a);
    if (bk_ghess_add_o(a, dX2, S) != BK_OK)
        fail_msg("add_o: %s", bk_last_error());
    const keyed_a k2 = factors_o(a);
    assert_ptr_equal(k2.A, k1.A);
    assert_ptr_equal(k2.src, k1.src);
    assert_memory_equal(&k2.scale, &k1.scale, sizeof k1.scale);
    assert_true(k2.gen != k1.gen);
    solve_o(c, &k2, W, m, n, NULL, &o, &fresh, &wf); /* the new A alone */
    if (fresh.loss_one_sided == r1.loss_one_sided &&
        !memcmp(fresh.codes, r1.codes, sizeof(int16_t) * (size_t)(m * n)))
        fail_msg("generation: the two Grams give the same results: the test cannot tell");
    solve_o(c, &k2, W, m, n, &sh, &o, &r2, &w2);
    assert_int_equal(sh.hits, 1); /* not reused */
    assert_true(sh.valid);        /* (kept again, for generation k2) */
    same_bits(&fresh, &r2, wf, w2, 0.0, 0.0, "generation: a new Gram, the kept side not dropped");

    /* the sums (MPI ranks) may overwrite the Grams: another generation, the
     * same name and scale (the no-op collective leaves A as it was) */
    if (bk_ghess_sums(a, 1u << BK_MOD_O, 1, BK_BUF_READ | BK_BUF_WRITE, sums_noop, NULL) !=
        BK_OK)
        fail_msg("sums: %s", bk_last_error());
    const keyed_a k3 = factors_o(a);
    assert_memory_equal(&k3.scale, &k2.scale, sizeof k2.scale);
    assert_true(k3.gen != k2.gen);
    solve_o(c, &k3, W, m, n, &sh, &o, &r3, &w3);
    assert_int_equal(sh.hits, 1);
    same_bits(&fresh, &r3, wf, w3, 0.0, 0.0, "generation: after the sums");

    bk_dshare_drop(c, &sh);
    bk_solve_result *rs[] = {&r1, &r1b, &fresh, &r2, &r3};
    float *ws[] = {w1, w1b, wf, w2, w3, X1, X2, W};
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++)
        bk_solve_result_free(rs[i]);
    for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
        free(ws[i]);
    cudaFree(dX1);
    cudaFree(dX2);
    bk_ghess_free(a);
    bk_gfwd_free(f);
    bk_backend_destroy(be);
}

static void test_shared_input_side(void **state)
{
    (void)state;
    const share_cfg cfgs[] = {
        {BK_ALG_GPTQ, BK_PREC_FP64, 0, 0, 1, 0, 0, "gptq fp64"},
        {BK_ALG_GPTQ, BK_PREC_FP32, 1, 0, 1, 0, 0, "gptq fp32 uniform4 g64"},
        {BK_ALG_BAKRON, BK_PREC_FP32, 0, 1, 1, 0, 0, "bakron fp32 with B"},
        {BK_ALG_BAKRON, BK_PREC_FP64, 1, 1, 0, 0, 0, "bakron fp64 with B, no statistics"},
        {BK_ALG_BAKRON, BK_PREC_FP32, 0, 1, 1, 1, 0, "bakron fp32 with B, a dead column"},
        {BK_ALG_GPTQ, BK_PREC_FP64, 0, 0, 1, 1, 0, "gptq fp64, a dead column"},
        {BK_ALG_BAKRON, BK_PREC_FP64, 0, 1, 1, 0, 1, "bakron fp64 with B, escalated damping"},
    };
    for (int dw = 0; dw < 2; dw++) {
        g_use_dw = dw;
        for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
            shared_side(&cfgs[i]);
    }
    g_use_dw = 0;
}

/* bk_cuda_download (cuda/mem.cu): byte for byte what was on the device, for
 * sizes around the staging's limits and unaligned ends, after work queued on
 * the stream (ordered after it), nothing written past the end. */
static void test_download(void **state)
{
    (void)state;
    const size_t sizes[] = {0,
                            1,
                            4097,
                            BK_DL_MIN - 1,
                            BK_DL_MIN,
                            BK_DL_CHUNK - 3,
                            BK_DL_CHUNK,
                            BK_DL_CHUNK + 1,
                            2 * BK_DL_CHUNK,
                            3 * BK_DL_CHUNK + BK_DL_CHUNK / 2 + 7};
    const size_t most = sizes[sizeof sizes / sizeof sizes[0] - 1] + 64;
    unsigned char *pat = static_cast<unsigned char *>(malloc(most));
    unsigned char *out = static_cast<unsigned char *>(malloc(most));
    assert_non_null(pat);
    assert_non_null(out);
    rng r = {12345u, 0, 0.0};
    for (size_t t = 0; t < most; t += 8) {
        const uint64_t v = rng_next(&r);
        memcpy(pat + t, &v, most - t < 8 ? most - t : 8);
    }
    unsigned char *d = NULL;
    assert_int_equal(cudaMalloc((void **)&d, most), cudaSuccess);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        for (int off = 0; off < 2; off++) {
            const size_t n = sizes[i], o = off ? 3 : 0;
            assert_int_equal(cudaMemcpy(d, pat, most, cudaMemcpyHostToDevice), cudaSuccess);
            memset(out, 0xAB, most);
            assert_int_equal(bk_cuda_download(g_c, out + o, d + o, n), BK_OK);
            if (memcmp(out + o, pat + o, n))
                fail_msg("download of %zu bytes at offset %zu differs", n, o);
            for (size_t t = 0; t < o; t++)
                assert_int_equal(out[t], 0xAB);
            for (size_t t = o + n; t < o + n + 32 && t < most; t++)
                assert_int_equal(out[t], 0xAB);
            /* ordered after the stream's work: a fill queued just before */
            if (n > 0) {
                assert_int_equal(cudaMemsetAsync(d + o, 0x5A, n, g_c->stream), cudaSuccess);
                assert_int_equal(bk_cuda_download(g_c, out + o, d + o, n), BK_OK);
                size_t bad = 0;
                for (size_t t = 0; t < n; t++)
                    bad += out[o + t] != 0x5A;
                if (bad)
                    fail_msg("download of %zu bytes after a queued fill: %zu stale bytes", n, bad);
            }
        }
    cudaFree(d);
    free(pat);
    free(out);
}

static void test_parity_dw(void **state)
{
    g_use_dw = 1;
    test_parity(state);
    g_use_dw = 0;
}

static void test_bad_inputs_dw(void **state)
{
    g_use_dw = 1;
    test_bad_inputs(state);
    g_use_dw = 0;
}

static void test_zero_diagonals_dw(void **state)
{
    g_use_dw = 1;
    test_zero_diagonals(state);
    g_use_dw = 0;
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    if (bk_cuda_ctx_create(0, &g_c) != BK_OK) {
        fprintf(stderr, "cannot create the CUDA context: %s\n", bk_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_zero_diagonals),
        cmocka_unit_test(test_escalation_and_not_pd),
        cmocka_unit_test(test_no_stats_and_no_plain),
        cmocka_unit_test(test_refit_and_fp64_factor),
        cmocka_unit_test(test_plain_from_stats),
        cmocka_unit_test(test_parity),
        cmocka_unit_test(test_parity_dw),
        cmocka_unit_test(test_bad_inputs_dw),
        cmocka_unit_test(test_zero_diagonals_dw),
        cmocka_unit_test(test_shared_input_side),
        cmocka_unit_test(test_share_generation),
        cmocka_unit_test(test_download),
    };
    const int rc = cmocka_run_group_tests_name("cuda_solve_dev", tests, NULL, NULL);
    bk_cuda_ctx_destroy(g_c);
    return rc;
}
