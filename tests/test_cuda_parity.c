/* CUDA backend parity tests (suite cuda; exit 77 = skipped without a GPU).
 *
 * The CPU backend (bk_solve) is the oracle: every case solves the same
 * problem on both backends and compares.
 *   - fp64: identical codes, scales, zeros, counters, damping, and losses /
 *     bound to 1e-9 relative, on the solver tests' shapes (1x1 .. 256x256),
 *     both quantizer families (and the integer alphabet), every algorithm,
 *     with and without B, with A/B or precomputed LA/LB, dead columns and a
 *     damping escalation;
 *   - fp32: >= 99% identical codes and the two-sided proxy loss within 0.5%
 *     at 1024x1024 and 1024x2816 (bakron and gptq; suite slow too);
 *   - bad inputs and non-PD factors: the same status as the CPU;
 *   - out of device memory (setting mem_limit): BK_ERR_DEVICE_OOM, no crash;
 *   - bk_backend_peak_memory reports what a solve held.
 * Problems come from the solver tests' own generator (test_solver_util.h).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend_impl.h"
#include "bakron/bakron.h"
#include "test_solver_util.h"

static bk_backend *g_cpu, *g_gpu;

/* ------------------------------------------------------------------ cases */

typedef struct pcase {
    int64_t m, n;
    double *W, *A, *B; /* B may be NULL */
    double *LA, *LB;   /* precomputed unnormalized factors (or NULL) */
} pcase;

static void pcase_free(pcase *c)
{
    free(c->W);
    free(c->A);
    free(c->B);
    free(c->LA);
    free(c->LB);
    memset(c, 0, sizeof *c);
}

static pcase make_case(int64_t m, int64_t n, uint64_t seed, int with_b, double sigma)
{
    pcase c = {m, n, test_weights(m, n, seed, sigma), test_spd(n, seed + 1, 0.05),
               with_b ? test_spd(m, seed + 2, 0.05) : NULL, NULL, NULL};
    return c;
}

/* L with L L^T = (X + 0.5 mean diag I)^-1, by the tests' own linear algebra */
static double *precomputed_factor(const double *X, int64_t n)
{
    double *D = test_damped(X, n, 0.5);
    double *I = test_inverse(D, n);
    free(D);
    test_cholesky(I, n);
    return I;
}

static void problem_of(const pcase *c, bk_solve_problem *p, int use_factors, const void *W,
                       const void *A, const void *B, const void *LA, const void *LB,
                       bk_dtype dt)
{
    memset(p, 0, sizeof *p);
    p->m = c->m;
    p->n = c->n;
    p->dtype = dt;
    p->W = W;
    if (use_factors) {
        p->LA = LA;
        p->LB = LB;
    } else {
        p->A = A;
        p->B = B;
    }
    p->label_w = "W";
    p->label_a = "A";
    p->label_b = "B";
}

static double rel(double a, double b)
{
    if (a == b)
        return 0.0;
    return fabs(a - b) / fmax(fabs(a), fabs(b));
}

/* Solve on both backends; fp64: everything identical. */
static void parity_fp64(const pcase *c, const bk_solve_opts *o, int use_factors,
                        const char *what)
{
    bk_solve_problem p;
    problem_of(c, &p, use_factors, c->W, c->A, c->B, c->LA, c->LB, BK_DT_F64);
    bk_solve_result rc, rg;
    bk_status sc = bk_backend_solve(g_cpu, &p, o, &rc);
    char cpu_msg[512];
    snprintf(cpu_msg, sizeof cpu_msg, "%s", bk_last_error());
    bk_status sg = bk_backend_solve(g_gpu, &p, o, &rg);
    if (sc != sg) {
        print_error("%s %lldx%lld %s: cpu %s (%s) vs cuda %s (%s)\n", what, (long long)c->m,
                    (long long)c->n, bk_algorithm_name(o->algorithm), bk_status_name(sc),
                    cpu_msg, bk_status_name(sg), bk_last_error());
        fail();
    }
    if (sc != BK_OK)
        return;
    const int64_t mn = c->m * c->n;
    int64_t diff = 0;
    for (int64_t t = 0; t < mn; t++)
        diff += rc.codes[t] != rg.codes[t];
    if (diff) {
        print_error("%s %lldx%lld %s q%d: %lld of %lld codes differ\n", what, (long long)c->m,
                    (long long)c->n, bk_algorithm_name(o->algorithm), (int)o->quant.kind,
                    (long long)diff, (long long)mn);
        fail();
    }
    assert_int_equal(rc.groups, rg.groups);
    assert_memory_equal(rc.scales, rg.scales, sizeof(float) * (size_t)(c->m * rc.groups));
    assert_true((rc.zeros == NULL) == (rg.zeros == NULL));
    if (rc.zeros)
        assert_memory_equal(rc.zeros, rg.zeros, sizeof(float) * (size_t)(c->m * rc.groups));
    assert_memory_equal(rc.weight, rg.weight, sizeof(float) * (size_t)mn);
    assert_int_equal(rc.clamped, rg.clamped);
    assert_int_equal(rc.dead_columns, rg.dead_columns);
    assert_int_equal(rc.damp_retries, rg.damp_retries);
    assert_true(rc.damp_a == rg.damp_a);
    assert_true(rc.damp_b == rg.damp_b);
    if (o->compute_stats) {
        if (rel(rc.loss_two_sided, rg.loss_two_sided) > 1e-9 ||
            rel(rc.loss_one_sided, rg.loss_one_sided) > 1e-9) {
            print_error("%s: losses cpu %.17g %.17g cuda %.17g %.17g\n", what, rc.loss_two_sided,
                        rc.loss_one_sided, rg.loss_two_sided, rg.loss_one_sided);
            fail();
        }
        assert_true(isnan(rc.bound) == isnan(rg.bound));
        if (!isnan(rc.bound))
            assert_true(rel(rc.bound, rg.bound) <= 1e-9);
    }
    assert_true(rg.time_solve_s >= 0.0);
    bk_solve_result_free(&rc);
    bk_solve_result_free(&rg);
}

static bk_quant_spec q_levels(int l, int mse)
{
    bk_quant_spec q;
    memset(&q, 0, sizeof q);
    q.kind = BK_Q_LEVELS;
    q.levels = l;
    q.mse = mse;
    return q;
}

static bk_quant_spec q_uniform(int bits, int64_t group, int asym, int mse)
{
    bk_quant_spec q;
    memset(&q, 0, sizeof q);
    q.kind = BK_Q_UNIFORM;
    q.bits = bits;
    q.group = group;
    q.asym = asym;
    q.mse = mse;
    return q;
}

static const int64_t shapes[][2] = {{1, 1},   {1, 17},   {19, 1},  {2, 2},    {7, 13},
                                    {13, 7},  {37, 101}, {64, 48}, {100, 37}, {3, 200},
                                    {128, 5}, {31, 31},  {65, 129}, {256, 256}};
#define NSHAPES (sizeof shapes / sizeof shapes[0])

static void test_fp64_all_algorithms(void **state)
{
    (void)state;
    const bk_algorithm algs[] = {BK_ALG_BAKRON, BK_ALG_GPTQ, BK_ALG_ANTIDIAG,
                                 BK_ALG_RECURSIVE, BK_ALG_NAIVE, BK_ALG_RTN};
    const bk_quant_spec qs[] = {q_levels(3, 1), q_uniform(4, 16, 1, 1), q_uniform(3, 0, 0, 0)};
    for (size_t s = 0; s < NSHAPES; s++)
        for (int with_b = 0; with_b <= 1; with_b++) {
            pcase c = make_case(shapes[s][0], shapes[s][1], 100 + s, with_b, 0.1);
            for (size_t qi = 0; qi < sizeof qs / sizeof qs[0]; qi++)
                for (size_t ai = 0; ai < sizeof algs / sizeof algs[0]; ai++) {
                    const int64_t mn = c.m * c.n;
                    if (algs[ai] == BK_ALG_NAIVE && mn > 128 * 128)
                        continue; /* the GPU refuses it (tested below) */
                    if (algs[ai] == BK_ALG_ANTIDIAG && mn > 128 * 128 && qi > 0)
                        continue; /* quartic on the CPU: once per shape is enough */
                    bk_solve_opts o;
                    bk_solve_opts_default(&o);
                    o.precision = BK_PREC_FP64;
                    o.algorithm = algs[ai];
                    o.quant = qs[qi];
                    parity_fp64(&c, &o, 0, "fp64");
                }
            pcase_free(&c);
        }
}

/* factors of order > 512 take the recursive triangular inverse on the GPU
 * (cuda/factor.cu, tri_inverse: uneven halves, leaves by cuSOLVER): the
 * CPU's codes in fp64, on the input side (n = 1100) and the output side
 * (m = 1100, B present) */
static void test_fp64_large_factors(void **state)
{
    (void)state;
    const int64_t sh[][2] = {{24, 1100}, {1100, 24}};
    for (size_t s = 0; s < 2; s++) {
        pcase c = make_case(sh[s][0], sh[s][1], 900 + s, 1, 0.1);
        const bk_algorithm algs[] = {BK_ALG_BAKRON, BK_ALG_GPTQ};
        for (size_t ai = 0; ai < 2; ai++) {
            bk_solve_opts o;
            bk_solve_opts_default(&o);
            o.precision = BK_PREC_FP64;
            o.algorithm = algs[ai];
            o.quant = q_levels(3, 1);
            parity_fp64(&c, &o, 0, "fp64 large factor");
        }
        pcase_free(&c);
    }
}

/* the tile size and the push schedule are variants of the solver
 * (bk_cuda_tuning, src/backend_impl.h; the product runs the defaults): every
 * combination gives the CPU's codes. The SM partition, the split
 * critical-path pushes, the banded side push, cp.async and the overlap of
 * the far pushes are forced on and off here (their defaults are automatic
 * or on). */
static void test_fp64_tile_and_push_variants(void **state)
{
    (void)state;
    /* tile, solve_wc, overlap, side_band, far_async, push_split, push_group, partition,
     * push_mma (fp32 only: the fp64 solves here must be unaffected by it), solve_chain
     * (the step chain's layout / schedule: the same codes bit for bit) */
    const bk_cuda_tuning cfg[] = {
        {32, 8, 1, -1, 1, 2, 4, -1, 0, 0},  {64, 16, 1, 0, 0, 1, 0, 0, 0, 0},
        {64, 8, 1, 1, 1, 2, 1, 64, 0, 0},   {32, 16, 1, 1, 0, 2, 3, 0, 0, 0},
        {64, 16, 1, 0, 1, 1, 7, 100, 0, 0}, {64, 8, 1, -1, 0, 2, 2, 24, 0, 0},
        {64, 16, 0, -1, 1, 2, 4, -1, 0, 0}, {32, 8, 0, 0, 0, 1, 3, 0, 0, 0},
        {64, 16, 1, -1, 1, 2, 4, -1, 2, 0}, {64, 16, 1, -1, 1, 2, 4, -1, 0, 1},
        {32, 16, 1, -1, 1, 2, 4, -1, 0, 1},  {64, 16, 1, 0, 1, 1, 0, 0, 0, 1},
        {32, 16, 0, 0, 0, 1, 3, 0, 0, 1},  {64, 8, 1, -1, 1, 2, 4, -1, 0, 1},
        {32, 8, 1, 0, 0, 1, 3, 0, 0, 1}};
    for (size_t v = 0; v < sizeof cfg / sizeof cfg[0]; v++) {
        const bk_cuda_tuning *t = &cfg[v];
        bk_backend *b = NULL;
        assert_int_equal(bk_backend_create(BK_BACKEND_CUDA, &b), BK_OK);
        assert_int_equal(bk_cuda_backend_tune(b, t), BK_OK);
        bk_backend *keep = g_gpu;
        g_gpu = b;
        char what[128];
        snprintf(what, sizeof what, "fp64 T=%d WC=%d O=%d B=%d A=%d S=%d G=%d P=%d C=%d", t->tile,
                 t->solve_wc, t->overlap, t->side_band, t->far_async, t->push_split,
                 t->push_group, t->partition, t->solve_chain);
        for (size_t s = 0; s < NSHAPES; s++)
            for (int with_b = 0; with_b <= 1; with_b++) {
                pcase c = make_case(shapes[s][0], shapes[s][1], 500 + s, with_b, 0.1);
                bk_solve_opts o;
                bk_solve_opts_default(&o);
                o.precision = BK_PREC_FP64;
                parity_fp64(&c, &o, 0, what);
                pcase_free(&c);
            }
        g_gpu = keep;
        bk_backend_destroy(b);
    }
    /* a bad value is refused, naming the field; the CPU backend refuses tuning */
    struct {
        const char *field;
        size_t off;
        int value;
    } const bad[] = {{"push_group", offsetof(bk_cuda_tuning, push_group), 65},
                     {"push_split", offsetof(bk_cuda_tuning, push_split), 3},
                     {"side_band", offsetof(bk_cuda_tuning, side_band), 2},
                     {"partition", offsetof(bk_cuda_tuning, partition), -2},
                     {"far_async", offsetof(bk_cuda_tuning, far_async), 2},
                     {"overlap", offsetof(bk_cuda_tuning, overlap), -1},
                     {"solve_wc", offsetof(bk_cuda_tuning, solve_wc), 32},
                     {"tile", offsetof(bk_cuda_tuning, tile), 48},
                     {"push_mma", offsetof(bk_cuda_tuning, push_mma), 3},
                     {"solve_chain", offsetof(bk_cuda_tuning, solve_chain), 2}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bk_cuda_tuning t;
        bk_cuda_tuning_default(&t);
        *(int *)((char *)&t + bad[i].off) = bad[i].value;
        assert_int_equal(bk_cuda_backend_tune(g_gpu, &t), BK_ERR_INVALID_ARG);
        assert_non_null(strstr(bk_last_error(), bad[i].field));
    }
    bk_cuda_tuning t;
    bk_cuda_tuning_default(&t);
    assert_int_equal(bk_cuda_backend_tune(g_cpu, &t), BK_ERR_INVALID_ARG);
}

/* integer alphabet (scale 1) with large weights: many clamps-free codes */
static void test_fp64_integer(void **state)
{
    (void)state;
    const bk_algorithm algs[] = {BK_ALG_BAKRON, BK_ALG_GPTQ, BK_ALG_ANTIDIAG, BK_ALG_RECURSIVE};
    for (size_t s = 0; s < NSHAPES; s++) {
        pcase c = make_case(shapes[s][0], shapes[s][1], 200 + s, 1, 3.0);
        for (size_t ai = 0; ai < sizeof algs / sizeof algs[0]; ai++) {
            if (algs[ai] == BK_ALG_ANTIDIAG && c.m * c.n > 128 * 128)
                continue;
            bk_solve_opts o;
            bk_solve_opts_default(&o);
            o.precision = BK_PREC_FP64;
            o.algorithm = algs[ai];
            memset(&o.quant, 0, sizeof o.quant);
            o.quant.kind = BK_Q_INTEGER;
            parity_fp64(&c, &o, 0, "fp64 integer");
        }
        pcase_free(&c);
    }
}

/* precomputed LA / LB (no damping), GPTQ refit_groups, dead columns */
static void test_fp64_factors_refit_dead(void **state)
{
    (void)state;
    for (size_t s = 0; s < NSHAPES; s++) {
        pcase c = make_case(shapes[s][0], shapes[s][1], 300 + s, 1, 0.1);
        c.LA = precomputed_factor(c.A, c.n);
        c.LB = precomputed_factor(c.B, c.m);
        bk_solve_opts o;
        bk_solve_opts_default(&o);
        o.precision = BK_PREC_FP64;
        parity_fp64(&c, &o, 1, "fp64 factors");
        o.algorithm = BK_ALG_GPTQ;
        parity_fp64(&c, &o, 1, "fp64 factors gptq");
        if (c.n > 8) {
            o.quant = q_uniform(4, 8, 1, 1);
            o.quant.refit_groups = 1;
            o.gptq_block = 5;
            parity_fp64(&c, &o, 0, "fp64 refit");
        }
        /* dead columns: zero rows/columns of A */
        for (int64_t j = 0; j < c.n; j += 3)
            for (int64_t t = 0; t < c.n; t++)
                c.A[j * c.n + t] = c.A[t * c.n + j] = 0.0;
        bk_solve_opts_default(&o);
        o.precision = BK_PREC_FP64;
        parity_fp64(&c, &o, 0, "fp64 dead");
        o.algorithm = BK_ALG_GPTQ;
        parity_fp64(&c, &o, 0, "fp64 dead gptq");
        pcase_free(&c);
    }
}

/* an indefinite A (eigenvalue -0.001) with damping 0 fails, then 1e-2
 * works: one escalation on both backends; no retries allowed: NOT_PD */
static void test_escalation_and_not_pd(void **state)
{
    (void)state;
    const int64_t m = 9, n = 12;
    pcase c = make_case(m, n, 41, 0, 0.1);
    double u[12], nu = 0;
    for (int64_t j = 0; j < n; j++) {
        u[j] = 1.0 + 0.1 * (double)j;
        nu += u[j] * u[j];
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++)
            c.A[i * n + j] = (i == j ? 1.0 : 0.0) - 1.001 * u[i] * u[j] / nu;
    for (int prec = 0; prec <= 1; prec++) {
        bk_solve_opts o;
        bk_solve_opts_default(&o);
        o.precision = prec ? BK_PREC_FP64 : BK_PREC_FP32;
        o.damp = 0.0;
        bk_solve_problem p;
        problem_of(&c, &p, 0, c.W, c.A, NULL, NULL, NULL, BK_DT_F64);
        bk_solve_result rc, rg;
        assert_int_equal(bk_backend_solve(g_cpu, &p, &o, &rc), BK_OK);
        assert_int_equal(bk_backend_solve(g_gpu, &p, &o, &rg), BK_OK);
        assert_int_equal(rc.damp_retries, 1);
        assert_int_equal(rg.damp_retries, 1);
        assert_true(rc.damp_a == rg.damp_a);
        bk_solve_result_free(&rc);
        bk_solve_result_free(&rg);
        o.max_damp_retries = 0;
        assert_int_equal(bk_backend_solve(g_cpu, &p, &o, &rc), BK_ERR_NOT_PD);
        assert_int_equal(bk_backend_solve(g_gpu, &p, &o, &rg), BK_ERR_NOT_PD);
        assert_non_null(strstr(bk_last_error(), "A"));
    }
    pcase_free(&c);
}

/* ------------------------------------------------------------ bad inputs */

static void same_status(const bk_solve_problem *p, const bk_solve_opts *o, bk_status want,
                        const char *what)
{
    bk_solve_result rc, rg;
    bk_status sc = bk_backend_solve(g_cpu, p, o, &rc);
    bk_status sg = bk_backend_solve(g_gpu, p, o, &rg);
    if (sc != want || sg != want) {
        print_error("%s: expected %s, cpu %s, cuda %s (%s)\n", what, bk_status_name(want),
                    bk_status_name(sc), bk_status_name(sg), bk_last_error());
        fail();
    }
    assert_true(strlen(bk_last_error()) > 0);
    assert_null(rg.codes);
    bk_solve_result_free(&rc);
    bk_solve_result_free(&rg);
}

static void test_bad_inputs(void **state)
{
    (void)state;
    const int64_t m = 6, n = 5;
    pcase c = make_case(m, n, 51, 1, 0.1);
    bk_solve_opts o;
    bk_solve_problem p;
    bk_solve_opts_default(&o);
    problem_of(&c, &p, 0, c.W, c.A, c.B, NULL, NULL, BK_DT_F64);

    p.m = 0;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "empty");
    p.m = m;
    p.dtype = BK_DT_BF16;
    same_status(&p, &o, BK_ERR_DTYPE, "dtype");
    p.dtype = BK_DT_F64;
    p.A = NULL;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "no A");
    p.A = c.A;
    double *LA = precomputed_factor(c.A, n);
    p.LA = LA;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "A and LA");
    p.LA = NULL;

    c.W[7] = NAN;
    same_status(&p, &o, BK_ERR_NONFINITE, "NaN in W");
    c.W[7] = 0.1;
    c.B[3] = INFINITY;
    same_status(&p, &o, BK_ERR_NONFINITE, "Inf in B");
    c.B[3] = c.B[3 * m];

    double keep = c.A[1];
    c.A[1] += 1.0;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "asymmetric A");
    c.A[1] = keep;
    keep = c.A[2 * n + 2];
    c.A[2 * n + 2] = -1.0;
    same_status(&p, &o, BK_ERR_NOT_PD, "negative diagonal");
    c.A[2 * n + 2] = keep;

    /* precomputed factor: something above the diagonal, a zero diagonal */
    p.A = NULL;
    p.LA = LA;
    LA[1] = 0.5;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "LA not lower");
    LA[1] = 0.0;
    keep = LA[n + 1];
    LA[n + 1] = 0.0;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "LA zero diagonal");
    LA[n + 1] = keep;
    p.A = c.A;
    p.LA = NULL;

    /* a B that no damping makes PD */
    double *Bn = calloc((size_t)(m * m), sizeof(double));
    for (int64_t i = 0; i < m; i++)
        Bn[i * m + i] = 1.0;
    Bn[0] = 1e-3;
    Bn[1] = Bn[m] = 1.0; /* [[1e-3, 1], [1, 1]]: indefinite, needs more than 1e4 mean */
    p.B = Bn;
    o.damp = 1e-9;
    o.max_damp_retries = 1;
    same_status(&p, &o, BK_ERR_NOT_PD, "non-PD B");
    for (int a = 0; a <= 1; a++) { /* also with GPTQ, which still factors B */
        o.algorithm = a ? BK_ALG_GPTQ : BK_ALG_BAKRON;
        same_status(&p, &o, BK_ERR_NOT_PD, "non-PD B (gptq)");
    }
    p.B = c.B;
    bk_solve_opts_default(&o);

    o.quant.refit_groups = 1;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "refit with bakron");
    bk_solve_opts_default(&o);
    o.quant = q_uniform(5, 0, 0, 0);
    same_status(&p, &o, BK_ERR_INVALID_ARG, "5 bits");
    bk_solve_opts_default(&o);
    o.damp = -1;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "negative damping");
    bk_solve_opts_default(&o);
    o.gptq_block = 0;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "gptq_block 0");

    /* integer codes beyond int16 */
    bk_solve_opts_default(&o);
    memset(&o.quant, 0, sizeof o.quant);
    o.quant.kind = BK_Q_INTEGER;
    c.W[3] = 1e6;
    same_status(&p, &o, BK_ERR_INVALID_ARG, "int16 overflow");
    free(Bn);
    free(LA);
    pcase_free(&c);
}

/* the GPU refuses naive above its size limit, naming the limit */
static void test_naive_limit(void **state)
{
    (void)state;
    pcase c = make_case(200, 100, 61, 0, 0.1);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.algorithm = BK_ALG_NAIVE;
    bk_solve_problem p;
    problem_of(&c, &p, 0, c.W, c.A, NULL, NULL, NULL, BK_DT_F64);
    bk_solve_result r;
    assert_int_equal(bk_backend_solve(g_gpu, &p, &o, &r), BK_ERR_UNSUPPORTED);
    assert_non_null(strstr(bk_last_error(), "16384"));
    pcase_free(&c);
}

/* out of device memory: a clear BK_ERR_DEVICE_OOM, and the backend works after */
static void test_oom(void **state)
{
    (void)state;
    bk_backend_params bp;
    bk_backend_params_default(&bp);
    bp.mem_limit = 200000;
    bk_backend *b = NULL;
    assert_int_equal(bk_backend_create_params(BK_BACKEND_CUDA, &bp, &b), BK_OK);
    pcase c = make_case(200, 300, 71, 1, 0.1);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    bk_solve_problem p;
    problem_of(&c, &p, 0, c.W, c.A, c.B, NULL, NULL, BK_DT_F64);
    bk_solve_result r;
    assert_int_equal(bk_backend_solve(b, &p, &o, &r), BK_ERR_DEVICE_OOM);
    assert_non_null(strstr(bk_last_error(), "out of memory"));
    assert_int_equal(bk_status_exit_code(BK_ERR_DEVICE_OOM), 3);
    assert_null(r.codes);
    bk_backend_destroy(b);
    /* the shared backend still solves */
    assert_int_equal(bk_backend_solve(g_gpu, &p, &o, &r), BK_OK);
    bk_solve_result_free(&r);
    pcase_free(&c);
}

static void test_peak_memory(void **state)
{
    (void)state;
    bk_backend *b = NULL;
    assert_int_equal(bk_backend_create(BK_BACKEND_CUDA, &b), BK_OK);
    assert_int_equal(bk_backend_peak_memory(b), 0);
    pcase c = make_case(300, 200, 81, 1, 0.1);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    bk_solve_problem p;
    problem_of(&c, &p, 0, c.W, c.A, c.B, NULL, NULL, BK_DT_F64);
    bk_solve_result r;
    assert_int_equal(bk_backend_solve(b, &p, &o, &r), BK_OK);
    /* at least the padded W, L_A and L_B in fp32 */
    const size_t floor_bytes = 4u * (384u * 256u + 256u * 256u + 384u * 384u);
    assert_true(bk_backend_peak_memory(b) >= floor_bytes);
    assert_true(bk_backend_peak_memory(b) < ((size_t)1 << 32));
    assert_int_equal(bk_backend_peak_memory(g_cpu), 0);
    bk_solve_result_free(&r);
    bk_backend_destroy(b);
    pcase_free(&c);
}

/* ------------------------------------------------------------ fp32 large */

static void parity_fp32_large(int64_t m, int64_t n, bk_algorithm alg)
{
    pcase c = make_case(m, n, 900 + m + n, 1, 0.02);
    float *W = test_to_f32(c.W, m * n), *A = test_to_f32(c.A, n * n),
          *B = test_to_f32(c.B, m * m);
    bk_solve_problem p;
    problem_of(&c, &p, 0, W, A, B, NULL, NULL, BK_DT_F32);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.algorithm = alg;
    bk_solve_result rc, rg;
    assert_int_equal(bk_backend_solve(g_cpu, &p, &o, &rc), BK_OK);
    assert_int_equal(bk_backend_solve(g_gpu, &p, &o, &rg), BK_OK);
    int64_t same = 0;
    for (int64_t t = 0; t < m * n; t++)
        same += rc.codes[t] == rg.codes[t];
    const double frac = (double)same / (double)(m * n);
    const double dl = rel(rc.loss_two_sided, rg.loss_two_sided);
    print_message("fp32 %s %lldx%lld: %.4f%% identical codes, loss cpu %.6g cuda %.6g (%.3f%%), "
                  "cuda core %.4f s\n",
                  bk_algorithm_name(alg), (long long)m, (long long)n, 100.0 * frac,
                  rc.loss_two_sided, rg.loss_two_sided, 100.0 * dl, rg.time_solve_s);
    assert_true(frac >= 0.99);
    assert_true(dl <= 0.005);
    assert_true(rc.damp_a == rg.damp_a && rc.damp_b == rg.damp_b);
    bk_solve_result_free(&rc);
    bk_solve_result_free(&rg);
    free(W);
    free(A);
    free(B);
    pcase_free(&c);
}

static void test_fp32_1024(void **state)
{
    (void)state;
    parity_fp32_large(1024, 1024, BK_ALG_BAKRON);
    parity_fp32_large(1024, 1024, BK_ALG_GPTQ);
}

static void test_fp32_1024x2816(void **state)
{
    (void)state;
    parity_fp32_large(1024, 2816, BK_ALG_BAKRON);
    parity_fp32_large(1024, 2816, BK_ALG_GPTQ);
}

/* fp32 on the small shapes: close to the CPU (a rounding flip may cascade
 * through a tiny problem, so the bar is per problem size) */
static void test_fp32_small(void **state)
{
    (void)state;
    const bk_algorithm algs[] = {BK_ALG_BAKRON, BK_ALG_GPTQ, BK_ALG_RECURSIVE, BK_ALG_RTN};
    int64_t total = 0, same = 0;
    for (size_t s = 0; s < NSHAPES; s++) {
        pcase c = make_case(shapes[s][0], shapes[s][1], 700 + s, 1, 0.1);
        float *W = test_to_f32(c.W, c.m * c.n), *A = test_to_f32(c.A, c.n * c.n),
              *B = test_to_f32(c.B, c.m * c.m);
        for (size_t ai = 0; ai < sizeof algs / sizeof algs[0]; ai++) {
            bk_solve_opts o;
            bk_solve_opts_default(&o);
            o.algorithm = algs[ai];
            bk_solve_problem p;
            problem_of(&c, &p, 0, W, A, B, NULL, NULL, BK_DT_F32);
            bk_solve_result rc, rg;
            assert_int_equal(bk_backend_solve(g_cpu, &p, &o, &rc), BK_OK);
            assert_int_equal(bk_backend_solve(g_gpu, &p, &o, &rg), BK_OK);
            for (int64_t t = 0; t < c.m * c.n; t++)
                same += rc.codes[t] == rg.codes[t];
            total += c.m * c.n;
            assert_memory_equal(rc.scales, rg.scales, sizeof(float) * (size_t)c.m);
            bk_solve_result_free(&rc);
            bk_solve_result_free(&rg);
        }
        free(W);
        free(A);
        free(B);
        pcase_free(&c);
    }
    print_message("fp32 small shapes: %.4f%% identical codes\n", 100.0 * same / total);
    assert_true((double)same >= 0.99 * (double)total);
}

/* setting factor_fp64=1 (damping + Cholesky in fp64 also for fp32 solves):
 * the fp32 small-shape bar against the CPU, which factors in fp32 */
static void test_fp32_small_factor_fp64(void **state)
{
    bk_backend_params bp;
    bk_backend_params_default(&bp);
    assert_int_equal(bk_backend_params_parse(&bp, "factor_fp64=1"), BK_OK);
    bk_backend *b = NULL;
    assert_int_equal(bk_backend_create_params(BK_BACKEND_CUDA, &bp, &b), BK_OK);
    assert_int_equal(bk_backend_get_params(b)->factor_fp64, 1);
    bk_backend *keep = g_gpu;
    g_gpu = b;
    test_fp32_small(state);
    g_gpu = keep;
    bk_backend_destroy(b);
}

int main(int argc, char **argv)
{
    if (bk_cuda_device_count() == 0) {
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    if (bk_backend_create(BK_BACKEND_CPU, &g_cpu) != BK_OK ||
        bk_backend_create(BK_BACKEND_CUDA, &g_gpu) != BK_OK) {
        fprintf(stderr, "cannot create the backends: %s\n", bk_last_error());
        return 1;
    }
    const int slow = argc > 1 && !strcmp(argv[1], "--slow");
    const struct CMUnitTest fast[] = {
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_escalation_and_not_pd),
        cmocka_unit_test(test_naive_limit),
        cmocka_unit_test(test_oom),
        cmocka_unit_test(test_peak_memory),
        cmocka_unit_test(test_fp64_all_algorithms),
        cmocka_unit_test(test_fp64_large_factors),
        cmocka_unit_test(test_fp64_tile_and_push_variants),
        cmocka_unit_test(test_fp64_integer),
        cmocka_unit_test(test_fp64_factors_refit_dead),
        cmocka_unit_test(test_fp32_small),
        cmocka_unit_test(test_fp32_small_factor_fp64),
    };
    const struct CMUnitTest big[] = {
        cmocka_unit_test(test_fp32_1024),
        cmocka_unit_test(test_fp32_1024x2816),
    };
    int rc = slow ? cmocka_run_group_tests_name("cuda_parity_slow", big, NULL, NULL)
                  : cmocka_run_group_tests_name("cuda_parity", fast, NULL, NULL);
    bk_backend_destroy(g_cpu);
    bk_backend_destroy(g_gpu);
    return rc;
}
