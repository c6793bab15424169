/* Separate damping of the output-side factor (--damp-b): B~ = B + damp_b *
 * mean(diag B) * I, checked against giving the pre-damped B with no damping. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "bakron/solver.h"

static double lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*s >> 11) / 9007199254740992.0 - 0.5;
}

static void spd(double *X, int n, int k, uint64_t *seed)
{
    double *G = malloc(sizeof(double) * (size_t)(n * k));
    for (int i = 0; i < n * k; i++)
        G[i] = lcg(seed);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int t = 0; t < k; t++)
                s += G[i * k + t] * G[j * k + t];
            X[i * n + j] = s / k;
        }
    free(G);
}

static void test_damp_b(void **state)
{
    (void)state;
    const int m = 23, n = 17;
    uint64_t seed = 7;
    double *W = malloc(sizeof(double) * m * n), *A = malloc(sizeof(double) * n * n),
           *B = malloc(sizeof(double) * m * m), *Bt = malloc(sizeof(double) * m * m);
    for (int i = 0; i < m * n; i++)
        W[i] = lcg(&seed);
    spd(A, n, 40, &seed);
    spd(B, m, 40, &seed);
    double mean = 0;
    for (int i = 0; i < m; i++)
        mean += B[i * m + i];
    mean /= m;
    const double db = 3.0;
    memcpy(Bt, B, sizeof(double) * m * m);
    for (int i = 0; i < m; i++)
        Bt[i * m + i] += db * mean;

    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.precision = BK_PREC_FP64;
    o.separate_damp_b = 1;
    o.damp_b = db;
    bk_solve_problem p = {.m = m, .n = n, .dtype = BK_DT_F64, .W = W, .A = A, .B = B};
    bk_solve_result r1, r2, r3;
    assert_int_equal(bk_solve(&p, &o, &r1), BK_OK);
    assert_true(fabs(r1.damp_b - db) < 1e-12);
    assert_true(fabs(r1.damp_a - 0.5) < 1e-12);

    o.damp_b = 0.0; /* the same B~ given directly, undamped */
    p.B = Bt;
    assert_int_equal(bk_solve(&p, &o, &r2), BK_OK);
    assert_memory_equal(r1.codes, r2.codes, sizeof(int16_t) * (size_t)(m * n));

    o.separate_damp_b = 0; /* the paper's setting damps B with 0.5: other codes */
    p.B = B;
    assert_int_equal(bk_solve(&p, &o, &r3), BK_OK);
    assert_true(fabs(r3.damp_b - 0.5) < 1e-12);
    assert_true(memcmp(r1.codes, r3.codes, sizeof(int16_t) * (size_t)(m * n)) != 0);

    o.separate_damp_b = 1;
    o.damp_b = -1.0;
    bk_solve_result r4;
    assert_int_equal(bk_solve(&p, &o, &r4), BK_ERR_INVALID_ARG);
    bk_solve_result_free(&r1);
    bk_solve_result_free(&r2);
    bk_solve_result_free(&r3);
    bk_solve_result_free(&r4);
    free(W);
    free(A);
    free(B);
    free(Bt);
}

/* bk_proxy_loss_fast (sgemm products) agrees with the float64 bk_proxy_loss */
static void test_proxy_loss_fast(void **state)
{
    (void)state;
    const int m = 61, n = 47;
    uint64_t seed = 11;
    double *Ad = malloc(sizeof(double) * n * n);
    spd(Ad, n, 90, &seed);
    float *E = malloc(sizeof(float) * m * n), *A = malloc(sizeof(float) * n * n);
    for (int i = 0; i < m * n; i++)
        E[i] = (float)lcg(&seed);
    for (int i = 0; i < n * n; i++)
        A[i] = (float)Ad[i];
    double exact, fast;
    assert_int_equal(bk_proxy_loss(m, n, E, A, NULL, &exact), BK_OK);
    assert_int_equal(bk_proxy_loss_fast(m, n, E, A, &fast), BK_OK);
    assert_true(exact > 0);
    assert_true(fabs(fast - exact) <= 1e-5 * exact);
    assert_int_equal(bk_proxy_loss_fast(0, n, E, A, &fast), BK_ERR_INVALID_ARG);
    free(Ad);
    free(E);
    free(A);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_damp_b),
                                       cmocka_unit_test(test_proxy_loss_fast)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
