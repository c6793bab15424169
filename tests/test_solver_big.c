/* Theorem 3.2 at 256 x 256 and on larger odd shapes (suite slow): naive,
 * antidiag, recursive and bakron give identical codes in fp64, and every
 * fp32 solve agrees with the fp64 naive reference on >= 99% of the codes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/solver.h"
#include "test_solver_util.h"

static bk_solve_result run(int64_t m, int64_t n, const double *W, const double *A,
                           const double *B, bk_algorithm alg, bk_precision prec,
                           bk_quant_spec q)
{
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.algorithm = alg;
    o.precision = prec;
    o.quant = q;
    bk_solve_problem pr;
    memset(&pr, 0, sizeof pr);
    pr.m = m;
    pr.n = n;
    pr.dtype = BK_DT_F64;
    pr.W = W;
    pr.A = A;
    pr.B = B;
    bk_solve_result r;
    if (bk_solve(&pr, &o, &r) != BK_OK)
        fail_msg("%s: %s", bk_algorithm_name(alg), bk_last_error());
    return r;
}

static int64_t diff(const bk_solve_result *a, const bk_solve_result *b)
{
    int64_t d = 0;
    for (int64_t t = 0; t < a->m * a->n; t++)
        d += a->codes[t] != b->codes[t];
    return d;
}

static void check(int64_t m, int64_t n, uint64_t seed, bk_quant_spec q, int fp32)
{
    double *W = test_weights(m, n, seed, 0.1);
    double *A = test_spd(n, seed + 1, 1e-3);
    double *B = test_spd(m, seed + 2, 1e-3);
    const bk_algorithm algs[] = {BK_ALG_NAIVE, BK_ALG_ANTIDIAG, BK_ALG_RECURSIVE, BK_ALG_BAKRON};
    bk_solve_result ref = run(m, n, W, A, B, BK_ALG_NAIVE, BK_PREC_FP64, q);
    for (int a = 1; a < 4; a++) {
        bk_solve_result r = run(m, n, W, A, B, algs[a], BK_PREC_FP64, q);
        int64_t d = diff(&ref, &r);
        if (d)
            fail_msg("fp64 %s [%lld x %lld] seed %llu: %lld codes differ from naive",
                     bk_algorithm_name(algs[a]), (long long)m, (long long)n,
                     (unsigned long long)seed, (long long)d);
        bk_solve_result_free(&r);
    }
    if (fp32)
        for (int a = 0; a < 4; a++) {
            bk_solve_result r = run(m, n, W, A, B, algs[a], BK_PREC_FP32, q);
            int64_t d = diff(&ref, &r);
            printf("fp32 %-9s [%lld x %lld]: %.3f%% codes differ from fp64 naive, loss %.6g vs %.6g\n",
                   bk_algorithm_name(algs[a]), (long long)m, (long long)n, 100.0 * d / (m * n),
                   r.loss_two_sided, ref.loss_two_sided);
            if (d * 100 > m * n)
                fail_msg("fp32 %s: %lld of %lld codes differ (> 1%%)", bk_algorithm_name(algs[a]),
                         (long long)d, (long long)(m * n));
            bk_solve_result_free(&r);
        }
    bk_solve_result_free(&ref);
    free(W);
    free(A);
    free(B);
}

static void test_256_levels(void **state)
{
    (void)state;
    bk_quant_spec q = {0};
    q.kind = BK_Q_LEVELS;
    q.levels = 3;
    q.mse = 1;
    check(256, 256, 1, q, 1);
    check(256, 256, 2, q, 0);
}

static void test_256_uniform(void **state)
{
    (void)state;
    bk_quant_spec q = {0};
    q.kind = BK_Q_UNIFORM;
    q.bits = 4;
    q.group = 32;
    q.asym = 1;
    q.mse = 1;
    check(256, 256, 3, q, 1);
}

static void test_odd_shapes(void **state)
{
    (void)state;
    bk_quant_spec q = {0};
    q.kind = BK_Q_LEVELS;
    q.levels = 3;
    check(211, 97, 5, q, 0);
    check(97, 211, 6, q, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_256_levels),
        cmocka_unit_test(test_256_uniform),
        cmocka_unit_test(test_odd_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
